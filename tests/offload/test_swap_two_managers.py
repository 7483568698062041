"""Two SwapManagers over one allocator (issue 20, item 4): each watches the allocator's frees,
so a free through one is seen by the other. Before the fix each manager called the
allocator's deallocate with its own mutex held, and the allocator then called the other's
watcher, which took the other's mutex: two threads freeing through the two managers locked
them in opposite orders and deadlocked (5 runs in 5, within a fraction of a second).

A deadlock cannot be caught in-process (the stuck threads hold C++ mutexes forever), so the
threads run in a child process: it joins them with a timeout and exits 3 when one is stuck,
and the parent's own timeout backs that up. The work is counted in operations, never timed;
the timeouts only turn a hang into a failure."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import vmalloc

CHILD = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import vmalloc
    from vmalloc import offload

    kind, plan = sys.argv[1], json.loads(sys.argv[2])  # plan: per thread, [step, size] pairs
    device = vmalloc.HostDevice(capacity="64MiB")
    if kind == "virtual":
        alloc = vmalloc.VirtualAllocator(device)
    else:
        alloc = vmalloc.CachingAllocator(device)
    managers = [offload.SwapManager(alloc), offload.SwapManager(alloc)]
    done = [0, 0]
    errors = []

    def work(i):
        swap = managers[i]
        try:
            for step, size in plan[i]:
                p = swap.allocate(size)
                if step == 1:  # out, then freed while out (or in flight)
                    p = swap.swap_out(p)
                elif step == 2:  # out and back
                    p = swap.swap_in(swap.swap_out(p))
                    swap.wait(p)
                elif step == 3:  # freed straight through the allocator: both watchers see it
                    alloc.deallocate(p)
                    done[i] += 1
                    continue
                swap.deallocate(p)
                done[i] += 1
        except BaseException as e:  # reported by the parent
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # a hang detector, not a timing: the work is counted
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        print("STUCK after", done, flush=True)
        os._exit(3)
    for m in managers:
        m.poll()
    print("DONE", done[0], done[1], len(errors), alloc.stats().live_allocations,
          sum(m.stats()["on_host"] + m.stats()["swapping_out"] + m.stats()["swapping_in"]
              for m in managers), flush=True)
    for e in errors:
        print("ERROR", e, flush=True)
    """
)


def run_child(kind, plan):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(vmalloc.__file__))
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, kind, json.dumps(plan)], env=env,
                             cwd="/", capture_output=True, text=True, timeout=110)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"two managers deadlocked ({kind}, {plan!r:.200}): {e.stdout!r}")
    assert out.returncode == 0, f"rc {out.returncode}: {out.stdout} {out.stderr[-2000:]}"
    return out.stdout.split()


def cycle(ops, i):
    """`ops` operations for thread i: each step in turn, a size per thread."""
    return [[n % 4, 3000 + 64 * i] for n in range(ops)]


@pytest.mark.parametrize("kind", ["virtual", "caching"])
def test_two_threads_freeing_through_two_managers_do_not_deadlock(kind):
    words = run_child(kind, [cycle(2000, 0), cycle(2000, 1)])
    # Every operation done, no error, nothing left live in the allocator or in either manager.
    assert words[:6] == ["DONE", "2000", "2000", "0", "0", "0"], words


@pytest.mark.parametrize("ops", [1, 7, 64, 500])
def test_two_managers_counted_in_operations(ops):
    # The same race at several operation counts (it deadlocked within the first hundreds of
    # operations before the fix); each run must finish all of them and leave nothing.
    words = run_child("virtual", [cycle(ops, 0), cycle(ops, 1)])
    assert words[:6] == ["DONE", str(ops), str(ops), "0", "0", "0"], words


thread_plan = st.lists(st.tuples(st.integers(0, 3), st.sampled_from([512, 3000, 64 << 10,
                                                                      3 << 20])),
                       min_size=1, max_size=200)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["virtual", "caching"]), a=thread_plan, b=thread_plan)
def test_two_managers_any_operations(kind, a, b):
    # Any mix of allocate / swap out / swap in / free (through either manager or the
    # allocator), on both threads: all done, nothing left.
    words = run_child(kind, [a, b])
    assert words[:6] == ["DONE", str(len(a)), str(len(b)), "0", "0", "0"], words
