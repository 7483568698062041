# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The window scheduler's main loop, compiled (issue 22 item 6: 10^5 functions in a second).

The same decisions, in the same order, as the Python loop in ``window.py`` beside it
(``WindowScheduler._schedule_py``), which stays as the reference (and serves ``trace=``):
``tests/offload/test_window_compiled.py`` compares the two step by step, and
``tests/offload/test_schedule_pinned.py`` pins the schedules. Byte figures are C ``int64``:
the caller passes no total above ``2**62`` (it falls back to the Python loop otherwise), so no
sum here can overflow.
"""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

import numpy as np

# variable states (as in window.py)
cdef enum:
    ABSENT = 0
    ON_HOST = 1
    HELD = 2
    SWAPPING_OUT = 3
    DROPPING = 4


def uses_and_next(list functions, int64_t nvar, const unsigned char[::1] managed):
    """``window._uses_and_next`` in one pass forward and one back, and every function's
    outputs (``outs``, function i's at ``out_bounds[i]:out_bounds[i+1]``, managed or not):
    ``(var, nxt, bounds, reads, first_reads, outs, out_bounds)``, NumPy arrays (int64;
    ``first_reads`` uint8). The NumPy version stays the Python loop's, so that the tests
    compare the two paths end to end."""
    cdef Py_ssize_t n = len(functions), i, e = 0, o = 0, m = 0, start
    cdef int64_t v
    cdef tuple f, ins, outs
    for i in range(n):
        fo = functions[i]
        if not isinstance(fo, tuple):       # a Function (a NamedTuple: a tuple's layout)
            raise TypeError(f"function {i} is a {type(fo).__name__}, not a Function")
        f = <tuple> fo
        m += len(<tuple?> f[2]) + len(<tuple?> f[3])
    var_a = np.empty(m, np.int64)
    wr_a = np.empty(m, np.uint8)
    outs_a = np.empty(m, np.int64)
    bounds_a = np.zeros(n + 1, np.int64)
    out_bounds_a = np.zeros(n + 1, np.int64)
    reads_a = np.empty(n, np.int64)
    stamp_a = np.full(nvar, -1, np.int64)
    cdef int64_t[::1] var = var_a, outv = outs_a, bounds = bounds_a, obounds = out_bounds_a
    cdef int64_t[::1] reads = reads_a, stamp = stamp_a
    cdef unsigned char[::1] wr = wr_a
    for i in range(n):
        f = <tuple> functions[i]
        ins = <tuple?> f[2]
        outs = <tuple?> f[3]
        start = e
        # each managed variable once per function, at its first mention: the reads first
        for x in ins:
            v = x
            if v < 0 or v >= nvar:
                raise IndexError(f"function {i} reads variable {v}, not in the sequence")
            if managed[v] and stamp[v] != i:
                stamp[v] = i
                var[e] = v
                wr[e] = 0
                e += 1
        reads[i] = e - start
        for x in outs:
            v = x
            if v < 0 or v >= nvar:
                raise IndexError(f"function {i} writes variable {v}, not in the sequence")
            outv[o] = v
            o += 1
            if managed[v] and stamp[v] != i:
                stamp[v] = i
                var[e] = v
                wr[e] = 1
                e += 1
        bounds[i + 1] = e
        obounds[i + 1] = o
    # backwards: each use's next use (stamp reused: the code of v's next use, -1 none), and
    # whether v's first use reads it (the last one seen going back)
    nxt_a = np.empty(e, np.int64)
    first_a = np.zeros(nvar, np.uint8)
    cdef int64_t[::1] nxt = nxt_a
    cdef unsigned char[::1] first = first_a
    stamp[:] = -1
    for i in range(n - 1, -1, -1):
        for start in range(bounds[i], bounds[i + 1]):
            v = var[start]
            nxt[start] = stamp[v]
            if wr[start]:
                stamp[v] = -2 - i
                first[v] = 0
            else:
                stamp[v] = i
                first[v] = 1
    return var_a[:e], nxt_a, bounds_a, reads_a, first_a, outs_a[:o], out_bounds_a


cdef inline int64_t settle(int64_t v, const int64_t[::1] sizes, int64_t *out_token,
                           unsigned char[::1] state, list drop, list wait_swap_out) except? -1:
    """v's swap-out in flight is taken before the current function (``drop``: a pending
    drop, its memory released; else ``wait_swap_out``, the copy waited for): v is on the
    host. Returns its bytes, which leave ``held`` and the bytes in flight (window.py's
    ``_settle``)."""
    out_token[v] = 0
    if state[v] == DROPPING:
        drop.append(v)
    else:
        wait_swap_out.append(v)
    state[v] = ON_HOST
    return sizes[v]


def window_loop(int64_t n, int64_t nvar, const int64_t[::1] sizes,
                const unsigned char[::1] persistent, const int64_t[::1] fvar,
                const int64_t[::1] fnext, const int64_t[::1] bounds, const int64_t[::1] fnin,
                const unsigned char[::1] first_reads, const int64_t[::1] outs,
                const int64_t[::1] out_bounds, unsigned char[::1] state,
                unsigned char[::1] hvalid, int64_t held, int64_t budget, int64_t window,
                bint use_drop, step_type):
    """The steps (``step_type`` objects, :class:`~vmalloc.offload.scheduling.schedule.Step`).
    ``fvar[bounds[i]:bounds[i+1]]`` are function i's managed variables (reads first, ``fnin[i]``
    of them), ``fnext`` their next uses (window.py's encoding), ``outs`` / ``out_bounds`` every
    output of each function. ``state`` and ``hvalid`` are the initial states, updated in place.
    Returns ``(-1, steps, end, end_drop)`` (the swap-outs and pending drops left in flight at
    the end, oldest first), or ``(i, None, None, None)`` when function i cannot fit the budget
    even with every swap-out waited."""
    # per function its action lists, made Steps at the end (cheaper than a Step's attributes)
    cdef list drop = [[] for _ in range(n)], wait_swap_out = [[] for _ in range(n)]
    cdef list allocate = [[] for _ in range(n)], swap_in = [[] for _ in range(n)]
    cdef list wait_swap_in = [[] for _ in range(n)], free_ = [[] for _ in range(n)]
    cdef list swap_out = [[] for _ in range(n)]
    cdef int64_t nent = bounds[n] + 1
    # FIFO of swap-outs in flight: (token, variable), oldest first, in [fhead, ftail)
    cdef int64_t *ftok = <int64_t *> malloc(nent * sizeof(int64_t))
    cdef int64_t *fv = <int64_t *> malloc(nent * sizeof(int64_t))
    cdef int64_t *out_token = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))
    cdef int64_t *out_step = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))
    cdef int64_t *cnt = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))
    cdef int64_t *own = <int64_t *> malloc((nvar + 1) * sizeof(int64_t))   # stamp: j + 1
    # reservations charged to the budget only at their own function (window.py)
    cdef int64_t *deferred = <int64_t *> malloc((n + 1) * sizeof(int64_t))
    if not (ftok and fv and out_token and out_step and cnt and own and deferred):
        free(ftok); free(fv); free(out_token); free(out_step); free(cnt); free(own)
        free(deferred)
        raise MemoryError()
    cdef int64_t fhead = 0, ftail = 0, token = 0, wbytes = 0, hm = 0, head = 0
    cdef int64_t pend = 0, fbytes = 0, later, d, nb
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
            deferred[i] = 0
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
            d = deferred[i]
            if d:
                # function i's reservations take the budget now (admission left room)
                pend -= d
                held += d
                while held > budget and fhead < ftail:
                    t = ftok[fhead]
                    v = fv[fhead]
                    fhead += 1
                    if out_token[v] != t:
                        continue
                    nb = settle(v, sizes, out_token, state, <list> drop[i],
                                <list> wait_swap_out[i])
                    held -= nb
                    fbytes -= nb
            # (a)/(b): admit functions entering the window
            while head < hm:
                j = head
                a = bounds[j]
                b = bounds[j + 1]
                need = 0
                if j == i:
                    for e in range(a, b):
                        v = fvar[e]
                        if state[v] <= ON_HOST:
                            need += sizes[v]
                else:
                    # swap-ins now, reservations at f_j: all must fit with every swap-out in
                    # flight waited for and the reservations still to come
                    k = a + fnin[j]
                    later = 0
                    for e in range(a, b):
                        v = fvar[e]
                        s = state[v]
                        if e < k and s == ON_HOST:
                            need += sizes[v]
                        elif s != HELD:
                            later += sizes[v]
                    if held - fbytes + pend + need + later > budget:
                        break                    # stop advancing: prefetch less
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
                        nb = settle(v, sizes, out_token, state, <list> drop[i],
                                    <list> wait_swap_out[i])
                        held -= nb
                        fbytes -= nb
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
                        fbytes -= sizes[v]
                    elif s == SWAPPING_OUT:
                        # offline cancel: the swap-out is dropped from the step that issued it
                        (<list> swap_out[out_step[v]]).remove(v)
                        out_token[v] = 0
                        fbytes -= sizes[v]
                        hvalid[v] = 0           # the copy never happens
                    elif s == ON_HOST:
                        (<list> swap_in[i]).append(v)
                        (<list> wait_swap_in[j]).append(v)
                        held += sizes[v]
                    else:
                        # a transient variable first used by a read (outside data): reserved
                        jstep_alloc.append(v)
                        if j == i:
                            held += sizes[v]
                        else:
                            deferred[j] += sizes[v]
                            pend += sizes[v]
                    state[v] = HELD
                for e in range(k, b):
                    # write-only at f_j: reserved now, allocated at f_j (see window.py)
                    v = fvar[e]
                    jstep_alloc.append(v)
                    if state[v] != HELD:
                        if j == i:
                            held += sizes[v]
                        else:
                            deferred[j] += sizes[v]
                            pend += sizes[v]
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
                    fbytes += sizes[v]
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
            return fail, None, None, None
        steps = []
        new = object.__new__
        for i in range(n):
            st = new(step_type)
            st.drop = drop[i]
            st.wait_swap_out = wait_swap_out[i]
            st.allocate = allocate[i]
            st.swap_in = swap_in[i]
            st.wait_swap_in = wait_swap_in[i]
            st.free = free_[i]
            st.swap_out = swap_out[i]
            steps.append(st)
        end = []
        end_drop = []
        for pos in range(fhead, ftail):
            v = fv[pos]
            if out_token[v] == ftok[pos]:
                if state[v] == SWAPPING_OUT:
                    end.append(v)
                elif state[v] == DROPPING:
                    end_drop.append(v)
        return -1, steps, end, end_drop
    finally:
        free(ftok); free(fv); free(out_token); free(out_step); free(cnt); free(own)
        free(deferred)
