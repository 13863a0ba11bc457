"""--num-distributed-optimizer-instances N: the distributed optimizer shards over one instance's ranks (DP x CP / N)
and all-reduces each shard across the instances (megatron-core 0.16.1's DistributedDataParallel and
_ParamAndGradBucketGroup.start_grad_sync); the groups themselves are checked against initialize_model_parallel in
tests/test_parallel_groups.py."""
import shlex

import pytest

from estimator.args import ConfigError, parse_args
from estimator.cli import build_report

BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
        "--micro-batch-size 1 --global-batch-size 64 --vocab-size 32000 --bf16 --use-distributed-optimizer "
        "--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall ")


def report(extra):
    return build_report(shlex.split(BASE + extra), reserved=False)


def test_shards_are_one_instances():
    """N instances over DP 8 hold what one optimizer over DP 8 / N holds: the same shards, the same padding."""
    two = report("--nproc_per_node 8 --num-distributed-optimizer-instances 2")
    half = report("--nproc_per_node 4")
    one = report("--nproc_per_node 8")
    for a, b in zip(two.estimate.ranks, half.estimate.ranks):
        assert a.static.optimizer_bytes == b.static.optimizer_bytes > 0
        assert a.static.grad_buffer_bytes == b.static.grad_buffer_bytes
    assert two.estimate.ranks[0].static.optimizer_bytes > one.estimate.ranks[0].static.optimizer_bytes


def test_rows_reduce_scatter_within_an_instance_and_all_reduce_the_shard_across():
    rep = report("--nproc_per_node 8 --num-distributed-optimizer-instances 2")
    plain = report("--nproc_per_node 8")
    rows = [c for c in rep.comm.collectives if c.dim == "dp"]
    by_group = {}
    for c in rows:
        by_group.setdefault((c.op, c.group), []).append(c)
    assert set(by_group) == {("reduce-scatter", "dp-cp-intra"), ("all-gather", "dp-cp-intra"),
                             ("reduce-scatter", "expert-dp-intra"), ("all-gather", "expert-dp-intra"),
                             ("all-reduce", "dist-opt-inter")}
    assert {c.group_size for c in by_group[("reduce-scatter", "dp-cp-intra")]} == {4}   # DP 8 / 2
    assert {c.group_size for c in by_group[("reduce-scatter", "expert-dp-intra")]} == {2}   # expert DP 4 / 2
    assert {c.group_size for c in by_group[("all-reduce", "dist-opt-inter")]} == {2}
    # each bucket's shard (the bucket over the instance's ranks) is all-reduced across the instances
    scattered = [c.shape[0] for c in rows if c.op == "reduce-scatter"]
    shards = [c.shape[0] for c in rows if c.op == "all-reduce"]
    sizes = [c.group_size for c in rows if c.op == "reduce-scatter"]
    assert shards == [n // d for n, d in zip(scattered, sizes)]
    # the buckets themselves are those of an optimizer over DP 4 (the padding follows the instance's size)
    half = report("--nproc_per_node 4")
    assert scattered == [c.shape[0] for c in half.comm.collectives if c.op == "reduce-scatter" and c.dim == "dp"]
    assert not [c for c in plain.comm.collectives if c.group == "dist-opt-inter"]


@pytest.mark.parametrize("extra,message", [
    ("--nproc_per_node 8 --num-distributed-optimizer-instances 3", "divisible by partial DistOpt shard factor"),
    ("--nproc_per_node 4 --num-distributed-optimizer-instances 4", "Expert data parallel size should be divisible"),
])
def test_megatrons_checks(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(shlex.split(BASE + extra))
    with pytest.raises(ConfigError, match="Partial DistOpt cannot be used without DistOpt"):
        parse_args(shlex.split(BASE.replace("--use-distributed-optimizer ", "")
                               + "--nproc_per_node 8 --num-distributed-optimizer-instances 2"))
