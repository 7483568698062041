"""The device, driver_costs and bandwidth sections: vmalloc.cli.probe on the GPU (or the driver
emulator under --dry-run), beside the constants the simulator uses."""

import shutil
import subprocess
import time

MiB = 1 << 20

# The constants vmalloc.offload's GPU models and docs/simulating.rst use, with their source
# (the project's reference/numbers.md): a measured figure is reported beside them.
DRIVER_REFERENCE = {
    "source": "kvcached bench_vmm on A100, 4096 x 2 MiB pages (reference/numbers.md)",
    "us": {"cuMemCreate": 193.0, "cuMemMap": 1.45, "cuMemSetAccess": 36.0,
           "cuMemUnmap": 25.6, "cuMemAddressReserve": 19.0, "cuMemRelease": None,
           "cuMemAddressFree": None},
}
BANDWIDTH_REFERENCE = {
    "source": "nvbandwidth on H800, PCIe 5 x16, copy engines (reference/numbers.md); the "
              "simulator's h100-80gb model uses these",
    "pinned_h2d_gbps": 55.3, "pinned_d2h_gbps": 55.1, "pinned_both_each_direction_gbps": 52.8,
    "pageable": "roughly half of pinned (third-party reports)",
}


def _nvidia_smi():
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pci.bus_id,"
             "clocks.max.sm,power.limit", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or proc.stderr.strip() or None


def _cuda_runtime_version():
    """PyTorch's CUDA version, read from torch/version.py: importing torch takes seconds."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(f"{spec.submodule_search_locations[0]}/version.py") as f:
            m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def device(ctx):
    from vmalloc.cli import probe

    dev, ran_on = ctx.open_device()
    info = probe.driver_info(dev)
    info["nvidia_smi"] = None if ctx.dry_run else _nvidia_smi()
    info["cuda_runtime_version"] = _cuda_runtime_version()
    if info["vmm_supported"] is None:
        # No attribute to ask (the emulator): a map round trip is the proof.
        probe.round_trip(dev)
        info["vmm_supported"] = True
        info["attributes_note"] = (info["attributes_note"] or "") + \
            "; vmm_supported from a successful map round trip"
    ctx.save(info, ran_on=ran_on)


def driver_costs(ctx):
    from vmalloc.cli import probe

    dev, ran_on = ctx.open_device()
    sizes = (2 * MiB, 20 * MiB, 512 * MiB)
    repeats = 3 if ctx.quick else 20
    # Leave time to write the result: stop sampling 5 s before the deadline.
    costs = probe.driver_costs(dev, sizes, repeats, deadline=time.monotonic() + ctx.left() - 5)
    calls = {call: {str(size): costs[size][call] for size in sizes} for call in probe.CALLS}
    ctx.save({"sizes_bytes": list(sizes), "repeats": repeats, "calls": calls,
              "reference": DRIVER_REFERENCE,
              "note": "microseconds per call through vmalloc's Device methods (Python call and "
                      "context push included); median of the samples after one warm-up "
                      "round trip per size" + ("; on the emulator these are host syscall "
                                               "costs, not a GPU's" if ctx.dry_run else "")},
             ran_on=ran_on)


def bandwidth(ctx):
    from vmalloc.cli import probe

    dev, ran_on = ctx.open_device()
    nbytes = (8 if ctx.dry_run else 64 if ctx.quick else 256) * MiB
    repeats = 2 if ctx.quick else 5
    result = probe.bandwidth(dev, nbytes, repeats)
    result["reference"] = BANDWIDTH_REFERENCE
    ctx.save(result, ran_on=ran_on + ("; emulator copies are host memcpy" if ctx.dry_run
                                      else ""))
