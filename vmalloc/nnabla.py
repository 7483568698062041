"""``vmalloc.nnabla``, the documented import path of the nnabla driver: this module *is*
:mod:`vmalloc.frameworks.nnabla` (the drivers live in :mod:`vmalloc.frameworks`)."""

import sys

from vmalloc.frameworks import nnabla as _driver

sys.modules[__name__] = _driver
