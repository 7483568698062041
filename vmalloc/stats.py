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
