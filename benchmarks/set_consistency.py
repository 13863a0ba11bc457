"""Does a composed set reproduce the runs it was fitted from? Every label's formula evaluated on every run of the
set's provenance, against that run's own measured segment.

    python benchmarks/set_consistency.py [--set cpu_compose] [--json FILE]

Per label and quantity: how many runs differ (a delta by more than 64 bytes either way; a peak only when the
formula is under the measured value: peaks may be upper bounds), and the largest such difference in hidden states
(s*b*h*e/st), and how many of those runs the estimator still counts as measured: only misses under
fit.unfitted.MISS_HIDDEN hidden states, since the fit records the cells of larger ones as `unfitted`. A label that
misses its own runs was fitted on an older campaign, refused a part, or bounded wrongly. Runs with recompute are
checks of the composition, not fit data, and are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from estimator import formulas as F  # noqa: E402
from fit import unfitted  # noqa: E402
from fit.segment_data import QUANTITIES  # noqa: E402


def misses(fset) -> dict:
    """(label, quantity) -> [(run, measured, predicted - measured in hidden states, counted measured there)]."""
    runs = unfitted.provenance_runs({"provenance": fset.provenance}, ROOT)
    out: dict = defaultdict(list)
    for label, i, run, measured, off, entry in unfitted.misses(fset, runs):
        sw = dict(F.switches(run.config), recompute="none")
        out[(label, QUANTITIES[i])].append((os.path.basename(run.path), measured, off,
                                            entry is not None and entry.measured_for(i, sw)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="cpu_compose", help="composed formula set (name or file)")
    ap.add_argument("--json", metavar="FILE", help="also write the misses as JSON")
    a = ap.parse_args(argv)
    fset = F.load(a.set)
    if not fset.composed:
        print(f"set_consistency: {a.set} is not a composed set", file=sys.stderr)
        return 2
    found = misses(fset)
    runs = len(fset.provenance.get("traces", []))
    for (label, q), rows in sorted(found.items(), key=lambda kv: -len(kv[1])):
        worst = max(rows, key=lambda r: abs(r[2]))
        claimed = sum(r[3] for r in rows)
        print(f"{label:58s} {q:9s} {len(rows):4d} runs ({claimed} counted measured); worst {worst[2]:+.3f} hidden "
              f"states ({worst[0]}, measured {worst[1]} B)")
    print(f"\n{len({k[0] for k in found})} labels miss some of the {runs} runs of {fset.name}'s provenance; "
          f"{sum(r[3] for rows in found.values() for r in rows)} misses counted measured (each under "
          f"{unfitted.MISS_HIDDEN} hidden states: fit/unfitted.py)")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump([{"label": k[0], "quantity": k[1], "runs": [list(r) for r in v]} for k, v in found.items()],
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
