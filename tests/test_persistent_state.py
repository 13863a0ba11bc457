"""The tensors megatron-core keeps between steps outside weights, gradients and optimizer states
(estimator.persistent_state), checked against packed CPU traces of real megatron-core runs: the `other` bytes live
when the second iteration's first forward starts, in the rotary embedding, the routers and the MoE layers."""
from __future__ import annotations

import os

import numpy as np
import pytest

from estimator import persistent_state as P
from estimator.static_memory import attention_buffer_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "fit", "traces", "cpu_compose")
RUNS = [
    "llama_base_s128_b1_h64_a8",                # rope, no MoE
    "gpt_moe_e8k1_s128_b1_h64_a8",              # all-gather dispatcher, nothing gathered
    "gpt_moe_tp2sp_s48_b3_h128_a8",             # all-gather over TP (sequence parallel)
    "gpt_moe_e8k2_ep2_s64_b2_h64_a4",           # all-gather over EP
    "llama_moe_ep2_s80_b2_h96_a4",              # all-gather over EP, rope
    "gpt_moe_a2a_tp2sp_s128_b1_h64_a8",         # all-to-all under TP + SP
    "llama_moe_a2a_e8k1_ep2_s64_b2_h64_a4",     # all-to-all over EP, rope
    "gpt_moe_a2a_e8k3_ep2_s48_b3_h128_a8",      # all-to-all, top-3
]


def _kept_between_steps(path: str, cfg) -> int:
    """`other` bytes live at the second iteration's first forward, outside the attention's global buffer."""
    from tracer.parse import CATEGORIES, parse_run
    from tracer.segments import rank_segments
    pr = parse_run(path)[0]
    start = min(s.start for s in rank_segments(pr) if s.iteration == 1 and s.phase == "fwd")
    a = pr.allocs
    live = np.flatnonzero((a["idx"] <= start) & (a["free"] > start) & (a["category"] == CATEGORIES.index("other")))
    buffer = attention_buffer_bytes(cfg)
    out = 0
    for i in live:
        path_ = "/".join(pr.scope_path(int(a["scope"][i])))
        if int(a["size"][i]) != buffer and any(k in path_ for k in ("rotary", "router", ".mlp")):
            out += int(a["size"][i])
    return out


@pytest.mark.parametrize("name", RUNS)
def test_persistent_bytes_cover_what_the_run_kept(name):
    pytest.importorskip("numpy")
    from fit.dataset import traced_config
    path = os.path.join(TRACES, name)
    if not os.path.isdir(path):
        pytest.skip(f"{path} is not packed")
    cfg, _, _ = traced_config(path)
    measured = _kept_between_steps(path, cfg)
    L = cfg.num_layers
    predicted = P.rotary_cache_bytes(cfg) + L * P.moe_layer_state_bytes(cfg)
    E = cfg.num_experts or 0
    tokens = cfg.seq_length * cfg.micro_batch_size // (cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1)
    # what the model takes above the measured bytes: the split counts' bound, and 4*T under EP's gather
    slack = L * (16 * E + 40 + 4 * tokens) if E else 0
    assert measured > 0
    assert measured <= predicted <= measured + slack, (name, measured, predicted)


def test_context_parallel_kv_chunks_join_fitted_sets_only():
    """TE's context-parallel attention keeps the key and value chunks it received from the other CP ranks: a layer
    transform adds them to every layer under a fitted set (no traced run had CP) and not under the modelled set,
    whose core-attention formulas count them already; they grow with CP - 1 and need CP and the TE spec."""
    from estimator import activations, transforms   # noqa: F401  (activations registers the transforms)
    from estimator import formulas as F
    from estimator.args import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--vocab-size", "256", "--bf16", "--group-query-attention", "--num-query-groups", "2"]

    def kv(extra, modelled=False):
        cfg = parse_args(base + extra)
        rows = [r for r in transforms.layer_rows(cfg, F.variables(cfg), False, modelled)
                if r[0] == "layers.*.self_attention.core_attention_cp_kv"]
        return rows[0][1] if rows else 0.0

    two = kv(["--context-parallel-size", "2", "--nproc_per_node", "2"])
    four = kv(["--context-parallel-size", "4", "--nproc_per_node", "4"])
    assert two > 0 and four == 3 * two / 2      # (cp - 1) chunks of s/cp tokens each: 1 x s/2 against 3 x s/4
    assert kv(["--context-parallel-size", "2", "--nproc_per_node", "2"], modelled=True) == 0.0
    assert kv([]) == 0.0
