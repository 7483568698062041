# vmalloc.offload._window_loop, compiled: its stub, by scripts/make-stubs (docs in the .pyx).
from typing import Any

def window_loop(n, nvar, sizes, persistent, fvar, fnext, bounds, fnin, first_reads, outs, out_bounds, state, hvalid, held, budget, window, use_drop, drop, wait_swap_out, allocate, swap_in, wait_swap_in, free_, swap_out) -> Any: ...
