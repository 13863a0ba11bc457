"""The standard attention's variants of the models people train now: the query's and key's per-head norms as
modules (--qk-layernorm, Qwen3's RMSNorm; --qk-l2-norm, Llama-4's parameter-free L2 norm) and the attention output
gate (--attention-output-gate, Qwen3-Next's). Measured by cpu_compose (fit/grids/make_cpu_attention_variants.py);
a set whose runs never had the L2 norm or the gate refuses them in one line, and one whose runs never had the
qk-layernorm models it (estimator/qk_norm.py). Parameter counts: tests/test_params_vs_megatron.py."""
import os
import shlex
import sys

import pytest

from estimator import formulas as F
from estimator import memory as MEM
from estimator.args import ConfigError, parse_args
from estimator.cli import build_report
from estimator.features import modelled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELD_OUT = os.path.join(ROOT, "fit", "traces", "cpu_attention_heldout")

# Qwen3-like: GQA with a head width other than hidden / heads, RMSNorm, SwiGLU, no biases, untied, TE's kernels
QWEN3 = ("--nproc_per_node 8 --num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 "
         "--group-query-attention --num-query-groups 4 --kv-channels 48 --seq-length 512 "
         "--max-position-embeddings 512 --vocab-size 1000 --micro-batch-size 2 --global-batch-size 32 --bf16 "
         "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
         "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer")


def _cfg(extra: str = ""):
    return parse_args(shlex.split(QWEN3 + " " + extra))


def _peak(extra: str, fset: str = "cpu_compose") -> float:
    return MEM.estimate(_cfg(extra), fset, per_op=False).max_peak_bytes


@pytest.mark.parametrize("flags, message", [
    ("--multi-latent-attention --qk-l2-norm", "qk_l2_norm is not supported with MLA."),
    ("--multi-latent-attention --attention-output-gate", "Output gate is not supported for MLA yet."),
])
def test_megatron_core_refuses_them_with_multi_latent_attention(flags, message):
    argv = shlex.split(QWEN3 + " " + flags)
    argv = [a for a in argv if a not in ("--group-query-attention",)]
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


@pytest.mark.parametrize("fset", ["gpu_h100", "modelled"])
@pytest.mark.parametrize("flag", ["--qk-l2-norm", "--attention-output-gate"])
def test_a_set_that_never_measured_them_refuses_them(flag, fset):
    with pytest.raises(ConfigError, match=f"{flag} changes memory and cannot be estimated with formula set "
                                          f"'{fset}': it measured no run with it"):
        build_report(shlex.split(QWEN3 + " " + flag), fset, reserved=False)


def test_the_default_set_measures_all_three():
    seen = F.load("cpu_compose").seen_switch_values()
    assert {"none", "layernorm", "l2"} <= seen["qk_norm"] and True in seen["output_gate"]
    for flags in ("--qk-layernorm", "--qk-l2-norm", "--qk-layernorm --attention-output-gate"):
        report = build_report(shlex.split(QWEN3 + " " + flags), reserved=False)
        cov = report.estimate.coverage
        assert cov["measured_share"] == 1.0 and not cov["untraced"] and not cov["modelled"], (flags, cov)
        assert not [n for n in modelled(report.cfg, report.formula_set) if "qk-layernorm" in n]


def test_qk_layernorm_is_modelled_where_a_set_never_measured_it():
    report = build_report(shlex.split(QWEN3 + " --qk-layernorm"), "gpu_h100", reserved=False)
    assert "layers.*.self_attention.qk_layernorm" in report.estimate.coverage["modelled"]
    assert [n for n in modelled(report.cfg, report.formula_set) if n.startswith("--qk-layernorm")]


def test_each_variant_adds_what_it_keeps():
    """The norms keep their inputs and outputs per layer, the gate its input and the gated output: each adds to
    the plain attention's peak; an L2 norm in place of the RMSNorm keeps no less (neither has statistics worth a
    tensor) and the gate adds on top of either."""
    plain, ln, l2 = _peak(""), _peak("--qk-layernorm"), _peak("--qk-l2-norm")
    gate, both = _peak("--attention-output-gate"), _peak("--qk-layernorm --attention-output-gate")
    assert ln > plain and l2 > plain and gate > plain
    assert both > ln and both > gate


@pytest.mark.skipif(not os.path.isdir(HELD_OUT), reason="held-out traces not committed")
@pytest.mark.parametrize("name", sorted(os.listdir(HELD_OUT)) if os.path.isdir(HELD_OUT) else [])
def test_runs_the_fit_never_saw(name):
    """Shapes, layouts and recompute outside the campaign (fit/grids/make_cpu_attention_heldout.py): every traced
    rank within 1% of the tracing allocator's peak."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from packed_runs import rank_peaks
    predicted, measured, _ = rank_peaks(os.path.join(HELD_OUT, name), F.load("cpu_compose"))
    for p, m in zip(predicted, measured):
        assert -0.01 <= (p - m) / m <= 0.01, (name, p, m)
