"""Compressed swaps executed by the runtime (issue 16 item 3): float32 activations swapped as
fp16 / bf16, half the bytes on the link, cast back on the way in; opt-in, and the default path
unchanged (bit-identical). Issue 20 item 2: only what a driver marks as an activation, never
a buffer of unknown kind, and compressed host copies count against host_capacity."""

import ctypes
import struct

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import vmalloc
from vmalloc.errors import InvalidArgumentError
from vmalloc.frameworks import numpy_training
from vmalloc.offload.runtime import Runtime
from vmalloc.offload.runtime.compression import (dtype_name, from_half_bits, round_trip,
                                                 to_half_bits)

MiB = 1 << 20


def bf16_reference(x):
    """bf16 of a float32, written out: round to nearest, ties to even, on the bits."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    if x != x:
        return (u >> 16) | 0x40
    low = u & 0xFFFF
    hi = u >> 16
    if low > 0x8000 or (low == 0x8000 and hi & 1):
        hi += 1
    return hi


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 0xFFFFFFFF))
def test_bf16_is_round_to_nearest_even_on_any_bits(bits):
    a = np.array([bits], np.uint32).view(np.float32)
    got = int(to_half_bits(a, "bf16")[0])
    assert got == bf16_reference(float(a[0]))
    back = from_half_bits(np.array([got], np.uint16), "bf16")
    assert back.view(np.uint32)[0] == got << 16


def test_casts_exact_values():
    a = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, 65504.0, 70000.0, np.inf, np.nan,
                  1e-8], np.float32)
    bf = round_trip(a, "bf16")
    # 1 + 2^-8 is a tie: to even (1.0); 1 + 3*2^-8 rounds up to 1 + 2^-6
    assert bf[:4].tolist() == [1.0, 1.0, 1 + 2 ** -6, -2.5]
    assert np.isinf(bf[6]) and np.isnan(bf[7])
    fp = round_trip(a, "fp16")
    # fp16 has 10 fraction bits: 1 + 2^-8 and 1 + 3*2^-8 are exact; 1e-8 underflows to 0
    assert fp[:5].tolist() == [1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, 65504.0]
    assert np.isinf(fp[5]) and np.isinf(fp[6]) and np.isnan(fp[7]) and fp[8] == 0.0


def test_bf16_matches_pytorch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 1e3,
                        rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(
                            np.uint32).view(np.float32)])
    a = a[~np.isnan(a)]
    ours = to_half_bits(a, "bf16")
    theirs = torch.from_numpy(a.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(
        np.uint16)
    assert np.array_equal(ours, theirs)


def test_dtype_names():
    assert dtype_name(np.float32) == dtype_name(np.dtype("float32")) == "float32"
    assert dtype_name("float32") == dtype_name("torch.float32") == "float32"
    assert dtype_name(None) is None


def runtime(budget="8MiB", **kw):
    dev = vmalloc.HostDevice(capacity="32MiB", granularity="2MiB")
    return Runtime(vmalloc.VirtualAllocator(dev, chunk_size="2MiB"), budget=budget, **kw)


def view(ptrs, buf, dtype=np.float32):
    return numpy_training.view(ptrs, buf, (buf.nbytes // np.dtype(dtype).itemsize,), dtype)


def test_bad_compression_is_refused():
    with pytest.raises(InvalidArgumentError, match="compress must be"):
        runtime(compress="int8")
    assert runtime().stats()["compression"] is None


def test_a_backend_that_cannot_compress_is_refused():
    class Lossless:     # a swap backend with the SwapManager's methods, no compressed swap
        def stats(self):
            return {}
    with pytest.raises(InvalidArgumentError, match="cannot compress"):
        Runtime(None, swap=Lossless(), compress="bf16")
    Runtime(None, swap=Lossless())      # lossless: fine
    pytest.importorskip("torch")
    from vmalloc.frameworks.torch_swap import CudaSwap
    from vmalloc.offload import SwapManager
    alloc = vmalloc.VirtualAllocator(vmalloc.HostDevice(capacity="8MiB"), chunk_size="2MiB")
    with pytest.raises(InvalidArgumentError, match="CudaSwap cannot compress"):
        Runtime(alloc, swap=CudaSwap(SwapManager(alloc), alloc), compress="fp16")  # not yet


def test_eviction_swaps_float32_compressed_and_other_dtypes_lossless():
    rt = runtime(budget=8 * MiB, compress="bf16", scheduler="none")
    rng = np.random.default_rng(0)
    vals = rng.standard_normal(MiB).astype(np.float32)            # 4 MiB
    ints = rng.integers(-2 ** 40, 2 ** 40, MiB // 2, dtype=np.int64)   # 4 MiB
    with rt.iteration():
        f = rt.allocate(4 * MiB, dtype=np.float32, kind="activation")
        i = rt.allocate(4 * MiB, dtype="int64", kind="activation")
        with rt.function(writes=[f, i]) as p:
            view(p, f)[...] = vals
            view(p, i, np.int64)[...] = ints
        big = rt.allocate(8 * MiB, dtype=np.float32)   # evicts both
        assert f.state == "on_host" and i.state == "on_host"
        s = rt.stats()
        assert s["compressed_swap_outs"] == 1
        assert s["swapped_out_bytes"] == 2 * MiB + 4 * MiB    # f at half its bytes, i whole
        rt.deallocate(big)
        with rt.function(reads=[f, i]) as p:
            assert np.array_equal(view(p, f), round_trip(vals, "bf16"))   # cast back
            assert not np.array_equal(view(p, f), vals)                      # (lossy)
            assert np.array_equal(view(p, i, np.int64), ints)
        s = rt.stats()
        assert s["compressed_swap_ins"] == 1
        assert s["swapped_in_bytes"] == 2 * MiB + 4 * MiB
        assert s["peak_device_bytes"] <= 8 * MiB
        rt.deallocate(f)
        rt.deallocate(i)


def test_persistent_and_mixed_buffers_are_never_compressed():
    rt = runtime(budget=8 * MiB, compress="fp16", scheduler="none")
    w = rt.allocate(4 * MiB, dtype=np.float32)      # persistent
    vals = np.arange(MiB, dtype=np.float32) * np.float32(1.0001)
    with rt.function(writes=[w]) as p:
        view(p, w)[...] = vals
    with rt.iteration():
        m = rt.allocate(4 * MiB, dtype=np.float32, kind="activation")
        rt.note_dtype(m, np.int32)                    # also viewed as int32: never compressed
        assert m.dtype == "mixed"
        with rt.function(writes=[m]) as p:
            view(p, m)[...] = vals
        big = rt.allocate(8 * MiB)
        rt.deallocate(big)
        with rt.function(reads=[w, m]) as p:
            assert np.array_equal(view(p, w), vals) and np.array_equal(view(p, m), vals)
        rt.deallocate(m)
    assert rt.stats()["compressed_swap_outs"] == 0


def test_a_schedule_that_compresses_a_non_float32_buffer_is_refused():
    class Compressing:
        def schedule(self, seq):
            from vmalloc.offload.scheduling.schedulers import make_scheduler
            s = make_scheduler("none").schedule(seq)
            s.compressed = frozenset(v.id for v in seq.variables if not v.persistent)
            return s
    rt = runtime(compress="fp16", scheduler=Compressing())
    with pytest.raises(InvalidArgumentError, match="not float32 transient"):
        with rt.iteration():
            a = rt.allocate(MiB, dtype=np.float32, kind="activation")
            b = rt.allocate(MiB, dtype=np.int64, kind="activation")
            with rt.function(writes=[a, b]):
                pass
            rt.deallocate(a)
            rt.deallocate(b)
    assert rt.schedule is None and not rt.in_iteration
    with rt.iteration():      # still usable (on demand)
        a = rt.allocate(MiB, dtype=np.float32)
        rt.deallocate(a)


def test_the_schedule_compresses_exactly_the_float32_activations():
    rt = runtime(budget=12 * MiB, compress="fp16")
    res = numpy_training.train(rt, network="mlp", batch=512, steps=2,
                               sizes=(1024, 1024, 1024, 10))
    sched = rt.schedule
    assert sched is not None and sched.compression == "fp16"
    seq = rt.sequence
    transients = {v.id for v in seq.variables if not v.persistent}
    # everything but the int64 labels, the input batch and the 3 weight gradients (the
    # driver marks only activations)
    assert sched.compressed and sched.compressed < transients
    assert len(transients - sched.compressed) == 1 + 1 + 3
    assert res.stats["compressed_swap_outs"] > 0


SMALL = dict(network="mlp", batch=256, sizes=(512, 512, 512, 10), lr=0.01)


def test_compress_none_is_bit_identical_and_compressed_runs_deviate_boundedly():
    # 20 steps of a small MLP, out of core at a 3 MiB budget (a quarter of its in-core peak).
    # Lossless: bit-identical to in core. fp16 and bf16: fewer bytes out, the same peak (the
    # cast is in place), and losses within bounds of the in-core ones. Measured (NumPy, this
    # CPU, activations only since issue 20): fp16 loss max_rel 9.57e-7, weights max_rel
    # 1.10e-4; bf16 1.15e-5 and 2.61e-4 (at 4 MiB only pre-activations that ReLU's backward
    # reads for their sign are compressed now: deviation 0). The bounds are about 10x those:
    # a wrong cast (a buffer read back as zeros, or in the other format) moves the losses by
    # far more.
    budget = 3 * MiB
    ref = numpy_training.train(runtime(budget=None, scheduler="none"), steps=20, **SMALL)
    plain = numpy_training.train(runtime(budget=budget), steps=20, **SMALL)
    assert plain.losses == ref.losses and plain.weights == ref.weights
    assert plain.stats["compressed_swap_outs"] == 0 and plain.stats["swapped_out_bytes"] > 0
    for fmt in ("fp16", "bf16"):
        out = numpy_training.train(runtime(budget=budget, compress=fmt), steps=20, **SMALL)
        s = out.stats
        assert s["compressed_swap_outs"] > 0 and s["compression"] == fmt
        assert s["swapped_out_bytes"] < plain.stats["swapped_out_bytes"]
        assert s["peak_device_bytes"] == plain.stats["peak_device_bytes"]   # no scratch
        d = numpy_training.deviation(ref, out)
        assert 0 < d["max_rel"] <= 1e-4, d
        assert 0 < d["weight_max_rel"] <= 5e-3, d


def torch_run(compress=None, budget="1MiB", steps=8):
    """``steps`` steps of a small MLP under out_of_core's poison backend: (losses, stats)."""
    import torch

    import vmalloc.torch as vtorch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    with vtorch.out_of_core(budget=budget, backend="poison", device="cpu",
                            compress=compress) as ooc:
        for _ in range(steps):
            x = torch.randn(128, 128, generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, ooc.stats()


def test_torch_poison_backend_compresses_float32_storages():
    pytest.importorskip("torch")
    ref, _ = torch_run(budget=None)
    plain, ps = torch_run()
    assert plain == ref and ps["compressed_swap_outs"] == 0
    # measured largest relative loss deviations: fp16 1.06e-7, bf16 1.67e-6 (activations only
    # since issue 20, none in the first iteration: 35 compressed swap-outs in 8 steps; before,
    # with parameters and gradients compressed too, 4 steps at 2 MiB: 1.45e-6 and 1.07e-4)
    for fmt, bound in (("fp16", 2e-5), ("bf16", 1e-3)):
        losses, s = torch_run(fmt)
        assert s["compressed_swap_outs"] > 0 and s["compressed_swap_ins"] > 0
        assert s["swapped_out_bytes"] < ps["swapped_out_bytes"]
        assert losses != ref
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < bound


@pytest.mark.filterwarnings("ignore::vmalloc.offload.BudgetWarning")   # scheduler "none"
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["virtual", "caching"]), fmt=st.sampled_from(["fp16", "bf16"]),
       ops=st.lists(st.tuples(st.sampled_from(["alloc32", "alloc32u", "alloc64", "evict",
                                               "read", "free", "forget"]),
                              st.integers(0, 7), st.integers(1, 3)), max_size=25))
