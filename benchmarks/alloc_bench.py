"""Allocation benchmark (thin script): the same as ``vmalloc bench`` and
``python -m vmalloc.bench``; see vmalloc/bench/ for what it measures.

    PYTHONPATH=build/<name>/python python benchmarks/alloc_bench.py [--json] [--quick]
"""

import sys

from vmalloc.bench import main

if __name__ == "__main__":
    sys.exit(main())
