"""Traces -> a composed formula set: one exact formula per segment label and quantity, split only by the switches
that change that label's bytes, plus the measured op structure the estimator replays them in (FORMATS 4.1).

Per label (tracer.segments, FORMATS 3.1) the four quantities of every run are fitted together: first pooled over
all runs; where some quantity has no exact formula, the runs are split by the switch whose split leaves the fewest
undetermined (part, quantity) pairs, and so on. So a label is split only by switches that change it, and a config
whose combination was never traced is composed from labels measured in other combinations. Nothing is dropped: a
part whose data no formula fits exactly is written as null (undetermined) with the reason, never fitted on a
subset of its runs. `seen` records, per switch, the values the part's runs had: the estimator calls a label
extrapolated for a config with a value outside them.

    python -m fit.segment_fit TRACE_DIR... -o SET.json [--name NAME]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from estimator.formulas import switches as config_switches

from . import basis
from .dataset import DatasetError, expand_dirs, parsed_run, point_of
from .group import SWITCH_ORDER, domain
from .segment_data import QUANTITIES, run_samples
from .solve import FitRefused, fit_group

# The op fitter's switch order, and the switches only composed sets split on (FORMATS 4.1).
ORDER = SWITCH_ORDER + ("bias", "tied", "softmax_fp32")
STRUCTURE_SWITCHES = ("moe", "position", "normalization", "activation", "gqa", "tp", "sp", "recompute")
# Labels that exist only for a config's switches (the op structure says which a config has) and labels of the
# step's own code: their basis (the widest, plus the loss head's atoms for the step).
_STEP_ATOMS = ["s*b*v/t", "s*b", "s*s*b", "s*b*h/st", "s*b*h", "s", "b", "1"]
_WEIGHT_ATOMS = ["h*f/t", "h*h/t", "h*a*d/t", "h*g*d/t", "v*h/t", "h", "f/t", "a*d/t", "g*d/t", "s*h", "h*fe/etp",
                 "h*E"]


class Run:
    def __init__(self, path: str, accept_damaged: bool = False):
        from tracer.segments import op_children
        ranks, _, self.config = parsed_run(path, accept_damaged)
        self.path = path
        self.switches = config_switches(self.config)
        self.point = point_of(self.config)
        self.samples = run_samples(path, ranks)
        self.children = op_children(ranks[0])
        self.peaks = [int(r.peak_bytes) for r in ranks]


def candidates(label: str) -> list:
    """The op family's atoms (basis.candidates), then weight-sized ones: a backward allocates weight gradients."""
    op = label.split("@", 1)[0]
    if op in ("step", "decoder"):
        atoms = [basis.parse_monomial(a) for a in _STEP_ATOMS]
        out = [basis.times(a, "e") for a in atoms] + atoms
    else:
        out = basis.candidates(op)
    for a in _WEIGHT_ATOMS:
        m = basis.parse_monomial(a)
        for x in (basis.times(m, "e"), m):
            if x not in out:
                out.append(x)
    return out


def constant_switches(runs: list) -> dict:
    first = runs[0].switches
    return {k: v for k, v in first.items() if all(r.switches.get(k) == v for r in runs)}


def _parts(runs: list, keys: tuple) -> dict:
    out: dict = {}
    for r in runs:
        out.setdefault(tuple(r.switches.get(k) for k in keys), []).append(r)
    return out


def _fit_part(label: str, runs: list, keys: tuple, cache: dict) -> dict:
    """quantity -> Fit or the refusal reason, for one part of one label's runs."""
    # Pinned as every run of the part has them: formulas that agree on that domain are equivalent (`seen` keeps
    # the estimator from using one outside it).
    fixed, ties = domain(constant_switches(runs))
    cands = candidates(label)
    out = {}
    for q in QUANTITIES:
        data = [(r.point, r.samples[label].values[q]) for r in runs if q in r.samples[label].values]
        if not data:
            continue
        key = (label, q, tuple(sorted(id(r) for r in runs)))
        if key not in cache:
            cache[key] = _fit(data, cands, fixed, ties)
        out[q] = cache[key]
    return out


PAIR_LIMIT = 24
SLACK_BYTES = 64   # a few scalars (a 4-byte tensor freed by the garbage collector in one run, not in another)


def _fit(data: list, cands: list, fixed, ties):
    """The sparsest exact fit; failing that, one whose every residual is within SLACK_BYTES (a run whose level
    a stray scalar moved); else the refusal's reason."""
    pts, ys = [p for p, _ in data], [y for _, y in data]
    try:
        return fit_group(pts, ys, cands, fixed=fixed, ties=ties, max_terms=5)
    except FitRefused as exc:
        reason = str(exc)
    try:
        fit = fit_group(pts, ys, cands, fixed=fixed, ties=ties, max_terms=5, tolerance=1e-3)
    except FitRefused:
        return reason
    from fractions import Fraction
    fit.terms = [(Fraction(c).limit_denominator(64), m) for c, m in fit.terms]
    worst = max(abs(float(fit.predict(p)) - y) for p, y in zip(pts, ys))
    if worst > SLACK_BYTES:
        return reason
    fit.notes.append(f"within {worst:.0f} B of every run")
    return fit


