"""``vmalloc doctor``: can this machine run vmalloc, and what do its driver and link cost?

Checks, in about a second on a GPU (well under 30 s anywhere): the CUDA driver (found, its
version, the GPU), virtual memory management (supported, granularity), one reserve / create /
map / set-access / unmap / release round trip with its cost, pinned host copy bandwidth, the
host memory available for swapping (and the cgroup and locked-memory limits), and which
frameworks can use vmalloc now. Without a GPU it says so in one line and runs the same checks
on the driver emulator (:mod:`vmalloc.testing`). Exits 0 unless the setup is broken; each
problem is one line with its fix.
"""

import argparse
import importlib
import json
import resource
import sys
import time

__all__ = ["run", "main", "format_report"]

MiB = 1 << 20
GiB = 1 << 30
BANDWIDTH_BYTES = 64 * MiB


def _problem(report, message, fix, broken=True):
    report["problems"].append({"problem": message, "fix": fix, "broken": broken})


def _open_device():
    """(device, None) on the driver vmalloc would use, or (None, why not)."""
    import vmalloc

    try:
        return vmalloc.CudaDevice(0), None
    except vmalloc.DeviceError as error:
        return None, error


def _no_gpu_reason(error):
    call = getattr(error, "call", None)
    code = getattr(error, "code_name", None)
    if call == "dlopen":
        return "no CUDA driver (libcuda.so.1) found", False
    if code in ("CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_INVALID_DEVICE"):
        return "the CUDA driver sees no GPU", False
    return f"the CUDA driver failed: {error}", True


def _device_checks(report, device):
    from vmalloc.cli import probe

    info = probe.driver_info(device)
    report["device"] = info
    if info["vmm_supported"] is False:
        _problem(report, f"{info['name']} does not support virtual memory management "
                 "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)",
                 "use a GPU and driver with VMM (CUDA 10.2+, not under vGPU without it); "
                 "vmalloc's CachingAllocator needs no VMM")
    try:
        report["round_trip_us"] = {k: v * 1e6 for k, v in probe.round_trip(device).items()}
    except Exception as error:  # noqa: BLE001 - any failure is the finding
        report["round_trip_us"] = None
        _problem(report, f"a virtual memory round trip failed: {error}",
                 "update the NVIDIA driver (>= 450) and check that nothing limits the GPU "
                 "(MIG, vGPU); run with VMALLOC_EMULATOR_VERBOSE=1 on the emulator to compare")
    try:
        report["bandwidth"] = probe.bandwidth(device, BANDWIDTH_BYTES, repeats=3,
                                              pageable=False, both=False)
    except Exception as error:  # noqa: BLE001
        report["bandwidth"] = None
        _problem(report, f"pinned host copies failed: {error}",
                 "raise the locked-memory limit (ulimit -l) or free host memory")


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_memory():
    """Host memory available for swapping: MemAvailable, the cgroup limit and usage, and the
    locked-memory limit pinned staging memory counts against (bytes; None = none or unknown)."""
    out = {"available_bytes": None, "total_bytes": None, "cgroup_limit_bytes": None,
           "cgroup_usage_bytes": None, "memlock_limit_bytes": None}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    name = "available_bytes" if key == "MemAvailable" else "total_bytes"
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        value = _read_int(limit)
        if value is not None and value < (1 << 60):
            out["cgroup_limit_bytes"] = value
            out["cgroup_usage_bytes"] = _read_int(usage)
            break
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out["memlock_limit_bytes"] = None if soft == resource.RLIM_INFINITY else soft
    room = [out["available_bytes"]]
    if out["cgroup_limit_bytes"] is not None:
        room.append(out["cgroup_limit_bytes"] - (out["cgroup_usage_bytes"] or 0))
    room = [r for r in room if r is not None]
    out["swap_room_bytes"] = min(room) if room else None
    return out


def _version(module):
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: either way not usable
        return None


def frameworks(gpu):
    """PyTorch, CuPy and cuda-core: version and whether each can use vmalloc now."""
    out = {}
    version = _version("torch")
    entry = {"version": version, "usable": False, "note": "not installed"}
    if version is not None:
        import torch

        if torch.version.cuda is None:
            entry["note"] = ("CPU-only build: vmalloc.torch.out_of_core runs with "
                             "backend='poison'; allocating from vmalloc needs a CUDA build")
        elif torch.cuda.is_initialized():
            entry["note"] = ("CUDA already initialized in this process: call "
                             "vmalloc.torch.use_vmalloc() before the first CUDA tensor")
        elif not gpu:
            entry["note"] = f"CUDA {torch.version.cuda} build, but no GPU here"
        else:
            entry.update(usable=True, note=f"CUDA {torch.version.cuda} build, CUDA not yet "
                         "initialized: vmalloc.torch.use_vmalloc() can install vmalloc")
        entry["cuda"] = torch.version.cuda
    out["torch"] = entry
    version = _version("cupy")
    entry = {"version": version, "usable": False, "note": "not installed"}
    if version is not None:
        entry["usable"] = gpu
        entry["note"] = ("vmalloc.cupy.use_vmalloc() can install vmalloc" if gpu
                         else "installed, but no GPU here")
    out["cupy"] = entry
    version = _version("cuda.core") or _version("cuda.core.experimental")
    entry = {"version": version, "usable": False, "note": "not installed"}
    if version is not None:
        entry["usable"] = gpu
        entry["note"] = ("vmalloc.cuda_core memory resources can serve it" if gpu
                         else "installed, but no GPU here")
    out["cuda_core"] = entry
    return out