# A draw that failed off the CI profile: reading one buffer in the final loop compressed
# another that the model had not noted (the model's bug, not the runtime's).
@example(kind="virtual", fmt="fp16",
         ops=[("alloc32", 0, 1), ("alloc32", 0, 1), ("alloc32", 0, 1), ("alloc32", 0, 2),
              ("alloc32", 0, 3)])
def test_any_swaps_read_back_the_values_or_their_cast(kind, fmt, ops):
    """Model: a float32 activation reads its values, or their round trip once any of its
    swap-outs was compressed; every other buffer (a float32 one of unknown kind included)
    reads its exact bytes, and is never compressed."""
    dev = vmalloc.HostDevice(capacity="32MiB", granularity="2MiB")
    alloc = (vmalloc.VirtualAllocator(dev, chunk_size="2MiB") if kind == "virtual"
             else vmalloc.CachingAllocator(dev))
    rt = Runtime(alloc, budget=8 * MiB, scheduler="none", compress=fmt)
    rng = np.random.default_rng(len(ops))
    live = []     # [buffer, values, dtype, compressed ever]

    def note():
        for entry in live:
            b = entry[0]
            if b.state in ("on_host", "swapping_out") and rt.swap.compressed(b.key):
                assert b.kind == "activation" and b.dtype == "float32", b.kind
                entry[3] = True

    def check(entry):
        b, vals, dt, comp = entry
        with rt.function(reads=[b]) as p:
            got = view(p, b, dt)
            want = round_trip(vals, fmt) if comp else vals
            assert np.array_equal(got, want, equal_nan=dt == np.float32)

    rt.begin_iteration()
    for op, k, size in ops:
        if op.startswith("alloc"):
            dt = np.int64 if op == "alloc64" else np.float32
            n = size * MiB
            b = rt.allocate(n, dtype=dt, kind="unknown" if op == "alloc32u" else "activation")
            vals = (rng.standard_normal(n // 4).astype(np.float32) if dt == np.float32
                    else rng.integers(-2 ** 50, 2 ** 50, n // 8, dtype=np.int64))
            with rt.function(writes=[b]) as p:
                view(p, b, dt)[...] = vals
            live.append([b, vals, dt, False])
        elif op == "evict":
            rt.make_room(size * 3 * MiB)
        elif live:
            entry = live[k % len(live)]
            if op == "read":
                check(entry)
            elif op == "free":
                rt.deallocate(entry[0])
                live.remove(entry)
            else:   # forget (not freed): the bytes come back first
                b = entry[0]
                note()
                ptr = b.ptr if b.state == "resident" else None
                rt.forget(b)
                live.remove(entry)
                if ptr is None:
                    ptr = b.ptr
                raw = (np.ctypeslib.as_array((ctypes.c_char * b.nbytes).from_address(ptr))
                       .view(entry[2]))
                want = round_trip(entry[1], fmt) if entry[3] else entry[1]
                assert np.array_equal(raw, want)
                rt.swap.deallocate(ptr)
        note()
    for entry in list(live):
        note()   # reading the previous entry may have compressed this one
        check(entry)
        rt.deallocate(entry[0])
    rt.end_iteration()
    assert rt.stats()["device_bytes"] == 0
    assert alloc.stats().live_allocations == 0      # nothing leaked: unbacked ones freed too
    assert rt.stats()["swap"]["host_bytes_in_use"] == 0
    assert rt.stats()["swap"]["compressed_host_bytes"] == 0
    assert rt.stats()["compressed_swap_outs"] >= sum(e[3] for e in live)


def test_vmalloc_offload_train_compress(capsys):
    import json

    from vmalloc.cli import main

    assert main(["offload", "train", "--network", "cnn", "--steps", "2", "--compress", "bf16",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["compress"] == "bf16" and r["stats"]["compressed_swap_outs"] > 0
    assert set(r["deviation"]) == {"max_abs", "mean_abs", "max_rel", "mean_rel",
                                   "weight_max_abs", "weight_max_rel"}
    assert main(["offload", "train", "--network", "cnn", "--steps", "2", "--compress",
                 "fp16"]) == 0
    assert "fp16 swaps: " in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["virtual", "caching"])
def test_compressing_swap_paths(kind):
    """The backend alone: out, wait, in, wait; a cancelled swap-out; frees and discards while
    on host; pointer-stable (virtual chunks) and relocating (caching) allocations."""
    from vmalloc.offload import SwapManager
    from vmalloc.offload.runtime.compression import CompressingSwap

    dev = vmalloc.HostDevice(capacity="32MiB", granularity="2MiB")
    alloc = (vmalloc.VirtualAllocator(dev, chunk_size="2MiB") if kind == "virtual"
             else vmalloc.CachingAllocator(dev))
    sw = CompressingSwap(SwapManager(alloc), alloc)
    vals = (np.arange(MiB, dtype=np.float32) - MiB / 2) / np.float32(977)

    def fresh():
        p = sw.allocate(4 * MiB)
        np.ctypeslib.as_array((ctypes.c_float * MiB).from_address(p))[...] = vals
        return p

    def read(p):
        return np.ctypeslib.as_array((ctypes.c_float * MiB).from_address(p)).copy()

    p = fresh()
    k = sw.swap_out_compressed(p, 4 * MiB, "fp16")
    assert sw.state(k) == "swapping_out" and sw.compressed(k)
    sw.wait(k)
    assert sw.state(k) == "on_host"
    used = dev.physical_bytes_in_use
    q = sw.swap_in(k)
    assert sw.state(q) == "swapping_in" and (q == p or kind == "caching")
    sw.wait(q)
    assert sw.state(q) == "resident" and np.array_equal(read(q), round_trip(vals, "fp16"))
    assert dev.physical_bytes_in_use >= used
    # cancelled: swapped in before the swap-out was waited
    k = sw.swap_out_compressed(q, 4 * MiB, "bf16")
    r = sw.swap_in(k)
    sw.wait(r)
    assert r == q and np.array_equal(read(r), round_trip(round_trip(vals, "fp16"), "bf16"))
    sw.deallocate(r)
    # freed while on host, and discarded (its owner frees the allocation itself)
    for how in ("free", "discard"):
        p = fresh()
        k = sw.swap_out_compressed(p, 4 * MiB, "bf16")
        sw.wait(k)
        if how == "free":
            sw.deallocate(k)
        else:
            assert sw.discard(k) is True
            if kind == "virtual":
                alloc.deallocate(p)      # still live, unbacked: the owner's to free
    s = sw.stats()
    assert s["compressed_swap_outs"] == 4 and s["compressed_swap_ins"] == 2
    assert s["bytes_swapped_out"] == 4 * 2 * MiB and s["bytes_swapped_in"] == 2 * MiB
    assert s["compressed_host_bytes"] == 0 and alloc.stats().live_allocations == 0
    with pytest.raises(InvalidArgumentError, match="multiple of 4"):
        sw.swap_out_compressed(sw.allocate(6), 6, "fp16")


# --- issue 20 item 2: only activations, by construction ------------------------------------
@pytest.mark.filterwarnings("ignore::vmalloc.offload.BudgetWarning")
def test_only_buffers_marked_as_activations_are_compressed():
    from vmalloc.offload.runtime.compression import KINDS

    rt = runtime(budget=6 * MiB, compress="fp16", scheduler="none")
    vals = (np.arange(MiB, dtype=np.float32) - MiB / 2) / np.float32(977)
    with rt.iteration():
        bufs = {}
        for kind in KINDS:
            b = rt.allocate(4 * MiB, dtype=np.float32, kind=kind)
            with rt.function(writes=[b]) as p:
                view(p, b)[...] = vals
            bufs[kind] = b
        unmarked = rt.allocate(4 * MiB, dtype=np.float32)       # no kind: "unknown"
        with rt.function(writes=[unmarked]) as p:
            view(p, unmarked)[...] = vals
        revoked = rt.allocate(4 * MiB, dtype=np.float32, kind="activation")
        with rt.function(writes=[revoked]) as p:
            view(p, revoked)[...] = vals
        rt.set_kind(revoked, "gradient")      # the driver learnt better before it went out
        assert unmarked.kind == "unknown" and revoked.kind == "gradient"
        assert rt.stats()["compressed_swap_outs"] == 1     # each evicted in turn: one compressed
        for b in list(bufs.values()) + [unmarked, revoked]:
            with rt.function(reads=[b]) as p:
                want = round_trip(vals, "fp16") if b is bufs["activation"] else vals
                assert np.array_equal(view(p, b), want)
            rt.deallocate(b)
    assert rt.stats()["compressed_swap_outs"] == 1
    with pytest.raises(InvalidArgumentError, match="kind must be one of"):
        rt.allocate(MiB, kind="weights")
    w = rt.allocate(MiB)
    with pytest.raises(InvalidArgumentError, match="kind must be one of"):
        rt.set_kind(w, "activations")
    assert w.kind == "unknown"


def torch_adam_run(compress=None, budget="2MiB", steps=4):
    """Adam on a small MLP under out_of_core's poison backend; returns (losses, stats, max |w|,
    [(iteration, kind of what was swapped compressed)])."""
    import torch

    import vmalloc.torch as vtorch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, compressed = [], []
    with vtorch.out_of_core(budget=budget, backend="poison", device="cpu",
                            compress=compress) as ooc:
        backend = ooc.backend
        plain = backend.swap_out_compressed
        iteration = [0]

        def what(ptr):
            for p in model.parameters():
                if p.untyped_storage().data_ptr() == ptr:
                    return "parameter"
                if p.grad is not None and p.grad.untyped_storage().data_ptr() == ptr:
                    return "gradient"
            for state in opt.state.values():
                for v in state.values():
                    if hasattr(v, "untyped_storage") and v.untyped_storage().data_ptr() == ptr:
                        return "state"
            return "other"

        def spy(ptr, nbytes, fmt, stream=0):
            compressed.append((iteration[0], what(ptr)))
            return plain(ptr, nbytes, fmt, stream=stream)
        backend.swap_out_compressed = spy
        for i in range(steps):
            iteration[0] = i
            x = torch.randn(128, 128, generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    wmax = max(float(p.detach().abs().max()) for p in model.parameters())
    return losses, ooc.stats(), wmax, compressed


def test_torch_adam_never_compresses_parameters_gradients_or_optimizer_state():
    """Before: two parameters and four Adam state storages were compressed in the first
    iteration (recorded as transients before the optimizer was known); fp16 exp_avg_sq
    underflowed and the weights blew up (max |w| 24.9 against 0.067 in core)."""
    pytest.importorskip("torch")
    _, _, ref_w, _ = torch_adam_run(budget=None)
    losses, s, wmax, compressed = torch_adam_run("fp16")
    assert compressed, "activations are still compressed"
    assert {kind for _, kind in compressed} == {"other"}       # activations only
    assert min(i for i, _ in compressed) >= 1       # nothing in the first iteration
    assert s["compressed_swap_outs"] == len(compressed)
    assert abs(wmax - ref_w) <= 1e-3 * ref_w, (wmax, ref_w)


def test_compressed_host_copies_count_against_host_capacity():
    """Before: compressed copies ignored host_capacity (20 MiB pinned under a 4 MiB cap)."""
    from vmalloc.errors import OutOfMemoryError
    from vmalloc.offload import SwapManager
    from vmalloc.offload.runtime.compressing_swap import CompressingSwap

    dev = vmalloc.HostDevice(capacity="64MiB", granularity="2MiB")
    alloc = vmalloc.VirtualAllocator(dev, chunk_size="2MiB")
    sw = CompressingSwap(SwapManager(alloc, host_capacity="4MiB"), alloc)
    vals = (np.arange(MiB, dtype=np.float32) - MiB / 2) / np.float32(977)
    ptrs = []
    for _ in range(3):
        p = sw.allocate(4 * MiB)
        np.ctypeslib.as_array((ctypes.c_float * MiB).from_address(p))[...] = vals
        ptrs.append(p)
    keys = [sw.swap_out_compressed(p, 4 * MiB, "fp16") for p in ptrs[:2]]   # 2 x 2 MiB
    for k in keys:
        sw.wait(k)
    with pytest.raises(OutOfMemoryError, match="host.*host_capacity 4194304"):
        sw.swap_out_compressed(ptrs[2], 4 * MiB, "fp16")
    with pytest.raises(OutOfMemoryError, match="host"):
        sw.swap_out(ptrs[2])            # a lossless swap-out sees the compressed copies too
    assert sw.state(ptrs[2]) == "resident"
    assert np.array_equal(np.ctypeslib.as_array((ctypes.c_float * MiB).from_address(ptrs[2])),
                          vals)
    assert dev.state()["host_bytes"] == 4 * MiB
    assert sw.stats()["compressed_host_bytes"] == 4 * MiB
    for k in keys:
        sw.wait(sw.swap_in(k))
    k = sw.swap_out_compressed(ptrs[2], 4 * MiB, "fp16")     # room again
    sw.wait(sw.swap_in(k))
    for p in ptrs:
        sw.deallocate(p)
    assert dev.state()["host_bytes"] == 0 and alloc.stats().live_allocations == 0
