"""The answer of ``vmalloc replay``: would virtual addressing fix this trace's fragmentation?

One line per trace from its :class:`~vmalloc.replay.ReplayResult` objects: the best virtual
allocator against best-fit caching (PyTorch's policy), by the smallest device that runs the
trace when it was searched (the fair figure: see docs/tutorial_fragmentation.rst), else by
peak reserved bytes; how much reserved memory it saves; the smallest device that runs it.
"""

from vmalloc.sizes import format_size

__all__ = ["verdict", "verdicts", "FIXES", "HELPS"]

#: A saving of at least this fraction of caching's memory is called a fix ("yes") ...
FIXES = 0.05
#: ... and a smaller positive one "a little": the job needs that memory, whatever allocates it.
HELPS = 0.0


def _need(r):
    """What ``r`` needs to run the trace: (bytes, how it was measured), or None."""
    if r.min_capacity_bytes is not None:
        return r.min_capacity_bytes, "min capacity"
    if r.completed and r.min_capacity_exact is None and r.peak_reserved_bytes:
        return r.peak_reserved_bytes, "peak reserved"
    return None


def _pct(part, whole):
    return f"{100 * part / whole:.0f} %"


def verdict(group):
    """The verdict line for the results of one trace (several allocators)."""
    caching = next((r for r in group if r.allocator == "caching"), None)
    virtual = [r for r in group if isinstance(r.allocator, str)
               and r.allocator.startswith("virtual")]
    ran = [r for r in virtual if r.completed]
    if caching is None or not virtual:
        known = [r for r in group if r.min_capacity_bytes is not None]
        return ("verdict: none: replay through both caching and a virtual allocator "
                "(-a caching,virtual,virtual-packed) to compare"
                + "".join(f"; {r.allocator} runs it on {format_size(r.min_capacity_bytes)}"
                          for r in known))
    if not ran:
        return ("verdict: no allocator runs this trace"
                + (f" under --capacity {format_size(caching.capacity_bytes)}"
                   if caching.capacity_bytes is not None else "")
                + ": the job needs more memory than that, whatever allocates it")
    best = min(ran, key=lambda r: (_need(r) or (float("inf"),))[0])
    smallest = (f"the smallest device that runs it: {format_size(best.min_capacity_bytes)} "
                f"({best.allocator}"
                + (f"; caching: {format_size(caching.min_capacity_bytes)})"
                   if caching.min_capacity_bytes is not None else ")")
                if best.min_capacity_bytes is not None else
                "smallest device not searched (--no-min-capacity)")
    if not caching.completed:
        return (f"verdict: yes, virtual addressing fixes this trace: caching runs out of "
                f"memory at event {caching.out_of_memory_event:,} where {best.allocator} runs "
                f"it whole; {smallest}")
    need_c, need_v = _need(caching), _need(best)
    if need_c is None or need_v is None:
        return f"verdict: no comparison (a run did not finish); {smallest}"
    if need_c[0] == 0:   # (the percentages below divide by it)
        return ("verdict: no, the trace allocates no memory (caching needs 0 B): there is "
                "nothing to fragment")
    saved = need_c[0] - need_v[0]
    reserved = caching.peak_reserved_bytes - best.peak_reserved_bytes
    saves = (f"{best.allocator} needs {format_size(saved)} less than caching "
             f"({format_size(need_v[0])} against {format_size(need_c[0])} {need_c[1]}, "
             f"{_pct(saved, need_c[0])}) and reserves {format_size(reserved)} less at peak"
             if reserved >= 0 else
             f"{best.allocator} needs {format_size(saved)} less than caching "
             f"({format_size(need_v[0])} against {format_size(need_c[0])} {need_c[1]}, "
             f"{_pct(saved, need_c[0])}), though it reserves "
             f"{format_size(-reserved)} more at peak with no capacity set")
    if saved >= FIXES * need_c[0]:
        return f"verdict: yes, virtual addressing fixes this trace's fragmentation: {saves}; " \
               f"{smallest}"
    if saved > HELPS * need_c[0]:
        return (f"verdict: a little: {saves}; the rest is memory the job needs (reduce it: "
                f"a smaller batch, checkpointing, swapping); {smallest}")
    return (f"verdict: no, caching already runs this trace in as little memory "
            f"({format_size(need_c[0])} {need_c[1]}, the best virtual allocator "
            f"{format_size(need_v[0])}); {smallest}")


def verdicts(results):
    """``[(trace, line)]``: one verdict per trace, in the order of ``results``."""
    traces = list(dict.fromkeys(r.trace for r in results))
    return [(t, verdict([r for r in results if r.trace == t])) for t in traces]
