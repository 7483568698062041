"""Regenerates vmalloc's shipped trace, vmalloc/traces/data/transformer_lm_cpu.vmtrace.

A small Transformer language model (4 layers, d_model 256, vocabulary 8,000, batch 16 x 128
tokens, AdamW) is built and trained for a few steps on the CPU under
``torch.profiler.profile(profile_memory=True)``; the profiler's ``[memory]`` events are
converted to ``.vmtrace``. Building the model happens inside the profiled window, so every
allocation the job makes is in the trace. The addresses are the CPU allocator's, but the
sequence of request sizes and lifetimes is the model's own: that is what replay measures.

    pip install torch            # CPU build is enough
    python benchmarks/record_trace.py [--steps 6] [--out PATH] [--keep-json PATH]

Needs torch (not a vmalloc dependency) and vmalloc importable (installed, or
``PYTHONPATH=build/<name>/python`` after scripts/dev-build). Deterministic sizes for a given torch version
(seeded); addresses differ from run to run.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "vmalloc" / "traces" / "data" / "transformer_lm_cpu.vmtrace"


def train(steps, vocab=8000, d_model=256, layers=4, heads=4, batch=16, seq=128):
    import torch
    from torch import nn

    torch.manual_seed(0)

    class LanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.position = nn.Parameter(torch.zeros(seq, d_model))
            layer = nn.TransformerEncoderLayer(
                d_model, heads, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens):
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
            x = self.embed(tokens) + self.position[: tokens.shape[1]]
            return self.head(self.encoder(x, mask=mask, is_causal=True))

    model = LanguageModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        logits = model(tokens[:, :-1])
        loss = loss_fn(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the .vmtrace to write")
    parser.add_argument("--keep-json", help="also keep the profiler's JSON trace here")
    args = parser.parse_args(argv)
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        sys.exit("record_trace.py needs torch: pip install torch")

    from vmalloc.traces import convert

    torch.set_num_threads(1)  # one allocating thread: a reproducible event order
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        json_path = args.keep_json or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(json_path)
        info = convert(json_path, args.out, format="kineto", device="cpu")
    size = os.path.getsize(args.out)
    print(
        f"{args.out}: {info.events} events ({info.allocs} allocs, largest "
        f"{info.largest_alloc_bytes} B, live peak {info.peak_live_bytes} B), {size} bytes "
        f"[torch {torch.__version__}]"
    )


if __name__ == "__main__":
    main()
