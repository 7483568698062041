"""The shape of report.json: its sections, in order, and the exact keys of each section and
of each section's ``result`` (a section that did not run has ``result`` None)."""

#: Keys of every section.
SECTION_KEYS = ("status", "ran_on", "reason", "seconds", "limit_seconds", "error", "result")

#: What a section's status may be.
STATUSES = ("ok", "failed", "timeout", "skipped", "pending")

#: Section -> keys of its result, in the order the report lists them.
RESULT_KEYS = {
    "device": ("name", "ordinal", "memory_bytes", "driver_version", "driver_version_text",
               "cuda_runtime_version", "vmm_supported", "granularity_minimum_bytes",
               "granularity_recommended_bytes", "compute_capability", "multiprocessor_count",
               "library", "library_path", "nvidia_smi", "attributes_note"),
    "build": ("method", "command", "python_path", "reused", "log_tail"),
    "tests": ("command", "device_kinds", "passed", "failed", "skipped", "errors",
              "failures", "examples", "output_tail"),
    "driver_costs": ("sizes_bytes", "repeats", "calls", "reference", "note"),
    "bandwidth": ("bytes", "repeats", "pinned_h2d_gbps", "pinned_d2h_gbps",
                  "pinned_both_each_direction_gbps", "pageable_h2d_gbps", "pageable_d2h_gbps",
                  "reference"),
    "torch_out_of_core": ("model", "input", "backend", "budget_bytes", "in_core",
                          "out_of_core", "correctness", "gpt2", "notes"),
    "simulator_vs_measured": ("gpu_model", "calibrated_on", "compute_efficiency",
                              "function_overhead_seconds", "sequence", "runs", "note"),
    "timeline": ("png", "source", "lanes", "seconds", "events"),
}

SECTIONS = tuple(RESULT_KEYS)


def conform(section, result):
    """``result`` with exactly the section's keys: missing ones None, extra ones dropped
    (their names listed under the last key's neighbour ``notes``/``note`` would hide them, so
    they are returned separately)."""
    keys = RESULT_KEYS[section]
    out = {k: result.get(k) for k in keys}
    extra = sorted(set(result) - set(keys))
    return out, extra