def _covered(fits: dict, runs: list, keys: tuple) -> int:
    """Minus the (run, quantity) pairs of the label's runs left without a determined formula under a split by
    `keys` (a quantity a part's runs do not have counts for nothing)."""
    n = {part: len(rs) for part, rs in _parts(runs, keys).items()}
    return -sum(n[part] for part, qs in fits.items() for v in qs.values() if isinstance(v, str))


OUTLIER_SHARE = 0.15   # at most this share of a part's runs may deviate from its formula (and are named)


def _robust(label: str, q: str, runs: list, reason: str):
    """A quantity no formula fits on every run: the sparsest exact formula of all but a few runs (at most
    OUTLIER_SHARE, at least 5 runs kept), dropping the run farthest from a least-squares fit one at a time. On CPU
    a free that gloo's thread makes a little earlier or later lands in a neighbouring segment of some runs; the
    runs left out are named in the formula's note. Else the refusal's reason."""
    data = [(r.point, r.samples[label].values[q], r) for r in runs if q in r.samples[label].values]
    fixed, ties = domain(constant_switches(runs))
    cands = candidates(label)
    dropped = []
    for _ in range(int(len(data) * OUTLIER_SHARE)):
        if len(data) - 1 < 5:
            break
        try:
            rough = fit_group([p for p, _, _ in data], [y for _, y, _ in data], cands, fixed=fixed, ties=ties,
                              max_terms=5, tolerance=1e9)
        except FitRefused:
            return reason
        worst = max(range(len(data)), key=lambda i: abs(float(rough.predict(data[i][0])) - data[i][1]))
        dropped.append(data.pop(worst)[2])
        fit = _fit([(p, y) for p, y, _ in data], cands, fixed, ties)
        if not isinstance(fit, str):
            fit.notes.append(f"exact on {len(data)} runs; {len(dropped)} deviate: "
                             + ", ".join(r.path.rstrip('/').rsplit('/', 1)[-1] for r in dropped))
            return fit
    return reason


PEAK_BOUND = 0.10


def _bound(label: str, q: str, runs: list, reason: str):
    """A transient no exact formula fits: an upper bound that never under-predicts a run and over-predicts by at
    most PEAK_BOUND of its value (solve.fit_group's bound), flagged in the note; else the reason."""
    data = [(r.point, r.samples[label].values[q]) for r in runs if q in r.samples[label].values]
    fixed, ties = domain(constant_switches(runs))
    try:
        fit = fit_group([p for p, _ in data], [y for _, y in data], candidates(label), fixed=fixed, ties=ties,
                        max_terms=5, bound=PEAK_BOUND)
    except FitRefused:
        return reason
    fit.notes.append(f"within {100 * PEAK_BOUND:.0f}% above every run (upper bound)")
    return fit


def _failures(fits: dict) -> int:
    return sum(1 for part in fits.values() for v in part.values() if isinstance(v, str))


def fit_label(label: str, runs: list, cache: dict) -> list[dict]:
    """Formula entries (FORMATS 4.1) for one label from the runs that have it."""
    keys: tuple = ()
    fits = {k: _fit_part(label, rs, keys, cache) for k, rs in _parts(runs, keys).items()}
    switches = [k for k in ORDER if len({r.switches.get(k) for r in runs}) > 1]
    while _failures(fits) and switches:
        # The switch whose split determines the most (run, quantity) pairs; none that determines more: stop.
        # Where no switch alone helps, two together (a label two switches change jointly, e.g. the attention's
        # backward by position and dropout), among the first PAIR_LIMIT pairs.
        best = None
        pairs = [(a, b) for i, a in enumerate(switches) for b in switches[i + 1:]][:PAIR_LIMIT]
        now = _covered(fits, runs, keys)
        for ks in [(k,) for k in switches] + pairs:
            if len(ks) == 2 and best is not None and _covered(best[1], runs, keys + best[0]) > now:
                break
            split = _parts(runs, keys + ks)
            trial = {part: _fit_part(label, rs, keys + ks, cache) for part, rs in split.items()}
            if best is None or _covered(trial, runs, keys + ks) > _covered(best[1], runs, keys + best[0]):
                best = (ks, trial)
        if best is None:
            break
        if _covered(best[1], runs, keys + best[0]) <= now:
            break
        keys += best[0]
        for k in best[0]:
            switches.remove(k)
        fits = best[1]
    for part, rs in _parts(runs, keys).items():
        for q, v in list(fits[part].items()):
            if isinstance(v, str):
                fits[part][q] = _robust(label, q, rs, v)
            if isinstance(fits[part][q], str) and q.endswith("_peak"):
                fits[part][q] = _bound(label, q, rs, fits[part][q])
    out = []
    for part, rs in _parts(runs, keys).items():
        entry = {"label": label, "per": "layer" if rs[0].samples[label].in_layer else "model",
                 "when": dict(zip(keys, part)),
                 "seen": {k: sorted({r.switches.get(k) for r in rs}, key=str) for k in ORDER},
                 "runs": len(rs)}
        notes = []
        for q in QUANTITIES:
            v = fits[part].get(q)
            if v is None:
                entry[q] = []          # the phase never has this segment: 0 bytes
            elif isinstance(v, str):
                entry[q] = None
                notes.append(f"{q}: {v}")
            else:
                entry[q] = [{"coef": _coef(c), "vars": dict(m)} for c, m in v.terms]
                notes += [f"{q}: {n}" for n in v.notes if "deviate" in n or "within" in n or "bound" in n]
        if notes:
            entry["note"] = "; ".join(notes)
        out.append(entry)
    return out


