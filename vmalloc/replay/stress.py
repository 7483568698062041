"""Allocation patterns that break best-fit caching, as replayable traces.

Each generator is deterministic for a given ``seed`` and returns one NumPy array of
:data:`vmalloc.traces.events.EVENT_DTYPE` events (every allocation has its own trace address,
all on the default stream), to be replayed with :func:`vmalloc.replay.replay` or
``vmalloc stress``:

- :func:`swap_pattern`: out-of-core training as a window scheduler drives it. Tensors of many
  sizes are swapped in (allocated) in execution order and swapped out (freed) oldest first
  once the window's byte budget is exceeded, forward then backward, every iteration starting
  at a shifted layer. The set of tensors resident together keeps changing, so best-fit
  caching splits its cached blocks ever finer.
- :func:`growing_pattern`: a few tensors per step whose sizes grow step after step (growing
  sequence lengths, progressive resizing): a freed block is always too small for the next
  request, so a caching allocator keeps every old block and reserves anew.
- :func:`survivors_pattern`: random sizes, mostly short-lived, with a few long-lived
  survivors that pin the cached segments they were carved from, while the sizes grow phase
  after phase.

:func:`trace_peaks` computes what any allocator must report for a pattern (peak requested
bytes and peak live allocations) and the physical need of chunk-rounded allocation, exactly.
"""

import numpy as np

from vmalloc.errors import InvalidArgumentError
from vmalloc.traces.events import ALLOC, EVENT_DTYPE, FREE

__all__ = ["PATTERNS", "generate", "growing_pattern", "survivors_pattern", "swap_pattern",
           "trace_peaks"]

MiB = 1 << 20
#: Trace addresses of generated allocations: far from zero, 4 KiB apart, never reused.
_BASE_ADDRESS = 0x7F0000000000


class _Builder:
    def __init__(self):
        self.ops, self.addrs, self.sizes = [], [], []
        self.next_id = 0

    def alloc(self, size):
        addr = _BASE_ADDRESS + (self.next_id << 12)
        self.next_id += 1
        self.ops.append(ALLOC)
        self.addrs.append(addr)
        self.sizes.append(int(size))
        return addr

    def free(self, addr, size=0):
        self.ops.append(FREE)
        self.addrs.append(addr)
        self.sizes.append(int(size))

    def events(self):
        out = np.zeros(len(self.ops), dtype=EVENT_DTYPE)
        out["op"] = self.ops
        out["addr"] = self.addrs
        out["size"] = self.sizes
        return out


