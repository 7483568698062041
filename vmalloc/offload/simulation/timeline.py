"""A timeline plot of one simulated iteration (:func:`vmalloc.offload.simulate` with
``timeline=True``): the compute stream and both copy engines as bars over time, and the
memory requested and reserved against the budget and the capacity. Uses matplotlib's Agg
canvas directly (no display, no global backend)."""

from __future__ import annotations

from vmalloc.sizes import binary_unit

__all__ = ["plot_timeline"]


def plot_timeline(result, path, title=None, dpi=110):
    """Writes a PNG of ``result``'s timeline to ``path``; returns ``path``. Raises ValueError
    if the result has no timeline (simulate with ``timeline=True``) or ran out of memory."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tl = result.timeline
    if tl is None:
        raise ValueError("the result has no timeline: simulate(..., timeline=True)")
    figure = Figure(figsize=(11, 6), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[1, 2])
    lanes = [("compute", tl["compute"], "#2ca02c"), ("host→device", tl["h2d"], "#1f77b4"),
             ("device→host", tl["d2h"], "#d62728")]
    for y, (name, ivs, color) in enumerate(lanes):
        bars = [(s, e - s) for s, e, _ in ivs if e > s]
        if bars:
            top.broken_barh(bars, (2 - y - 0.4, 0.8), facecolors=color, linewidth=0)
    top.set_yticks([2, 1, 0], [name for name, _, _ in lanes])
    top.set_ylim(-0.6, 2.6)
    mem = tl["memory"]
    # Bytes in the unit vmalloc.format_size gives the capacity (the largest figure drawn).
    unit, scale = binary_unit(max([tl["capacity"], tl["budget"]] + [m[2] for m in mem]))
    if mem:
        ts = [m[0] for m in mem]
        bottom.step(ts, [m[1] / scale for m in mem], where="post", color="black",
                    label="requested")
        bottom.step(ts, [m[2] / scale for m in mem], where="post", color="#ff7f0e",
                    label=f"reserved ({result.allocator})")
    bottom.axhline(tl["budget"] / scale, color="#9467bd", linestyle="--", label="budget")
    bottom.axhline(tl["capacity"] / scale, color="grey", linestyle=":", label="capacity")
    bottom.set_ylabel(unit)
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right", fontsize="small")
    t = tl.get("iteration_seconds") or 0
    bottom.set_xlim(0, t * 1.01 if t else None)
    if title is None:
        title = result.summary() if not result.out_of_memory else "out of memory"
        if len(title) > 120:
            title = (f"{result.model} batch {result.batch} on {result.gpu}: {result.scheduler} + "
                     f"{result.allocator}, {result.images_per_second:.0f} images/s "
                     + (f"(relative_speed {result.relative_speed:.0%}, "
                        if result.relative_speed is not None else "(")
                     + f"same_batch_compute_ratio {result.speed_vs_compute_only:.0%}; "
                     f"{result.profile}, {result.precision})"
                     + f"; link {result.link}")
    top.set_title(title, fontsize="medium")
    figure.savefig(path)
    return path
