"""GPT-2 small in the torch_out_of_core section (issue 21): Hugging Face's ``GPT2LMHeadModel``
built from a config (no download), batch 8, 1024 tokens, trained plain, inside
``vmalloc.torch.out_of_core`` with no pressure (``budget=None``), at half its memory, and
compiled (``torch.compile`` alone, then with ``vmalloc.torch.policy`` at half memory).

Each run reports seconds per step and, against plain, microseconds added per aten op (the ops
of one step counted once by a counting dispatch mode). Dropout is off so that the runs'
losses can be compared bit for bit. Every run is guarded by the section's clock: a run that no
longer fits is skipped, saying so. Under --dry-run a two-layer GPT-2 on CPU (poison backend)
stands in.
"""

import time

from vmalloc.frameworks.torch_ops import count_aten_ops

MiB = 1 << 20
#: GPT-2 small (Radford et al. 2019): 12 layers, 768 wide, 12 heads, 50,257 tokens, 1,024
#: positions. Under --dry-run: a two-layer miniature.
SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
TINY = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)


def _model_factory(setup):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(TINY if setup.dry else SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    class LM(torch.nn.Module):
        """Logits only: the loss is taken outside, as every run takes it."""

        def __init__(self):
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(GPT2Config(**cfg))

        def forward(self, ids):
            return self.gpt2(input_ids=ids, use_cache=False).logits

    def make(seed=0):
        torch.manual_seed(seed)
        model = LM().to(setup.device)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return make, cfg


def _loss(logits, ids):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           ids[:, 1:].reshape(-1))


def _step(model, opt, ids):
    loss = _loss(model(ids), ids)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss



def _timed(setup, model, opt, ids, warmup, iters):
    losses = []
    first = None
    for i in range(warmup):
        start = time.perf_counter()
        losses.append(float(_step(model, opt, ids)))
        setup.sync()
        if i == 0:
            first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(iters):
        losses.append(float(_step(model, opt, ids)))
    setup.sync()
    return {"step_seconds": (time.perf_counter() - start) / iters, "first_step_seconds": first,
            "losses": losses}


def run(setup, ctx, out, release, reserve_seconds=0.0, compile_runs=None):
    """Fills ``out["gpt2"]``; ``reserve_seconds`` of the section's time are left for later
    parts. ``compile_runs`` (default: not under --dry-run, where compiling on a CI core
    takes minutes; tests/frameworks cover compiling on CPU) adds the two compiled runs."""
    import torch

    res = {"status": None, "config": None, "batch": None, "tokens": None, "aten_ops_per_step":
           None, "runs": {}, "note": None}
    out["gpt2"] = res
    try:
        make, cfg = _model_factory(setup)
    except ImportError as error:
        res["status"] = f"skipped: transformers is not installed ({error})"
        ctx.save(out)
        return res
    batch, tokens = (2, 64) if setup.dry else (8, 1024)
    res.update(config={k: cfg[k] for k in SMALL}, batch=batch, tokens=tokens)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg["vocab_size"], (batch, tokens), generator=g).to(setup.device)
    warmup, iters = (2, 2) if (setup.quick or setup.dry) else (3, 5)

    def left():
        return ctx.left() - reserve_seconds

    def attempt(name, fn, needs):
        if left() < needs and not setup.dry:
            res["runs"][name] = {"status": f"skipped: {left():.0f} s left, needs ~{needs} s"}
            ctx.save(out)
            return None
        release(setup)
        setup.peak_reset()
        try:
            entry = fn()
            entry["status"] = "ok"
            entry["peak_reserved_bytes"] = setup.peak_reserved()
        except Exception as error:  # noqa: BLE001 - recorded; the next run goes on
            entry = {"status": f"failed: {type(error).__name__}: {error}"[:600]}
        res["runs"][name] = entry
        ctx.save(out)
        return entry

    if compile_runs is None:
        compile_runs = not setup.dry
    # Deterministic kernels where PyTorch has them (warned where not: SDPA's memory-efficient
    # backward on CUDA), and plain twice: how far apart two plain runs already are.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _runs(setup, res, attempt, make, ids, warmup, iters, compile_runs)
    finally:
        torch.use_deterministic_algorithms(False)
    _summarize(res)
    res["status"] = "ok"
    ctx.save(out)
    return res