def run():
    """All checks; returns the report dict (see ``vmalloc doctor --json``)."""
    import vmalloc

    start = time.monotonic()
    report = {"vmalloc": vmalloc.__version__, "python": sys.version.split()[0], "gpu": False,
              "ran_on": None, "no_gpu_reason": None, "device": None, "round_trip_us": None,
              "bandwidth": None, "host_memory": None, "frameworks": None, "problems": []}
    device, error = _open_device()
    if device is None:
        reason, broken = _no_gpu_reason(error)
        report["no_gpu_reason"] = reason
        if broken:
            _problem(report, reason, "check the NVIDIA driver (nvidia-smi) and "
                     "CUDA_VISIBLE_DEVICES")
        try:
            from vmalloc import testing

            device = testing.emulated_cuda_device()
            report["ran_on"] = "driver emulator (vmalloc.testing)"
        except Exception as emulator_error:  # noqa: BLE001
            _problem(report, f"the driver emulator does not load: {emulator_error}",
                     "rebuild vmalloc (pip install . or scripts/dev-build)")
    else:
        report["gpu"] = True
        report["ran_on"] = f"{device.device_name} via {device.library}"
    if device is not None:
        _device_checks(report, device)
        del device
    report["host_memory"] = mem = host_memory()
    if mem["memlock_limit_bytes"] is not None and mem["memlock_limit_bytes"] < 64 * MiB:
        _problem(report, f"locked-memory limit {_size(mem['memlock_limit_bytes'])}: pinned "
                 "staging memory for swapping may fail", "raise it: ulimit -l unlimited",
                 broken=False)
    report["frameworks"] = frameworks(report["gpu"])
    report["seconds"] = time.monotonic() - start
    report["exit_code"] = 1 if any(p["broken"] for p in report["problems"]) else 0
    return report


def _size(n):
    from vmalloc.sizes import format_size

    return "unknown" if n is None else format_size(n)


def format_report(report):
    """The report as lines of text, one check per line, problems last."""
    lines = []
    if not report["gpu"]:
        lines.append(f"no GPU: {report['no_gpu_reason']}; the checks below ran on "
                     f"{report['ran_on'] or 'nothing (the emulator did not load)'}")
    dev = report["device"]
    if dev:
        lines.append(f"device: {dev['name']}, {_size(dev['memory_bytes'])}, driver "
                     f"{dev['driver_version_text']} ({dev['library_path']})")
        cc = dev["compute_capability"] or "unknown"
        vmm = {True: "yes", False: "NO", None: "yes (the round trip below is the test)"}
        lines.append(f"virtual memory management: {vmm[dev['vmm_supported']]}; granularity "
                     f"{_size(dev['granularity_minimum_bytes'])} minimum, "
                     f"{_size(dev['granularity_recommended_bytes'])} recommended; compute "
                     f"capability {cc}")
    rt = report["round_trip_us"]
    if rt:
        lines.append("round trip: " + ", ".join(
            f"{k.replace('cuMem', '')} {v:.1f} us" for k, v in rt.items()))
    bw = report["bandwidth"]
    if bw:
        lines.append(f"pinned copies ({_size(bw['bytes'])}): host to device "
                     f"{bw['pinned_h2d_gbps']:.1f} GB/s, device to host "
                     f"{bw['pinned_d2h_gbps']:.1f} GB/s")
    mem = report["host_memory"]
    cgroup = _size(mem["cgroup_limit_bytes"]) if mem["cgroup_limit_bytes"] else "none"
    memlock = ("unlimited" if mem["memlock_limit_bytes"] is None
               else _size(mem["memlock_limit_bytes"]))
    lines.append(f"host memory for swapping: {_size(mem['swap_room_bytes'])} available "
                 f"(cgroup limit {cgroup}, locked-memory limit {memlock})")
    for name, fw in report["frameworks"].items():
        state = "can use vmalloc now" if fw["usable"] else "cannot use vmalloc now"
        version = fw["version"] or "-"
        lines.append(f"{name} {version}: {state} ({fw['note']})")
    for p in report["problems"]:
        label = "PROBLEM" if p["broken"] else "WARNING"
        lines.append(f"{label}: {p['problem']}; fix: {p['fix']}")
    lines.append("status: " + ("broken (see PROBLEM lines)" if report["exit_code"]
                               else "ok"))
    return lines


def main(argv=None):
    """``vmalloc doctor [--json]``; returns the exit status."""
    class Parser(argparse.ArgumentParser):
        def error(self, message):   # one line, as every error of the command line
            self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    parser = Parser(
        prog="vmalloc doctor",
        description="Check whether this machine can run vmalloc: driver, virtual memory "
                    "management, one map round trip and its cost, pinned bandwidth, host "
                    "memory for swapping, frameworks. Without a GPU the checks run on the "
                    "driver emulator. Exit status 0 unless the setup is broken.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = run()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(format_report(report)))
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
