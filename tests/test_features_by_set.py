"""Every memory-changing feature changes the estimate under every shipped formula set (features x sets), and the
features no traced run measured reach the estimate through the one registry (estimator.transforms) whatever set
supplies the op values."""
import shlex

import pytest

from estimator import formulas as F
from estimator import memory as MEM
from estimator import transforms
from estimator.args import parse_args

BASE = ("--nproc_per_node 8 --num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 "
        "--seq-length 512 --max-position-embeddings 512 --vocab-size 1000 --micro-batch-size 2 "
        "--global-batch-size 32 --bf16 --use-distributed-optimizer --tensor-model-parallel-size 2 "
        "--sequence-parallel --swiglu --normalization RMSNorm --position-embedding-type rope "
        "--untie-embeddings-and-output-weights --disable-bias-linear")
MOE = " --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-grouped-gemm"
PP2 = " --pipeline-model-parallel-size 2"

# name: (flags added to the base, flags removed from it, base extra, sign of the change: +1, -1 or 0 for either,
#        the registered transform it exercises or None)
FEATURES = {
    "full recompute": ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", "", "",
                       -1, None),
    "selective recompute (unfused attention)": ("--recompute-granularity selective", "",
                                                " --attention-backend unfused", -1, None),
    "no dropout": ("--attention-dropout 0 --hidden-dropout 0", "", "", -1, None),
    "no distributed optimizer": ("", "--use-distributed-optimizer", "", +1, None),
    "gradients reduced in bf16": ("--grad-reduce-in-bf16", "", "", -1, None),
    "fp16": ("--fp16", "--bf16", "", 0, None),
    "interleaved pipeline": ("--num-layers-per-virtual-pipeline-stage 1", "", PP2, 0, None),
    "context parallel": ("--context-parallel-size 2", "", "", -1, "context-parallel KV chunks"),
    "unfused attention": ("--attention-backend unfused", "", "", +1, None),
    "alltoall dispatcher": ("--moe-token-dispatcher-type alltoall", "", MOE, 0, None),   # allgather is the default
    "router dtype fp32": ("--moe-router-dtype fp32", "", MOE, +1, "router dtype"),
    "fp8": ("--fp8-format hybrid", "", "", 0, "fp8 saved inputs"),
    "activation CPU offload": ("--cpu-offloading-num-layers 2", "", "", -1, "activation CPU offload"),
    "optimizer CPU offload": ("--optimizer-cpu-offload --optimizer-offload-fraction 1.0", "",
                              " --use-precision-aware-optimizer", -1, None),
    "TP comm overlap": ("--tp-comm-overlap", "", "", +1, None),
    "Megatron FSDP": ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params", "", "", 0, None),
    "two distributed-optimizer instances": ("--num-distributed-optimizer-instances 2", "", "", +1, None),
    "cross-entropy loss fusion": ("--cross-entropy-loss-fusion", "", " --vocab-size 32000", +1, None),  # the loss sets the peak
    "fp32 residual connection": ("--fp32-residual-connection", "", "", +1, "fp32 residual stream"),
    "qk layernorm": ("--qk-layernorm", "", "", +1, "qk layernorm"),
    "shared experts": ("--moe-shared-expert-intermediate-size 512", "", MOE, +1, "shared experts"),
    "probs on input (top-1)": ("--moe-apply-probs-on-input", "", MOE.replace("topk 2", "topk 1")
                               + " --moe-router-pre-softmax", +1, "probs on input"),
}
# Registered transforms exercised elsewhere: torch's fp32 softmax fallback applies to the modelled set only (a
# fitted set measured the softmax its runs took), tests/test_formulas.py and tests/test_features.py.
ELSEWHERE = {"fp32 softmax fallback"}
# Transforms for fitted sets only: the modelled set counts their bytes in its own formulas (TE's context-parallel
# key/value chunks in its core attention; shared experts, whose formula the transform lends the fitted sets), so
# the transform gives it no row.
FITTED_ONLY = {"context-parallel KV chunks", "shared experts"}
SETS = F.shipped_sets()


def _argv(flags: str, removed: str, extra: str) -> list:
    drop = set(removed.split())
    return [a for a in shlex.split(BASE + extra) if a not in drop] + shlex.split(flags)


def _peak(argv, fset) -> float:
    return MEM.estimate(parse_args(argv), fset, per_op=False).max_peak_bytes


def test_sets_are_the_shipped_ones():
    assert "modelled" in SETS and len(SETS) >= 3   # the modelled set and the fitted program sets


@pytest.mark.parametrize("fset", SETS)
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature_changes_the_estimate(name, fset):
    flags, removed, extra, sign, _ = FEATURES[name]
    base, with_feature = _peak(_argv("", "", extra), fset), _peak(_argv(flags, removed, extra), fset)
    assert with_feature != base, f"{name} does not change the estimate under {fset}"
    if sign:
        assert (with_feature - base) * sign > 0, f"{name} moves the estimate the wrong way under {fset}"