def _runs(setup, res, attempt, make, ids, warmup, iters, compile_runs):
    import torch

    import vmalloc.torch

    def plain(count=False):
        def go():
            model, opt = make()
            entry = _timed(setup, model, opt, ids, warmup, iters)
            if count:
                res["aten_ops_per_step"] = count_aten_ops(_step, model, opt, ids)
            return entry
        return go

    def ooc(budget):
        def go():
            model, opt = make()
            with vmalloc.torch.out_of_core(budget=budget, backend=setup.backend) as o:
                entry = _timed(setup, model, opt, ids, warmup, iters)
                stats = o.stats()
            entry.update(budget_bytes=budget, **{k: stats.get(k) for k in (
                "peak_device_bytes", "swapped_out_bytes", "swapped_in_bytes",
                "on_demand_swap_ins", "recomputed_functions", "iterations",
                # the steady states (without per-op Python) and, under pressure, whether
                # the replay's swap-outs were waited for late (an asynchronous backend)
                "steady_iterations", "pressure_iterations", "pressure_swap_outs",
                "pressure_boundaries", "pressure_replans", "pressure_refused",
                "pressure_deferred")})
            return entry
        return go

    def compiled():
        model, opt = make()
        return _timed(setup, torch.compile(model), opt, ids, warmup, iters)

    def compiled_ooc():
        model, opt = make()
        start = time.perf_counter()
        plan = vmalloc.torch.policy(model, (ids, ids), loss_fn=_loss, budget=half,
                                    optimizer="sgd")
        planned = time.perf_counter() - start
        compiled_model = vmalloc.torch.compile_out_of_core(model, plan)
        entry = _timed(setup, compiled_model, opt, ids, warmup, iters)
        entry.update(plan_seconds=planned, budget_bytes=half, decisions=plan.stats())
        return entry

    base = attempt("plain", plain(count=True), 30)
    attempt("plain_repeat", plain(), 20)
    roomy = attempt("out_of_core_no_pressure", ooc(None), 60)
    peak = (roomy or {}).get("peak_device_bytes") or (base or {}).get("peak_reserved_bytes")
    half = int(peak) // 2 if peak else None
    if half:
        attempt("out_of_core_half_memory", ooc(half), 60)
    else:
        res["runs"]["out_of_core_half_memory"] = {"status": "skipped: no peak to halve"}
    if not compile_runs:
        for name in ("compiled", "compiled_policy_half_memory"):
            res["runs"][name] = {"status": "skipped: --dry-run (compiling takes minutes on a "
                                           "CI core; tests/frameworks compile on CPU)"}
        return
    attempt("compiled", compiled, 90)
    if half:
        attempt("compiled_policy_half_memory", compiled_ooc, 120)


def _summarize(res):
    """Ratios to plain and microseconds added per aten op, beside each run's step time."""
    runs = res["runs"]
    base = runs.get("plain") or {}
    ops = res["aten_ops_per_step"]
    for name, entry in runs.items():
        if entry.get("status") != "ok" or base.get("status") != "ok":
            continue
        entry["ratio_to_plain"] = entry["step_seconds"] / base["step_seconds"]
        if ops:
            entry["us_added_per_aten_op"] = (entry["step_seconds"] - base["step_seconds"]) \
                / ops * 1e6
        entry["losses_identical_to_plain"] = entry["losses"] == base["losses"]
    compiled = runs.get("compiled") or {}
    for name in ("compiled_policy_half_memory",):
        entry = runs.get(name) or {}
        if entry.get("status") == "ok" and compiled.get("status") == "ok":
            entry["ratio_to_compiled"] = entry["step_seconds"] / compiled["step_seconds"]
            entry["losses_identical_to_compiled"] = entry["losses"] == compiled["losses"]
