"""vmalloc.xgboost: XGBoost trained from pages a PageStream serves builds the same model as
XGBoost's own external-memory run over the same pages (CPU build; the emulated device)."""

import numpy as np
import pytest

import vmalloc
from vmalloc import offload
from vmalloc.offload.pages import PageStream

xgboost = pytest.importorskip("xgboost", reason="XGBoost is not installed (pip install "
                              "xgboost-cpu): vmalloc.xgboost is an optional driver")
import vmalloc.xgboost as vxgb  # noqa: E402

PARAMS = {"tree_method": "hist", "max_depth": 4, "eta": 0.3, "max_bin": 32, "nthread": 1,
          "seed": 0, "objective": "reg:squarederror"}


def data(pages=4, rows=200, cols=8):
    rng = np.random.default_rng(7)
    X = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(pages)]
    y = [x[:, 0] * 2 + np.sin(x[:, 1]) + 0.1 * rng.standard_normal(rows).astype(np.float32)
         for x in X]
    return X, y


class HostPages(xgboost.DataIter):
    """XGBoost's own external-memory iterator over host pages (the reference)."""

    def __init__(self, X, y, cache_prefix):
        self.X, self.y, self.i = X, y, 0
        super().__init__(cache_prefix=cache_prefix)

    def next(self, input_data):
        if self.i == len(self.X):
            return False
        input_data(data=self.X[self.i], label=self.y[self.i])
        self.i += 1
        return True

    def reset(self):
        self.i = 0


def train(Xy, params=PARAMS, rounds=6):
    booster = xgboost.train(params, Xy, num_boost_round=rounds)
    return booster.get_dump(with_stats=True), booster


SAMPLING = {"none": {}, "uniform": {"subsample": 0.5},
            # Ou's gradient-based sampling at f = 0.1; the CPU build of XGBoost 3.2 runs it.
            "gradient_based": {"subsample": 0.1, "sampling_method": "gradient_based"}}


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_the_model_from_vmalloc_pages_is_xgboosts_own_external_memory_model(tmp_path, sampling):
    X, y = data()
    params = dict(PARAMS, **SAMPLING[sampling])
    dev = vmalloc.HostDevice(capacity="16MiB", granularity="64KiB")
    va = vmalloc.VirtualAllocator(dev)
    manager = offload.SwapManager(va)
    page_bytes = X[0].nbytes
    with PageStream(X, manager=manager, prefetch=1, budget=3 * page_bytes) as stream:
        it = vxgb.pages(stream, label=y, cache_prefix=str(tmp_path / "vm"))
        ours, ours_booster = train(xgboost.ExtMemQuantileDMatrix(it, max_bin=32), params)
        s = stream.stats()
    ref_it = HostPages(X, y, str(tmp_path / "ref"))
    ref, ref_booster = train(xgboost.ExtMemQuantileDMatrix(ref_it, max_bin=32), params)
    assert ours == ref
    test = xgboost.DMatrix(np.concatenate(X))
    np.testing.assert_array_equal(ours_booster.predict(test), ref_booster.predict(test))
    # Every batch XGBoost read was a page the stream served (one resident, the rest streamed).
    assert s["pages_served"] == it.batches and it.batches % len(X) == 0
    assert s["resident_pages"] == 1 and s["pages_copied"] > len(X)
    assert manager.stats()["host_bytes_in_use"] == 0 and va.stats().live_allocations == 0


def test_labels_must_match_the_pages():
    X, y = data(pages=2, rows=10)
    dev = vmalloc.HostDevice(capacity="8MiB", granularity="64KiB")
    with PageStream(X, vmalloc.VirtualAllocator(dev)) as stream:
        with pytest.raises(vmalloc.InvalidArgumentError, match="label: 1 arrays for 2 pages"):
            vxgb.pages(stream, label=y[:1])
        with pytest.raises(vmalloc.InvalidArgumentError,
                           match=r"label\[1\] has 9 values, page 1 has 10 rows"):
            vxgb.pages(stream, label=[y[0], y[1][:9]])