def test_every_registered_transform_is_exercised():
    covered = {v[4] for v in FEATURES.values() if v[4]} | ELSEWHERE
    assert set(transforms.LAYER) | set(transforms.CHUNK) == covered


@pytest.mark.parametrize("fset", SETS)
@pytest.mark.parametrize("name", sorted(n for n, v in FEATURES.items() if v[4] in transforms.LAYER))
def test_layer_transform_rows_reach_every_set(name, fset):
    """A layer transform's row is in the per-op rows once per layer whatever set supplies the rest, and equals
    what the registered function gives for the config (the same row under every set)."""
    flags, removed, extra, _, tname = FEATURES[name]
    cfg = parse_args(_argv(flags, removed, extra))
    est = MEM.estimate(cfg, fset)
    env = F.variables(cfg)
    expected = [r for moe in (False, True) for r in [transforms.LAYER[tname](cfg, env, moe, fset == "modelled")]
                if r is not None and (moe == bool(cfg.num_experts))]
    if tname in FITTED_ONLY and fset == "modelled":
        from estimator.context_parallel import LABEL
        assert not expected and (LABEL not in est.ranks[0].per_op or tname != "context-parallel KV chunks")
        return
    if tname in transforms.STANDS_FOR and F.load(fset).measures(*transforms.STANDS_FOR[tname]):
        # the set's runs had the feature: its programs answer, the transform adds no row
        assert expected and expected[0][0] not in est.ranks[0].per_op
        return
    assert expected
    op, saved = expected[0][0], expected[0][1]
    row = est.ranks[0].per_op[op]
    layers = cfg.num_layers // cfg.pipeline_model_parallel_size
    assert row["count"] == layers and row["saved"] == pytest.approx(layers * saved)


@pytest.mark.parametrize("fset", [s for s in SETS if s != "modelled"])
def test_activation_offload_relieves_fitted_sets_as_the_modelled_set(fset):
    """Offloading N layers leaves one layer's saved bytes on the device (the buffer in flight): the saved level
    drops by N - 1 layers' saved bytes, under a program set as under the modelled one."""
    argv = _argv("", "", "")
    plain, two, three = (MEM.estimate(parse_args(argv + (["--cpu-offloading-num-layers", str(n)] if n else [])),
                                      fset) for n in (0, 2, 3))
    drop2 = plain.ranks[0].bytes["activations"] - two.ranks[0].bytes["activations"]
    drop3 = plain.ranks[0].bytes["activations"] - three.ranks[0].bytes["activations"]
    assert drop2 > 0 and drop3 == pytest.approx(2 * drop2)


def test_an_untraced_kernel_switch_adds_the_modelled_difference(tmp_path):
    """A set whose runs never had the fused cross entropy (a set fitted here from the committed one-process runs of
    Megatron's default kernels without it): the config's value is composed from the traced one, plus the modelled
    set's difference between the two, named in the per-op rows and the coverage. The shipped sets traced it: no
    difference is added there."""
    import os

    from estimator import programs as P
    from fit.programs.build import documents, fit_runs, load_runs
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = os.path.join(root, "fit", "traces", "cpu_gpu_kernels")
    runs = load_runs([os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith("llama_gqa_w1_")])
    assert {r.switches["fuse_ce"] for r in runs} == {"none"}
    doc, _ = documents(runs, fit_runs(runs), "no_fused_loss", "")
    path = tmp_path / "no_fused_loss.json"
    path.write_text(P.to_json(doc))
    fset = F.load(str(path))
    one = ("--nproc_per_node 1 --num-layers 2 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 8 "
           "--group-query-attention --num-query-groups 4 --seq-length 64 --max-position-embeddings 64 "
           "--micro-batch-size 2 --vocab-size 32000 --bf16 --swiglu --normalization RMSNorm "
           "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
           "--hidden-dropout 0 --attention-dropout 0")
    plain, cfg = parse_args(shlex.split(one)), parse_args(shlex.split(one + " --cross-entropy-loss-fusion"))
    est = MEM.estimate(cfg, fset)
    assert "fuse_ce=native" in est.coverage["untraced"] and est.coverage["modelled_difference"] == ["fuse_ce=native"]
    row = est.ranks[0].per_op["untraced fuse_ce=native (modelled difference)"]
    modelled = (MEM.estimate(cfg, "modelled").max_peak_bytes - MEM.estimate(plain, "modelled").max_peak_bytes)
    assert row["fwd_peak"] > 0
    assert est.max_peak_bytes - MEM.estimate(plain, fset).max_peak_bytes == pytest.approx(modelled, rel=0.05)
    for shipped in ("cpu_compose", "gpu_h100"):
        traced = MEM.estimate(cfg, shipped)
        assert not traced.coverage["modelled_difference"]
        assert not any(op.startswith("untraced") for op in traced.ranks[0].per_op)
