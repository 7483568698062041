"""The text report of replay results: a table per trace, the traces side by side, and the
note on memory a trace frees without allocating it."""

from vmalloc.sizes import format_size


def format_table(results):
    """A readable report of results: per trace, one column per allocator."""
    rows = [
        ("events replayed", lambda r: f"{r.events:,}" + ("" if r.completed else " (stopped)")),
        ("peak requested", lambda r: format_size(r.peak_requested_bytes)),
        ("peak reserved", lambda r: format_size(r.peak_reserved_bytes)),
        ("utilization", lambda r: "-" if r.utilization is None else f"{r.utilization:.3f}"),
        ("peak internal fragmentation",
         lambda r: format_size(r.peak_internal_fragmentation_bytes)),
        ("peak live allocations", lambda r: f"{r.peak_live_allocations:,}"),
        ("driver calls: memory mgmt / all",
         lambda r: f"{r.memory_management_calls:,} / {r.driver_calls:,}"),
        ("modeled driver time", lambda r: _format_seconds(r.modeled_driver_seconds)),
        ("out of memory at",
         lambda r: "-" if r.out_of_memory_event is None else
         f"event {r.out_of_memory_event:,} ({format_size(r.out_of_memory_request_bytes)})"),
        ("min capacity that runs it", _format_min_capacity),
        ("utilization at min capacity",
         lambda r: "-" if r.min_capacity_utilization is None else
         f"{r.min_capacity_utilization:.3f}"),
    ]
    blocks = []
    traces = list(dict.fromkeys(r.trace for r in results))
    for trace in traces:
        group = [r for r in results if r.trace == trace]
        header = trace
        notes = []
        if group[0].device is not None:
            notes.append(group[0].device)
        if group[0].capacity_bytes is not None:
            notes.append(f"capacity {format_size(group[0].capacity_bytes)}")
        if notes:
            header += f" ({', '.join(notes)})"
        table = [[""] + [r.allocator for r in group]]
        table += [[label] + [fmt(r) for r in group] for label, fmt in rows]
        recorded = _recorded_column(group[0], [label for label, _ in rows])
        if recorded:
            # What PyTorch itself reserved, as its profiler recorded: the allocator the trace
            # ran under, next to what each replayed allocator would reserve.
            table[0].append("pytorch (recorded)")
            for row, cell in zip(table[1:], recorded):
                row.append(cell)

        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [header]
        for row in table:
            lines.append("  " + "  ".join(
                cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                for i, cell in enumerate(row)).rstrip())
        note = before_window_note(group[0])
        if note:
            lines.append("  " + note)
        blocks.append("\n".join(lines))
    if len(traces) > 1:
        blocks.append(format_summary(results))
    return "\n\n".join(blocks)


def format_summary(results):
    """The traces side by side (the ranks of one job, say): one row per trace, its peak
    requested bytes, then each allocator's peak reserved bytes and utilization, and PyTorch's
    recorded ones when a profiler trace has them."""
    traces = list(dict.fromkeys(r.trace for r in results))
    kinds = list(dict.fromkeys(r.allocator for r in results))
    by = {(r.trace, r.allocator): r for r in results}
    header = ["trace", "device", "peak requested"] + [f"{k} reserved (util.)" for k in kinds]
    recorded = any(r.recorded_peak_reserved_bytes is not None for r in results)
    if recorded:
        header.append("pytorch reserved (util.)")
    table = [header]
    for trace in traces:
        group = [r for r in results if r.trace == trace]
        row = [trace, group[0].device or "-",
               format_size(max(r.peak_requested_bytes for r in group))]
        for k in kinds:
            r = by.get((trace, k))
            if r is None:
                row.append("-")
                continue
            util = "-" if r.utilization is None else f"{r.utilization:.3f}"
            stopped = "" if r.completed else ", stopped"
            row.append(f"{format_size(r.peak_reserved_bytes)} ({util}{stopped})")
        if recorded:
            r = group[0]
            if r.recorded_peak_reserved_bytes is None:
                row.append("-")
            else:
                util = "-"
                if r.recorded_peak_allocated_bytes is not None and r.recorded_peak_reserved_bytes:
                    util = (f"{r.recorded_peak_allocated_bytes / r.recorded_peak_reserved_bytes:.3f}")
                row.append(f"{format_size(r.recorded_peak_reserved_bytes)} ({util})")
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["side by side"]
    for row in table:
        lines.append("  " + "  ".join(
            cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i])
            for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines)


def before_window_note(r):
    """One line on the memory a trace frees without allocating it (None when it frees none
    or it is unknown)."""
    if r.unmatched_frees is None:
        return None
    text = (f"frees of memory the trace never allocated: {r.unmatched_frees:,} "
            f"({format_size(r.unmatched_free_bytes)})")
    if r.before_window == "live":
        if not r.live_before_window_bytes:
            return text if r.unmatched_frees else None
        return (text + f"; {format_size(r.live_before_window_bytes)} live before the trace "
                "began, replayed as allocated from the start")
    if not r.unmatched_frees:
        return None
    return text + "; dropped (--before-window live replays that memory from the start)"


def double_free_note(r):
    """One line on the trace's double frees (frees of memory it freed already), or None."""
    if not r.double_frees:
        return None
    return (f"double frees: {r.double_frees:,} (frees of memory the trace had freed already "
            "and not allocated again); dropped")


def _recorded_column(r, labels):
    """The cells of the "pytorch (recorded)" column for rows ``labels``, or None when the
    trace recorded no counters."""
    if r.recorded_peak_reserved_bytes is None:
        return None
    cells = {"peak reserved": format_size(r.recorded_peak_reserved_bytes)}
    if r.recorded_peak_allocated_bytes is not None:
        cells["peak requested"] = format_size(r.recorded_peak_allocated_bytes)
        if r.recorded_peak_reserved_bytes:
            cells["utilization"] = (
                f"{r.recorded_peak_allocated_bytes / r.recorded_peak_reserved_bytes:.3f}")
    return [cells.get(label, "") for label in labels]


def _format_min_capacity(r):
    if r.min_capacity_bytes is None:
        if r.min_capacity_exact is None:
            return "-"  # not searched
        if not r.completed and r.capacity_bytes is None:
            return "none (refused even unlimited)"
        return "none found"
    text = format_size(r.min_capacity_bytes)
    return text if r.min_capacity_exact else text + " (upper bound)"


def _format_seconds(seconds):
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"
