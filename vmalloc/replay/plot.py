"""Plots of replay results: requested and reserved bytes over a trace, per allocator.

The plot the fragmentation study is about (the paper's Figure 3, for your own trace): one
panel per trace, the event index across, bytes up (in the unit of the largest figure); the
bytes the trace asked for (the same for every allocator) and the bytes each allocator
reserved. The gap between the two is the waste.
Uses matplotlib's Agg canvas directly, so no display and no global backend are needed.
"""

from collections import OrderedDict

from vmalloc.sizes import binary_unit, format_size

__all__ = ["plot_results"]

# One colour per allocator, the same in every panel.
_COLORS = {"caching": "#d62728", "virtual": "#1f77b4"}
_OTHER_COLORS = ["#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


#: The suffixes --plot writes, and the matplotlib format of each.
PLOT_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def plot_format(path):
    """The image format ``path``'s suffix names; InvalidArgumentError for any other."""
    import os

    from vmalloc.errors import InvalidArgumentError

    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in PLOT_FORMATS:
        raise InvalidArgumentError(
            f"cannot tell the image format from {suffix or 'no suffix'!r}: name the file "
            + ", ".join("*" + s for s in PLOT_FORMATS))
    return PLOT_FORMATS[suffix]


def plot_results(results, path, title=None, dpi=110):
    """Writes a plot of ``results`` (:class:`vmalloc.replay.ReplayResult` with timelines) to
    ``path`` (PNG, SVG or PDF, as its suffix says; anything else is an InvalidArgumentError):
    one panel per trace, requested bytes in black and each allocator's reserved bytes in
    colour, the utilization of each in the legend and the panel title. Returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by_trace = OrderedDict()
    for result in results:
        if result.timeline is None:
            raise ValueError(f"result for {result.trace}/{result.allocator} has no timeline")
        by_trace.setdefault(result.trace, []).append(result)
    if not by_trace:
        raise ValueError("nothing to plot: no results")

    figure = Figure(figsize=(10, 4.4 * len(by_trace)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(by_trace), 1, squeeze=False)[:, 0]
    spare = iter(_OTHER_COLORS)
    colors = {}
    for ax, (trace, group) in zip(axes, by_trace.items()):
        # Requested bytes are the trace's, whatever the allocator: draw the longest run's.
        longest = max(group, key=lambda r: r.events)
        t = longest.timeline
        # The axis in the unit format_size gives the largest figure drawn, as in the labels.
        unit, scale = binary_unit(max([longest.peak_requested_bytes or 0]
                                      + [r.peak_reserved_bytes or 0 for r in group]
                                      + [r.capacity_bytes or 0 for r in group]))
        ax.step(t.events, t.requested_bytes / scale, where="post", color="black", lw=1.2,
                label=f"requested (peak {format_size(longest.peak_requested_bytes)})")
        parts = []
        for result in group:
            name = result.allocator
            if name not in colors:
                colors[name] = _COLORS.get(name) or next(spare, "#7f7f7f")
            t = result.timeline
            util = "-" if result.utilization is None else f"{result.utilization:.3f}"
            label = (f"reserved: {name} (peak {format_size(result.peak_reserved_bytes)}, "
                     f"utilization {util})")
            if result.min_capacity_bytes:
                label += f", runs in {format_size(result.min_capacity_bytes)}"
            if result.out_of_memory_event is not None:
                label += f", out of memory at event {result.out_of_memory_event:,}"
                ax.axvline(result.out_of_memory_event, color=colors[name], ls=":", lw=1)
            ax.step(t.events, t.reserved_bytes / scale, where="post", color=colors[name], lw=1.6,
                    label=label)
            parts.append(f"{name} {util}")
            if result.capacity_bytes:
                ax.axhline(result.capacity_bytes / scale, color="gray", ls="--", lw=0.8)
        ax.set_title(f"{trace}\nutilization (peak requested / peak reserved): "
                     + ", ".join(parts), fontsize=10)
        ax.set_xlabel("event index")
        ax.set_ylabel(unit)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        # Below the panel: memory curves fill any corner inside it.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, fontsize=8,
                  frameon=False)
    if title:
        figure.suptitle(title)
    figure.savefig(path, format=plot_format(path))
    return path
