"""Out-of-core training, simulated: the paper's Table 1 for ResNet-50 on a V100 16 GB.

Hayakawa & Narihira train ResNet-50 at batch 1440 on a 16 GB V100 by swapping tensors to host
memory on a window-based schedule, with a virtual-addressing allocator so that the freed memory
never fragments. This example simulates their Table 1 with no GPU: each row is a batch size,
each column a (scheduler, allocator); every allocation of every simulated iteration goes through
a real vmalloc allocator on an emulated 16 GiB device, so "OOM" is the allocator's own verdict.
The scheduler's parameters (window, budget; LMS's threshold and look-ahead) are chosen by
simulation. Then it simulates batch 1440 once more and prints the schedule's summary.

Usage: python examples/offload_table.py [MODEL] [GPU]    (default resnet50 v100-16gb)
"""

import sys

from vmalloc.offload import model_sequence, plan, simulate
from vmalloc.offload.cli import table


def main(model="resnet50", gpu="v100-16gb"):
    t = table(model, gpu, batches=[64, 128, 190, 256, 512, 928, 1440])
    print(f"{model} on {gpu}: images/s; in-core limit batch {t['in_core_limit']}")
    cols = ["in_core", "window+caching", "window+virtual", "lms+virtual", "vdnn+virtual"]
    print(f"{'batch':>6}" + "".join(f"{c:>16}" for c in cols) + f"{'paper (VA)':>12}")
    for r in t["rows"]:
        cells = "".join(f"{'OOM' if r[c] is None else format(r[c], '.0f'):>16}" for c in cols)
        paper = r.get("paper_schedule_va")
        print(f"{r['batch']:>6}{cells}{'-' if paper is None else paper:>12}")

    seq = model_sequence(model, 1440)
    p = plan(seq, gpu, "window", "virtual")
    r = simulate(seq, p.schedule, gpu=gpu, allocator="virtual")
    print()
    print(r.summary())
    print(f"the bound max(compute, bytes / link) is {r.bound_seconds:.2f} s; with swap-outs and "
          f"swap-ins one after the other {r.serial_bound_seconds:.2f} s "
          f"(the iteration is x{r.serial_bound_ratio:.3f} of it)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
