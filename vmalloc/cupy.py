"""``vmalloc.cupy``, the documented import path of the CuPy driver: this module *is*
:mod:`vmalloc.frameworks.cupy` (the drivers live in :mod:`vmalloc.frameworks`)."""

import sys

from vmalloc.frameworks import cupy as _driver

sys.modules[__name__] = _driver
