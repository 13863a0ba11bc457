"""Group membership and rank coordinates equal megatron-core's own (RankGenerator and initialize_model_parallel)."""

import itertools
import warnings

import pytest

from estimator.parallel import (DEFAULT_ORDER, TP_PP_DP_ORDER, ParallelConfigError, build_layout, gpu_name,
                                layout_from_config)

warnings.filterwarnings("ignore")
torch = pytest.importorskip("torch")
ps = pytest.importorskip("megatron.core.parallel_state")
import torch.distributed as dist  # noqa: E402


def _grid():
    """Every (world, tp, pp, cp, ep, etp, order) megatron accepts for worlds up to 16."""
    out = []
    for world in (1, 2, 4, 6, 8, 12, 16):
        for tp, pp, cp, ep, etp in itertools.product((1, 2, 4), (1, 2, 3), (1, 2), (1, 2, 4), (None, 1, 2)):
            if world % (tp * pp * cp) or world % ((etp or tp) * ep * pp):
                continue
            for order in (DEFAULT_ORDER, TP_PP_DP_ORDER):
                dp, edp = world // (tp * pp * cp), world // ((etp or tp) * ep * pp)
                if not order.endswith("pp") and pp > 1 and edp != dp:
                    continue
                out.append((world, tp, pp, cp, ep, etp, order))
    return out


GRID = _grid()


@pytest.mark.parametrize("world,tp,pp,cp,ep,etp,order", GRID)
def test_groups_equal_rank_generator(world, tp, pp, cp, ep, etp, order):
    lay = build_layout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
    dp, etp_ = world // (tp * pp * cp), etp or tp
    dense = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = ps.RankGenerator(tp=etp_, ep=ep, dp=world // (etp_ * ep * pp), pp=pp, cp=1, order=order)
    for name, tok in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("dp-cp", "dp-cp"), ("pp", "pp"),
                      ("tp-pp", "tp-pp"), ("tp-cp", "tp-cp"), ("tp-dp-cp", "tp-dp-cp")):
        assert lay.groups[name] == dense.get_ranks(tok), name
    for name, tok in (("ep", "ep"), ("expert-tp", "tp"), ("expert-dp", "dp"), ("expert-tp-ep", "tp-ep")):
        assert lay.groups[name] == expert.get_ranks(tok), name
    assert lay.groups["embedding"] == [ps.default_embedding_ranks(g) for g in dense.get_ranks("pp")]
    assert lay.groups["position-embedding"] == [ps.default_position_embedding_ranks(g)
                                                for g in dense.get_ranks("pp")]


# initialize_model_parallel itself, one process per rank of a fake world (torch's "fake" backend: no communication).
FAKE_GRID = [(8, 2, 2, 1, 2, 1, DEFAULT_ORDER), (8, 1, 2, 2, 1, None, DEFAULT_ORDER), (16, 2, 2, 2, 4, 1, DEFAULT_ORDER),
             (12, 2, 3, 1, 2, None, DEFAULT_ORDER), (8, 2, 2, 1, 1, None, TP_PP_DP_ORDER), (16, 2, 2, 1, 2, 1, TP_PP_DP_ORDER), (16, 4, 1, 2, 2, 2, DEFAULT_ORDER),
             (4, 1, 4, 1, 1, None, DEFAULT_ORDER), (8, 2, 1, 1, 8, 1, DEFAULT_ORDER)]


