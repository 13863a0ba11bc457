"""Parts of one estimate that describe the same thing agree: the DP collectives move exactly the grad buffers that
static memory sizes (same buckets, same padding), and compiled formula evaluation equals the term-by-term sum."""
import random
import shlex

import pytest

from estimator import formulas as F
from estimator.cli import build_report

LAYOUTS = [
    "--nproc_per_node 8 --nnodes 2 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
    "--nproc_per_node 8 --nnodes 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce",
    # CP > 1 with overlap: Megatron-LM sizes buckets from the dp x cp group (64 ranks: 64M elements, not 40M)
    "--nproc_per_node 8 --nnodes 8 --context-parallel-size 8 --use-distributed-optimizer --overlap-grad-reduce",
    "--nproc_per_node 8 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 50000000",
    "--nproc_per_node 8 --nnodes 2 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 "
    "--use-distributed-optimizer",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dp_collectives_cover_the_grad_buffers(layout):
    argv = ["--preset", "llama2_7b", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
            *shlex.split(layout)]
    report = build_report(argv)
    for rank in report.estimate.ranks:
        dense_dp = report.layout.dp * report.layout.cp
        op = "reduce-scatter" if report.cfg.use_distributed_optimizer else "all-reduce"
        rows = [c for c in report.comm.collectives
                if c.dim == "dp" and c.op == op and c.group == "dp-cp" and min(c.ranks) in
                report.layout.stage_ranks(rank.pp_rank)]
        assert rows, layout
        assert sum(c.shape[0] for c in rows) == rank.static.grad_buffer_numel
        if dense_dp > 1:
            assert all(c.group_size == dense_dp for c in rows)
    if "--overlap-grad-reduce" in layout:
        # Stage 0's first chunk is bucketed as Megatron-LM 0.16.1 asks megatron-core's DDP to: --ddp-bucket-size,
        # else max(40M, 1M x DP x CP) elements (training.get_model sets it before DDP's own default, which counts
        # DP alone, could apply).
        from estimator.memory import all_param_chunks
        from estimator.static_memory import buffer_layout
        cfg = report.cfg
        want = cfg.ddp_bucket_size or max(40_000_000, 1_000_000 * cfg.data_parallel_size * cfg.context_parallel_size)
        chunk = all_param_chunks(cfg)[0][0]
        lay = buffer_layout([p.numel for p in chunk], [p.shared_embedding for p in chunk],
                            report.layout.dp * report.layout.cp, True, want)
        stage0 = [c.shape[0] for c in report.comm.collectives if c.dim == "dp" and c.op == "reduce-scatter"
                  and c.what == "grad bucket (chunk 0)" and 0 in c.ranks]
        assert stage0 == [b1 - b0 for b0, b1 in lay.buckets] and len(stage0) > 1


def _term_sum(terms, env):
    vals = []
    for t in terms:
        x = float(t.coef)
        for name, exp in t.vars:
            x *= env[name] ** exp
        vals.append(x)
    return sum(vals)


@pytest.mark.parametrize("name", F.shipped_sets())
def test_compiled_evaluation_equals_term_sums(name):
    fset = F.load(name)
    formulas = [fo for fo in fset.formulas if None not in (fo.saved, fo.fwd_peak, fo.bwd_peak)]
    names = {v for fo in formulas for q in (fo.saved, fo.fwd_peak, fo.bwd_peak) for t in q for v, _ in t.vars}
    rng = random.Random(name)
    for _ in range(50):
        env = {v: rng.choice([rng.randint(1, 9000), rng.random() * 1e4, 2, 0.5]) for v in names}
        for fo in formulas:
            got = fo.evaluate(env)
            want = tuple(_term_sum(q, env) for q in (fo.saved, fo.fwd_peak, fo.bwd_peak))
            assert got == want and [type(x) for x in got] == [type(x) for x in want], fo.op
