"""A per-tensor plan you can read: what the planner chose for each class of variable.

:func:`plan_table` groups a schedule's variables by *class* -- the operator that produces them
(``convolution``, ``native_batch_norm``, ...), ``parameters and state`` for persistent ones,
``input`` for data from outside -- and counts, per class, what the schedule does with them:

- **keep**: never leaves the device (no swap, no drop, no recompute);
- **swap**: swapped out and/or in (bytes on the link, both directions, at their compressed
  size when compressed);
- **drop**: released with no copy at least once (its host copy was valid);
- **recompute**: re-created by re-running its producer before a later read;
- **compress**: swapped as fp16/bf16.

With the simulation's result it also gives the predicted step time and its **bottleneck**: the
busiest of the compute stream (compute + re-runs), the host-to-device and the device-to-host
copy engines.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["plan_table", "format_plan", "bottleneck"]

CHOICES = ("keep", "swap", "drop", "recompute", "compress")


def _class_of(seq, writer, v):
    var = seq.variables[v]
    if var.persistent:
        return "parameters and state"
    f = writer.get(v)
    if f is None:
        return "input"
    name = seq.functions[f].name
    if name.startswith("recompute:"):
        name = name[len("recompute:"):]
    parts = name.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[0]


def bottleneck(result) -> str:
    """``"compute"``, ``"H2D"`` or ``"D2H"``: whichever is busiest over the iteration."""
    busy = {"compute": result.compute_seconds, "H2D": result.h2d_seconds,
            "D2H": result.d2h_seconds}
    return max(busy, key=busy.get)


def plan_table(seq, schedule, result=None) -> dict:
    """Per class: variables, bytes, and per choice the variables and the bytes it moves."""
    ex = schedule.sequence_of(seq)
    clones = schedule.recompute.clones if schedule.recompute is not None else {}
    writer = {}
    for f in ex.functions:
        for v in f.outputs:
            if v not in writer:
                writer[v] = f.index
    orig = lambda v: clones.get(v, v)      # noqa: E731 (a clone counts as its original)
    moved = {}
    for v in schedule.swapped_out() + schedule.swapped_in():
        moved[orig(v)] = moved.get(orig(v), 0) + schedule.moved_bytes(seq, v)
    dropped = {orig(v) for v in schedule.dropped()}
    recomputed = set(clones.values())
    compressed = {orig(v) for v in schedule.compressed}
    rows = OrderedDict()
    for var in seq.variables:
        v = var.id
        cls = _class_of(ex, writer, v)
        row = rows.setdefault(cls, {"variables": 0, "bytes": 0,
                                    **{c: 0 for c in CHOICES},
                                    **{c + "_bytes_moved": 0 for c in CHOICES}})
        row["variables"] += 1
        row["bytes"] += var.nbytes
        m = moved.get(v, 0)
        chosen = []
        if v in recomputed:
            chosen.append("recompute")
        if v in dropped:
            chosen.append("drop")
        if m:
            chosen.append("compress" if v in compressed else "swap")
        if not chosen:
            chosen.append("keep")
        for c in chosen:
            row[c] += 1
        if m:
            row[("compress" if v in compressed else "swap") + "_bytes_moved"] += m
    out = {"classes": rows, "scheduler": schedule.scheduler, "params": dict(schedule.params),
           "recomputed_functions": schedule.recomputed_functions(),
           "compression": schedule.compression if schedule.compressed else None}
    if result is not None and not result.out_of_memory:
        out.update(step_seconds=result.iteration_seconds, bottleneck=bottleneck(result),
                   compute_seconds=result.compute_seconds, h2d_seconds=result.h2d_seconds,
                   d2h_seconds=result.d2h_seconds, link=result.link,
                   recompute_seconds=result.recompute_seconds,
                   swapped_out_bytes=result.swapped_out_bytes,
                   swapped_in_bytes=result.swapped_in_bytes)
    return out


def format_plan(table) -> str:
    """The table as text: one line per class, largest first."""
    from vmalloc.sizes import format_size

    lines = [f"{'class':<28} {'vars':>5} {'bytes':>10}  {'keep':>4} {'swap':>4} {'drop':>4} "
             f"{'recomp':>6} {'compr':>5}  {'moved by swap':>13} {'by compress':>11}"]
    rows = sorted(table["classes"].items(), key=lambda kv: -kv[1]["bytes"])
    for cls, r in rows:
        lines.append(f"{cls[:28]:<28} {r['variables']:>5} {format_size(r['bytes']):>10}  "
                     f"{r['keep']:>4} {r['swap']:>4} {r['drop']:>4} {r['recompute']:>6} "
                     f"{r['compress']:>5}  {format_size(r['swap_bytes_moved']):>13} "
                     f"{format_size(r['compress_bytes_moved']):>11}")
    if "step_seconds" in table:
        lines.append(
            f"predicted step {table['step_seconds'] * 1e3:.1f} ms, bottleneck "
            f"{table['bottleneck']} (compute {table['compute_seconds'] * 1e3:.1f} ms incl. "
            f"{table['recompute_seconds'] * 1e3:.1f} ms re-run by "
            f"{table['recomputed_functions']} functions; H2D busy "
            f"{table['h2d_seconds'] * 1e3:.1f} ms; D2H busy {table['d2h_seconds'] * 1e3:.1f} "
            f"ms); link {table['link']}")
    return "\n".join(lines)
