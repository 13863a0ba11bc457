"""The shipped CPU set (fit/sets/cpu_local.json) reproduces the committed training traces it was fitted from
(fit/traces/cpu_local/, xz-packed): every per-layer op's saved bytes that it determines exactly, on every rank,
layer and microbatch of iteration >= 1 (the few it leaves null are listed below), and every determined
model-level quantity (input batch, embedding, final norm, logits, loss saved bytes; the optimizer step's transient)
exactly; a quantity the set marks as an upper bound (not exact) must cover the traced value within its recorded
residual.
Reads the packed traces directly (about a second); no profiling, no megatron-core."""
from __future__ import annotations

import json
import os
from fractions import Fraction

import pytest

from estimator import formulas as F
from fit.dataset import expand_dirs, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "fit", "traces", "cpu_local")
SET = os.path.join(ROOT, "fit", "sets", "cpu_local.json")

pytestmark = pytest.mark.skipif(not os.path.isdir(TRACES), reason="no packed traces in fit/traces/cpu_local")


@pytest.fixture(scope="module")
def data():
    runs, samples = load([TRACES])
    return runs, samples, F.load(SET)


def _value(fset, op, sample, quantity):
    """(bytes, determined) of the set's formula for the sample's op/switches at the sample's point."""
    fset.fallbacks.clear()
    fset._cache.clear()
    fo = F.select(fset, op, sample.switches)
    if fo is None:
        return None, False
    terms = getattr(fo, quantity)
    value = sum((Fraction(t.coef) * _mono(t.vars, sample.point) for t in terms), Fraction(0))
    return value, (op, quantity) not in fset.fallbacks


def _mono(vars_, point):
    out = Fraction(1)
    for name, exp in vars_:
        out *= Fraction(point[name]) ** exp
    return out


def _record(fset, fo, quantity):
    """The set's provenance record of the fit behind `fo` for `quantity` (exact, max_rel_residual, notes)."""
    return next(r for r in fset.provenance["fits"]
                if r["op"] == fo.op and r["metric"] == quantity and r["when"] == dict(fo.when))


def _bound_holds(pred, traced_max, rec) -> bool:
    """An upper-bound fit: never under the traced value, over it by at most the fit's recorded residual."""
    return traced_max <= pred <= traced_max * (1 + rec["max_rel_residual"] + 1e-9)


def test_packed_traces_are_the_sets_provenance(data):
    runs, _, fset = data
    packed = {os.path.basename(d) for d in expand_dirs([TRACES])}
    listed = {os.path.basename(t["dir"]) for t in fset.provenance["traces"]}
    assert packed == listed and len(runs) == len(packed)
    assert all(os.path.basename(r.path) in listed for r in runs)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(TRACES) for f in fs)
    assert size < 15e6, f"packed traces {size / 1e6:.1f} MB"


# Per-layer saved bytes the shipped set leaves null (the estimator takes the modelled formula and says so): unfused
# attention with GQA expands K/V per head (no single polynomial over the GQA configs), and two SP self-attention parts
# are underdetermined. (MoE router/experts/MLP saved bytes are exact since the campaign traces MoE with balanced
# routing.) A gap not listed here fails the test.
GQA = {"gqa_g1_h96_b1", "gqa_g2", "gqa_g2_kv32_h96", "gqa_g2_s64_b1", "gqa_g2_tp2", "gqa_g2_tp2_sp"}
KNOWN_GAPS = {
    "layers.*.self_attention": GQA | {"rope_tp2_sp_s48", "sel_tp2_sp_s48"},
    "layers.*.self_attention.core_attention": GQA,
    "layers.*.self_attention.linear_qkv": GQA,
}


def test_every_layer_op_saved_bytes_reproduced_exactly(data):
    _, samples, fset = data
    checked, misses, gaps = 0, [], []
    for s in samples:
        if s.per != "layer":
            continue
        pred, determined = _value(fset, s.op, s, "saved")
        run = os.path.basename(s.run)
        if not determined:
            if run not in KNOWN_GAPS.get(s.op, ()):
                gaps.append(f"{run} {s.op}")
            continue
        lo, hi = s.spread["saved"]
        if not (pred == lo == hi):
            misses.append(f"{run} {s.op}: set {pred}, trace {lo}..{hi}")
        checked += 1
    assert not misses, "\n".join(misses)
    assert not gaps, "saved bytes newly undetermined (null, modelled fallback):\n" + "\n".join(gaps)
    assert checked >= 500


