"""Big synthetic traces for the end-to-end reading benchmark in docs/benchmarks.md.

    PYTHONPATH=build/<name>/python python benchmarks/make_big_traces.py DIR [--events N]

Writes DIR/big.csv (an RMM log of N events, default 1,000,000) and DIR/big.json (a Kineto
profiler trace with the same N ``[memory]`` events, pretty-printed as Kineto writes them, with a
``cpu_op`` complete event after every fourth memory event: about 320 MB for 1 M events). The
events are those of ``benchmarks/trace_readers.py``'s ``synthetic``.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_readers import synthetic  # noqa: E402


def write_rmm(batch, path):
    with open(path, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n")
        lines = []
        for op, _, addr, size in batch.tolist():
            lines.append(f"1,10:00:00.000000,{'allocate' if op == 0 else 'free'},{addr:#x},{size},0x0\n")
            if len(lines) == 65536:
                f.write("".join(lines))
                lines = []
        f.write("".join(lines))


def write_kineto(batch, path):
    with open(path, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [{"id": 0, "name": "H100"}],\n'
                '  "traceEvents": [\n')
        parts = []
        for i, (op, _, addr, size) in enumerate(batch.tolist()):
            event = {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                     "pid": 1, "tid": 1, "ts": i, "args": {"Total Reserved": 0,
                     "Total Allocated": 0, "Bytes": size if op == 0 else -size,
                     "Device Id": 0, "Device Type": 1, "Addr": addr}}
            parts.append(("," if i else "") + json.dumps(event, indent=1) + "\n")
            if i % 4 == 3:
                op_event = {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1,
                            "tid": 1, "ts": i, "dur": 3.5, "args": {"External id": i,
                            "Record function id": 0, "Sequence number": i // 4,
                            "Fwd thread id": 0, "Ev Idx": i, "Input Dims": [[64, 512], [512, 512], [512]],
                            "Input type": ["float", "float", "float"], "Concrete Inputs": ["", "", ""]}}
                parts.append("," + json.dumps(op_event, indent=1) + "\n")
            if len(parts) >= 65536:
                f.write("".join(parts))
                parts = []
        f.write("".join(parts))
        f.write('],\n  "traceName": "big.json",\n  "displayTimeUnit": "ms"\n}\n')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    batch = synthetic(args.events)
    write_rmm(batch, os.path.join(args.dir, "big.csv"))
    write_kineto(batch, os.path.join(args.dir, "big.json"))
    for name in ("big.csv", "big.json"):
        p = os.path.join(args.dir, name)
        print(f"{p}: {os.path.getsize(p) / 1e6:.1f} MB, {len(batch):,} memory events")


if __name__ == "__main__":
    main()
