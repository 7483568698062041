"""Data that does not fit, as models: how many rows of the seed's data set fit a 16 GiB V100,
and how fast a page stream scans them on the simulator's GPUs.

The seed (Ou, out-of-core GPU gradient boosting in XGBoost) fits 9 M rows x 500 dense columns
(256 bins each, ELLPACK) in core, 13 M streamed, 85 M streamed with gradient-based sampling at
f = 0.1. ``xgboost_memory`` counts the device buffers of that layout and prints its largest row
counts beside the seed's, with the signed error; ``model.predict_scan`` gives pages per second
and the fraction of a scan the consumer waits for the link. Then the stream's own plan for
the same pages is checked on the emulated device: a small copy of the data set, scanned twice.

Run: python examples/page_stream_model.py
"""

import numpy as np

import vmalloc
from vmalloc import offload
from vmalloc.offload.pages import xgboost_memory
from vmalloc.offload.pages.model import predict_scan

MiB = 1 << 20


def main():
    table = xgboost_memory.seed_table()
    print(xgboost_memory.format_seed_table(table))
    in_core = table[0]
    assert in_core["mode"] == "in_core" and in_core["seed"] == 9_000_000

    # The compressed matrix: 500 symbols of 17 bits a row.
    layout = xgboost_memory.Layout()
    print(f"\nELLPACK: {layout.symbol_bits} bits a symbol, "
          f"{layout.ellpack_bytes(1_000_000) / 2**30:.2f} GiB per million rows")

    # 85 M rows of ELLPACK streamed once per tree level in 32 MiB pages over the V100's link.
    total = layout.ellpack_bytes(85_000_000)
    for gpu in ("v100-16gb", "h100-80gb"):
        p = predict_scan(gpu, 32 * MiB, total // (32 * MiB), prefetch=1)
        print(f"{gpu}: one scan of {total / 1e9:.1f} GB takes {p.seconds:.2f} s "
              f"({p.pages_per_second:.0f} pages/s, consumer waits {p.wait_fraction:.0%})")

    # The same pattern at a small scale on the emulated device: 8 pages, room for 3.
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, size=(256, 1024), dtype=np.uint8) for _ in range(8)]
    dev = vmalloc.HostDevice(capacity="16MiB")
    manager = offload.SwapManager(vmalloc.VirtualAllocator(dev))
    with offload.PageStream(pages, manager=manager, prefetch=1,
                            budget=3 * pages[0].nbytes) as stream:
        for _ in range(2):
            for page, want in zip(stream, pages):
                assert np.array_equal(page.to_numpy(), want)
        s = stream.stats()
    print(f"\nemulated device: {s['pages_served']} pages served, {s['pages_copied']} copied, "
          f"{s['resident_hits']} from the resident cache, {s['host_waits']} host waits")
    assert s["pages_served"] == 16


if __name__ == "__main__":
    main()
