import json
from fractions import Fraction

import pytest

from estimator import formulas as F

LAYER_OPS = ["layers.*.input_layernorm", "layers.*.self_attention.linear_qkv", "layers.*.self_attention.core_attention",
             "layers.*.self_attention.linear_proj", "layers.*.self_attention", "layers.*", "layers.*.pre_mlp_layernorm",
             "layers.*.mlp.linear_fc1", "layers.*.mlp", "layers.*.mlp.linear_fc2"]


def cfg(**kw):
    base = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=128, micro_batch_size=2,
                padded_vocab_size=512, transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return base


def layer_saved(c):
    s = F.load("modelled")
    sw, env = F.switches(c), F.variables(c)
    return sum(F.select(s, op, sw).evaluate(env)[0] for op in LAYER_OPS)


def test_shipped_set_loads_and_is_modelled():
    s = F.load("modelled")
    assert s.kind == "modelled" and "Korthikanti" in s.description and len(s.formulas) > 40


def test_local_fp32_matches_cpu_measurement():
    # DESIGN 7: local spec, fp32, no dropout saves e*(16sbh + a s^2 b) per layer (norm statistics are the rest)
    c = cfg()
    s_, b, h, a = 128, 2, 256, 8
    ref = 4 * (16 * s_ * b * h + a * s_ * s_ * b)
    assert ref <= layer_saved(c) <= ref * 1.003


@pytest.mark.parametrize("softmax_fp32", [False, True])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_korthikanti_structure_16bit(t, softmax_fp32):
    # 16-bit with dropout: sbh(10 + 24/t) without SP and 34 sbh/t with SP (hidden terms); the s^2 terms are
    # Korthikanti's 5 a s^2 b / t (16-bit softmax output, 1-byte dropout mask, 16-bit dropout output), with or
    # without --attention-softmax-in-fp32: on a GPU the fused masked-softmax kernel returns (and saves) the
    # probabilities in the input dtype either way (megatron-core fusions/fused_softmax.py).
    s_, b, h = 128, 2, 256
    kw = dict(bf16=True, hidden_dropout=0.1, attention_dropout=0.1, tensor_model_parallel_size=t,
              attention_softmax_in_fp32=softmax_fp32)
    s2 = 5
    no_s2 = lambda c: layer_saved(c) - (s2 * 8 * s_ * s_ * b / t) - 2 * 8 * s_ * b / (t if c.get("sequence_parallel") else 1)
    assert no_s2(cfg(**kw)) == pytest.approx(s_ * b * h * (10 + 24 / t))
    assert no_s2(cfg(sequence_parallel=True, **kw)) == pytest.approx(34 * s_ * b * h / t)


def test_softmax_fp32_switch():
    sw = lambda **kw: F.switches(cfg(**kw))["softmax_fp32"]
    assert sw() is True                                     # fp32: the softmax is fp32 anyway
    assert sw(bf16=True) is False and sw(fp16=True) is False  # Megatron-LM's default for 16-bit models
    assert sw(bf16=True, attention_softmax_in_fp32=True) is True
    assert sw(bf16=True, apply_query_key_layer_scaling=True) is True
    # The modelled (GPU) set: the fused softmax kernel keeps 16-bit probabilities whatever the switch says (its
    # fp32 fallback is what the CPU sets measure); the fp32 formulas win for fp32 configs.
    s = F.load("modelled")
    op = "layers.*.self_attention.core_attention"
    saved = lambda **kw: F.evaluate(s, op, cfg(bf16=True, **kw))[0]
    assert saved(attention_softmax_in_fp32=True) == saved() == 2 * 8 * 128 * 128 * 2 + 2 * 128 * 256 * 2
    assert dict(F.select(s, op, cfg()).when)["dtype"] == "fp32"


def test_a2a_switch_is_moe_with_the_all_to_all_dispatcher():
    sw = lambda **kw: F.switches(cfg(**kw))["a2a"]
    moe = dict(num_experts=4, moe_router_topk=2)
    assert sw() is False and sw(moe_token_dispatcher_type="alltoall") is False    # dense: no dispatcher
    assert sw(**moe) is False                                                    # allgather, the default
    assert sw(moe_token_dispatcher_type="alltoall", **moe) is True
    assert F.indicators(F.switches(cfg(moe_token_dispatcher_type="alltoall", **moe)))["x_a2a"] == 1


def test_select_most_specific_and_switches():
    s = F.load("modelled")
    fo = F.select(s, "layers.*.self_attention.core_attention", cfg(recompute_granularity="selective"))
    assert dict(fo.when)["recompute"] == "selective"
    assert F.switches(cfg(transformer_impl="transformer_engine", bf16=True))["attention"] == "flash"
    assert F.switches(cfg(transformer_impl="transformer_engine"))["attention"] == "unfused"   # fp32: no flash
    assert F.switches(cfg(num_query_groups=2))["gqa"]
    flash = cfg(transformer_impl="transformer_engine", attention_backend="flash")
    assert F.evaluate(s, "layers.*.self_attention.core_attention", flash)[0] < \
        F.evaluate(s, "layers.*.self_attention.core_attention", cfg())[0]


