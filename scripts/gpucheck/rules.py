"""What a driver answers to each VMM rule the emulator enforces (tests/device's list): the
failing call's name and CUresult, or what happened. ``python scripts/gpucheck/rules.py``
on a GPU machine; ``--emulator`` for the driver emulator. Prints JSON."""

import json
import sys

MiB = 1 << 20
G = 2 * MiB


def probe(dev):
    from vmalloc import DeviceError

    out = {}

    def attempt(name, fn):
        try:
            r = fn()
            out[name] = {"ok": True, "result": repr(r)[:80]}
        except DeviceError as e:
            out[name] = {"call": e.call, "code": e.code}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        print(json.dumps({name: out[name]}), flush=True)

    handle, big = dev.create(G), dev.create(2 * G)
    ptr = dev.reserve(4 * G)
    dev.map(ptr, G, handle)
    # Safe refusals first; reads that might fault asynchronously (a sticky error would end
    # the context) and a made-up handle last. Each answer is printed as it comes.
    attempt("create_unaligned_size", lambda: dev.create(G + 4096))
    attempt("reserve_bad_alignment", lambda: dev.reserve(G, alignment=3 * MiB))
    attempt("map_already_mapped", lambda: dev.map(ptr, G, handle))
    attempt("map_unaligned_address", lambda: dev.map(ptr + 4096, G, big))
    attempt("map_past_reservation", lambda: dev.map(ptr + 3 * G, 2 * G, big))
    attempt("unmap_unaligned", lambda: dev.unmap(ptr + 4096, G))
    attempt("set_access_over_gap", lambda: dev.set_access(ptr, 2 * G))
    attempt("free_address_mapped", lambda: dev.free_address(ptr, 4 * G))
    attempt("free_address_partial", lambda: dev.free_address(ptr + G, 3 * G))
    attempt("read_mapped_no_access", lambda: dev.read(ptr, 1))
    attempt("read_unmapped", lambda: dev.read(ptr + G, 1))
    dev.set_access(ptr, G)
    dev.write(ptr + 10, b"chunk bytes")
    attempt("release_while_mapped", lambda: dev.release(handle))
    attempt("read_after_release_while_mapped", lambda: dev.read(ptr + 10, 11))
    attempt("read_past_mapping_end", lambda: dev.read(ptr + G - 2, 4))
    attempt("read_after_the_past_end_read", lambda: dev.read(ptr + 10, 11))
    attempt("unmap_after_release", lambda: dev.unmap(ptr, G))
    attempt("release_big", lambda: dev.release(big))
    attempt("free_address", lambda: dev.free_address(ptr, 4 * G))
    attempt("release_bogus_handle", lambda: dev.release(12345))
    return out


def main(argv):
    import vmalloc

    if "--emulator" in argv:
        from vmalloc import testing
        dev = testing.emulated_cuda_device(capacity=64 * MiB, granularity=G)
    else:
        dev = vmalloc.CudaDevice(0)
    print(json.dumps({"device": repr(dev)}), flush=True)
    probe(dev)


if __name__ == "__main__":
    main(sys.argv[1:])
