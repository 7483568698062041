"""Plan out-of-core training with recompute considered, and read the per-tensor plan.

A small forward/backward network on a 1 GiB model of a V100: the planner searches the window
scheduler's window and budget continuously, tries recomputing memory-bound variables (and
convolutions, when that pays) instead of swapping them, drops what the host already holds, and
prints, per variable class, what it chose and the bytes each choice moves.

    python examples/offload_plan_recompute.py
"""

from vmalloc.offload import FunctionSequence, plan
from vmalloc.offload.hardware.gpus import get_gpu
from vmalloc.offload.planning.plan_report import format_plan, plan_table

MiB = 1 << 20


def network(layers=16, size=64 * MiB):
    seq = FunctionSequence(name="net", batch=1)
    x = seq.add_variable(size, name="x")
    prev, saved = x, []
    for k in range(layers):
        w = seq.add_variable(MiB, persistent=True, name=f"w{k}")
        c = seq.add_variable(size, name=f"c{k}")
        b = seq.add_variable(size, name=f"b{k}")
        seq.add_function([prev, w], [c], flops=2e10, name="aten.convolution.default")
        seq.add_function([c], [b], flops=0.0, name="aten.native_batch_norm.default")
        seq.add_function([b], [b], flops=0.0, name="aten.relu_.default")
        saved.append((prev, w, c, b))
        prev = b
    g = seq.add_variable(size, name="g")
    seq.add_function([prev], [g], name="loss")
    for k in reversed(range(layers)):
        inp, w, c, b = saved[k]
        gi = seq.add_variable(seq.nbytes(inp), name=f"g{k}")
        gw = seq.add_variable(MiB, name=f"gw{k}")
        seq.add_function([g, b], [g], flops=0.0, name="aten.threshold_backward.default")
        seq.add_function([g, c], [g], flops=0.0, name="aten.native_batch_norm_backward.default")
        seq.add_function([g, inp, w], [gi, gw], flops=4e10, name="aten.convolution_backward.default")
        seq.add_function([w, gw], [w], name="sgd")
        g = gi
    return seq


seq = network()
# a V100 with 1 GiB behind a PCIe 3 link (about 12 GB/s each way, numbers.md)
gpu = get_gpu("v100-16gb").with_(name="v100-1gib-pcie3", memory_bytes=1 << 30, h2d_bandwidth=12e9,
                                 d2h_bandwidth=12e9, bidirectional_bandwidth=12e9,
                                 link="PCIe 3 x16")
swap_only = plan(seq, gpu, "window", "virtual")
best = plan(seq, gpu, "window", "virtual", recompute=True)
for label, p in (("swap only", swap_only), ("recompute considered", best)):
    r = p.result
    print(f"{label}: {r.iteration_seconds * 1e3:.1f} ms per step, "
          f"{(r.swapped_out_bytes + r.swapped_in_bytes) / 2**30:.2f} GiB over the link, "
          f"params {p.params}")
print(format_plan(plan_table(seq, best.schedule, best.result)))
assert best.result.iteration_seconds <= swap_only.result.iteration_seconds
assert best.result.recomputed_functions > 0
