"""Where an out-of-core PyTorch step spends its time on a real GPU (needs CUDA; says so and
exits 0 without it).

GPT-2 small (Hugging Face, from a config; a 12-layer ``nn.TransformerEncoder`` without
transformers) at batch 8, PyTorch allocating from a ``vmalloc.VirtualAllocator``: plain steps,
then ``vmalloc.torch.out_of_core`` at half the peak, printing per iteration the step time and
what changed in the driver's call counters, the swap manager's and the allocator's stats; then
one steady iteration under cProfile (top functions by own time). Writes everything to
``--json``.

    python benchmarks/torch_cuda_swap_profile.py --json out.json
"""

import argparse
import cProfile
import io
import json
import pstats
import sys
import time


def build(torch, device, batch, tokens):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        GPT2LMHeadModel = None
    torch.manual_seed(0)
    if GPT2LMHeadModel is not None:
        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        net = GPT2LMHeadModel(cfg).to(device)

        def forward(ids):
            return net(input_ids=ids, use_cache=False).logits
        vocab, name = cfg.vocab_size, "GPT-2 small (transformers)"
    else:
        vocab, width = 32000, 768
        emb = torch.nn.Embedding(vocab, width)
        enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(
            width, 12, 4 * width, dropout=0.0, batch_first=True), 12)
        head = torch.nn.Linear(width, vocab)
        net = torch.nn.Sequential(emb, enc, head).to(device)
        forward, name = net, "12-layer TransformerEncoder 768 wide (no transformers)"
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (batch, tokens), generator=g).to(device)

    def step():
        logits = forward(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return step, name


def delta(after, before):
    return {k: after[k] - before.get(k, 0) for k in after
            if isinstance(after[k], (int, float)) and after[k] != before.get(k, 0)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--fraction", type=float, default=0.5)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this profile needs a GPU")
        return 0
    import vmalloc
    import vmalloc.torch

    dev = vmalloc.CudaDevice(0)
    alloc = vmalloc.VirtualAllocator(dev)
    vmalloc.torch.use_vmalloc(alloc)
    torch.use_deterministic_algorithms(True, warn_only=True)
    step, name = build(torch, "cuda", args.batch, args.tokens)
    report = {"model": name, "gpu": torch.cuda.get_device_name(0), "batch": args.batch,
              "tokens": args.tokens, "plain": [], "out_of_core": [], "profile": None}
    for _ in range(3):
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        report["plain"].append({"seconds": time.perf_counter() - t, "loss": loss})
    report["plain_peak_reserved"] = alloc.stats().peak_reserved_bytes
    with vmalloc.torch.out_of_core(budget=None) as o:
        step()
        step()
        peak = o.stats()["peak_device_bytes"]
    budget = int(peak * args.fraction)
    report["budget_bytes"] = budget
    print(f"{name} b={args.batch}: plain {report['plain'][-1]['seconds']:.3f} s, "
          f"budget {budget / 2**30:.2f} GiB", flush=True)
    with vmalloc.torch.out_of_core(budget=budget) as o:
        for i in range(args.iterations):
            c0, s0 = dev.counters(), dict(o.stats().get("swap") or {})
            a0 = alloc.stats()
            t = time.perf_counter()
            loss = step()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t
            a1 = alloc.stats()
            entry = {"iteration": i, "seconds": seconds, "loss": loss,
                     "driver_calls": delta(dev.counters(), c0),
                     "swap": delta(dict(o.stats().get("swap") or {}), s0),
                     "reserved_bytes": a1.reserved_bytes, "cached_bytes": a1.cached_bytes,
                     "peak_reserved_bytes": a1.peak_reserved_bytes,
                     "allocations": a1.total_allocations - a0.total_allocations,
                     # What stays swapped out between iterations, and what the backend holds
                     # alive for it (the host growth seen on an H200 is not explained yet).
                     "on_host_now": (o.stats().get("swap") or {}).get("on_host"),
                     "host_bytes_in_use_now": (o.stats().get("swap") or {}).get(
                         "host_bytes_in_use"),
                     "backend_held_storages": len(getattr(o.backend, "_held", ()))}
            report["out_of_core"].append(entry)
            print(json.dumps(entry), flush=True)
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        step()
        torch.cuda.synchronize()
        prof.disable()
        report["profiled_seconds"] = time.perf_counter() - t
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        report["profile"] = text.getvalue()
        report["stats"] = {k: v for k, v in o.stats().items() if not isinstance(v, dict)}
    print(report["profile"][-6000:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
