"""The last check before a report is printed: no negative, non-finite or inconsistent number leaves the estimator.

Validation (estimator.validate, args.validate) refuses bad values where they are read; this catches what a
combination of valid-looking inputs can still produce -- above all a formula set whose terms go negative or
overflow for a config -- and names the input responsible instead of printing a wrong number.
"""
from __future__ import annotations

import math

from estimator.formulas import FormulaError

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "other")


class EstimateError(ValueError):
    """A report that failed its consistency check; the message is one line naming the likely input."""


def _bad(x) -> bool:
    """Negative beyond float rounding (the JSON report rounds to whole bytes), NaN or infinite."""
    return not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x <= -0.5


def check(report) -> None:
    """Raise FormulaError (a formula is to blame) or EstimateError if any number of `report` is impossible."""
    est, fset = report.estimate, report.formula_set
    for r in est.ranks:
        where = f"pipeline stage {r.pp_rank}"
        for name in ("params", "expert_params", "in_flight_max"):
            value = getattr(r, name)
            if _bad(value) or value != int(value):
                raise EstimateError(f"{name.replace('_', ' ')} on {where} is {value}: the model shape flags give "
                                    f"an impossible model")
        _check_formula_rows(r, fset, where)
        for c in CATEGORIES:
            if _bad(r.bytes[c]):
                raise _blame(r, fset, f"{c.replace('_', ' ')} bytes on {where} are {r.bytes[c]}")
        total = sum(r.bytes[c] for c in CATEGORIES)
        if _bad(r.peak_bytes) or abs(total - r.peak_bytes) > 1.0 + 1e-9 * abs(r.peak_bytes):
            raise _blame(r, fset, f"the categories on {where} sum to {total}, the peak is {r.peak_bytes}")
    top = max(r.peak_bytes for r in est.ranks)
    if est.max_peak_bytes != top:
        raise EstimateError(f"the maximum peak {est.max_peak_bytes} is not the largest stage peak {top}")
    for c in report.comm.collectives:
        for name in ("bytes", "per_microbatch", "per_iteration", "group_size"):
            value = getattr(c, name)
            if _bad(value):
                raise EstimateError(f"{c.dim} {c.op} ({c.what}): {name.replace('_', ' ')} is {value}: the "
                                    f"parallel layout or the model shape flags give an impossible message")


def _check_formula_rows(r, fset, where: str) -> None:
    """Per-op activation bytes from the formula set must be finite and not negative; a bad one names its op."""
    for op, row in r.per_op.items():
        for q in ("saved", "fwd_peak", "bwd_peak"):
            x = row.get(q, 0.0)
            if _bad(x):
                why = "a negative formula" if x < 0 else "a coefficient or exponent too large"
                raise FormulaError(f"formula set {_set_name(fset)}: op {op!r} gives {q} = {x:g} bytes on {where} "
                                   f"for this config ({why})")


def _blame(r, fset, what: str) -> Exception:
    """The error for an impossible total: its per-op rows passed, so the inputs as a whole are to blame."""
    return EstimateError(f"{what}: an input is out of the range the estimator models (formula set "
                         f"{_set_name(fset)})")


def _set_name(fset) -> str:
    return f"{fset.name!r}" + (f" ({fset.path})" if fset.path else "")
