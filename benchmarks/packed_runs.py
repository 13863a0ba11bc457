"""Every packed CPU run's peak predicted from a formula set, against the run's own allocator peak.

    python benchmarks/packed_runs.py [--formulas SET] [--json FILE] [DIR ...]

DIR (default fit/traces/cpu_compose and fit/traces/cpu_recompute_twins): packed runs (rank<R>.json headers with the
tracing allocator's exact `allocator_peak_bytes`). Per run, the estimator on the run's own flags and kernels
(fit.dataset.traced_config; device "cpu": no GPU runtime buffers) gives each traced rank's peak; a row is a run,
each of its ranks' errors, and the summary counts ranks (a rank over by more cannot hide another under). A program set reproduces each plain run's every label phase exactly (make refit),
so what this measures is the composition: the walk of the op structure, recompute (runs with recompute are never
fitted: they are held out), pipeline boundaries, and the alternatives a set keeps where one switch combination had
several event structures (the estimate takes the highest: errs high).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from fit.dataset import traced_ranks  # noqa: E402  (the ranks a run traced)

DEFAULT_DIRS = [os.path.join(ROOT, "fit", "traces", d) for d in ("cpu_compose", "cpu_recompute_twins")]


def rank_peaks(path: str, fset) -> tuple:
    """(predicted peak per traced rank, the run's own allocator peak per traced rank, its argv) of one packed run;
    a rank is predicted by its pipeline stage's estimate (fit.dataset.predicted_and_measured)."""
    from fit.dataset import predicted_and_measured, run_argv
    rows = predicted_and_measured(path, fset)
    return [p for _, _, p, _ in rows], [m for _, _, _, m in rows], run_argv(path)[0]


def run_errors(path: str, fset) -> tuple:
    """(relative error per traced rank, recompute) of one packed run."""
    predicted, measured, argv = rank_peaks(path, fset)
    return [(p - m) / m for p, m in zip(predicted, measured)], any(a.startswith("--recompute") for a in argv)


def main(argv=None) -> int:
    from estimator import formulas as F
    ap = argparse.ArgumentParser(prog="benchmarks/packed_runs.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", default=DEFAULT_DIRS)
    ap.add_argument("--formulas", default="cpu_compose")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    from estimator.args import ConfigError
    fset = F.load(a.formulas)
    rows, refused = [], []
    for d in a.dirs:
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if not os.path.isdir(path) or not traced_ranks(path):
                continue
            try:
                errs, rec = run_errors(path, fset)
            except ConfigError as exc:   # a run the set cannot estimate (a feature it never traced): said, not hidden
                refused.append(os.path.relpath(path, ROOT))
                print(f"{refused[-1]:<70} refused: {exc}", flush=True)
                continue
            rows.append({"run": os.path.relpath(path, ROOT), "errors": errs, "recompute": rec})
            print(f"{rows[-1]['run']:<70} " + " ".join(f"{100 * e:+7.2f}%" for e in errs)
                  + ("  (recompute: held out)" if rec else ""), flush=True)
    for label, sel in (("plain", [r for r in rows if not r["recompute"]]),
                       ("recompute (held out)", [r for r in rows if r["recompute"]])):
        if not sel:
            continue
        e = [100 * x for r in sel for x in r["errors"]]
        print(f"{a.formulas} {label}: {len(sel)} runs, {len(e)} ranks, median {statistics.median(e):+.2f}%, "
              f"range {min(e):+.2f}% .. "
              f"{max(e):+.2f}%, {sum(abs(x) <= 0.2 for x in e)} within 0.2%, {sum(-0.5 <= x <= 1 for x in e)} within "
              f"-0.5% .. +1%, {sum(x < -0.5 for x in e)} under by more than 0.5%")
    if refused:
        print(f"{a.formulas}: {len(refused)} runs refused (above)")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"formulas": a.formulas, "rows": rows, "refused": refused}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
