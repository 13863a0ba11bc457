"""--tp-comm-overlap userbuffers (estimator.tp_overlap, modelled): on every rank, under `other`, from the start."""
import shlex

import pytest

from estimator import memory as MEM
from estimator import tp_overlap
from estimator.args import ConfigError, parse_args

BASE = ("--nproc_per_node 4 --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
        "--max-position-embeddings 256 --vocab-size 500 --micro-batch-size 2 --bf16 --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --sequence-parallel ")
MIB = 1 << 20


def est(extra):
    return MEM.estimate(parse_args(shlex.split(BASE + extra)), "modelled")


@pytest.mark.parametrize("extra,per_token_bytes", [("", 12 * 2), ("--fp8-format hybrid", 8 + 4 * 2),
                                                   ("--fp8-format hybrid --fp8-recipe tensorwise "
                                                    "--first-last-layers-bf16", 8 + 4 * 2 + 12 * 2)])
def test_userbuffers_on_every_rank(extra, per_token_bytes):
    plain, overlap = est(extra), est(extra + " --tp-comm-overlap")
    added = 256 * 2 * 128 * per_token_bytes + 64 * MIB
    assert tp_overlap.buffer_bytes(parse_args(shlex.split(BASE + extra + " --tp-comm-overlap"))) == added
    for a, b in zip(plain.ranks, overlap.ranks):
        assert b.peak_bytes - a.peak_bytes == added
        assert b.bytes["other"] - a.bytes["other"] == added and b.bytes["activations"] == a.bytes["activations"]


def test_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match="only when sequence parallelism is enabled"):
        parse_args(shlex.split(BASE.replace("--sequence-parallel ", "") + "--tp-comm-overlap"))
