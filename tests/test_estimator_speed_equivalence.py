"""The estimator's fast paths give exactly what the straightforward computations give.

- schedule.rank_timeline (periodic steady state skipped, the rest walked in runs of equal units) == schedule.simulate over the full order() + the saved
  bytes live at the peak, over a grid of (pp, vp, M, group, stage), several chunk byte patterns and p2p tensor
  sizes (0: none; the pipeline p2p tensors of schedule.p2p_counts otherwise).
- parallel.masked_orthogonal_groups (stride arithmetic) == megatron's rank-by-rank decomposition.
- the JSON document written from per-stage templates (report_json) == the straightforward one, byte for byte; the
  per-rank communication figures by stage == sums over every rank of every row; rank coordinates by column ==
  RankGrid.coords per rank.
"""
import itertools
import random
import shlex
import time
import types
from fractions import Fraction

import pytest

from estimator import parallel as P
from estimator import schedule as S


def _full(pp, rank, M, vp, group, chunks, static, opt, p2p=0.0):
    """The step-by-step simulation in exact arithmetic, its numbers rounded once at the end: every float is a
    multiple of some 1/2**k, so the simulation runs on integers scaled by the largest such 2**k."""
    vals = [Fraction(x) for x in [static, opt, p2p] + [x for c in chunks for x in (c.saved, c.fwd_extra, c.bwd_extra)]]
    steps = S.order(pp, rank, M, vp, group)
    scale = max(x.denominator for x in vals)
    ints = lambda x: int(Fraction(x) * scale)                     # noqa: E731  (exact: a power-of-two scale)
    chunks = [types.SimpleNamespace(saved=ints(c.saved), fwd_extra=ints(c.fwd_extra), bwd_extra=ints(c.bwd_extra))
              for c in chunks]
    static, opt, p2p = ints(static), ints(opt), ints(p2p)
    recv, sends = S.p2p_flags(pp, rank, vp)
    tl = S.simulate(steps, chunks, static, opt, warmup=S.warmup_count(pp, rank, M, vp if vp and vp > 1 else None,
                                                                       group),
                    p2p=p2p, recv=recv, sends=sends, interleaved=bool(vp and vp > 1))
    act = 0
    if tl.peak_phase != "optimizer step":
        for i, (kind, _, c) in enumerate(steps[: tl.peak_index + 1]):
            if kind == "F":
                act += chunks[c].saved
            elif i < tl.peak_index:
                act -= chunks[c].saved
    tl.peak = float(Fraction(tl.peak, scale))
    return tl, float(Fraction(act, scale))


def _chunk_sets(vp, rng):
    n = vp or 1
    mk = lambda s, f, b: types.SimpleNamespace(saved=s, fwd_extra=f, bwd_extra=b)  # noqa: E731
    yield [mk(10.0, 12.0, 3.0)] * n                                   # identical chunks
    yield [mk(float(100 + 7 * c), float(3 + c), float(50 - 9 * c)) for c in range(n)]
    yield [mk(float(rng.randint(0, 40)), float(rng.randint(0, 60)), float(rng.randint(0, 60))) for _ in range(n)]
    yield [mk(float(rng.randint(-5, 40)), float(rng.randint(-3, 60)), float(rng.randint(-10, 80))) for _ in range(n)]
    yield [mk(0.0, 0.0, 0.0)] * n                                      # ties everywhere: first occurrence wins
    yield [mk(8 + c, 2 * c, 5) for c in range(n)]                       # ints, as some callers pass
    yield [mk(0.1 * (c + 1), 0.3, 0.7) for c in range(n)]              # fractional: the walk runs on Fractions
    yield [mk(2 ** 60 + 7 * c, 2 ** 61 + 3, 5) for c in range(n)]       # sums past 2**53: on Python integers


GRID = [(pp, vp, M, group)
        for pp in (1, 2, 3, 4, 8)
        for vp in (None, 2, 3, 5)
        for M in (1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 33, 64)
        for group in ((None,) if not vp else (None, 1, 2, 3, pp + 1))]


