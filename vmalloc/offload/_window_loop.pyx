# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The window scheduler's main loop, compiled (issue 22 item 6: 10^5 functions in a second).

The same decisions, in the same order, as the Python loop in ``vmalloc/offload/window.py``
(``WindowScheduler._schedule_py``), which stays as the reference (and serves ``trace=``):
``tests/offload/test_window_compiled.py`` compares the two step by step, and
``tests/offload/test_schedule_pinned.py`` pins the schedules. Byte figures are C ``int64``:
the caller passes no total above ``2**62`` (it falls back to the Python loop otherwise), so no
sum here can overflow.
"""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

# variable states (as in window.py)
cdef enum:
    ABSENT = 0
    ON_HOST = 1
    HELD = 2
    SWAPPING_OUT = 3
    DROPPING = 4


def window_loop(int64_t n, int64_t nvar, const int64_t[::1] sizes,
                const unsigned char[::1] persistent, const int64_t[::1] fvar,
                const int64_t[::1] fnext, const int64_t[::1] bounds, const int64_t[::1] fnin,
                const unsigned char[::1] first_reads, const int64_t[::1] outs,
                const int64_t[::1] out_bounds, unsigned char[::1] state,
                unsigned char[::1] hvalid, int64_t held, int64_t budget, int64_t window,
                bint use_drop, list drop, list wait_swap_out, list allocate, list swap_in,
                list wait_swap_in, list free_, list swap_out):
    """Fills the per-function action lists (``drop[i]`` ... ``swap_out[i]``: lists of variable
    ids) in place. ``fvar[bounds[i]:bounds[i+1]]`` are function i's managed variables (reads
    first, ``fnin[i]`` of them), ``fnext`` their next uses (window.py's encoding), ``outs`` /
    ``out_bounds`` every output of each function. ``state`` and ``hvalid`` are the initial
    states, updated in place. Returns ``(-1, end, end_drop)`` (the swap-outs and pending drops
    left in flight at the end, oldest first), or ``(i, None, None)`` when function i cannot
    fit the budget even with every swap-out waited."""
    cdef int64_t nent = bounds[n] + 1
    # FIFO of swap-outs in flight: (token, variable), oldest first, in [fhead, ftail)
    cdef int64_t *ftok = <int64_t *> malloc(nent * sizeof(int64_t))
    cdef int64_t *fv = <int64_t *> malloc(nent * sizeof(int64_t))
    cdef int64_t *out_token = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))
    cdef int64_t *out_step = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))
    cdef int64_t *cnt = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))
    cdef int64_t *own = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))   # stamp: j + 1
    if not (ftok and fv and out_token and out_step and cnt and own):
        free(ftok); free(fv); free(out_token); free(out_step); free(cnt); free(own)
        raise MemoryError()
    cdef int64_t fhead = 0, ftail = 0, token = 0, wbytes = 0, hm = 0, head = 0
    cdef int64_t i, j, k, a, b, e, v, nx, t, c, add, need, nskip, pos, fail = -1
    cdef unsigned char s
    cdef bint out
    cdef list step_list, jstep_alloc
    try:
        for v in range(nvar):
            out_token[v] = 0
            out_step[v] = 0
            cnt[v] = 0
            own[v] = 0
        for i in range(n):
            # the byte window [i, hm)
            if i:
                for e in range(bounds[i - 1], bounds[i]):
                    v = fvar[e]
                    c = cnt[v] - 1
                    cnt[v] = c
                    if not c:
                        wbytes -= sizes[v]
            while hm < n:
                add = 0
                for e in range(bounds[hm], bounds[hm + 1]):
                    v = fvar[e]
                    if not cnt[v]:
                        add += sizes[v]
                if hm > i and wbytes + add > window:
                    break
                for e in range(bounds[hm], bounds[hm + 1]):
                    cnt[fvar[e]] += 1
                wbytes += add
                hm += 1
            # (a)/(b): admit functions entering the window
            while head < hm:
                j = head
                a = bounds[j]
                b = bounds[j + 1]
                need = 0
                for e in range(a, b):
                    v = fvar[e]
                    if state[v] <= ON_HOST:
                        need += sizes[v]
                if held + need > budget and fhead < ftail:
                    for e in range(a, b):
                        own[fvar[e]] = j + 1
                    # popped entries are rewritten in place: the skipped ones (about to be
                    # cancelled: not waited) go back to the front in their order
                    pos = fhead
                    nskip = 0
                    while held + need > budget and pos < ftail:
                        t = ftok[pos]
                        v = fv[pos]
                        pos += 1
                        if out_token[v] != t:
                            continue            # cancelled
                        if own[v] == j + 1:
                            ftok[fhead + nskip] = t
                            fv[fhead + nskip] = v
                            nskip += 1
                            continue
                        out_token[v] = 0
                        held -= sizes[v]
                        if state[v] == DROPPING:
                            (<list> drop[i]).append(v)
                        else:
                            (<list> wait_swap_out[i]).append(v)
                        state[v] = ON_HOST
                    # move the skipped ones up against the entries not popped
                    for k in range(nskip - 1, -1, -1):
                        ftok[pos - nskip + k] = ftok[fhead + k]
                        fv[pos - nskip + k] = fv[fhead + k]
                    fhead = pos - nskip
                if held + need > budget:
                    if j == i:
                        fail = i
                        break
                    break                        # stop advancing: prefetch less
                k = a + fnin[j]
                jstep_alloc = <list> allocate[j]
                for e in range(a, k):            # the reads
                    v = fvar[e]
                    s = state[v]
                    if s == HELD:
                        continue
                    elif s == DROPPING:
                        # a pending drop re-enters the window: it simply stays resident
                        out_token[v] = 0
                    elif s == SWAPPING_OUT:
                        # offline cancel: the swap-out is dropped from the step that issued it
                        (<list> swap_out[out_step[v]]).remove(v)
                        out_token[v] = 0
                        hvalid[v] = 0           # the copy never happens
                    elif s == ON_HOST:
                        (<list> swap_in[i]).append(v)
                        (<list> wait_swap_in[j]).append(v)
                        held += sizes[v]
                    else:
                        # a transient variable first used by a read (outside data): reserved
                        jstep_alloc.append(v)
                        held += sizes[v]
                    state[v] = HELD
                for e in range(k, b):
                    # write-only at f_j: reserved now, allocated at f_j (see window.py)
                    v = fvar[e]
                    jstep_alloc.append(v)
                    if state[v] != HELD:
                        held += sizes[v]
                        state[v] = HELD
                head += 1
            if fail >= 0:
                break
            # (c)/(d): after function i
            if use_drop:
                for e in range(out_bounds[i], out_bounds[i + 1]):
                    hvalid[outs[e]] = 0
            for e in range(bounds[i], bounds[i + 1]):
                v = fvar[e]
                nx = fnext[e]
                if nx >= 0:
                    if nx < head:
                        continue                # next use (a read) inside the window: keep
                    out = True
                elif nx == -1:
                    # never used again this iteration: back to the host for the next one
                    out = persistent[v] and first_reads[v]
                else:
                    out = False                 # next use overwrites it: content dead
                if out:
                    token += 1
                    out_token[v] = token
                    out_step[v] = i
                    ftok[ftail] = token
                    fv[ftail] = v
                    ftail += 1
                    if use_drop and hvalid[v]:
                        # no copy needed: a pending drop, taken only when the budget needs it
                        state[v] = DROPPING
                    else:
                        state[v] = SWAPPING_OUT
                        (<list> swap_out[i]).append(v)
                        hvalid[v] = 1
                else:
                    (<list> free_[i]).append(v)
                    if nx < -1 and -2 - nx < head:
                        state[v] = HELD         # the bytes stay reserved for its next use
                    else:
                        state[v] = ABSENT
                        held -= sizes[v]
        if fail >= 0:
            return fail, None, None
        end = []
        end_drop = []
        for pos in range(fhead, ftail):
            v = fv[pos]
            if out_token[v] == ftok[pos]:
                if state[v] == SWAPPING_OUT:
                    end.append(v)
                elif state[v] == DROPPING:
                    end_drop.append(v)
        return -1, end, end_drop
    finally:
        free(ftok); free(fv); free(out_token); free(out_step); free(cnt); free(own)
