import types

import pytest

from estimator import schedule as S

sched = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def _comm(pp, rank, vp):
    grp = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return types.SimpleNamespace(pp_group=grp, virtual_pipeline_model_parallel_size=vp)


@pytest.mark.parametrize("pp,M", [(2, 1), (2, 4), (4, 3), (4, 8), (8, 16)])
def test_1f1b_in_flight_and_warmup(pp, M):
    for rank in range(pp):
        steps = S.order(pp, rank, M)
        assert S.max_in_flight(steps) == min(pp - rank, M)
        ref = sched.get_pp_rank_microbatches(M, 1, pp, p2p_communicator=_comm(pp, rank, None))
        assert S.warmup_count(pp, rank, M) == ref[2]


@pytest.mark.parametrize("pp,vp,M,group", [(2, 2, 4, 2), (2, 2, 5, 3), (4, 2, 8, 4), (4, 3, 12, 4), (2, 4, 6, 2)])
def test_interleaved_matches_megatron(pp, vp, M, group):
    assert S.schedule_table(M, vp, group) == sched.get_schedule_table(M, vp, group)
    for rank in range(pp):
        ref = sched.get_pp_rank_microbatches(M, vp, group, p2p_communicator=_comm(pp, rank, vp))
        assert S.warmup_count(pp, rank, M, vp, group) == ref[2]
        steps = S.order(pp, rank, M, vp, group)
        assert len(steps) == 2 * M * vp
        # every (mb, chunk) runs forward once, and its backward after its forward
        seen = {}
        for i, (k, mb, c) in enumerate(steps):
            seen.setdefault((mb, c), []).append(k)
        assert all(v == ["F", "B"] for v in seen.values())
        assert S.max_in_flight(steps) == min(ref[2] + 1, M * vp)
    # earlier stages hold more microbatches under interleaving
    counts = [S.max_in_flight(S.order(pp, r, M, vp, group)) for r in range(pp)]
    assert counts == sorted(counts, reverse=True)


def test_simulate_peak_phase():
    ch = types.SimpleNamespace(saved=10.0, fwd_extra=12.0, bwd_extra=3.0)
    tl = S.simulate(S.order(4, 0, 8), [ch], 100.0, optimizer_transient=1.0, keep_events=True, warmup=3)
    assert tl.in_flight_max == 4 and tl.peak == 100 + 40 + 3
    assert tl.peak_phase.startswith("backward")
    assert tl.events[-1].phase == "optimizer"
    nopipe = S.simulate(S.order(1, 0, 4), [ch], 0.0)
    assert nopipe.in_flight_max == 1 and nopipe.peak == 13.0


def test_p2p_counts_match_interleaved_trace():
    """Pipeline p2p tensors live per step beyond the saved bytes, as read from the traced megatron-core 0.16 run
    runs/accuracy/l4_pp2_vpp2_m4 (pp=2, vp=2, M=4, overlap_p2p_comm): kept chunk inputs and their gradients,
    pending input-gradient sends, interleaved output sends after the pair's backward, prefetched output grads."""
    want = {0: ([2, 2, 0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 1, 2, 2], 2),
            1: ([2, 2, 0, 0, 1, 1, 3, 3, 4, 4, 1, 1, 1, 1, 2, 3], 4)}
    for rank, (counts, end) in want.items():
        steps = S.order(2, rank, 4, 2, 2)
        recv, sends = S.p2p_flags(2, rank, 2)
        assert S.p2p_counts([(k, c) for k, _, c in steps], recv, sends, True) == (counts, end)
    # 1F1B: a sent input gradient lives through the next forward and backward; the chunk keeps its last input
    # and that input's gradient through the optimizer step, and through the whole of a forward right after its
    # backward (test_1f1b_last_stage_keeps_the_last_input_through_the_next_forward); the first stage receives only
    # output gradients, each referenced through the forward after its backward
    # (test_1f1b_received_gradient_lives_through_next_forward).
    steps = S.order(2, 1, 4)
    recv, sends = S.p2p_flags(2, 1)
    assert S.p2p_counts([(k, c) for k, _, c in steps], recv, sends, False) == ([0, 0, 2, 1, 2, 1, 2, 1], 2)
    steps = S.order(2, 0, 4)
    recv, sends = S.p2p_flags(2, 0)
    assert S.p2p_counts([(k, c) for k, _, c in steps], recv, sends, False) == ([0, 0, 0, 1, 0, 1, 0, 0], 0)


