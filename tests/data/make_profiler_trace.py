"""Regenerates tests/data/profiler_cpu_mlp.json: a real PyTorch profiler (Kineto) trace.

Two training steps of a small MLP on the CPU under
``torch.profiler.profile(profile_memory=True)``, exported with ``export_chrome_trace``. The
trace tests read it as users' profiler traces are read (device="cpu"). Needs torch:

    python tests/data/make_profiler_trace.py
"""

from pathlib import Path

import os

import torch
from torch.profiler import ProfilerActivity, profile

OUT = Path(__file__).resolve().parent / "profiler_cpu_mlp.json"


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(torch.randn(32, 64)).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    os.chdir(OUT.parent)  # the trace records the name it was exported to: keep it relative
    prof.export_chrome_trace(OUT.name)
    print(f"{OUT}: {OUT.stat().st_size} bytes, torch {torch.__version__}")


if __name__ == "__main__":
    main()