@pytest.mark.parametrize("pp,vp,M,group", GRID)
def test_rank_timeline_equals_full_simulation(pp, vp, M, group):
    rng = random.Random(f"{pp}-{vp}-{M}-{group}")
    for chunks in _chunk_sets(vp, rng):
        for rank in range(pp):
            for static, opt, p2p in ((1000.0, 0.0, 0.0), (0, 10_000.0, 0.0), (5.0, 3.0, 0.0), (1000.0, 0.0, 4.0),
                                     (5.0, 3.0, 9.0), (0, 30.0, 2.5)):
                want_tl, want_act = _full(pp, rank, M, vp, group, chunks, static, opt, p2p)
                got_tl, got_act = S.rank_timeline(pp, rank, M, chunks, static, opt, vp=vp, group=group, p2p=p2p)
                key = (pp, vp, M, group, rank, static, opt, p2p, [c.__dict__ for c in chunks])
                assert got_tl.peak == want_tl.peak and type(got_tl.peak) is type(want_tl.peak), key
                assert got_tl.peak_phase == want_tl.peak_phase, key
                assert got_tl.peak_index == want_tl.peak_index, key
                assert got_tl.in_flight_max == want_tl.in_flight_max, key
                assert repr(got_act) == repr(want_act), key


def _reference_groups(world_size, sizes, mask):
    def decompose(index, shape):
        stride = P._prefix_product(shape)
        return [(index // d) % s for s, d in zip(shape, stride)]
    masked = [s for s, m in zip(sizes, mask) if m]
    unmasked = [s for s, m in zip(sizes, mask) if not m]
    stride = P._prefix_product(sizes)
    ms = [d for d, m in zip(stride, mask) if m]
    us = [d for d, m in zip(stride, mask) if not m]
    size = P._prefix_product(masked)[-1]
    out = []
    for gi in range(world_size // size):
        base = sum(x * y for x, y in zip(decompose(gi, unmasked), us))
        out.append([base + sum(x * y for x, y in zip(decompose(r, masked), ms)) for r in range(size)])
    return out


def test_masked_orthogonal_groups_equal_rank_by_rank_decomposition():
    for sizes in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2), (1, 3, 4), (1, 2, 5)):
        world = 1
        for x in sizes:
            world *= x
        for mask in itertools.product((False, True), repeat=5):
            assert P.masked_orthogonal_groups(world, list(sizes), list(mask)) == \
                _reference_groups(world, list(sizes), list(mask)), (sizes, mask)


def test_stage_ranks_equal_rank_coordinates():
    for world, tp, pp, cp, ep, order in [(16, 2, 2, 2, 1, P.DEFAULT_ORDER), (24, 2, 3, 1, 1, P.TP_PP_DP_ORDER),
                                         (32, 1, 4, 1, 4, P.DEFAULT_ORDER), (8, 1, 8, 1, 1, P.DEFAULT_ORDER)]:
        lay = P.build_layout(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
        for p in range(pp):
            assert lay.stage_ranks(p) == [r.rank for r in lay.ranks if r.pp == p]


# --- static memory: the one-bucket fast paths against the general walk ------------------------------------------

def _reference_buffer_layout(numels, shared, dp, dist_opt, bucket_size):
    import math
    pad = lambda n, m: -(-n // m) * m  # noqa: E731
    divisor = math.lcm(dp, 128)
    ranges, buckets = [(0, 0)] * len(numels), []
    state = {"bucket_start": 0, "n": 0, "unpadded": 0}

    def close(end_index):
        state["unpadded"] += end_index - state["bucket_start"]
        padded = pad(end_index, divisor) if dist_opt else end_index
        buckets.append((state["bucket_start"], padded))
        state["bucket_start"], state["n"] = padded, 0
        return padded

    start = end = 0
    for i in range(len(numels) - 1, -1, -1):
        if dist_opt:
            start = pad(start, 64)
        own = dist_opt and shared[i]
        if own and state["n"]:
            start = close(start)
        end = start + numels[i]
        ranges[i] = (start, end)
        state["n"] += 1
        if (bucket_size is not None and end - state["bucket_start"] >= bucket_size) or own:
            start = close(end)
        else:
            start = end
    if state["n"]:
        close(end)
    return (buckets[-1][1] if buckets else 0), state["unpadded"], buckets, ranges


def _reference_shard(buckets, ranges, dp, dp_rank):
    n = 0
    for (b0, b1) in buckets:
        size = (b1 - b0) // dp
        lo, hi = b0 + dp_rank * size, b0 + (dp_rank + 1) * size
        for (p0, p1) in ranges:
            if p1 > lo and p0 < hi and p0 >= b0 and p1 <= b1:
                n += min(p1, hi) - max(p0, lo)
    return n


def test_buffer_layout_and_shards_equal_the_general_walk():
    from estimator.static_memory import buffer_layout, shard_param_elements
    rng = random.Random(7)
    for _ in range(5000):
        k = rng.randint(0, 12)
        numels = [rng.choice([0, 1, 3, 64, 100, 129, 4096, rng.randint(0, 5000)]) for _ in range(k)]
        shared = [rng.random() < 0.1 for _ in range(k)]
        dp = rng.choice([1, 2, 3, 4, 6, 8])
        dist_opt = rng.random() < 0.6
        bucket = rng.choice([None, None, None, 100, 5000])
        got = buffer_layout(numels, shared, dp, dist_opt, bucket)
        want = _reference_buffer_layout(numels, shared, dp, dist_opt, bucket)
        assert (got.numel, got.numel_unpadded, got.buckets, got.param_ranges) == want
        for r in range(dp):
            assert shard_param_elements(got, dp, r) == _reference_shard(want[2], want[3], dp, r)


# --- parameter lists: per-kind templates against the per-layer op lists -----------------------------------------

@pytest.mark.parametrize("flags", [
    "--pipeline-model-parallel-size 4 --tensor-model-parallel-size 2",
    "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2",
    "--pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights --swiglu --normalization RMSNorm",
    "--pipeline-model-parallel-size 1 --qk-layernorm",
    "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3",
    "--pipeline-model-parallel-size 2 --num-experts 8 --expert-model-parallel-size 2 --moe-layer-freq 2",
    "--pipeline-model-parallel-size 2 --num-experts 4 --moe-shared-expert-intermediate-size 128 "
    "--moe-layer-freq [1,0,1,1,0,0,1,0]",
])
def test_param_chunks_equal_rank_params(flags):
    import shlex

    from estimator import memory as MEM
    from estimator import model as MODEL
    from estimator.args import parse_args
    argv = shlex.split("--nproc_per_node 8 --num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 "
                       "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 --vocab-size 1000 "
                       + flags)
    cfg = parse_args(argv)
    vpp = MODEL.virtual_stages(cfg)
    pp = cfg.pipeline_model_parallel_size
    fast = MEM.all_param_chunks(cfg)
    for r in range(pp):
        want = [MEM._param_infos(MODEL.rank_params(cfg, r, vp if vpp > 1 else None).ops)
                for vp in range(vpp)]
        assert fast[r] == want
        assert MEM.param_chunks(cfg, r, vpp) == want
        table = MODEL.chunk_layer_table(cfg)
        for vp in range(vpp):
            assert table[(r, vp)] == MODEL.stage_layers(cfg, r, vp if vpp > 1 else None)


# --- formulas, per-op rows, grad buffers: compiled / merged / columnar paths against the plain ones ----------------

def _grid_configs():
    import shlex

    from estimator.args import parse_args
    base = ("--nproc_per_node 8 --num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 "
            "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 16 --vocab-size 1000 ")
    for flags in ("--pipeline-model-parallel-size 4 --tensor-model-parallel-size 2 --sequence-parallel",
                  "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
                  "--use-distributed-optimizer",
                  "--pipeline-model-parallel-size 2 --swiglu --normalization RMSNorm --recompute-activations",
                  "--pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method uniform "
                  "--recompute-num-layers 2 --transformer-impl local --use-distributed-optimizer",
                  "--pipeline-model-parallel-size 2 --num-experts 8 --expert-model-parallel-size 2 --moe-layer-freq 2 "
                  "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 5000",
                  "--tensor-model-parallel-size 2 --untie-embeddings-and-output-weights --bf16"):
        yield parse_args(shlex.split(base + flags))


@pytest.mark.parametrize("set_name", ["modelled"])
def test_rows_evaluator_equals_evaluate_selected(set_name):
    from estimator import activations as A
    from estimator import formulas as F
    fset = F.load(set_name)
    for cfg in _grid_configs():
        env = F.variables(cfg)
        base_sw = F.switches(cfg, env)
        for moe in (False, True):
            for rec in ("none", "selective", "full"):
                sw = dict(base_sw, moe=moe, recompute=rec)
                for ops in (A.ATTN_OPS + A.DENSE_MLP_OPS + (A.LAYER_OP,), A.ATTN_OPS + A.MOE_MLP_OPS + (A.LAYER_OP,),
                            A.FIRST_OPS, A.LAST_OPS):
                    want, used = [], []
                    for op in ops:
                        fo, u = F.select_and_fallbacks(fset, op, sw)
                        used += u
                        want.append((op, *(F.evaluate_selected(fset, op, fo, env) if fo else (0.0, 0.0, 0.0))))
                    for _ in range(F._COMPILE_AFTER):  # op by op (None) until compiling pays
                        compiled = F.rows_evaluator(fset, ops, sw)
                        if compiled is not None:
                            break
                    fn, got_used = F.rows_evaluator(fset, ops, sw)
                    got = fn(env)
                    assert repr(got) == repr(want) and tuple(used) == got_used, (set_name, ops, sw)


def _sequential_per_op(chunk_ops):
    per_op = {}
    for ops in chunk_ops:
        for op, d in ops.items():
            acc = per_op.setdefault(op, {"saved": 0.0, "fwd_peak": 0.0, "bwd_peak": 0.0, "count": 0})
            acc["saved"] += d["saved"]
            acc["count"] += d["count"]
            acc["fwd_peak"] = max(acc["fwd_peak"], d["fwd_peak"])
            acc["bwd_peak"] = max(acc["bwd_peak"], d["bwd_peak"])
    return per_op


def test_stage_per_op_equals_sequential_merge():
    from estimator.memory import _stage_per_op
    rng = random.Random(11)
    for _ in range(2000):
        pool = []
        for _ in range(rng.randint(1, 3)):
            ops = {}
            for name in rng.sample(["a", "b", "c", "d", "e"], rng.randint(1, 4)):
                pick = rng.random()
                x = (float(rng.randint(0, 10 ** 6)) if pick < 0.5 else rng.randint(0, 1000) if pick < 0.6
                     else rng.random() * 1e6 if pick < 0.9 else 0.1 * rng.randint(0, 30))
                ops[name] = {"saved": x, "fwd_peak": rng.choice([0, 0.0, float(rng.randint(0, 9))]),
                             "bwd_peak": rng.choice([0.0, float(rng.randint(0, 9)), rng.random()]),
                             "count": rng.randint(0, 4)}
            pool.append(ops)
        chunk_ops = [rng.choice(pool) for _ in range(rng.randint(1, 7))]
        assert repr(_stage_per_op(chunk_ops)) == repr(_sequential_per_op(chunk_ops))


def test_chunk_columns_give_the_generic_grad_buffers():
    from estimator import memory as MEM
    from estimator.static_memory import _chunk_buffer, chunk_buffer
    for cfg in _grid_configs():
        for chunks in MEM.all_param_chunks(cfg).values():
            for chunk in chunks:
                numels, expert, shared = chunk.columns
                assert numels == [p.numel for p in chunk] and shared == [p.shared_embedding for p in chunk]
                assert expert == any(p.expert for p in chunk)
                for is_exp in (False, True):
                    for dp, dist_opt, bucket in ((1, False, None), (4, True, None), (3, True, 5000), (2, False, 100)):
                        got = chunk_buffer(chunk, is_exp, dp, dist_opt, bucket)
                        want = _chunk_buffer(list(chunk), is_exp, dp, dist_opt, bucket)
                        assert got[0] == want[0] and got[1] == want[1]
                        if got[1] is not None:
                            assert got[1].param_ranges == want[1].param_ranges
                            assert repr(got[1]) == repr(want[1])


# Larger schedules, as the benchmark's interleaved PP-8 configs run them: runs of `group` pairs, skipped periods,
# partial last groups, p2p tensors that tie the steady state or dominate it, rising and falling levels.
BIG_GRID = [(pp, vp, M, group)
            for pp in (4, 8)
            for vp in (None, 2, 5, 6)
            for M in (8, 31, 64, 128)
            for group in ((None,) if not vp else (None, 3, pp + 2))]


@pytest.mark.parametrize("pp,vp,M,group", BIG_GRID)
def test_rank_timeline_runs_equal_full_simulation_large(pp, vp, M, group):
    rng = random.Random(f"big-{pp}-{vp}-{M}-{group}")
    n = vp or 1
    mk = lambda s, f, b: types.SimpleNamespace(saved=s, fwd_extra=f, bwd_extra=b)  # noqa: E731
    sets = [[mk(805765120.0, 856096768.0, 100663296.0)] * n,
            [mk(float(rng.randint(1, 9) << 26), float(rng.randint(0, 9) << 26), float(rng.randint(0, 9) << 26))
             for _ in range(n)],
            [mk(float(rng.randint(-4, 9)), float(rng.randint(-4, 30)), float(rng.randint(-9, 30))) for _ in range(n)]]
    for chunks in sets:
        for rank in range(pp):
            for static, opt, p2p in ((2e9, 3e7, 0.0), (2e9, 3e7, 5e7), (0.0, 0.0, 4e8), (10.0, 3.0, 2.0)):
                want_tl, want_act = _full(pp, rank, M, vp, group, chunks, static, opt, p2p)
                got_tl, got_act = S.rank_timeline(pp, rank, M, chunks, static, opt, vp=vp, group=group, p2p=p2p)
                key = (pp, vp, M, group, rank, static, opt, p2p, [c.__dict__ for c in chunks])
                assert (got_tl.peak, got_tl.peak_phase, got_tl.peak_index, got_tl.in_flight_max) == \
                    (want_tl.peak, want_tl.peak_phase, want_tl.peak_index, want_tl.in_flight_max), key
                assert repr(got_act) == repr(want_act), key


@pytest.mark.parametrize("pp,vp,group", [(4, None, None), (8, 3, None), (8, 5, 3), (6, 2, 8)])
def test_rank_timeline_cost_is_flat_in_the_microbatch_count(pp, vp, group):
    """10**6 and 10**7 microbatches, byte counts whose sums leave the exact floats: no step list, a few ms per rank,
    and the numbers the exact step-by-step simulation gives for a small microbatch count with the same remainder
    of the last microbatch group (every full period in between repeats the same levels)."""
    mk = lambda s, f, b: types.SimpleNamespace(saved=s, fwd_extra=f, bwd_extra=b)  # noqa: E731
    chunks = [mk(805765120.0 + (c << 20), 856096768.0 + 3 * c, 100663296.0) for c in range(vp or 1)]
    g = (group or pp) if vp else 1
    P = g * (vp or 1)
    for M in (10 ** 6, 10 ** 7):
        small = 8 * P + M % g
        t0 = time.process_time()
        got = [S.rank_timeline(pp, r, M, chunks, 2e9, 3e7, vp=vp, group=group, p2p=5e7) for r in range(pp)]
        assert time.process_time() - t0 < 0.5
        for r, (tl, act) in enumerate(got):
            want_tl, want_act = _full(pp, r, small, vp, group, chunks, 2e9, 3e7, 5e7)
            strip = lambda s: s.split(" chunk=")[-1] if s.startswith(("forward", "backward")) else s  # noqa: E731
            assert (tl.peak, act, tl.in_flight_max, strip(tl.peak_phase)) == \
                (want_tl.peak, want_act, want_tl.in_flight_max, strip(want_tl.peak_phase)), (M, r)


JSON_CASES = [
    "--preset llama2_7b --nproc_per_node 8 --nnodes 2 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
    "--preset llama2_7b --nproc_per_node 8 --nnodes 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
    "--num-layers-per-virtual-pipeline-stage 2 --use-distributed-optimizer --sequence-parallel",
    "--preset llama2_7b --nproc_per_node 1",
    "--preset mixtral_8x7b --nproc_per_node 8 --nnodes 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1",
    "--preset llama3_8b --nproc_per_node 4 --nnodes 3 --context-parallel-size 2 --pipeline-model-parallel-size 3 "
    "--decoder-first-pipeline-num-layers 8 --vocab-size 1000000 --untie-embeddings-and-output-weights",
    "--preset gpt3_175b --nproc_per_node 8 --nnodes 16 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
    "--use-distributed-optimizer --overlap-grad-reduce",
]


@pytest.mark.parametrize("flags", JSON_CASES)
def test_json_writer_and_comm_classes_equal_the_straightforward_ones(flags):
    from estimator import cli
    from estimator import report as R
    from estimator.report_json import json_text
    rep = cli.build_report(shlex.split(flags) + ["--micro-batch-size", "1", "--global-batch-size", "96", "--bf16"])
    assert json_text(rep) == cli.dumps_indent1(R.to_json(rep))
    # an ignored argument (a stray positional) that reads like the writer's placeholder is not taken for one
    odd = cli.build_report(shlex.split(flags) + ["--micro-batch-size", "1", "--global-batch-size", "96", "--bf16",
                                                 "\0memtrace:0\0"])
    assert "\0memtrace:0\0" in odd.cfg.ignored_args
    assert json_text(odd) == cli.dumps_indent1(R.to_json(odd))
    # the first rank with the highest rounded peak, searched the plain way
    docs = R.to_json(rep)["ranks"]
    top = max(d["peak_bytes"] for d in docs)
    assert R.worst_rank(rep) == next(d["rank"] for d in docs if d["peak_bytes"] == top)
    # per-rank communication bytes and the summary, rank by rank over every row
    comm = rep.comm
    per_rank = {r: {} for r in range(rep.layout.world_size)}
    calls: dict = {}
    for c in comm.collectives:
        for r in c.ranks:
            per_rank[r][c.dim] = per_rank[r].get(c.dim, 0) + c.wire_bytes_per_iteration
            calls.setdefault(c.dim, {})[r] = calls.get(c.dim, {}).get(r, 0) + c.per_iteration
    assert comm.stage_classes() is not None
    got = comm.per_rank_bytes()
    assert got == per_rank and all(list(got[r]) == list(per_rank[r]) for r in got)   # same keys, same order
    for dim, d in comm.summary().items():
        assert d["calls_per_iteration"] == max(calls[dim].values())
        assert d["max_rank_bytes_per_iteration"] == max(b.get(dim, 0) for b in per_rank.values())
    # rank coordinates by column == RankGrid.coords per rank
    dense, expert = rep.layout._grids
    for rc in rep.layout.ranks:
        d, e = dense.coords(rc.rank), expert.coords(rc.rank)
        assert (rc.tp, rc.cp, rc.dp, rc.pp, rc.ep, rc.etp, rc.edp) == (d["tp"], d["cp"], d["dp"], d["pp"], e["ep"],
                                                                        e["tp"], e["dp"])
        assert rc.name == P.gpu_name(rc.rank, rep.layout.nproc_per_node)
