"""``vmalloc.xgboost``, the documented import path of the XGBoost driver: this module *is*
:mod:`vmalloc.frameworks.xgboost` (the drivers live in :mod:`vmalloc.frameworks`)."""

import sys

from vmalloc.frameworks import xgboost as _driver

sys.modules[__name__] = _driver
