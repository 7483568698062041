"""``vmalloc offload validate``: every published row beside its simulation.

For each :data:`vmalloc.offload.simulation.published.ROWS` entry the row's GPU model is given its profile
and precision (:func:`~vmalloc.offload.simulation.profiles.profiled_gpu`), the shipped sequence its
precision's bytes (:func:`~vmalloc.offload.simulation.profiles.apply_precision`), and:

- an ``in-core`` row is the compute-only images/s at the row's batch;
- an out-of-core row (``window+virtual``, ``lms+virtual``) is planned by the planner against
  the in-core reference of the same GPU model and model (with the settings the source
  published fixed: ``Row.settings``, e.g. the paper's 40 MB chunk), and reports both ratios: ``relative_speed``
  (the paper's: images/s over the in-core images/s at the in-core limit) and
  ``same_batch_compute_ratio`` (this batch's compute-only time over its iteration time).

``error`` is signed: simulated / published - 1 (None where the simulation runs out of memory).
Everything is deterministic, so a test pins the errors.
"""

from __future__ import annotations

__all__ = ["validate", "format_validation"]


def _simulate_row(row, refs):
    from vmalloc.offload.sequence.models import model_sequence
    from vmalloc.offload.planning.planner import in_core_reference, plan
    from vmalloc.offload.simulation.profiles import apply_precision, profiled_gpu
    from vmalloc.offload.simulation.simulator import in_core_seconds

    gpu = profiled_gpu(row.gpu, row.profile, row.precision, model=row.model)

    def seq_at(b):
        return apply_precision(model_sequence(row.model, b), row.precision)

    out = {"images_per_second": None, "relative_speed": None,
           "same_batch_compute_ratio": None, "params": None}
    seq = seq_at(row.batch)
    if row.run == "in-core":
        out["images_per_second"] = row.batch / in_core_seconds(seq, gpu)
        return out
    key = (row.model, gpu)
    if key not in refs:
        refs[key] = in_core_reference(seq_at, gpu)
    limit, ips = refs[key]
    out["in_core_limit_batch"], out["in_core_limit_images_per_second"] = limit, ips
    scheduler, allocator = row.run.split("+")
    p = plan(seq, gpu, scheduler, allocator, reference=(limit, ips) if limit else None,
             **dict(row.settings))
    if p.feasible:
        r = p.result
        out.update(images_per_second=r.images_per_second, relative_speed=r.relative_speed,
                   same_batch_compute_ratio=r.speed_vs_compute_only, params=p.params)
    return out


def validate(rows=None, progress=False) -> dict:
    """Simulates ``rows`` (default every published row); returns ``{"rows": [...]}``, each the
    row's fields, the simulation's and the signed ``error``, plus the published ratio where
    the paper's in-core limit defines it."""
    import sys

    from vmalloc.offload.simulation.published import ROWS

    rows = ROWS if rows is None else rows
    refs = {}
    # each source's own in-core figure at its largest in-core batch (the paper: 581 at 190)
    limit_ips = {}
    for r in sorted(ROWS, key=lambda r: r.batch):
        if r.run == "in-core":
            limit_ips[r.source] = r.images_per_second
    out = []
    for k, row in enumerate(rows):
        if progress:
            print(f"\rvalidate: {k + 1}/{len(rows)}", end="", file=sys.stderr, flush=True)
        sim = _simulate_row(row, refs)
        ips = sim["images_per_second"]
        d = dict(row._asdict())
        d["simulated_images_per_second"] = ips
        d["error"] = None if ips is None else ips / row.images_per_second - 1
        for key in ("relative_speed", "same_batch_compute_ratio", "params",
                    "in_core_limit_batch", "in_core_limit_images_per_second"):
            if key in sim:
                d["simulated_" + key] = sim[key]
        if row.run != "in-core" and row.source in limit_ips:
            # the paper's metric on the source's own figures (the paper: against 581 at 190)
            d["published_relative_speed"] = row.images_per_second / limit_ips[row.source]
        out.append(d)
    if progress:
        print(file=sys.stderr)
    return {"rows": out}


def _pct(x, signed=False):
    if x is None:
        return "-"
    return format(x, "+.1%" if signed else ".1%")


def format_validation(v) -> str:
    """The validation as text: one line per row, then the sources."""
    lines = [f"{'gpu':<10} {'profile':<13} {'precision':<18} {'run':<15} {'batch':>5} "
             f"{'published':>9} {'simulated':>9} {'error':>7}  {'role':<10} "
             f"{'rel_speed pub/sim':>17} {'same_batch_compute':>18}"]
    sources = []
    for r in v["rows"]:
        if r["source"] not in sources:
            sources.append(r["source"])
        sim = r["simulated_images_per_second"]
        rel = ""
        if r["run"] != "in-core":
            rel = f"{_pct(r.get('published_relative_speed'))}/{_pct(r.get('simulated_relative_speed'))}"
        lines.append(
            f"{r['gpu']:<10} {r['profile']:<13} {r['precision']:<18} {r['run']:<15} "
            f"{r['batch']:>5} {r['images_per_second']:>9.0f} "
            f"{'OOM' if sim is None else format(sim, '.0f'):>9} {_pct(r['error'], True):>7}  "
            f"{r['role']:<10} {rel:>17} "
            f"{_pct(r.get('simulated_same_batch_compute_ratio')) if r['run'] != 'in-core' else '':>18}"
            f"  [{sources.index(r['source']) + 1}]")
    lines.append("error: simulated / published - 1. calibrates: the row fixed the model's "
                 "constants; validates: never used to fit.")
    lines.append("rel_speed: relative_speed (the paper's metric, images/s over in-core at the "
                 "in-core limit), published / simulated; same_batch_compute: "
                 "same_batch_compute_ratio (compute-only time at this batch / iteration time).")
    lines += [f"[{i + 1}] {s}" for i, s in enumerate(sources)]
    return "\n".join(lines)
