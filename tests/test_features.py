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
