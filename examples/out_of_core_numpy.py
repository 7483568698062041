"""Out-of-core training for real, on the emulated device: a NumPy network whose every tensor
lives in vmalloc memory trains under half of its in-core memory, bit-identically.

    python examples/out_of_core_numpy.py [--network mlp|cnn] [--steps N]

(the same as ``vmalloc offload train``).
"""

import sys

from vmalloc.offload.cli import add_parser, run


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="out_of_core_numpy")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["offload", "train"] + list(sys.argv[1:] if argv is None else argv))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
