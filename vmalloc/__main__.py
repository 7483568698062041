"""``python -m vmalloc`` and the ``vmalloc`` console script: see :mod:`vmalloc.cli`."""

import sys


def main(argv=None):
    """Runs the ``vmalloc`` command line; returns its exit status."""
    from vmalloc.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
