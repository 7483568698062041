"""One section of gpu-check, run in a child process: ``python -m gpucheck.section NAME ...``.

Writes ``{"ran_on", "reason", "status", "error", "result"}`` to ``--result`` (a section may
write it several times as it goes, so that a timeout keeps what it finished) and exits 0, or
1 after writing the error."""

import argparse
import json
import os
import sys
import time
import traceback


class Context:
    """What a section gets: its options, the report so far, a deadline, and ``save``."""

    def __init__(self, args):
        self.args = args
        self.dry_run = args.dry_run
        self.quick = args.quick
        self.out = args.out
        self.budget = args.budget
        self.deadline = time.monotonic() + args.deadline_seconds
        try:
            with open(args.report) as f:
                self.report = json.load(f)
        except (OSError, ValueError):
            self.report = {"sections": {}}
        self.payload = {"ran_on": None, "reason": None, "status": "ok", "error": None,
                        "result": None}

    def left(self):
        return self.deadline - time.monotonic()

    def result_of(self, section):
        """Another section's result in the report so far (None if it has none)."""
        return (self.report.get("sections", {}).get(section) or {}).get("result")

    def save(self, result=None, **fields):
        if result is not None:
            self.payload["result"] = result
        self.payload.update(fields)
        tmp = self.args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.payload, f, indent=1, default=str)
        os.replace(tmp, self.args.result)

    def open_device(self):
        """The CudaDevice the section measures, and what it is, in words."""
        if self.dry_run:
            from vmalloc import testing

            device = testing.emulated_cuda_device()
            return device, f"driver emulator ({device.device_name}, --dry-run)"
        import vmalloc

        device = vmalloc.CudaDevice(0)
        return device, f"{device.device_name} via {device.library} (real driver)"


def _sections():
    from gpucheck import driver, sim, tests_step, torch_ooc

    return {"device": driver.device, "driver_costs": driver.driver_costs,
            "bandwidth": driver.bandwidth, "tests": tests_step.run,
            "torch_out_of_core": torch_ooc.run, "simulator_vs_measured": sim.run}


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpucheck.section")
    p.add_argument("name")
    p.add_argument("--report", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--deadline-seconds", type=float, default=60)
    args = p.parse_args(argv)
    ctx = Context(args)
    try:
        _sections()[args.name](ctx)
    except BaseException as error:  # noqa: BLE001 - the report carries it
        ctx.save(error=f"{type(error).__name__}: {error}",
                 traceback=traceback.format_exc()[-4000:])
        print(traceback.format_exc(), file=sys.stderr)
        return 1
    ctx.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
