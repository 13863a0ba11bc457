"""Where a composed set's formulas miss the runs they were fitted from: each entry's `unfitted` cells.

A fitted formula may still miss some of its runs: a part the fit refused (no exact formula, no bound) is then
predicted by the formula merged from the other parts; a robust fit leaves deviating runs out; a label not refitted
after new runs joined the campaign never saw them. Such a config must not count as measured, and the fit's own
bookkeeping (which parts had a formula) cannot tell a refused part from one never traced. So the written set is
checked the way the estimator reads it: every run of its provenance through the estimator's own lookup
(estimator.compose.ComposedCache), per label and quantity against the run's measured segment. Where the answer
misses (a delta either way, a peak under the measured value: peaks may be upper bounds) by more than
MISS_HIDDEN hidden states, the answering entry records cells (`mark`): the part of the split, or where the formula
holds on the part's other runs, the missed runs' exact switch combinations. A config in such a cell is
extrapolated for that label (SegmentFormula.measured_for), and a part holding one stops counting as evidence for
the two-switch composition rule.

    python -m fit.unfitted SET.json      # recompute the cells of a set from its provenance, in place
"""
from __future__ import annotations

import json
import os
import sys

from estimator import formulas as F
from estimator.compose import ComposedCache

from .segment_data import QUANTITIES

# A miss smaller than this many hidden states (s*b*h*e/st) on a run is noise for what a formula is for: a layer
# holds ten or more, and terms this small (a router's s*b*E scores, a 4-byte scalar per token) are below it.
MISS_HIDDEN = 0.05


def misses(fset, runs: list, tolerance_hidden: float = 0.0, slack_bytes: int = 64) -> list:
    """[(label, quantity index, run, measured, predicted - measured in hidden states, answering entry or None)]
    for every run without recompute (recompute is composed, never fitted) whose value the set misses by more than
    slack_bytes and tolerance_hidden hidden states."""
    return [row[:-1] for row in checked(fset, runs, tolerance_hidden, slack_bytes) if row[-1]]


def checked(fset, runs: list, tolerance_hidden: float = 0.0, slack_bytes: int = 64):
    """Every (label, quantity index, run, measured, predicted - measured in hidden states, answering entry, missed)."""
    for run in runs:
        if run.switches.get("recompute") not in (None, "none"):
            continue
        cache = ComposedCache(fset, run.config)
        sw = dict(F.switches(run.config), recompute="none")
        env = cache.env
        hidden = env["s"] * env["b"] * env["h"] * env["e"] / env["st"]
        for label, sample in run.samples.items():
            values = cache.values(label, sw)
            for i, q in enumerate(QUANTITIES):
                measured = sample.values.get(q, 0)
                diff = values[i] - measured
                off = abs(diff) if q.endswith("delta") else -diff
                yield (label, i, run, int(measured), diff / hidden, cache.answering(label, i, sw),
                       off > slack_bytes and off > tolerance_hidden * hidden)


def split_keys(entry, i: int) -> list:
    """The switches quantity i of entry was split by (its `measured` parts name them)."""
    return sorted({k for part in entry.measured[i] or () for k, _ in part})


def mark(doc: dict, runs: list) -> dict:
    """The set's document with every entry's `unfitted` cells computed afresh from the runs. A part of the split
    (the runs with the same values of the switches the quantity was split by) whose every run is missed is unfitted
    as a whole: its values of those switches. Where the formula reproduces some of the part's runs, it holds
    there and the miss is a corner of the part (two runs of 52 that deviate, say): unfitted are the exact
    combinations of the missed runs, their values of every switch the entry's runs varied in."""
    fset = F.from_dict(doc)
    index = {id(sf): n for n, sf in enumerate(fset.segments)}    # from_dict keeps the entries' order
    parts: dict = {}
    for label, i, run, _, _, entry, missed in checked(fset, runs, MISS_HIDDEN):
        if entry is None:
            continue
        keys = split_keys(entry, i)
        part = tuple(run.switches.get(k) for k in keys)
        got = parts.setdefault((index[id(entry)], i, tuple(keys), part), [[], 0])
        if missed:
            got[0].append(run)
        else:
            got[1] += 1
    cells: dict = {}
    for (n, i, keys, part), (missed, reproduced) in parts.items():
        if not missed:
            continue
        varying = [k for k, vals in fset.segments[n].seen if len(vals) > 1]
        found = [dict(zip(keys, part))] if not reproduced else \
            [{k: r.switches.get(k) for k in sorted(set(varying) | set(keys))} for r in missed]
        got = cells.setdefault(n, {}).setdefault(QUANTITIES[i], [])
        for c in found:
            if c not in got:
                got.append(c)
    out = dict(doc)
    out["segments"] = []
    for n, e in enumerate(doc["segments"]):
        e = {k: v for k, v in e.items() if k != "unfitted"}
        if n in cells:
            e["unfitted"] = {q: sorted(cs, key=lambda c: json.dumps(c, sort_keys=True))
                             for q, cs in sorted(cells[n].items(), key=lambda kv: QUANTITIES.index(kv[0]))}
        out["segments"].append(e)
    return out


def provenance_runs(doc: dict, root: str, have: list = ()) -> list:
    """The runs of a set's provenance (paths relative to root), reusing those already loaded."""
    from .segment_fit import Run
    known = {r.path: r for r in have}
    out = []
    for t in doc.get("provenance", {}).get("traces", []):
        path = t["path"] if isinstance(t, dict) else t
        out.append(known.get(path) or Run(os.path.join(root, path)))
    return out


def main(argv=None) -> int:
    import argparse
    from .dataset import DatasetError
    ap = argparse.ArgumentParser(prog="python -m fit.unfitted", description=__doc__.split("\n\n")[0])
    ap.add_argument("set", help="composed formula set (JSON file), rewritten in place")
    ap.add_argument("--root", default=".", help="directory the provenance paths are relative to")
    a = ap.parse_args(argv)
    try:
        with open(a.set, encoding="utf-8") as fh:
            doc = json.load(fh)
        if not (isinstance(doc, dict) and doc.get("composed")):
            raise DatasetError(f"{a.set}: not a composed formula set")
        doc = mark(doc, provenance_runs(doc, a.root))
    except json.JSONDecodeError as exc:
        print(f"fit.unfitted: error: {a.set}: not JSON ({exc.msg}, line {exc.lineno})", file=sys.stderr)
        return 2
    except (DatasetError, F.FormulaError, OSError, ValueError) as exc:
        print(f"fit.unfitted: error: {exc}", file=sys.stderr)
        return 2
    with open(a.set, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    marked = [(e["label"], q) for e in doc["segments"] for q in e.get("unfitted", {})]
    print(f"{a.set}: {len(marked)} label quantities miss some of their runs")
    for label, q in marked:
        print(f"  {label} {q}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
