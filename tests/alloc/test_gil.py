"""No wrapper entry point waits for a C++ lock, a stream or the device with the GIL held.

An ``allocate`` releases the GIL and may block inside the allocator's mutex on a device
synchronize (a steal waits for the work of the frees it unmaps). A second thread that then
entered ``deallocate`` (or ``stats``, ...) holding the GIL would wait for that mutex forever,
and the thread that should let the device go on (here: release a stream hold) would never get
the GIL back. The repros run in a subprocess so that a regression fails on a timeout instead
of hanging the test run.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import vmalloc

REPRO = textwrap.dedent(
    """
    import sys, threading, time
    import vmalloc
    from vmalloc import testing

    MiB = 1 << 20
    kind, call = sys.argv[1], sys.argv[2]
    if kind == "cuda-emulator":
        emu = testing.emulator()
        dev = testing.emulated_cuda_device(capacity="8MiB", granularity="2MiB")
        hold = lambda s: emu.hold_stream(s)
        release = lambda token: emu.release_hold(token)
    else:
        dev = vmalloc.HostDevice(capacity="8MiB", granularity="2MiB")
        hold = dev.hold_stream
        release = dev.release_hold
    placement = sys.argv[3]
    va = vmalloc.VirtualAllocator(dev, chunk_size="2MiB", placement=placement)
    s = dev.create_stream()
    a = va.allocate(2 * MiB, s)
    b = va.allocate(2 * MiB, s)
    c = va.allocate(2 * MiB, s)
    small = va.allocate(512, s)     # the 4th chunk: the device is full
    va.deallocate(a, 2 * MiB, s)
    va.deallocate(c, 2 * MiB, s)
    token = hold(s)                 # the frees' work cannot complete
    results = {}

    def allocate():                 # must steal a's and c's chunks: waits for the stream
        results["allocate"] = va.allocate(4 * MiB, s)

    def other():
        if call == "deallocate":
            va.deallocate(b, 2 * MiB, s)
        elif call == "stats":
            va.stats()
        elif call == "allocation_size":
            va.allocation_size(b)
        elif call == "reset_peak_stats":
            va.reset_peak_stats()
        elif call == "chunk_stats":
            va.chunk_stats()
        elif call == "release_cached":
            va.release_cached()
        elif call == "repr":
            repr(va)
        results["other"] = True

    t1 = threading.Thread(target=allocate, daemon=True)
    t1.start()
    time.sleep(0.5)                 # t1 now waits inside the allocator's mutex
    t2 = threading.Thread(target=other, daemon=True)
    t2.start()
    time.sleep(0.5)                 # t2 now waits for the mutex
    release(token)                  # needs the GIL
    t1.join(20)
    t2.join(20)
    assert not t1.is_alive() and not t2.is_alive(), "threads still blocked"
    assert set(results) == {"allocate", "other"}, results
    print("OK")
    """
)

CALLS = ["deallocate", "stats", "allocation_size", "reset_peak_stats", "chunk_stats",
         "release_cached", "repr"]


@pytest.mark.parametrize("placement", ["chunks", "packed"])
@pytest.mark.parametrize("kind", ["cuda-emulator", "host"])
@pytest.mark.parametrize("call", CALLS)
def test_no_deadlock_while_allocate_waits_for_a_held_stream(call, kind, placement, tmp_path):
    if kind == "host" and call not in ("deallocate", "stats"):
        pytest.skip("the emulator runs cover every call; the host device the main two")
    env = dict(os.environ)
    # The child imports the vmalloc this process imported (not a source tree in its cwd).
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(vmalloc.__file__)))]
        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        proc = subprocess.run([sys.executable, "-c", REPRO, kind, call, placement],
                              capture_output=True, text=True, timeout=40, env=env,
                              cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{call} deadlocked against an allocate waiting for a held stream")
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
