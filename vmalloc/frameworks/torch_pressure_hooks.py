"""The boundaries' hooks of the steady state under pressure
(:mod:`vmalloc.frameworks.torch_pressure`), made for speed.

Why a second set: a steady step passes about a thousand boundaries (a 12-layer
TransformerEncoder: 288 saved-tensor packs and as many unpacks, 218 module hooks, 144 gradient
hooks, 144 optimizer-step ops) and the plan acts at fewer than a hundred of them. The
probation's hooks go through one general ``Pressure._event`` that also records; these compare
each boundary with the record inline (its key, no more) and call into the Pressure only where
the plan binds a storage or swaps (``work``) or the iteration diverges. Measured in
docs/benchmarks.md ("fewer and cheaper boundaries under pressure").

Each hook counts its boundary only on the driver's thread while the steady state is active;
the keys are the probation's (:meth:`Pressure._event` builds the same ones).
"""

from __future__ import annotations

import threading

from vmalloc.frameworks.torch_pressure_boundaries import (GRAD, OP, PACK, POST, UNPACK,
                                                          pre_key)


class Hooks:
    """The steady state's hook functions for one plan (built at ``Pressure.start``)."""

    def __init__(self, pressure):
        p = pressure
        keys = p.keys
        nkeys = len(keys)
        work = p.work
        thread = p.thread
        get_ident = threading.get_ident
        hit, diverged = p._hit, p._diverged

        def at(key, exposes):
            """Boundary ``p.n``: checked, and worked on if the plan acts there."""
            i = p.n
            p.n = i + 1
            if p.halted is None:
                if i >= nkeys or keys[i] != key:
                    diverged(i, key)
                elif i in work:
                    hit(i, exposes)

        def pre(module, args):
            if get_ident() == thread and p.active:
                at(pre_key(module, args), args)
                p.steady.running = True

        def post(module, args, out):
            if get_ident() == thread and p.active:
                at((POST, type(module)), out)

        def grad(k, param):
            if get_ident() == thread and p.active:
                i = p.n
                p.n = i + 1
                if p.halted is None:
                    if i >= nkeys or keys[i] != (GRAD, k):
                        diverged(i, (GRAD, k))
                    elif i in work:
                        hit(i, param.grad)      # (read only where the plan binds it)

        def pack(t):
            if get_ident() != thread or not p.active:
                return (None, t.detach(), t._version)
            i = p.n
            p.n = i + 1
            if p.halted is None:
                key = (PACK, t.shape, t.dtype)
                if i >= nkeys or keys[i] != key:
                    diverged(i, key)
                elif i in work:
                    hit(i, t)
            # (a detached alias, as the probation's hook: see Pressure._pack)
            return (i, t.detach(), t._version)

        def unpack(handle):
            j, t, version = handle
            if t._version != version:
                p._modified(t, version)
            if j is not None and get_ident() == thread and p.active:
                at((UNPACK, j), None)
            return t

        def op(func):
            if p.active:
                at((OP, func), None)

        self.pre, self.post, self.grad, self.pack, self.unpack = pre, post, grad, pack, unpack
        self.op = op