def test_1f1b_received_gradient_lives_through_next_forward():
    """The first stage of a traced 1F1B run (PP 4, 8 microbatches, megatron-core 0.16.1 on the fake process group,
    committed): every tensor it receives is an output gradient, and the one a backward received is still live when
    the next forward starts (the schedule's `output_tensor_grad` is replaced only by the next exchange). Counted at
    each forward's start of the traced iteration 1, it equals the schedule model's p2p count for that forward."""
    import os

    import numpy as np
    from tracer.parse import current_scope, op_label, parse_run

    run = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fit", "traces", "cpu_layouts",
                       "pp4_fp32_s64_b2_h128")
    pr = next(p for p in parse_run(run) if p.rank == 0)
    a = pr.allocs
    received = np.flatnonzero(np.array(op_label(pr, np.arange(len(a["idx"])))) == "pp_recv")
    rows = current_scope(pr.scopes, np.arange(pr.n_events))
    starts, last = [], None
    for k in range(pr.n_events):
        path = pr.scope_path(int(rows[k]))
        step = path[1] if len(path) > 1 and path[0] == "iter:1" and path[1][:4] in ("fwd:", "bwd:") else None
        if step and step != last:
            starts.append((k, step))
        last = step
    traced = [int(((a["idx"][received] < k) & (a["free"][received] > k)).sum())
              for k, step in starts if step.startswith("fwd:")]
    steps = S.order(4, 0, 8)
    recv, sends = S.p2p_flags(4, 0)
    counts, _ = S.p2p_counts([(kind, c) for kind, _, c in steps], recv, sends, False)
    model = [n for (kind, _, _), n in zip(steps, counts) if kind == "F"]
    assert len(traced) == 8 and traced == model and sum(model) == 4


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_1f1b_last_stage_keeps_the_last_input_through_the_next_forward(dtype):
    """The last stage of a traced 1F1B run (PP 4, 8 microbatches, megatron-core 0.16.1 on the fake process group,
    committed): at each forward's peak of iteration 1, the hidden-state tensors it received (pp_recv) or made in
    a backward (the input gradients it sent) that are live are its own input and what the schedule model counts:
    from the second forward on, the previous backward's input and its gradient, which megatron-core releases only
    once this forward is done (set_input_tensor alone would release the input at the forward's start)."""
    import os

    import numpy as np
    from tracer.parse import op_label, parse_run

    run = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fit", "traces", "cpu_layouts",
                       f"pp4_{dtype}_s64_b2_h128")
    pr = next(p for p in parse_run(run) if p.rank == 3)
    a, sc = pr.allocs, pr.scopes
    labels = np.array(op_label(pr, np.arange(len(a["idx"]))))
    hidden = a["size"][np.flatnonzero(labels == "pp_recv")[0]]
    p2p = np.flatnonzero(((labels == "pp_recv") | np.char.startswith(labels.astype(str), "bwd:"))
                         & (a["size"] == hidden))
    traced = []
    for i in range(len(sc.id)):
        if sc.depth[i] == 2 and pr.scope_name(int(sc.parent[i])) == "iter:1" and pr.scope_name(i)[:4] == "fwd:":
            o, c = int(sc.open[i]), int(sc.close[i])
            k = o + int(np.argmax(pr.live[o:c + 1]))
            traced.append(int(((a["idx"][p2p] <= k) & (a["free"][p2p] > k)).sum()))
    steps = S.order(4, 3, 8)
    recv, sends = S.p2p_flags(4, 3)
    counts, _ = S.p2p_counts([(kind, c) for kind, _, c in steps], recv, sends, False)
    model = [1 + n for (kind, _, _), n in zip(steps, counts) if kind == "F"]
    assert len(traced) == 8 and traced == model and model[1:] == [3] * 7


def test_simulate_adds_p2p_tensors():
    ch = types.SimpleNamespace(saved=10.0, fwd_extra=12.0, bwd_extra=3.0)
    steps = S.order(2, 1, 4)
    recv, sends = S.p2p_flags(2, 1)
    base = S.simulate(steps, [ch], 100.0, optimizer_transient=1.0, keep_events=True)
    tl = S.simulate(steps, [ch], 100.0, optimizer_transient=1.0, keep_events=True, p2p=5.0, recv=recv, sends=sends)
    assert [e.peak - b.peak for e, b in zip(tl.events, base.events)] == [0, 0, 10, 5, 10, 5, 10, 5, 10]
    assert S.rank_timeline(2, 1, 4, [ch], 100.0, 1.0, p2p=5.0)[0].peak == tl.peak
