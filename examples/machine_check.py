"""Can this machine run vmalloc on its GPU? The checks of ``vmalloc doctor`` from Python.

Without a GPU the checks run on the driver emulator and the report says so.

Run: python examples/machine_check.py
"""

from vmalloc.cli import doctor


def main():
    report = doctor.run()
    where = "GPU" if report["gpu"] else f"no GPU ({report['no_gpu_reason']})"
    print(f"{where}: checks ran on {report['ran_on']}")
    for call, us in report["round_trip_us"].items():
        print(f"  {call:20} {us:8.1f} us")
    bw = report["bandwidth"]
    print(f"  pinned host->device {bw['pinned_h2d_gbps']:.1f} GB/s, "
          f"device->host {bw['pinned_d2h_gbps']:.1f} GB/s")
    for problem in report["problems"]:
        print(f"  {'PROBLEM' if problem['broken'] else 'WARNING'}: {problem['problem']}")
    return report["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
