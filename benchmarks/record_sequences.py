"""Regenerates the shipped model sequences (vmalloc/offload/sequence/data/<name>.json.gz).

    PYTHONPATH=... python benchmarks/record_sequences.py \
        [--out vmalloc/offload/sequence/data] [names...]

Records one training iteration of each model of vmalloc.offload.sequence.torch_models on the
meta device at batches 2 and 4, stores it at batch 1 and prints, per model: functions, variables,
parameters, persistent bytes, FLOPs per sample and the in-core peak at a few batch sizes, and
the seconds the recording took. Needs torch (CPU is enough), not torchvision.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, os.pardir, "vmalloc", "offload", "data")
BATCHES = {"resnet50": (32, 64, 128, 190, 256), "densenet121": (32, 64, 128, 256),
           "unet": (1, 4, 8, 16), "gpt2-medium": (1, 2, 4, 8)}


def record_model(name):
    import torch

    from vmalloc.offload.sequence.recorder import record
    from vmalloc.offload.sequence.torch_models import build

    with torch.device("meta"):
        model, inputs_fn, loss_fn, meta = build(name)
    return record(model, inputs_fn, loss_fn, name=name, batch=1, meta=meta)


def main(argv=None):
    from vmalloc.offload.sequence.models import MODELS
    from vmalloc.sizes import format_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="directory for <name>.json.gz")
    ap.add_argument("names", nargs="*", default=list(MODELS))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name in args.names:
        t0 = time.perf_counter()
        seq = record_model(name)
        seconds = time.perf_counter() - t0
        path = os.path.join(args.out, f"{name}.json.gz")
        seq.save(path)
        per = [v for v in seq.variables if v.persistent]
        print(f"{name}: {len(seq.functions)} functions, {len(seq.variables)} variables "
              f"({len(per)} persistent, {format_size(seq.persistent_bytes())}), "
              f"{seq.meta['params']:,} params, {seq.total_flops() / 1e9:.2f} GFLOP/sample, "
              f"recorded in {seconds:.2f} s -> {path} ({os.path.getsize(path):,} bytes)")
        for b in BATCHES.get(name, (1, 8, 64)):
            print(f"  batch {b:4d}: in-core peak {format_size(seq.at_batch(b).in_core_peak())}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
