"""Checked mode of the emulated device: memory an allocator freed, or a swap moved, faults.

On the packed placement and the caching allocators freed memory stays mapped for reuse, so a
stale pointer silently reads another buffer's bytes. With HostDevice(checked=True) (what the
test suite runs with: VMALLOC_CHECKED=1) a copy there is refused and a touch ends the process
with SIGSEGV and a line naming the freed allocation. Shown here on each allocator kind, the
touch in a child process.

Run: python examples/checked_mode.py
"""

import os
import signal
import subprocess
import sys

import vmalloc
from vmalloc import allocator_kinds
from vmalloc.offload import SwapManager

KiB = 1 << 10

TOUCH = """
import ctypes, sys, vmalloc
from vmalloc import allocator_kinds
dev = vmalloc.HostDevice(checked=sys.argv[2] == "1")
alloc = allocator_kinds.get(sys.argv[1]).make(dev)
keep, p = alloc.allocate(64 << 10), alloc.allocate(64 << 10)
ctypes.memset(p, 7, 64 << 10)
alloc.deallocate(p)
print("read through a dangling pointer:", ctypes.string_at(p, 4))  # faults when checked
"""


def touch(kind, checked):
    """Runs TOUCH in a child process; returns (exit code, the child's last line)."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(vmalloc.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root,
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", TOUCH, kind, "1" if checked else "0"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=os.path.dirname(
                           os.path.abspath(__file__)))
    return r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1]


def main():
    for kind in allocator_kinds.NAMES:
        if not allocator_kinds.get(kind).available:
            continue
        code, line = touch(kind, checked=False)
        assert code == 0, line
        print(f"{kind:20s} unchecked: {line}")
        code, line = touch(kind, checked=True)
        assert code == -signal.SIGSEGV and "checked HostDevice" in line, (code, line)
        print(f"{kind:20s} checked:   SIGSEGV; {line[:110]}...")

    # The device's own copies: refused after the free, kept when queued before it (a swap).
    dev = vmalloc.HostDevice(checked=True)
    alloc = vmalloc.CachingAllocator(dev)
    swap = SwapManager(alloc)
    keep, p = alloc.allocate(64 * KiB), alloc.allocate(64 * KiB)
    dev.write(p, b"kept by the swap")
    key = swap.swap_out(p)              # the copy to host is queued, then the block freed
    swap.wait(key)
    try:
        dev.read(p, 16)
        raise SystemExit("a read of freed memory was not refused")
    except vmalloc.DeviceError as error:
        assert error.code == 700        # CUDA_ERROR_ILLEGAL_ADDRESS
        print("refused:", str(error)[:100], "...")
    q = swap.swap_in(key)
    dev.synchronize()
    assert dev.read(q, 16) == b"kept by the swap"
    print("swapped back in at", hex(q), "with its bytes;", dev.state()["live_allocations"],
          "live allocations,", dev.state()["bytes_guarded"], "bytes guarded")


if __name__ == "__main__":
    main()
