"""CI slice of benchmarks/accuracy_random.py: the seeded generator of realistic held-out configs, and the tracer's
peak checked against an independent measurement (torch.profiler memory events with c10's process-wide CPU
accounting, `python -m tracer.profile --crosscheck`) on one small drawn config profiled with real megatron-core."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FITTED = os.path.join(ROOT, "fit", "sets", "cpu_compose.json")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def R():
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    import accuracy_random
    return accuracy_random


@pytest.fixture(scope="module")
def drawn(R):
    gen = R.Generator(R.DEFAULT_SEED, FITTED if os.path.isfile(FITTED) else None)
    return gen, gen.take(R.DEFAULT_COUNT)


def test_generator_draws_30_deterministic_configs(R, drawn):
    gen, configs = drawn
    assert len(configs) >= 30
    names = [c["name"] for c in configs]
    assert len(set(names)) == len(names)
    again = R.Generator(R.DEFAULT_SEED, gen.fitted_path).take(len(configs))
    assert [(c["name"], c["argv"], c["nproc"], c["launcher"]) for c in again] == \
           [(c["name"], c["argv"], c["nproc"], c["launcher"]) for c in configs]
    other = R.Generator(R.DEFAULT_SEED + 1, gen.fitted_path).take(5)   # another seed, other configs
    assert [c["argv"] for c in other] != [c["argv"] for c in configs[:5]]


def test_drawn_configs_have_realistic_shapes_and_cover_the_switches(R, drawn):
    _, configs = drawn
    seen = set()
    for c in configs:
        cfg = c["config"]
        assert c["nproc"] <= 2 and cfg["world_size"] == c["nproc"]
        assert 2 <= cfg["num_layers"] <= 4 and 64 <= cfg["hidden_size"] <= 192
        assert 128 <= cfg["seq_length"] <= 384 and 1000 <= cfg["vocab_size"] <= 3000
        assert 1 <= cfg["micro_batch_size"] <= 4 and cfg["transformer_impl"] == "local"
        assert "--crosscheck" in c["launcher"]
        assert ("--balanced-routing" in c["launcher"]) == bool(cfg["num_experts"])
        seen |= {k for k, on in {
            "swiglu": cfg["swiglu"], "rmsnorm": cfg["normalization"] == "RMSNorm",
            "rope": cfg["position_embedding_type"] == "rope", "gqa": cfg["group_query_attention"],
            "nobias": not cfg["add_bias_linear"], "untied": cfg["untie_embeddings_and_output_weights"],
            "dropout": cfg["hidden_dropout"] > 0, "nodropout": cfg["hidden_dropout"] == 0,
            "bf16": cfg["params_dtype"] == "bf16", "tp2": cfg["tensor_model_parallel_size"] == 2,
            "tp2_nosp": cfg["tensor_model_parallel_size"] == 2 and not cfg["sequence_parallel"],
            "sp": cfg["sequence_parallel"], "pp2": cfg["pipeline_model_parallel_size"] == 2,
            "vpp": bool(cfg["virtual_pipeline_model_parallel_size"]), "dp2": cfg["data_parallel_size"] == 2,
            "distopt": cfg["use_distributed_optimizer"], "selective": cfg["recompute_granularity"] == "selective",
            "full_uniform": cfg["recompute_method"] == "uniform", "full_block": cfg["recompute_method"] == "block",
            "moe": bool(cfg["num_experts"]), "ep2": cfg["expert_model_parallel_size"] == 2,
            "alltoall": bool(cfg["num_experts"]) and cfg["moe_token_dispatcher_type"] == "alltoall",
            "allgather": bool(cfg["num_experts"]) and cfg["moe_token_dispatcher_type"] == "allgather",
        }.items() if on}
    missing = {"swiglu", "rmsnorm", "rope", "gqa", "nobias", "untied", "dropout", "nodropout", "bf16", "tp2",
               "tp2_nosp", "sp", "pp2", "vpp", "dp2", "distopt", "selective", "full_uniform", "full_block", "moe",
               "ep2", "alltoall", "allgather"} - seen
    assert not missing, f"the default draw never uses: {sorted(missing)}"
    assert sum(c["config"]["params_dtype"] == "bf16" for c in configs) <= len(configs) / 6


def test_drawn_configs_are_held_out(R, drawn):
    gen, configs = drawn
    fit = R.fit_configs(gen.fitted_path)
    assert len(fit) >= 90   # fit/grids/*.json (cpu_local, ci_tiny) and the fitted set's provenance
    for c in configs:
        key = R.A._config_key(c["argv"], c["nproc"])
        assert key not in gen.prov and key not in gen.grids
        mine = R.features(c["config"])
        for label, other in fit:
            assert len(R.differences(mine, other)) >= 2, (c["name"], label)


def test_held_out_rule_rejects_a_fit_config_and_a_one_shape_change(R, drawn):
    gen, _ = drawn
    with open(os.path.join(ROOT, "fit", "grids", "cpu_local.json"), encoding="utf-8") as fh:
        base = next(c for c in R.A.expand(json.load(fh)) if c["name"] == "tp2_sp_s48")
    same = {"name": "x", "argv": base["argv"], "nproc": base["nproc"], "launcher": []}
    with pytest.raises(R.Rejected, match="not held out"):
        gen.check(same)
    one_off = dict(same, argv=base["argv"] + ["--seq-length", "56"])   # differs from tp2_sp_s48 in seq only
    with pytest.raises(R.Rejected, match=r"only in \['seq_length'\]"):
        gen.check(one_off)
    with pytest.raises(R.Rejected, match="arguments"):   # Megatron-LM's argument validation (the estimator's)
        gen.check(dict(same, argv=base["argv"] + ["--num-attention-heads", "3"]))
    # a rule of megatron-core's TransformerConfig: the estimator's argument checks refuse it too, in its words
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--distribute-saved-activations"]
    with pytest.raises(R.Rejected, match="arguments: distribute_saved_activations: True must be false when "
                                         "sequence parallel is enabled"):
        gen.check(dict(same, argv=base["argv"] + full))


def test_crosscheck_peak_equals_tracer_peak_on_a_drawn_config(R, drawn, tmp_path):
    """The cheapest two-process draw, profiled with --crosscheck: gloo's worker threads free buffers on their own
    threads, which the profiler only sees through c10's process-wide total."""
    _, configs = drawn
    cfg = min((c for c in configs if c["nproc"] == 2), key=lambda c: c["cost_s"])
    R.A.profile(cfg, str(tmp_path), R.ITERATIONS, timeout=120)
    heads = R.A.measured(os.path.join(str(tmp_path), cfg["name"]), cfg["nproc"])
    for h in heads:
        assert "crosscheck_error" not in h, h["crosscheck_error"]
        assert h["crosscheck_events"] > 1000 and h["crosscheck_threads"] >= 2
        tracer, xc = h["allocator_peak_bytes"], h["crosscheck_peak_bytes"]
        assert abs(xc - tracer) <= R.XCHECK_TOL / 100 * tracer, (cfg["name"], h["rank"], tracer, xc)