def _doc(**over):
    d = {"format": F.FORMAT, "version": 1, "name": "x", "kind": "fitted", "description": "", "provenance": {},
         "formulas": [{"op": "embedding", "per": "model", "when": {"sp": True},
                       "saved": [{"coef": "3/2", "vars": {"s": 1, "t": -1}}]}]}
    d.update(over)
    return d


def test_rational_coefficients_exact(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps(_doc()))
    s = F.load(str(p))
    assert s.formulas[0].saved[0].coef == Fraction(3, 2)
    assert F.evaluate(s, "embedding", cfg(sequence_parallel=True, tensor_model_parallel_size=2))[0] == 96.0  # 3/2 * s(128) / t(2)


@pytest.mark.parametrize("bad,msg", [
    (dict(format="nope"), "format"), (dict(version=9), "version"), (dict(kind="guess"), "kind"),
    (dict(formulas=[{"op": "x", "per": "layer", "saved": [{"coef": 1, "vars": {"zz": 1}}]}]), "unknown variable"),
    (dict(formulas=[{"op": "x", "per": "layer", "when": {"sp": "yes"}}]), "switch"),
    (dict(formulas=[{"op": "x", "per": "layer", "saved": [{"coef": "1/0"}]}]), "coef"),
    (dict(formulas=[{"op": "x", "per": "layer", "saved": [{"coef": 1, "vars": {"s": 1.5}}]}]), "exponent"),
    (dict(formulas=[{"op": "x", "per": "oops"}]), "per"),
])
def test_malformed_files_give_clear_errors(tmp_path, bad, msg):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(_doc(**bad)))
    with pytest.raises(F.FormulaError, match=msg):
        F.load(str(p))


def test_unknown_set_name():
    with pytest.raises(F.FormulaError, match="shipped"):
        F.load("no-such-set")


def test_fitted_set_falls_back_to_modelled_for_null_quantities_and_missing_ops():
    from estimator.args import parse_args
    cfg = parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                     "--max-position-embeddings 32 --micro-batch-size 2 --vocab-size 128 "
                     "--transformer-impl local".split())
    modelled = F.load("modelled")
    sw = F.switches(cfg)
    doc = {"format": F.FORMAT, "version": F.VERSION, "name": "t", "kind": "fitted",
           "formulas": [{"op": "layers.*.mlp", "per": "layer", "when": {},
                         "saved": [], "fwd_peak": None, "bwd_peak": [{"coef": 3, "vars": {"h": 1}}]}]}
    fitted = F.from_dict(doc)
    fitted.fallback = modelled
    env = F.variables(cfg)
    saved, fwd, bwd = F.select(fitted, "layers.*.mlp", sw).evaluate(env)
    assert saved == 0                                   # an empty list is a determined zero
    assert bwd == 3 * cfg.hidden_size                   # a determined quantity is the fitted one
    assert fwd == F.select(modelled, "layers.*.mlp", sw).evaluate(env)[1]  # null -> modelled
    assert F.select(fitted, "layers.*", sw).evaluate(env) == F.select(modelled, "layers.*", sw).evaluate(env)
    assert ("layers.*.mlp", "fwd_peak") in fitted.fallbacks and ("layers.*", "saved") in fitted.fallbacks
    assert ("layers.*.mlp", "saved") not in fitted.fallbacks


def test_modelled_input_batch_and_moe_gelu_experts():
    s = F.load("modelled")
    # Megatron-LM's GPT batch on a GPU: bool [b, 1, s/cp, s] mask, int64 tokens + position ids, int64 labels and
    # fp32 loss mask, per microbatch in flight
    c = cfg(bf16=True, context_parallel_size=2, seq_length=128)
    assert F.evaluate(s, "data.mask", c)[0] == 2 * (128 // 2) * 128
    assert F.evaluate(s, "data.tokens", c)[0] == 16 * 2 * 64 and F.evaluate(s, "data.labels", c)[0] == 12 * 2 * 64
    # MoE experts: fc1 output, activation output and (gelu, no weighted fusion) the probs-weighted product
    moe = dict(bf16=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, transformer_impl="transformer_engine")
    rows = 128 * 2 * 2   # tokens x top-k (etp 1)
    assert F.evaluate(s, "layers.*.mlp.experts", cfg(**moe))[0] == 3 * 2 * rows * 96
    assert F.evaluate(s, "layers.*.mlp.experts", cfg(swiglu=True, **moe))[0] == 3 * 2 * rows * 96


def test_modelled_set_is_what_its_builder_writes():
    """The shipped modelled set is generated (estimator/formula_sets/build_modelled.py): a row edited into the JSON
    by hand would be lost on the next build, so the builder must reproduce the file's formulas exactly."""
    import json
    import os
    from estimator.formula_sets import build_modelled

    build_modelled.FORMULAS.clear()
    with open(os.path.join(F.SHIPPED_DIR, "modelled.json"), encoding="utf-8") as fh:
        shipped = json.load(fh)["formulas"]
    assert json.loads(json.dumps(build_modelled.build())) == shipped