def _coef(c):
    return int(c) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def fit_structure(runs: list) -> list[dict]:
    """Per op, its children in forward order, split by the switches that change them."""
    ops = sorted({op for r in runs for op in r.children})
    out = []
    for op in ops:
        have = [r for r in runs if op in r.children]
        keys: tuple = ()
        for k in STRUCTURE_SWITCHES:
            if all(len({tuple(r.children[op]) for r in rs}) == 1 for rs in _parts(have, keys).values()):
                break
            if len({r.switches.get(k) for r in have}) > 1:
                keys += (k,)
        for part, rs in _parts(have, keys).items():
            variants = Counter(tuple(r.children[op]) for r in rs)
            children, n = variants.most_common(1)[0]
            entry = {"op": op, "when": dict(zip(keys, part)), "children": list(children)}
            if len(variants) > 1:
                entry["note"] = f"{len(rs) - n} of {len(rs)} runs had other children: {sorted(variants)}"
            out.append(entry)
    return out


_RUNS: list = []   # the runs being fitted, shared with forked workers


def _fit_one(label: str) -> tuple:
    return label, fit_label(label, [r for r in _RUNS if label in r.samples], {})


def fit_runs(paths: list[str], name: str, description: str = "", jobs: int = 1,
             accept_damaged: bool = False) -> dict:
    from estimator.formulas import FORMAT
    runs = [Run(p, accept_damaged) for p in expand_dirs(paths)]
    runs = [r for r in runs if r.switches.get("recompute") != "full"]   # composed from the plain layer instead
    if not runs:
        raise DatasetError("no runs to fit")
    labels = sorted({lb for r in runs for lb in r.samples})
    segments = []
    _RUNS[:] = runs
    if jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for i, (label, entries) in enumerate(pool.imap(_fit_one, labels)):
                segments += entries
                print(f"  [{i + 1}/{len(labels)}] {label}", file=sys.stderr, flush=True)
    else:
        for i, label in enumerate(labels):
            segments += _fit_one(label)[1]
            print(f"  [{i + 1}/{len(labels)}] {label}", file=sys.stderr, flush=True)
    doc = {"format": FORMAT, "version": 2, "name": name, "kind": "fitted", "composed": True,
           "description": description or "Composed per-op segment formulas fitted from CPU traces.",
           "provenance": {"traces": [{"path": r.path, "config": r.config, "peaks": r.peaks} for r in runs]},
           "formulas": [],
           "segments": segments, "structure": fit_structure(runs)}
    return doc


def main(argv=None) -> int:
    import json
    ap = argparse.ArgumentParser(prog="python -m fit.segment_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run directories, or directories of them")
    ap.add_argument("-o", "--output", required=True, help="formula set to write")
    ap.add_argument("--name", default="cpu_compose")
    ap.add_argument("--jobs", type=int, default=1, help="labels fitted in parallel (processes)")
    ap.add_argument("--accept-damaged", action="store_true",
                    help="fit traces that are damaged, truncated or of runs that did not end cleanly (refused by "
                         "default)")
    a = ap.parse_args(argv)
    try:
        doc = fit_runs(a.paths, a.name, jobs=max(1, a.jobs), accept_damaged=a.accept_damaged)
    except (DatasetError, OSError, ValueError) as exc:
        print(f"fit.segment_fit: error: {exc}", file=sys.stderr)
        return 2
    from estimator.formulas import from_dict
    from_dict(doc, a.output)   # the estimator's own loader must accept it
    with open(a.output, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    undetermined = [(s["label"], s["when"]) for s in doc["segments"] if any(s[q] is None for q in QUANTITIES)]
    print(f"wrote {a.output}: {len(doc['segments'])} segment formulas ({len(undetermined)} with undetermined "
          f"quantities), {len(doc['structure'])} structure entries, from {len(doc['provenance']['traces'])} runs")
    for label, when in undetermined:
        print(f"  undetermined: {label} {when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