def _each_fake_rank(world, **kwargs):
    """Each rank of a fake world in turn, with megatron-core's initialize_model_parallel(**kwargs) done for it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    for r in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=world)
        try:
            ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
            yield r
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


@pytest.mark.parametrize("world,tp,pp,cp,ep,etp,order", FAKE_GRID)
def test_groups_equal_initialize_model_parallel(world, tp, pp, cp, ep, etp, order):
    lay = build_layout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order, nproc_per_node=4)
    ranks_of = dist.get_process_group_ranks
    for r in _each_fake_rank(world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             context_parallel_size=cp, expert_model_parallel_size=ep,
                             expert_tensor_parallel_size=etp, order=order):
        real = {
            "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(), "dp-cp": ps.get_data_parallel_group(with_context_parallel=True),
            "cp": ps.get_context_parallel_group(), "tp-pp": ps.get_model_parallel_group(),
            "tp-cp": ps.get_tensor_and_context_parallel_group(),
            "tp-dp-cp": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
            "embedding": ps.get_embedding_group(check_initialized=False),
            "position-embedding": ps.get_position_embedding_group(check_initialized=False),
            "ep": ps.get_expert_model_parallel_group(), "expert-tp": ps.get_expert_tensor_parallel_group(),
            "expert-dp": ps.get_expert_data_parallel_group(),
            "expert-tp-ep": ps.get_expert_tensor_and_model_parallel_group(),
        }
        for name, group in real.items():
            # megatron keeps an embedding group only on the ranks inside it
            assert lay.group_of(name, r) == (ranks_of(group) if group is not None else []), (name, r)
        c = lay.ranks[r]
        assert (c.tp, c.pp, c.dp, c.cp) == (ps.get_tensor_model_parallel_rank(),
                                            ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
                                            ps.get_context_parallel_rank())
        assert (c.ep, c.etp, c.edp) == (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank(),
                                        ps.get_expert_data_parallel_rank())
        assert c.name == gpu_name(r, 4) == f"n{r // 4}_g{r % 4}"


@pytest.mark.parametrize("world,tp,pp,cp,ep,etp,n", [(8, 1, 1, 1, 2, None, 2), (16, 2, 2, 2, 2, 1, 2),
                                                      (16, 1, 2, 1, 1, None, 4), (8, 1, 1, 2, 1, None, 4)])
def test_optimizer_instance_groups_equal_initialize_model_parallel(world, tp, pp, cp, ep, etp, n):
    """--num-distributed-optimizer-instances N: the data-parallel groups one instance shards over (dense: DP x CP,
    expert: expert DP) and the group that all-reduces a shard across the instances, as megatron-core builds them."""
    lay = build_layout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dist_opt_instances=n)
    assert {"dp-cp-intra", "expert-dp-intra", "dist-opt-inter"} <= set(lay.groups)
    ranks_of = dist.get_process_group_ranks
    for r in _each_fake_rank(world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             context_parallel_size=cp, expert_model_parallel_size=ep,
                             expert_tensor_parallel_size=etp, num_distributed_optimizer_instances=n):
        real = {"dp-cp-intra": ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
                "expert-dp-intra": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
                "dist-opt-inter": ps.get_inter_distributed_optimizer_instance_group()}
        for name, group in real.items():
            assert lay.group_of(name, r) == ranks_of(group), (name, r)
    assert "dp-cp-intra" not in build_layout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp).groups


def test_invalid_layouts_raise_megatron_messages():
    with pytest.raises(ParallelConfigError, match="not divisible"):
        build_layout(6, tp=4)
    with pytest.raises(ParallelConfigError, match="expert_tensor_model_pipeline"):
        build_layout(4, tp=1, ep=8)
    with pytest.raises(ParallelConfigError, match="pp-last"):
        build_layout(8, tp=2, pp=2, ep=2, etp=2, order=TP_PP_DP_ORDER)
    with pytest.raises(ParallelConfigError, match="partial DistOpt shard factor"):
        build_layout(8, tp=2, dist_opt_instances=3)


def test_layout_from_config_uses_megatron_dest_names():
    class Cfg:
        world_size, nproc_per_node = 16, 8
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size = 2, 2, 1
        expert_model_parallel_size, expert_tensor_parallel_size = 4, 1

    lay = layout_from_config(Cfg())
    assert (lay.dp, lay.edp) == (4, 2)
    assert lay.ranks[9].name == "n1_g1"
    d = lay.to_dict()
    assert d["groups"]["tp"][0] == [0, 1] and len(d["ranks"]) == 16
