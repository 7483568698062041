"""PageStream: a data set four times the device's budget, scanned in pages from disk.

Six 1 MiB pages of float32 rows live in a file on disk (np.memmap). A 4 MiB device budget
keeps two of them resident and streams the others through two slots with one page of
prefetch; each pass sums every column on the "device" (the emulated device's memory is host
memory, so NumPy stands in for a kernel). The second pass copies only the streamed pages.
Then gather() compacts a 10 % row sample of the whole set into one device buffer, the
sampling step of out-of-core gradient boosting. Prints the counters; checks the sums.

Run: python examples/page_stream.py
"""

import ctypes
import os
import tempfile

import numpy as np

import vmalloc
from vmalloc import offload

MiB = 1 << 20
ROWS, COLS = 1024, 256            # 1 MiB of float32 a page


def device_view(page):
    # On the emulated device a device address is a host address: a NumPy view is the kernel.
    buffer = (ctypes.c_char * page.nbytes).from_address(page.ptr)
    return np.frombuffer(buffer, dtype=page.dtype).reshape(page.shape)


def main():
    rng = np.random.default_rng(0)
    data = rng.standard_normal((6 * ROWS, COLS)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.f32")
        data.tofile(path)
        on_disk = np.memmap(path, dtype=np.float32, mode="r", shape=data.shape)
        pages = [on_disk[i * ROWS:(i + 1) * ROWS] for i in range(6)]

        dev = vmalloc.HostDevice(capacity="16MiB")
        allocator = vmalloc.VirtualAllocator(dev)
        manager = offload.SwapManager(allocator, host_capacity="8MiB")
        with offload.PageStream(pages, manager=manager, prefetch=1, budget="4MiB") as stream:
            print(stream)
            for n in range(2):
                sums = np.zeros(COLS, np.float64)
                for page in stream:
                    dev.synchronize_stream(stream.stream)
                    sums += device_view(page).sum(axis=0, dtype=np.float64)
                assert np.allclose(sums, data.sum(axis=0, dtype=np.float64))
                s = stream.stats()
                print(f"pass {n + 1}: {s['pages_copied']} pages copied so far, "
                      f"{s['resident_hits']} served from the resident cache, "
                      f"{s['bytes_read_from_disk'] // MiB} MiB read from disk")
            sample = np.sort(rng.choice(len(data), size=len(data) // 10, replace=False))
            rows = stream.gather(sample)
            assert np.array_equal(rows.to_numpy(), data[sample])
            print(f"gathered {rows.shape[0]} sampled rows into one {rows.nbytes // 1024} KiB "
                  f"device buffer")
            print("host waits:", s["host_waits"], "| pinned staging held by prefetches:",
                  manager.stats()["host_bytes_in_use"], "bytes")
        print("after close: device allocations", allocator.stats().live_allocations,
              "| staging in use", manager.stats()["host_bytes_in_use"])


if __name__ == "__main__":
    main()