# Model-level bytes that differ between the ranks of one run: the vocab-parallel loss (TP > 1) saves 9*s*b bytes on
# one TP rank and 13*s*b on the other in some configs, swapping between iterations (which targets fall in a rank's
# vocab shard, or a gloo all-reduce buffer still referenced when the forward step ends). The set must stay within the
# traced range there.
def _varies_between_ranks(s, q) -> bool:
    return s.op == "loss" and q == "saved" and s.switches.get("tp") is True


def test_determined_model_level_quantities_reproduced_exactly(data):
    _, samples, fset = data
    checked, misses = 0, []
    for s in samples:
        if s.per != "model":
            continue
        for q in ("saved", "fwd_peak") if s.op == "optimizer" else ("saved",):
            pred, determined = _value(fset, s.op, s, q)
            if not determined or s.values.get(q) is None:
                continue
            lo, hi = s.spread.get(q, (s.values[q], s.values[q]))
            if _varies_between_ranks(s, q) and lo <= pred <= hi:
                continue
            rec = _record(fset, F.select(fset, s.op, s.switches), q)
            if not rec["exact"]:   # an upper bound (a few bytes a gloo thread frees late on some configs)
                if not _bound_holds(pred, hi, rec):
                    misses.append(f"{os.path.basename(s.run)} {s.op} {q}: bound {pred}, trace {lo}..{hi}")
                checked += 1
                continue
            if not (pred == s.values[q] == hi):
                misses.append(f"{os.path.basename(s.run)} {s.op} {q}: set {pred}, trace {lo}..{hi}")
            checked += 1
    assert not misses, "\n".join(misses)
    assert checked > 0


def _eval_terms(terms, point):
    return sum((Fraction(t.coef) * _mono(t.vars, point) for t in terms), Fraction(0))


def test_layer_transients_reproduced_exactly_at_every_fitted_point(data):
    """Where the set fits the layer op's transients per allocation point (FORMATS 4 point formulas), each point's
    formula equals the traced level at that point, and the op's transient (their maximum) the traced maximum."""
    _, samples, fset = data
    checked, misses = 0, []
    for s in samples:
        if s.op != "layers.*" or not s.points:
            continue
        fset._cache.clear()
        fo = F.select(fset, "layers.*", s.switches)
        points = F.point_formulas(fset, "layers.*", fo.when) if fo is not None else ()
        for q in ("fwd_peak", "bwd_peak"):
            fitted = [pf for pf in points if getattr(pf, q)]
            if not fitted or q not in s.points:
                continue
            pred = [_eval_terms(getattr(pf, q), s.point) for pf in fitted]
            rec = _record(fset, fo, q)
            if not rec["exact"]:
                # Some points are upper bounds (FORMATS 4): the maximum covers the traced peak, within the bound.
                if not _bound_holds(max(pred), max(s.points[q][0]), rec):
                    misses.append(f"{os.path.basename(s.run)} {q}: set max {max(pred)} is no bound of the trace "
                                  f"max {max(s.points[q][0])} within {rec['max_rel_residual']:.2%}")
                checked += 1
                continue
            traced = set(s.points[q][0])
            wrong = [p for p in pred if p not in traced]
            if wrong or max(pred) != max(s.points[q][0]):
                misses.append(f"{os.path.basename(s.run)} {q}: set max {max(pred)}, trace max {max(s.points[q][0])}, "
                              f"{len(wrong)} point(s) not traced")
            checked += 1
    assert not misses, "\n".join(misses)
    assert checked >= 20


def test_backward_held_reproduced_exactly(data):
    _, samples, fset = data
    checked = 0
    for s in samples:
        if s.op != "backward_held":
            continue
        fset._cache.clear()
        fo = F.select(fset, "backward_held", s.switches)
        if fo is None or fo.bwd_peak is None:
            continue
        lo, hi = s.spread["bwd_peak"]
        assert _eval_terms(fo.bwd_peak, s.point) == lo == hi, os.path.basename(s.run)
        checked += 1
    assert checked >= 40
