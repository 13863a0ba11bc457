"""MoE routing in the estimate (issue 11 item 6): capacity factors as megatron-core computes them, the dropless
imbalance bound (--moe-imbalance) against a fresh router's natural routing, and a real padded-to-capacity run.

The real runs are CPU traces of megatron-core 0.16.1 (tracer.profile --cpu), compared with the estimate for the
same command line (benchmarks/accuracy.py's predict, the shipped composed CPU set with the harness's CPU kernels).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from estimator import cli, moe_tokens  # noqa: E402
from estimator.args import parse_args  # noqa: E402

BASE = ("--nproc_per_node 2 --num-layers 2 --hidden-size 128 --num-attention-heads 8 --seq-length 128 "
        "--max-position-embeddings 256 --micro-batch-size 1 --vocab-size 512 --transformer-impl local "
        "--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2").split()


def _need(mod: str):
    try:
        __import__(mod)
    except ImportError:
        pytest.skip(f"{mod} is not installed")


# ------------------------------------------------------------------------------------------ capacity vs megatron
@pytest.mark.parametrize("tokens", [1, 7, 96, 128, 255, 4096])
@pytest.mark.parametrize("experts", [2, 6, 8, 64])
@pytest.mark.parametrize("factor", [0.3, 1.0, 1.25, 1.5, 2.0, 3.7])
def test_get_capacity_is_megatron_cores(tokens, experts, factor):
    _need("megatron.core")
    from megatron.core.transformer.moe.moe_utils import get_capacity
    assert moe_tokens.get_capacity(tokens, experts, factor) == get_capacity(tokens, experts, factor)
    assert moe_tokens.get_capacity(tokens, experts, factor, 50) == get_capacity(tokens, experts, factor, 50)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("seq,mbs,experts,topk,factor", [
    (128, 1, 8, 2, 1.5), (96, 2, 4, 1, 1.0), (64, 1, 6, 2, 0.5), (128, 2, 4, 2, 1.25), (32, 1, 8, 2, 3.0),
    (16, 1, 4, 2, 3.0)])   # the last: capacity 24 > 16 tokens, every expert gets all 16
def test_capacity_paths_against_megatron_core_routing(seq, mbs, experts, topk, factor, pad):
    """megatron-core's own router token dropping (apply_router_token_dropping, on random top-k routing) sends each
    expert exactly the estimate's tokens with padding, and never more than its bound without."""
    _need("torch")
    _need("megatron.core")
    import torch
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
    argv = (f"--num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length {seq} --max-position-embeddings "
            f"{seq} --micro-batch-size {mbs} --vocab-size 128 --num-experts {experts} --moe-router-topk {topk} "
            f"--moe-router-pre-softmax --moe-token-dispatcher-type allgather --moe-expert-capacity-factor {factor}"
            + (" --moe-pad-expert-input-to-capacity" if pad else "")).split()
    r = moe_tokens.routing(parse_args(argv))
    tokens = seq * mbs
    assert r.tokens == tokens and r.mode == ("padded" if pad else "capacity")
    balanced = tokens * topk / experts
    g = torch.Generator().manual_seed(seq * 31 + experts)
    for trial in range(5):
        logits = torch.randn(tokens, experts, generator=g) * (1 + 3 * trial)   # ever more skewed routing
        probs = torch.softmax(logits, -1)
        top, idx = probs.topk(topk, -1)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, idx, True)
        routed_probs = torch.zeros_like(probs).scatter(1, idx, top)
        _, final_map = apply_router_token_dropping(routed_probs, routing_map, topk, factor, pad_to_capacity=pad)
        counts = final_map.sum(0)
        if pad:
            assert (counts == round(r.busiest * balanced)).all(), (counts, r)
        else:
            assert counts.max() <= r.busiest * balanced + 1e-9, (counts, r)


