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
