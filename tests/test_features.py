"""Every modelled (not measured) feature a config uses is labelled in the report and the JSON."""
import shlex

import pytest

from estimator import report as R
from estimator.cli import build_report

BASE = ("--nproc_per_node 4 --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
        "--max-position-embeddings 256 --vocab-size 500 --micro-batch-size 1 --bf16 ")


@pytest.mark.parametrize("flags,label", [
    ("--use-distributed-optimizer --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",
     "Megatron FSDP (optim_grads)"),
    ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights", "torch FSDP2"),
    ("--fp8-format hybrid", "fp8 (hybrid, delayed)"),
    ("--use-distributed-optimizer --use-precision-aware-optimizer --optimizer-cpu-offload "
     "--optimizer-offload-fraction 0.5", "optimizer CPU offload: 0.5"),
    ("--cpu-offloading-num-layers 2", "activation CPU offload: the first 2 layers"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap", "TP comm overlap"),
    ("--quick-geglu", "--quick-geglu"),
    ("--softmax-type learnable", "--softmax-type learnable"),
    ("--num-experts 4 --moe-router-dtype fp32", "--moe-router-dtype fp32: router logits"),
    ("--cross-entropy-loss-fusion", "--cross-entropy-loss-fusion"),
    ("--moe-permute-fusion", "--moe-permute-fusion: estimated as if absent"),
])
def test_modelled_features_are_labelled(flags, label):
    report = build_report(shlex.split(BASE + flags))
    assert any(label in line for line in R.to_json(report)["modelled_features"])
    text = R.to_text(report).split("Modelled, not measured:\n")[1]
    assert label in text.split("\n\n")[0]


def test_a_plain_config_has_no_modelled_features():
    report = build_report(shlex.split(BASE))
    assert R.to_json(report)["modelled_features"] == [] and "Modelled, not measured" not in R.to_text(report)


def test_router_dtype_adds_its_logits_and_scores_per_moe_layer():
    from estimator import memory as MEM
    from estimator.args import parse_args
    base = BASE + "--num-experts 8 --moe-layer-freq [1,0,1,1] "
    plain = MEM.estimate(parse_args(shlex.split(base)), "modelled").ranks[0].per_op
    fp32 = MEM.estimate(parse_args(shlex.split(base + "--moe-router-dtype fp32")), "modelled").ranks[0].per_op
    row = fp32.pop("layers.*.mlp.router_dtype")
    assert row["count"] == 3 and row["saved"] == 3 * 2 * (4 - 2) * 256 * 1 * 8   # 3 MoE layers, s b E
    assert {op: d["saved"] for op, d in fp32.items()} == {op: d["saved"] for op, d in plain.items()}
