"""Recompute composed from the plain layer, checked without any fit: every packed CPU run with selective or full
recompute whose twin without recompute (the same flags otherwise) is packed too is predicted from that twin's
*measured* segments, replayed through the estimator's composition (estimator/compose.py).

    python benchmarks/recompute_twins.py [--json FILE]

Runs under fit/traces/cpu_compose and fit/traces/cpu_recompute_twins. Printed per pair: measured rank-0 peak,
predicted, error; then how many are within 0.2%. An error here is the composition's (what a checkpoint holds in
its forward and backward), not a fitted formula's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from estimator.memory import estimate  # noqa: E402
from fit.dataset import run_argv, traced_config  # noqa: E402
from fit.programs.build import measured_set  # noqa: E402

DIRS = [os.path.join(ROOT, "fit", "traces", d) for d in ("cpu_compose", "cpu_recompute_twins")]
RECOMPUTE_FLAGS = {"--recompute-activations": 0, "--recompute-granularity": 1, "--recompute-method": 1,
                   "--recompute-num-layers": 1}
TOLERANCE = 0.2   # %


def _without_recompute(argv: list) -> tuple:
    out, skip = [], 0
    for x in argv:
        if skip:
            skip -= 1
        elif x in RECOMPUTE_FLAGS:
            skip = RECOMPUTE_FLAGS[x]
        else:
            out.append(x)
    return tuple(out)


def twins() -> list[tuple[str, str, list]]:
    """(recompute run, plain twin, the recompute run's flags) directory pairs."""
    out = []
    for d in DIRS:
        if not os.path.isdir(d):
            continue
        runs = {n: run_argv(os.path.join(d, n))[0] for n in sorted(os.listdir(d))
                if os.path.isfile(os.path.join(d, n, "rank0.json"))}
        plain = {_without_recompute(a): n for n, a in runs.items() if _without_recompute(a) == tuple(a)}
        out += [(os.path.join(d, n), os.path.join(d, plain[_without_recompute(a)]), a) for n, a in runs.items()
                if _without_recompute(a) != tuple(a) and _without_recompute(a) in plain]
    return out


def predict(path: str, fset) -> tuple[int, float]:
    """(measured, predicted) rank-0 peak of the run at `path`."""
    cfg, hdr, _ = traced_config(path)
    return hdr["allocator_peak_bytes"], estimate(cfg, fset, device="cpu").ranks[0].peak_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args(argv)
    rows = []
    for rec, plain, flags in twins():
        measured, predicted = predict(rec, measured_set(plain))
        err = 100.0 * (predicted - measured) / measured
        kind = "full" if "full" in flags else "selective"
        rows.append({"run": os.path.relpath(rec, ROOT), "twin": os.path.basename(plain), "recompute": kind,
                     "measured": measured, "predicted": predicted, "err_pct": err})
        print(f"{kind:9s} {os.path.basename(rec):48s} measured {measured / 1024:10.1f} KiB  predicted "
              f"{predicted / 1024:10.1f} KiB  {err:+6.2f}%")
    if not rows:
        print("recompute_twins: no twin pairs found under fit/traces", file=sys.stderr)
        return 2
    errs = [r["err_pct"] for r in rows]
    within = sum(abs(e) <= TOLERANCE for e in errs)
    print(f"\n{len(rows)} pairs: {within} within {TOLERANCE}%, range {min(errs):+.2f}% .. {max(errs):+.2f}%, "
          f"{sum(e < -TOLERANCE for e in errs)} under")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
