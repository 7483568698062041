"""``python -m vmalloc.bench``: the allocation benchmark (see :mod:`vmalloc.bench`)."""

import sys

from vmalloc.bench import main

sys.exit(main())
