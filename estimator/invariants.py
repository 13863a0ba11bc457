"""The last check before a report is printed: no negative, non-finite or inconsistent number leaves the estimator.

Validation (estimator.validate, args.validate) refuses bad values where they are read; this catches what a
combination of valid-looking inputs can still produce -- above all a formula set whose terms go negative or
overflow for a config -- and names the input responsible instead of printing a wrong number.
"""
from __future__ import annotations

import math

from estimator import fp8
from estimator.formulas import FormulaError

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "gpu_runtime", "other")
QUANTITIES = ("saved", "fwd_peak", "bwd_peak")
# Per-op rows that are the estimator's own signed corrections of the formulas, not formulas of the set: their
# `saved` may be negative (fp8 keeps some inputs in 1 byte); they must still be finite.
SIGNED_OPS = frozenset([fp8.SAVED_INPUTS_OP])


class EstimateError(ValueError):
    """A report that failed its consistency check; the message is one line naming the likely input."""


def _bad(x) -> bool:
    """Negative beyond float rounding (the JSON report rounds to whole bytes), NaN, infinite or not a number."""
    return not isinstance(x, (int, float)) or isinstance(x, bool) or not _finite(x) or x <= -0.5


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:   # an int past any float
        return False


def _all_good(values: list) -> bool:
    """No value is _bad, in one pass for the common case (a NaN or an infinity makes the sum non-finite)."""
    try:
        return not values or (min(values) > -0.5 and _finite(sum(values)))
    except TypeError:   # a value that is not a number
        return False


def checked_estimate(cfg, fset, **kwargs):
    """memory.estimate(cfg, fset, **kwargs), its numbers checked (check_estimate); a formula that cannot be
    evaluated for the config (a term like E**-1 with E = 0, a float overflow) is a FormulaError naming the set."""
    from estimator import memory as MEM
    try:
        est = MEM.estimate(cfg, fset, **kwargs)
    except (ZeroDivisionError, OverflowError) as exc:
        raise FormulaError(f"formula set {fset.name!r}: a formula cannot be evaluated for this config ({exc})") \
            from None
    check_estimate(est, fset)
    return est


def check(report) -> None:
    """Raise FormulaError (a formula is to blame) or EstimateError if any number of `report` is impossible."""
    check_estimate(report.estimate, report.formula_set)
    check_comm(report.comm)


def check_estimate(est, fset) -> None:
    """The memory estimate's part of check: one record per pipeline stage (ranks of a stage share it)."""
    for r in est.ranks:
        counts = (r.params, r.expert_params, r.in_flight_max)
        cats = [r.bytes[c] for c in CATEGORIES]
        if not (_all_good([*counts, *cats, r.peak_bytes]) and all(x.__class__ is int for x in counts)):
            _stage_failure(r, fset)
        rows = r.per_op
        values, signed = [], []
        for op, row in rows.items():
            for q in QUANTITIES:
                (signed if _signed(fset, op, q) else values).append(row.get(q, 0.0))
        if not (_all_good(values) and _finite(sum(signed))):
            _formula_row_failure(r, fset)
        total = sum(cats)
        if abs(total - r.peak_bytes) > 1.0 + 1e-9 * r.peak_bytes:
            raise _blame(fset, f"the categories on pipeline stage {r.pp_rank} sum to {total}, the peak is "
                               f"{r.peak_bytes}")
    top = max(r.peak_bytes for r in est.ranks)
    if est.max_peak_bytes != top:
        raise EstimateError(f"the maximum peak {est.max_peak_bytes} is not the largest stage peak {top}")


def check_comm(comm) -> None:
    """The communication report's part of check: one record per collective row (never per rank)."""
    fields = ("bytes", "per_microbatch", "per_iteration", "group_size")
    colls = comm.collectives
    if _all_good([getattr(c, name) for c in colls for name in fields]):
        return
    for c in colls:
        for name in fields:
            value = getattr(c, name)
            if _bad(value):
                raise EstimateError(f"{c.dim} {c.op} ({c.what}): {name.replace('_', ' ')} is {value}: the "
                                    f"parallel layout or the model shape flags give an impossible message")


def _stage_failure(r, fset) -> None:
    """Raise the error naming what is wrong on stage r (its counts and bytes failed the one-pass check)."""
    where = f"pipeline stage {r.pp_rank}"
    for name in ("params", "expert_params", "in_flight_max"):
        value = getattr(r, name)
        if _bad(value) or value != int(value):
            raise EstimateError(f"{name.replace('_', ' ')} on {where} is {value}: the model shape flags give "
                                f"an impossible model")
    _formula_row_failure(r, fset)   # activations come from the formula set: name its op if one is to blame
    for c in CATEGORIES:
        if _bad(r.bytes[c]):
            raise _blame(fset, f"{c.replace('_', ' ')} bytes on {where} are {r.bytes[c]}")
    raise _blame(fset, f"the peak on {where} is {r.peak_bytes}")


def _signed(fset, op: str, q: str) -> bool:
    """May this per-op quantity be negative? The signed corrections (SIGNED_OPS), and a composed set's `saved`
    rows: each is the net bytes of an op's own code, which frees what its children handed it (the forward step
    after a bf16 loss, a layer after its attention), measured so."""
    return op in SIGNED_OPS or (q == "saved" and bool(getattr(fset, "composed", False)))


def _formula_row_failure(r, fset) -> None:
    """Raise FormulaError naming the first op whose bytes are negative, NaN or infinite, if any."""
    for op, row in r.per_op.items():
        for q in QUANTITIES:
            x = row.get(q, 0.0)
            if (_bad(x) and not _signed(fset, op, q)) or not _finite(x):
                why = "a negative formula" if _finite(x) else "a coefficient or exponent too large"
                raise FormulaError(f"formula set {_set_name(fset)}: op {op!r} gives {q} = {x:g} bytes on pipeline "
                                   f"stage {r.pp_rank} for this config ({why})")


def _blame(fset, what: str) -> Exception:
    """The error for an impossible total whose per-op rows passed: the inputs as a whole are to blame."""
    return EstimateError(f"{what}: an input is out of the range the estimator models (formula set "
                         f"{_set_name(fset)})")


def _set_name(fset) -> str:
    return f"{fset.name!r}" + (f" ({fset.path})" if fset.path else "")
