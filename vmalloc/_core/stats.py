"""Allocator statistics (the same fields for every allocator)."""

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Stats:
    """A snapshot of an allocator's accounting, in bytes and counts.

    ``requested`` sums what callers asked for; ``allocated`` what was set aside for them
    (chunk- or block-rounded); ``reserved`` the physical device memory the allocator holds
    (allocated + cached). For live allocations the identities
    ``internal_fragmentation = allocated - requested`` and ``cached = reserved - allocated``
    always hold. Utilization, the paper's figure of merit, is
    ``peak_requested_bytes / peak_reserved_bytes``.
    """

    requested_bytes: int = 0
    peak_requested_bytes: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    internal_fragmentation_bytes: int = 0
    peak_internal_fragmentation_bytes: int = 0
    cached_bytes: int = 0
    live_allocations: int = 0
    peak_live_allocations: int = 0
    total_allocations: int = 0
    total_deallocations: int = 0
    out_of_memory_count: int = 0

    def to_dict(self):
        """The fields as a plain dict (for JSON)."""
        return asdict(self)

    @property
    def utilization(self):
        """peak requested / peak reserved (1.0 before anything was reserved)."""
        if self.peak_reserved_bytes == 0:
            return 1.0
        return self.peak_requested_bytes / self.peak_reserved_bytes

    @classmethod
    def field_names(cls):
        return [f.name for f in fields(cls)]


def format_memory_summary(stats, device=0):
    """``stats`` (a :class:`Stats`) as a table in the manner of ``torch.cuda.memory_summary()``:
    current, peak and total figures per row, sizes human-readable."""
    from vmalloc.sizes import format_size

    s = stats
    rows = [
        ("Requested memory", format_size(s.requested_bytes),
         format_size(s.peak_requested_bytes), "-"),
        ("Allocated memory", format_size(s.allocated_bytes),
         format_size(s.peak_allocated_bytes), "-"),
        ("Reserved memory", format_size(s.reserved_bytes),
         format_size(s.peak_reserved_bytes), "-"),
        ("Internal fragmentation", format_size(s.internal_fragmentation_bytes),
         format_size(s.peak_internal_fragmentation_bytes), "-"),
        ("Cached (reserved, free)", format_size(s.cached_bytes), "-", "-"),
        None,
        ("Allocations", f"{s.live_allocations:,}", f"{s.peak_live_allocations:,}",
         f"{s.total_allocations:,}"),
        ("Frees", "-", "-", f"{s.total_deallocations:,}"),
        ("Out-of-memory errors", "-", "-", f"{s.out_of_memory_count:,}"),
    ]

    def row(*cells):
        return f"| {cells[0]:<24} | {cells[1]:>12} | {cells[2]:>12} | {cells[3]:>12} |"

    width = len(row("", "", "", ""))
    rule, double = "|" + "-" * (width - 2) + "|", "|" + "=" * (width - 2) + "|"
    title = f"vmalloc memory summary, device {device}"
    util = f"utilization (peak requested / peak reserved): {s.utilization:.3f}"
    out = [double, "|" + title.center(width - 2) + "|", "|" + util.center(width - 2) + "|",
           double, row("Metric", "Current", "Peak", "Total"), rule]
    out += [rule if r is None else row(*r) for r in rows]
    out.append(double)
    return "\n".join(out)
