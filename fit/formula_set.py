"""Write fitted formulas as a FORMATS 4 formula-set file, with provenance.

A formula is written when at least one of its quantities is determined. A quantity the data could not determine
is `null` (FORMATS 4: the estimator then takes that quantity from the modelled set and lists it as a fallback),
with a `note` saying why; `[]` means a determined 0 bytes (or a quantity the op never has, such as the optimizer
step's backward). Every refusal with its reason also goes into provenance, so gaps are visible rather than guessed. The result is validated with the estimator's own loader before it is written.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from fractions import Fraction

import numpy as np

from estimator.formulas import FORMAT, VERSION, from_dict

from .dataset import RunInfo
from .group import OpFormula, PointsFit
from .solve import format_terms

FITTER_VERSION = 2   # 2: undetermined quantities are null (FORMATS 4), not []


def coef_json(c: Fraction):
    """Integers as JSON numbers, other rationals as exact 'p/q' strings."""
    return int(c) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def terms_json(terms) -> list:
    return [{"coef": coef_json(c), "vars": dict(m)} for c, m in terms]


def formula_json(f: OpFormula) -> dict:
    out = {"op": f.op, "per": f.per, "when": dict(f.when)}
    for m in ("saved", "fwd_peak", "bwd_peak"):
        out[m] = terms_json(f.fits[m].terms) if m in f.fits else None if m in f.refused else []
    if f.refused:
        out["note"] = "; ".join(f"{m} not determined (null: the estimator falls back to the modelled set): {why}"
                                for m, why in f.refused.items())
    return out


def formulas_json(f: OpFormula) -> list:
    """The op's formula, then its point formulas (FORMATS 4: `<op>#<k>`, the op's transient being the maximum
    over them) where a transient was fitted per point: the op's own quantity is then [] (its points carry it)."""
    out = [formula_json(f)]
    points = {m: fit.fits for m, fit in f.fits.items() if isinstance(fit, PointsFit)}
    n = max((len(v) for v in points.values()), default=0)
    for k in range(n):
        pf = {"op": f"{f.op}#{k + 1}", "per": f.per, "when": dict(f.when), "saved": []}
        for m in ("fwd_peak", "bwd_peak"):
            fits = points.get(m, [])
            pf[m] = terms_json(fits[k].terms) if k < len(fits) else []
        out.append(pf)
    return out


def _fit_record(f: OpFormula, metric: str) -> dict:
    rec = {"op": f.op, "when": dict(f.when), "metric": metric, "configs": len(f.runs)}
    if metric in f.fits:
        fit = f.fits[metric]
        rec.update(formula=str(fit) if isinstance(fit, PointsFit) else format_terms(fit.terms), exact=fit.exact, n_points=fit.n_points,
                   max_abs_residual_bytes=fit.max_abs_residual, max_rel_residual=fit.max_rel_residual,
                   loo_max_rel_err=fit.loo_max_rel_err, loo_undetermined_folds=fit.loo_undetermined)
        if fit.notes:
            rec["notes"] = list(fit.notes)
    else:
        rec["refused"] = f.refused[metric]
    return rec


def build(name: str, runs: list[RunInfo], formulas: list[OpFormula], description: str = "",
          base_dir: str | None = None) -> dict:
    # Trace dirs are recorded relative to the output file when near it, else as <campaign dir>/<config>.
    base = base_dir or os.getcwd()
    if runs and any(os.path.relpath(r.path, base).startswith("..") for r in runs):
        base = os.path.dirname(os.path.commonpath([os.path.abspath(os.path.dirname(r.path)) for r in runs]))
    kept = [f for f in formulas if f.fits]   # any determined quantity; the rest are null
    versions = sorted({json.dumps(r.versions, sort_keys=True) for r in runs})
    prov = {
        "fitter": {"name": "megatron-memtrace fit", "version": FITTER_VERSION, "numpy": np.__version__,
                   "python": platform.python_version()},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "devices": sorted({r.device for r in runs}),
        "backends": sorted({r.backend for r in runs}),
        "versions": [json.loads(v) for v in versions],
        "traces": [{"dir": os.path.relpath(r.path, base), "ranks": r.ranks, "world_size": r.world_size,
                    "iterations": r.iterations, "device": r.device, "argv": r.argv, "measured_peaks": r.peaks,
                    "config": r.config} for r in runs],
        "fits": [_fit_record(f, m) for f in kept for m in ("saved", "fwd_peak", "bwd_peak") if m in f.fits],
        "refused": [_fit_record(f, m) for f in formulas
                    for m in ("saved", "fwd_peak", "bwd_peak") if m in f.refused],
    }
    doc = {"format": FORMAT, "version": VERSION, "name": name, "kind": "fitted",
           "description": description or f"Fitted from {len(runs)} trace run(s) on "
                                         f"{', '.join(prov['devices'])}.",
           "provenance": prov, "formulas": [d for f in kept for d in formulas_json(f)]}
    return doc


def write(path: str, doc: dict) -> None:
    if not doc["formulas"]:
        raise ValueError("no formula could be determined from these traces (see the refusals above)")
    from_dict(doc, path)  # the estimator must be able to read what we write
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)

