"""The allocator kinds, listed once: what ``vmalloc replay``, ``vmalloc stress``,
``vmalloc bench`` and the test suites build and compare.

A kind is a vmalloc allocator class with some constructor options fixed by the kind (``"virtual-
packed"`` is :class:`vmalloc.VirtualAllocator` with ``placement="packed"``), and the comparison
options that apply to it (a replay's ``chunk_size`` applies to the virtual allocators, its
``max_split_size`` to the caching ones).

>>> from vmalloc import allocator_kinds
>>> allocator_kinds.NAMES
('caching', 'expandable-segments', 'virtual', 'virtual-packed')
>>> allocator_kinds.get("virtual-packed").applicable(chunk_size="4MiB", policy="cupy")
{'chunk_size': 4194304}
"""

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from vmalloc.errors import InvalidArgumentError
from vmalloc.sizes import parse_size

__all__ = ["AllocatorKind", "KINDS", "NAMES", "accounting_device", "get", "make",
           "make_allocator"]


#: The comparison options, each with how its value is parsed: (value, name) -> value. The
#: allocator's constructor checks the rest (a policy's name, a slack's range).
_PARSERS = {
    "chunk_size": parse_size,
    "steal_before_create": lambda value, what: bool(value),
    "remap_slack": lambda value, what: float(value),
    "max_split_size": parse_size,
    "policy": lambda value, what: value,
}


@dataclass(frozen=True)
class AllocatorKind:
    """One allocator kind.

    ``class_name`` is the attribute of :mod:`vmalloc` that builds it; ``fixed`` the
    constructor options the kind sets itself; ``options`` the comparison options (of
    :func:`vmalloc.replay.replay`: ``chunk_size``, ``steal_before_create``, ``remap_slack``,
    ``max_split_size``, ``policy``) that apply to it.
    """

    name: str
    class_name: str
    fixed: Mapping[str, object]
    options: tuple
    summary: str

    @property
    def available(self):
        """Whether this build of vmalloc has the class."""
        import vmalloc

        return hasattr(vmalloc, self.class_name)

    def make(self, device, **options):
        """A new allocator of this kind on ``device``: the class built with the kind's fixed
        options and ``options`` (any keyword the class takes). Raises
        :class:`vmalloc.InvalidArgumentError` for an option that contradicts the kind."""
        import vmalloc

        for key, value in options.items():
            if key in self.fixed and value != self.fixed[key]:
                raise InvalidArgumentError(
                    f"allocator {self.name!r} is {self.class_name} with {key}="
                    f"{self.fixed[key]!r}; got {key}={value!r}")
        cls = getattr(vmalloc, self.class_name, None)
        if cls is None:
            raise InvalidArgumentError(f"allocator {self.name!r} (vmalloc.{self.class_name}) "
                                       "is not built")
        return cls(device, **{**self.fixed, **options})

    def applicable(self, **options):
        """Of the comparison ``options``, those that apply to this kind and are not None,
        parsed (sizes to ints); the others are dropped, so that one set of options serves a
        comparison of several kinds. Raises :class:`vmalloc.InvalidArgumentError` for a name
        that is no comparison option, and for a value that does not parse."""
        unknown = sorted(set(options) - set(_PARSERS))
        if unknown:
            raise InvalidArgumentError(f"unknown allocator option {unknown[0]!r}; known: "
                                       f"{', '.join(_PARSERS)}")
        return {key: _PARSERS[key](value, key) for key, value in options.items()
                if key in self.options and value is not None}


_VIRTUAL_OPTIONS = ("chunk_size", "steal_before_create")

#: Every kind by name, in the order comparisons list them.
KINDS = MappingProxyType({kind.name: kind for kind in (
    AllocatorKind(
        "caching", "CachingAllocator", MappingProxyType({}),
        ("max_split_size", "policy"),
        "the best-fit caching baseline (PyTorch's CUDACachingAllocator; policy nnabla or cupy "
        "for theirs)"),
    AllocatorKind(
        "expandable-segments", "CachingAllocator",
        MappingProxyType({"expandable_segments": True}), ("max_split_size",),
        "the caching allocator with PyTorch's expandable_segments:True"),
    AllocatorKind(
        "virtual", "VirtualAllocator", MappingProxyType({"placement": "chunks"}),
        _VIRTUAL_OPTIONS,
        "the virtual-addressing allocator, each request on whole chunks (the paper's)"),
    AllocatorKind(
        "virtual-packed", "VirtualAllocator", MappingProxyType({"placement": "packed"}),
        _VIRTUAL_OPTIONS + ("remap_slack",),
        "the virtual-addressing allocator, requests packed back to back over shared chunks"),
)})

#: The kinds' names, in order.
NAMES = tuple(KINDS)


def get(name):
    """The :class:`AllocatorKind` named ``name``; :class:`vmalloc.InvalidArgumentError` naming
    the known ones for any other name."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown allocator {name!r}; choose from {', '.join(NAMES)}") from None


def make(name, device, **options):
    """A new allocator of kind ``name`` on ``device`` (see :meth:`AllocatorKind.make`)."""
    return get(name).make(device, **options)


def make_allocator(kind, device, **options):
    """The package's one allocator factory (replay, stress, bench and the simulator build
    through it): the allocator ``kind`` on ``device``.

    ``kind`` is the name of one of :data:`KINDS`: ``"caching"``
    (:class:`vmalloc.CachingAllocator`, which takes ``max_split_size`` and ``policy``),
    ``"expandable-segments"`` (the same with ``expandable_segments=True``, PyTorch's
    ``expandable_segments:True``), ``"virtual"`` (:class:`vmalloc.VirtualAllocator`, which
    takes ``chunk_size`` and ``steal_before_create``), ``"virtual-packed"`` (the same with
    ``placement="packed"``, which also takes ``remap_slack``); or a callable
    ``kind(device) -> Allocator`` for anything else. ``options`` are comparison options
    (:meth:`AllocatorKind.applicable`): those that do not apply to the kind, and those that
    are None, are ignored, so that one set of options serves a comparison.
    """
    if callable(kind):
        return kind(device)
    return make(kind, device, **get(kind).applicable(**options))


def accounting_device(capacity=None, granularity=None):
    """The package's one accounting-only device (replay, bench and the simulator run on it):
    a fresh :class:`vmalloc.HostDevice` with ``backed=False``, which keeps the books of
    capacity, mappings and driver calls but holds no memory. ``capacity`` and ``granularity``
    (bytes or size strings) default to the HostDevice's own (unlimited; 2 MiB) when None."""
    import vmalloc

    options = {"backed": False}
    if capacity is not None:
        options["capacity"] = capacity
    if granularity is not None:
        options["granularity"] = granularity
    return vmalloc.HostDevice(**options)
