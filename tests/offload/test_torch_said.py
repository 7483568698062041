"""vmalloc.torch.out_of_core says what it cannot do, never silently (issue 20, item 5): a CUDA
device PyTorch lacks is refused, budget warnings point at the user's line and name the function
one way, an op over the budget runs over with one warning or, under strict, is refused, and
recompute says once why it recomputes nothing."""

import warnings

import pytest

torch = pytest.importorskip("torch")

import vmalloc.torch as vtorch  # noqa: E402
from vmalloc.errors import InvalidArgumentError, OutOfMemoryError  # noqa: E402
from vmalloc.offload.runtime import BudgetWarning  # noqa: E402


def make(seed=0, width=256):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(steps, batch=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 128, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this PyTorch has CUDA")
@pytest.mark.parametrize("backend", [None, "poison"])
def test_a_cuda_device_without_cuda_is_refused(backend):
    # Was a block that tracked no tensor, did nothing and said nothing.
    with pytest.raises(InvalidArgumentError) as info:
        vtorch.out_of_core(device="cuda", backend=backend)
    assert str(info.value) == (
        f"device='cuda' but this PyTorch ({torch.__version__}) has no CUDA device: no tensor "
        "would be tracked; use device='cpu' with backend='poison' to train out of core on the "
        "CPU")


def test_an_unknown_device_is_refused():
    with pytest.raises(InvalidArgumentError) as info:
        vtorch.out_of_core(device="tpu", backend="poison")
    assert str(info.value) == "device must be 'cuda' or 'cpu', got 'tpu'"