def _log_uniform_sizes(rng, n, low, high, quantum=512):
    """`n` sizes spread evenly in log scale over [low, high], multiples of `quantum`."""
    raw = np.exp(rng.uniform(np.log(low), np.log(high), size=n))
    return np.maximum(quantum, (raw // quantum).astype(np.int64) * quantum)


def _check_positive(**values):
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


def swap_pattern(layers=64, iterations=6, window_bytes=512 * MiB, min_size=1 * MiB,
                 max_size=96 * MiB, shift=5, seed=0):
    """The out-of-core swap pattern of a window scheduler.

    Each of ``layers`` layers owns a tensor of a size drawn log-uniformly from
    [``min_size``, ``max_size``]. An iteration visits the layers forward then backward,
    starting at layer ``(iteration * shift) % layers``; each visit swaps the layer's tensor
    in (an allocation), then swaps out (frees) the oldest resident tensors until the resident
    bytes are back within ``window_bytes``. Everything is freed at the end.
    """
    _check_positive(layers=layers, iterations=iterations, window_bytes=window_bytes,
                    min_size=min_size, max_size=max_size)
    if min_size > max_size:
        raise InvalidArgumentError(f"min_size {min_size} is larger than max_size {max_size}")
    rng = np.random.default_rng(seed)
    sizes = _log_uniform_sizes(rng, layers, min_size, max_size)
    b = _Builder()
    resident = []  # (addr, size), oldest first
    resident_bytes = 0
    for iteration in range(iterations):
        start = (iteration * shift) % layers
        forward = [(start + i) % layers for i in range(layers)]
        for layer in forward + forward[::-1]:
            size = int(sizes[layer])
            resident.append((b.alloc(size), size))
            resident_bytes += size
            while resident_bytes > window_bytes and len(resident) > 1:
                addr, old = resident.pop(0)
                b.free(addr, old)
                resident_bytes -= old
    for addr, size in resident:
        b.free(addr, size)
    return b.events()


def growing_pattern(steps=40, tensors=4, start_size=2 * MiB, growth=1 * MiB + 4096, seed=0):
    """Sizes that grow every step.

    Step ``k`` allocates ``tensors`` tensors of about ``start_size + k * growth`` bytes (each
    jittered by up to 10 %) and then frees the previous step's. So at most ``2 * tensors``
    are live, and every request is larger than any block freed before it.
    """
    _check_positive(steps=steps, tensors=tensors, start_size=start_size, growth=growth)
    rng = np.random.default_rng(seed)
    b = _Builder()
    previous = []
    for step in range(steps):
        base = start_size + step * growth
        current = []
        for _ in range(tensors):
            size = int(base * (1 + 0.1 * rng.random())) // 512 * 512
            current.append((b.alloc(size), size))
        for addr, size in previous:
            b.free(addr, size)
        previous = current
    for addr, size in previous:
        b.free(addr, size)
    return b.events()


def survivors_pattern(allocations=4000, min_size=4096, max_size=64 * MiB,
                      survivor_fraction=0.03, max_lifetime=24, phases=4, growth=2.0, seed=0):
    """Random sizes with long-lived survivors.

    ``allocations`` allocations in ``phases`` equal phases; in phase ``p`` sizes are drawn
    log-uniformly from [``min_size``, ``max_size``] times ``growth ** p`` (a job whose tensors
    grow stage after stage). Each allocation survives to the end with probability
    ``survivor_fraction``; the others are freed after 1 to ``max_lifetime`` further
    allocations. Survivors pin the cached segments they were carved from, and the holes
    around them are too small for the next phase.
    """
    _check_positive(allocations=allocations, min_size=min_size, max_size=max_size,
                    max_lifetime=max_lifetime, phases=phases)
    if not 0 <= survivor_fraction <= 1:
        raise InvalidArgumentError(
            f"survivor_fraction must be between 0 and 1, got {survivor_fraction!r}")
    if not growth >= 1:
        raise InvalidArgumentError(f"growth must be at least 1, got {growth!r}")
    rng = np.random.default_rng(seed)
    per_phase = max(1, allocations // phases)
    scale = np.float64(growth) ** np.minimum(np.arange(allocations) // per_phase, phases - 1)
    raw = np.exp(rng.uniform(np.log(min_size), np.log(max_size), size=allocations)) * scale
    sizes = np.maximum(512, (raw // 512).astype(np.int64) * 512)
    survives = rng.random(allocations) < survivor_fraction
    lifetimes = rng.integers(1, max_lifetime + 1, size=allocations)
    b = _Builder()
    due = {}  # allocation index -> [(addr, size)] freed just before it
    survivors = []
    for i in range(allocations):
        for addr, size in due.pop(i, ()):
            b.free(addr, size)
        size = int(sizes[i])
        addr = b.alloc(size)
        if survives[i]:
            survivors.append((addr, size))
        else:
            due.setdefault(i + int(lifetimes[i]), []).append((addr, size))
    for i in sorted(due):
        for addr, size in due[i]:
            b.free(addr, size)
    for addr, size in survivors:
        b.free(addr, size)
    return b.events()


#: name -> generator, for ``vmalloc stress NAME``.
PATTERNS = {
    "swap": swap_pattern,
    "growing": growing_pattern,
    "survivors": survivors_pattern,
}


def generate(pattern, seed=0, scale=1, **params):
    """The events of stress pattern ``pattern`` (a key of :data:`PATTERNS`).

    ``params`` are passed to the generator. ``scale`` repeats the pattern that many times
    back to back (each repetition with addresses of its own; every pattern frees all it
    allocated at its end), for long traces with the pattern's own peaks.
    """
    try:
        generator = PATTERNS[pattern]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown stress pattern {pattern!r}; choose from {', '.join(PATTERNS)}") from None
    _check_positive(scale=scale)
    events = generator(seed=seed, **params)
    if scale == 1:
        return events
    out = np.tile(events, scale)
    span = (int(events["addr"].max()) - _BASE_ADDRESS + 4096) if len(events) else 0
    out["addr"] += np.repeat(np.arange(scale, dtype=np.uint64) * np.uint64(span), len(events))
    return out


def trace_peaks(events, chunk_size=None):
    """Exact figures every allocator must reproduce for ``events``.

    Returns a dict with ``peak_requested_bytes`` and ``peak_live_allocations`` (the largest
    sum of live sizes and count of live allocations; zero-size allocations are not counted,
    as allocators return null for them) and, given ``chunk_size``, ``peak_chunked_bytes``:
    the largest sum over live allocations of their sizes rounded up to whole chunks, the
    physical memory an allocator that reuses any free chunk for any request needs.
    """
    events = np.asarray(events)
    is_alloc = events["op"] == ALLOC
    sizes = events["size"].astype(np.int64)
    addrs = events["addr"]
    # A free's size is taken from its allocation (the free's own size field may be 0).
    live_size = {}
    delta = np.zeros(len(events), dtype=np.int64)
    count = np.zeros(len(events), dtype=np.int64)
    chunked = np.zeros(len(events), dtype=np.int64)
    chunk = int(chunk_size) if chunk_size else 0
    for i in range(len(events)):
        a = int(addrs[i])
        if is_alloc[i]:
            size = int(sizes[i])
            if a in live_size:  # a reused address: its free was lost
                old = live_size.pop(a)
                if old:
                    delta[i] -= old
                    count[i] -= 1
                    chunked[i] -= -(-old // chunk) * chunk if chunk else 0
            live_size[a] = size
            if size:
                delta[i] += size
                count[i] += 1
                chunked[i] += -(-size // chunk) * chunk if chunk else 0
        elif a in live_size:
            size = live_size.pop(a)
            if size:
                delta[i] -= size
                count[i] -= 1
                chunked[i] -= -(-size // chunk) * chunk if chunk else 0
    out = {
        "peak_requested_bytes": int(np.cumsum(delta).max(initial=0)),
        "peak_live_allocations": int(np.cumsum(count).max(initial=0)),
    }
    if chunk:
        out["peak_chunked_bytes"] = int(np.cumsum(chunked).max(initial=0))
    return out
