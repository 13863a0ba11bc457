"""Sharded data parallelism (estimator.sharding): torch FSDP2's shards against torch's own fully_shard on a real
megatron-core GPTModel (CPU, gloo, 2 ranks); Megatron FSDP's strategies (modelled: it needs CUDA) in order."""
import os
import shlex

import pytest

from estimator import memory as MEM
from estimator import sharding
from estimator.args import ConfigError, parse_args
from estimator.cli import build_report

BASE = ("--nproc_per_node 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --vocab-size 500 --micro-batch-size 2 --global-batch-size 8 "
        "--untie-embeddings-and-output-weights --no-gradient-accumulation-fusion --transformer-impl local ")


def parse(extra):
    return parse_args(shlex.split(BASE + extra))


def _fsdp2_worker(rank, world, port, cfg, results):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tests.conftest import transformer_config
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel()
        model = GPTModel(config=transformer_config(cfg), transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=cfg.padded_vocab_size, max_sequence_length=cfg.max_position_embeddings,
                         share_embeddings_and_output_weights=False)
        # What Megatron-LM's TorchFullyShardedDataParallel wraps with the local spec, then the root.
        mesh = DeviceMesh.from_group(parallel_state.get_data_parallel_group(with_context_parallel=True), "cpu")
        for sub in model.modules():
            if isinstance(sub, (TransformerLayer, LanguageModelEmbedding)):
                fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
        results.put((rank, sum(p.to_local().numel() for p in model.parameters()),
                     sum(p.numel() for p in model.parameters())))
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


@pytest.mark.megatron
def test_fsdp2_shards_equal_torch_fully_shard():
    import torch.multiprocessing as mp

    from tests.conftest import _free_port
    cfg = parse("--use-torch-fsdp2 --ffn-hidden-size 145")  # fc1: 145 rows, not even over 2 ranks
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_fsdp2_worker, args=(r, 2, port, cfg, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (local, full)) for r, local, full in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert got[0][1] == MEM.estimate(cfg, "modelled").ranks[0].params     # the whole model, as megatron-core
    assert got[0][0] == sharding.fsdp2_local_elements(cfg) > got[1][0]     # rank 0 holds the larger shards
    est = MEM.estimate(cfg, "modelled").ranks[0]
    assert est.static.grad_buffer_bytes == 4 * got[0][0]   # fp32 model: fp32 grads, the shards alone persist
    weights, grads = sharding.compute_bytes(cfg, MEM.all_param_chunks(cfg)[0])
    assert weights == grads == 4 * sharding.units_in_flight(cfg) > 0     # two units gathered while computing
    assert est.bytes["parameters"] == est.static.weights_bytes + weights


def test_megatron_fsdp_gathered_buckets_are_gone_after_the_step():
    """Gathering the weights (optim_grads_params) adds the two units in flight to the peak, and after the step
    leaves only the difference of the sharded and the whole weights (the buckets are freed after use)."""
    base = "--nproc_per_node 8 --global-batch-size 16 --bf16 --use-distributed-optimizer --use-megatron-fsdp "
    grads, params = (MEM.estimate(parse(base + "--data-parallel-sharding-strategy " + how), "modelled").ranks[0]
                     for how in ("optim_grads", "optim_grads_params"))
    gathered, _ = sharding.compute_bytes(parse(base + "--data-parallel-sharding-strategy optim_grads_params"),
                                         MEM.all_param_chunks(parse(base))[0])
    assert gathered == 2 * sharding.units_in_flight(parse(base)) > 0
    assert grads.after_step_bytes - params.after_step_bytes == \
        grads.static.weights_bytes - params.static.weights_bytes > 0
    assert params.bytes["parameters"] == params.static.weights_bytes + gathered


def test_megatron_fsdp_strategies_shard_more_in_order():
    base = "--nproc_per_node 8 --global-batch-size 16 --bf16 --use-distributed-optimizer --use-megatron-fsdp "
    peaks, cats = [], []
    for how in sharding.STRATEGIES:
        est = MEM.estimate(parse(base + "--data-parallel-sharding-strategy " + how), "modelled").ranks[0]
        peaks.append(est.peak_bytes)
        cats.append((est.bytes["parameters"], est.bytes["gradients"], est.bytes["optimizer_states"]))
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    no_shard, optim, grads, params = cats
    assert optim[2] < no_shard[2] and optim[:2] == no_shard[:2]        # optim: optimizer states only
    assert grads[1] < optim[1] and grads[0] == optim[0]                 # optim_grads: + gradients
    assert params[0] < grads[0] and params[1:] == grads[1:]             # optim_grads_params: + weights
    # Plain DDP with the distributed optimizer keeps the same optimizer states as Megatron FSDP "optim" (within
    # DDP's padding) and the same weights and gradients.
    ddp = MEM.estimate(parse(base.replace("--use-megatron-fsdp ", "")), "modelled").ranks[0]
    assert abs(ddp.bytes["optimizer_states"] - optim[2]) < 0.001 * optim[2]
    assert ddp.bytes["parameters"] >= optim[0] and ddp.bytes["gradients"] >= optim[1]


def test_fsdp_communication_rows():
    def rows(extra):
        rep = build_report(shlex.split(BASE + "--nproc_per_node 8 --global-batch-size 64 --bf16 " + extra))
        m = rep.cfg.num_microbatches
        return m, [(c.op, c.per_iteration, c.modelled) for c in rep.comm.collectives if c.dim == "dp"]
    m, zero3 = rows("--use-torch-fsdp2")
    assert m == 4
    assert zero3 == [("all-gather", m, True), ("all-gather", m, True), ("reduce-scatter", m, True)]
    _, no_reshard = rows("--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward")
    assert no_reshard == [("all-gather", m, True), ("reduce-scatter", m, True)]
    _, zero1 = rows("--use-distributed-optimizer --use-megatron-fsdp --data-parallel-sharding-strategy optim")
    assert zero1 == [("all-gather", 1, True), ("reduce-scatter", 1, True)]


@pytest.mark.parametrize("extra,message", [
    ("--use-torch-fsdp2 --use-distributed-optimizer", "not supported with MCore's distributed optimizer"),
    ("--use-torch-fsdp2 --pipeline-model-parallel-size 2", "not supported with pipeline parallelism"),
    ("--use-torch-fsdp2 --bf16 --fp16", "Only one of"),
    ("--data-parallel-sharding-strategy zero3", "invalid choice"),
])
def test_fsdp_validation(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse(extra)
    with pytest.raises(ConfigError, match="requires --untie-embeddings"):
        parse_args(shlex.split(BASE.replace("--untie-embeddings-and-output-weights ", "") + "--use-torch-fsdp2"))