def test_padded_alltoall_beyond_the_tokens_is_refused(capsys):
    """Capacity ceil(128*2/8*5) = 160 > 128 tokens: megatron-core's router then keeps every token for every expert
    and the alltoall dispatcher's padded permute cannot reshape them; the estimator refuses the config."""
    rc = cli.main(BASE + ["--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "5",
                          "--moe-pad-expert-input-to-capacity"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "capacity 160 exceeds the 128 tokens" in err
    _need("torch")
    _need("megatron.core")
    import torch
    from megatron.core.transformer.moe.moe_utils import get_capacity, permute
    cap = get_capacity(128 * 2, 8, 5.0)
    assert cap == 160
    with pytest.raises(RuntimeError):
        permute(torch.zeros(128, 4), torch.ones(128, 8, dtype=torch.bool), probs=torch.ones(128, 8),
                num_out_tokens=cap * 8, drop_and_pad=True)

@pytest.mark.parametrize("extra,words", [
    (["--moe-imbalance", "0.9"], "--moe-imbalance must be a finite number in [1.0, inf)"),
    (["--moe-imbalance", "nan"], "--moe-imbalance must be a finite number"),
    (["--moe-pad-expert-input-to-capacity"], "moe_expert_capacity_factor must be set"),
    (["--moe-expert-capacity-factor", "1", "--moe-router-load-balancing-type", "sinkhorn"], "only works with aux_loss"),
])
def test_bad_routing_flags_are_one_line_errors(capsys, extra, words):
    rc = cli.main(BASE + extra)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and words in err, err


def test_bound_scales_only_the_expert_side():
    """The rank's bound raises the EP rank's estimate; F is clamped to what routing can do; with EP=1 the rank's
    expert tokens are fixed; the report states the assumption."""
    def est(argv):
        rep = cli.build_report(argv, formulas="modelled")
        return rep, rep.estimate.max_peak_bytes
    rep1, one = est(BASE + ["--moe-imbalance", "1"])
    _, two = est(BASE + ["--moe-imbalance", "2"])
    _, big = est(BASE + ["--moe-imbalance", "50"])
    assert two > one and big == two   # E=8, k=2, 4 local experts: a rank gets at most 2x its balanced tokens
    j = cli.dumps_indent1
    doc = json.loads(j(__import__("estimator.report", fromlist=["to_json"]).to_json(rep1)))
    assert doc["moe_routing"]["mode"] == "balanced" and doc["moe_routing"]["imbalance"] == 1.0
    text = __import__("estimator.report").report.to_text(rep1)
    assert "MoE routing  dropless, balanced x --moe-imbalance 1" in text and "top-2 (<=1x balanced)" in text
    ep1 = [a for a in BASE if a != "--expert-model-parallel-size"]
    ep1[ep1.index("2", ep1.index("--moe-router-topk") + 2)] = "1"
    r = moe_tokens.routing(parse_args(ep1 + ["--moe-imbalance", "3"]))
    assert r.rank == 1.0 and r.busiest == 4.0   # E/k: every token to one expert at most once
    pad = moe_tokens.routing(parse_args(BASE + ["--moe-expert-capacity-factor", "1.5",
                                                "--moe-pad-expert-input-to-capacity", "--moe-imbalance", "9"]))
    assert pad.mode == "padded" and pad.rank == pad.busiest == pad.rest == 1.5


# ------------------------------------------------------------------------------------------ real runs
def _profile(tmp_path, name: str, argv: list, nproc: int, launcher=()) -> tuple:
    _need("torch")
    _need("megatron.core")
    from benchmarks import accuracy as A
    cfg = {"name": name, "argv": argv, "nproc": nproc, "launcher": list(launcher)}
    A.profile(cfg, str(tmp_path), 3, 300)
    measured = [int(h["allocator_peak_bytes"]) for h in A.measured(str(tmp_path / name), nproc)]
    return cfg, measured


def _grid_base() -> list:
    with open(os.path.join(ROOT, "benchmarks", "moe_routing.json"), encoding="utf-8") as fh:
        return json.load(fh)["base"]


def test_natural_routing_within_the_default_bound(tmp_path):
    """A fresh router's own routing (EP 2, 4 local experts: the config of benchmarks/moe_routing.py whose rank 0
    needs F = 1.10) stays under the estimate with the default bound on every rank."""
    from benchmarks import accuracy as A
    argv = _grid_base() + ("--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --seq-length 128 "
                           "--micro-batch-size 1 --hidden-size 128 --num-attention-heads 8 --ffn-hidden-size 256 "
                           "--moe-token-dispatcher-type alltoall").split()
    cfg, measured = _profile(tmp_path, "natural", argv, 2)
    predicted = [r["peak_bytes"] for r in A.predict(cfg, "cpu_compose")]
    assert all(p >= m for p, m in zip(predicted, measured)), (predicted, measured)


def test_padded_to_capacity_run_is_predicted_as_well_as_the_balanced_run(tmp_path):
    from benchmarks import accuracy as A
    argv = _grid_base() + ("--num-experts 4 --moe-router-topk 2 --seq-length 128 --micro-batch-size 1 "
                           "--hidden-size 128 --num-attention-heads 8 --ffn-hidden-size 256 "
                           "--moe-token-dispatcher-type alltoall").split()
    pad = argv + ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"]
    cfg_p, (m_pad,) = _profile(tmp_path, "padded", pad, 1)
    cfg_b, (m_bal,) = _profile(tmp_path, "balanced", argv, 1, ["--balanced-routing"])
    assert m_pad > m_bal * 1.02   # padding to 1.5x capacity adds expert rows: the test can see a wrong factor
    err_pad = A._err(A.predict(cfg_p, "cpu_compose")[0]["peak_bytes"], m_pad)
    err_bal = A._err(A.predict(cfg_b, "cpu_compose")[0]["peak_bytes"], m_bal)
    assert -0.5 <= err_pad <= max(abs(err_bal), 0.5) + 0.5, (err_pad, err_bal)


@pytest.mark.parametrize("fset", ["modelled", "cpu_compose"])
def test_rank_bound_scales_routed_rows_and_leaves_the_router(fset):
    """Per-op and composed sets alike: a MoE layer's routed saved bytes grow by exactly the rank's factor (2 here:
    E=8, k=2, 4 local experts, F=2) -- the local experts' summed over them, the modelled set's expert-side ops whole
    (every term routed) --, the expert side as a whole more, the router's and the attention's not at all. (A fitted
    segment alone may shrink: its k terms can carry negative coefficients that another segment's cancel.)"""
    from estimator import activations as ACT
    from estimator import formulas as F
    s = F.load(fset)

    def ops(extra):
        cfg = parse_args(BASE + extra)
        cache = ACT.cache_for(s, cfg)
        _, per_op = ACT.chunk_activations(cache, [True, True], True, True, False)
        return per_op

    one, two = ops(["--moe-imbalance", "1"]), ops(["--moe-imbalance", "2"])
    exact = [op for op in one if (moe_tokens.per_expert(op) or fset == "modelled") and moe_tokens.routed(op)
             and one[op]["saved"] > 0]
    assert exact, one.keys()
    for op in one:
        if moe_tokens.routed(op) and (moe_tokens.per_expert(op) or fset == "modelled"):
            assert two[op]["saved"] == pytest.approx(2 * one[op]["saved"]), op
        elif op.startswith("layers.*.mlp.router") or op.startswith("layers.*.self_attention"):
            assert two[op]["saved"] == one[op]["saved"], op
    side = [op for op in one if moe_tokens.routed(op)]
    assert sum(two[op]["saved"] for op in side) > sum(one[op]["saved"] for op in side)


# ------------------------------------------------------------------------------------------ forced load balancing
@pytest.mark.parametrize("experts, topk, ep, tokens", [(8, 2, 8, 2048), (64, 6, 8, 1024), (128, 8, 16, 512)])
def test_forced_balancing_is_random_routing_within_its_bound(experts, topk, ep, tokens):
    """--moe-router-force-load-balancing draws the router's logits i.i.d. normal (megatron-core's RandomSTE):
    megatron-core's own top-k routing of such logits is balanced on average, not exactly. Over 20 draws of the
    expert group's tokens, the busiest rank's and expert's counts stay within the estimate's bound, and exceed
    exactly balanced routing (which `--moe-imbalance 1` would assume) on some draw."""
    _need("megatron.core")
    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    cfg = parse_args(("--num-layers 2 --hidden-size 128 --num-attention-heads 8 --seq-length "
                      f"{tokens} --max-position-embeddings {tokens} --micro-batch-size 1 --vocab-size 512 "
                      f"--num-experts {experts} --moe-router-topk {topk} --expert-model-parallel-size {ep} "
                      f"--nproc_per_node {ep} --moe-router-force-load-balancing").split())
    r = moe_tokens.routing(cfg)
    n = experts // ep
    assert r.forced and r.local_experts == n and r.tokens == tokens
    balanced_rank, balanced_one = tokens * topk, tokens * ep * topk / experts
    worst_rank = worst_one = 0.0
    gen = torch.Generator().manual_seed(experts * 1000 + topk)
    for _ in range(20):
        logits = torch.randn(tokens * ep, experts, generator=gen)     # the expert group's source tokens
        _, routing_map = topk_routing_with_score_function(logits, topk)
        per_expert = routing_map.sum(0).double()
        assert int(per_expert.sum()) == tokens * ep * topk
        worst_one = max(worst_one, float(per_expert.max()) / balanced_one)
        worst_rank = max(worst_rank, float(per_expert.view(ep, n).sum(1).max()) / balanced_rank)
    assert 1.0 < worst_rank <= r.rank and 1.0 < worst_one <= r.busiest
    plain = moe_tokens.routing(parse_args(("--num-layers 2 --hidden-size 128 --num-attention-heads 8 "
                                           f"--seq-length {tokens} --max-position-embeddings {tokens} "
                                           f"--micro-batch-size 1 --vocab-size 512 --num-experts {experts} "
                                           f"--moe-router-topk {topk} --expert-model-parallel-size {ep} "
                                           f"--nproc_per_node {ep}").split()))
    assert r.rank < plain.rank or r.busiest < plain.busiest      # tighter than the assumed default bound


def test_an_explicit_imbalance_wins_over_forced_balancing():
    cfg = parse_args(BASE + ["--moe-router-force-load-balancing", "--moe-imbalance", "1"])
    r = moe_tokens.routing(cfg)
    assert not r.forced and r.rank == r.busiest == r.rest == 1.0
