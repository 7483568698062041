"""Reading the graphs compile_out_of_core compiles (test_torch_compile.py,
test_torch_compile_hf.py): which activations the forward offloads, by the policy's keys."""

import torch


def region_keys(graph):
    """{node: (op name, occurrence)} for the forward graph's op nodes: the policy's keys (the
    forward graph runs the region's ops in order; node names are no key: their counters are
    shared across the graphs a process compiles)."""
    seen, keys = {}, {}
    for n in graph.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and n.target is not torch.ops.prims.device_put.default:
            name = str(n.target)
            keys[n] = (name, seen.get(name, 0))
            seen[name] = seen.get(name, 0) + 1
    return keys


def device_puts(graph):
    return [n for n in graph.graph.nodes if n.target is torch.ops.prims.device_put.default]


def offloaded_keys(forward):
    """The keys of the activations the forward graph offloads."""
    keys = region_keys(forward)
    puts = device_puts(forward)
    assert all(p.name.startswith("cpu_offload_") for p in puts)
    return [keys[p.args[0]] for p in puts]
