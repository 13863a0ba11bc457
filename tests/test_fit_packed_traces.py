"""The shipped CPU set (fit/sets/cpu_local.json) reproduces the committed training traces it was fitted from
(fit/traces/cpu_local/, xz-packed): every per-layer op's saved bytes that it determines exactly, on every rank,
layer and microbatch of iteration >= 1 (the few it leaves null are listed below), and every determined
model-level quantity (embedding, final norm, logits, loss saved bytes; the optimizer step's transient) exactly.
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


def test_packed_traces_are_the_sets_provenance(data):
    runs, _, fset = data
    packed = {os.path.basename(d) for d in expand_dirs([TRACES])}
    listed = {os.path.basename(t["dir"]) for t in fset.provenance["traces"]}
    assert packed == listed and len(runs) == len(packed)
    assert all(os.path.basename(r.path) in listed for r in runs)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(TRACES) for f in fs)
    assert size < 15e6, f"packed traces {size / 1e6:.1f} MB"


# Per-layer saved bytes the shipped set leaves null (the estimator takes the modelled formula and says so): unfused
# attention with GQA expands K/V per head (no single polynomial over the GQA configs), MoE has five configs for its
# router/experts/MLP, and two SP self-attention parts are underdetermined. A gap not listed here fails the test.
GQA = {"gqa_g1_h96_b1", "gqa_g2", "gqa_g2_kv32_h96", "gqa_g2_s64_b1", "gqa_g2_tp2", "gqa_g2_tp2_sp"}
MOE = {"moe_base", "moe_e8_f192", "moe_ep2", "moe_k3_h96", "moe_s64_b1"}
KNOWN_GAPS = {
    "layers.*.self_attention": GQA | {"rope_tp2_sp_s48", "sel_tp2_sp_s48"},
    "layers.*.self_attention.core_attention": GQA,
    "layers.*.self_attention.linear_qkv": GQA,
    "layers.*.mlp": MOE, "layers.*.mlp.experts": MOE, "layers.*.mlp.router": MOE,
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
            if not (pred == s.values[q] == hi):
                misses.append(f"{os.path.basename(s.run)} {s.op} {q}: set {pred}, trace {lo}..{hi}")
            checked += 1
    assert not misses, "\n".join(misses)
    assert checked > 0
