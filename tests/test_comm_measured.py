"""Collectives measured in real megatron-core training (CPU, gloo) equal estimator.comm's prediction.

Each case launches one process per rank running this file as a script: a tiny GPTModel (local spec), megatron DDP,
the Megatron optimizer and the 1F1B schedule, with torch.distributed's collectives wrapped to log op, group, dtype
and bytes. Only calls made inside training iterations are logged (setup broadcasts are not part of an iteration).
"""

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 2
# Small, but every dimension distinct so a wrong shape cannot match by accident.
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
             micro_batch_size=2, vocab_size=250, make_vocab_size_divisible_by=128)
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=4, v_head_dim=8)


# ------------------------------------------------------------------------------------------------ worker side
_LOG: list = []
_RECORDING = [False]
_DEPTH = [0]  # nesting of wrapped calls (collectives are issued from the main thread)


def _install_recorders():
    """Wrap torch.distributed collectives before megatron imports them (some are captured at import time)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d


    def nbytes(t):
        return t.numel() * t.element_size()

    def ranks(group):
        return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))

    def wrap(name, op, tensor_arg, group_pos, size_of=nbytes):
        orig = getattr(c10d, name)

        def wrapper(*args, **kwargs):
            # c10d re-dispatches through the public API when a TorchFunctionMode is active: log the outer call only.
            if _RECORDING[0] and not _DEPTH[0]:
                t = args[tensor_arg] if len(args) > tensor_arg else kwargs.get(("tensor", "output_tensor",
                                                                              "output")[min(tensor_arg, 2)])
                group = kwargs.get("group", args[group_pos] if len(args) > group_pos else None)
                _LOG.append({"op": op, "group": ranks(group), "bytes": size_of(t), "dtype": str(t.dtype),
                             "shape": list(t.shape)})
            _DEPTH[0] += 1
            try:
                return orig(*args, **kwargs)
            finally:
                _DEPTH[0] -= 1

        setattr(c10d, name, wrapper)  # c10d globals: P2POp's op check and batch_isend_irecv see the wrapper
        setattr(dist, name, wrapper)

    # The full (gathered / unscattered) tensor is the message size for all-gather and reduce-scatter.
    wrap("all_reduce", "all-reduce", 0, 2)
    wrap("all_gather_into_tensor", "all-gather", 0, 2)
    wrap("_all_gather_base", "all-gather", 0, 2)
    wrap("reduce_scatter_tensor", "reduce-scatter", 1, 3)
    wrap("_reduce_scatter_base", "reduce-scatter", 1, 3)
    wrap("broadcast", "broadcast", 0, 2)
    wrap("all_to_all_single", "all-to-all", 1, 4)
    for name, op in (("isend", "send"), ("irecv", "recv"), ("send", "send"), ("recv", "recv")):
        wrap(name, op, 0, 2)
    orig_ag = c10d.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if _RECORDING[0] and not _DEPTH[0]:
            _LOG.append({"op": "all-gather", "group": ranks(group), "bytes": nbytes(tensor) * len(tensor_list),
                         "dtype": str(tensor.dtype), "shape": [len(tensor_list)] + list(tensor.shape)})
        _DEPTH[0] += 1
        try:
            return orig_ag(tensor_list, tensor, group=group, async_op=async_op)
        finally:
            _DEPTH[0] -= 1

    c10d.all_gather = dist.all_gather = all_gather


def _worker(case: dict, out: str):
    import warnings

    warnings.filterwarnings("ignore")
    _install_recorders()
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from tracer import megatron_compat

    megatron_compat.install()
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly (no recursion).
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(seed)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    dist.init_process_group("gloo")
    tp, pp = case["tensor_model_parallel_size"], case["pipeline_model_parallel_size"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    m = MODEL
    kw = dict(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=case["sequence_parallel"],
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False)
    if case["mla"]:
        # multi-latent attention builds only with the TE spec: its CPU stand-ins (tracer.standins)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        from tracer.standins import _install_te_spec
        _install_te_spec()
        # (Megatron-LM passes its --normalization default, LayerNorm; MLATransformerConfig alone would take RMSNorm)
        config = MLATransformerConfig(**kw, **MLA, qk_layernorm=True, apply_rope_fusion=False,
                                      normalization="LayerNorm")
        spec = get_gpt_layer_with_transformer_engine_spec(None, False, True, True)
    else:
        config, spec = TransformerConfig(**kw, mtp_num_layers=case["mtp"]), get_gpt_layer_local_spec()
    padded_vocab = case["padded_vocab_size"]
    mtp_spec = None
    if case["mtp"]:     # as pretrain_gpt.py: the MTP block on the last stage repeats the layer spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab, mtp_block_spec=mtp_spec,
                     max_sequence_length=m["max_position_embeddings"], pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=True,
                     position_embedding_type=case["position_embedding_type"])
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=case["use_distributed_optimizer"],
                                               overlap_grad_reduce=False, grad_reduce_in_fp32=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=case["use_distributed_optimizer"]),
        [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync

    s, b = m["seq_length"], m["micro_batch_size"]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, m["vocab_size"], (b, s + 1), generator=gen)
            yield tokens[:, :-1], tokens[:, 1:]

    def forward_step(data_iterator, model_):
        tokens, labels = next(data_iterator)
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        out = model_(tokens, pos, mask, labels=labels, loss_mask=torch.ones(b, s))

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    it = batches()
    log_per_iter = []
    for _ in range(ITERATIONS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _RECORDING[0] = True
        fwd_bwd(forward_step_func=forward_step, data_iterator=it, model=[model],
                num_microbatches=case["num_microbatches"], seq_length=s, micro_batch_size=b, forward_only=False)
        optimizer.step()
        _RECORDING[0] = False
        log_per_iter.append(list(_LOG))
        _LOG.clear()
    # The rank's parameters as DDP sees them, so the DP prediction is checked on megatron's own parameter list.
    params = [[p.numel(), not getattr(p, "allreduce", True), bool(getattr(p, "shared_embedding", False))]
              for p in model.module.parameters() if p.requires_grad]
    Path(out).write_text(json.dumps({"rank": dist.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                                     "params": params, "iterations": log_per_iter}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ test side
def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_case(case: dict, tmp_path: Path) -> list:
    world = case["world_size"]
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(case), str(tmp_path / f"r{r}.json")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


def _case(tp=1, pp=1, dp=1, sp=False, dist_opt=False, microbatches=2, rope=False, mla=False, mtp=None):
    from estimator.args import parse_args

    argv = [f"--nproc_per_node={tp * pp * dp}", f"--tensor-model-parallel-size={tp}",
            f"--pipeline-model-parallel-size={pp}",
            "--transformer-impl=" + ("transformer_engine" if mla else "local"),
            f"--global-batch-size={MODEL['micro_batch_size'] * dp * microbatches}"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    argv += ["--sequence-parallel"] * sp + ["--use-distributed-optimizer"] * dist_opt
    argv += ["--hidden-dropout=0", "--attention-dropout=0"] + ["--position-embedding-type=rope"] * (rope or mla)
    if mla:
        argv += ["--multi-latent-attention", "--qk-layernorm"]
        argv += [f"--{k.replace('_', '-')}={v}" for k, v in MLA.items()]
    argv += [f"--mtp-num-layers={mtp}"] * bool(mtp)
    cfg = parse_args(argv)
    case = {k: getattr(cfg, k) for k in ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                                         "sequence_parallel", "use_distributed_optimizer", "num_microbatches",
                                         "padded_vocab_size", "position_embedding_type")}
    case["mla"], case["mtp"] = mla, mtp
    return cfg, case


def _key(op, group, nbytes):
    return (op, tuple(group), int(nbytes))


def _measured_counter(records):
    # group size 1 collectives move nothing; the estimator lists only real communication.
    return Counter(_key(r["op"], r["group"], r["bytes"]) for r in records if len(r["group"]) > 1)


def _predicted_counter(report, rank):
    c = Counter()
    for coll in report.collectives:
        if rank in coll.ranks and coll.group_size > 1:
            group = next(g for g in coll.groups if rank in g)
            for op in coll.measured_ops():
                c[_key(op, group, coll.bytes)] += coll.per_iteration
    return c


CASES = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "tp2_sp_rope": dict(tp=2, sp=True, rope=True),   # the embedding reduce-scatters (no position embedding)
    "pp2": dict(pp=2, microbatches=3),
    "dp2_distopt": dict(dp=2, dist_opt=True),
    "dp2": dict(dp=2),
    # multi-latent attention: the latents gathered for the up projections, the rotary key part, replicated down
    # projections' gradients reduced over TP under SP
    "mla_tp2_sp": dict(tp=2, sp=True, mla=True),
    "mla_tp2": dict(tp=2, mla=True),
    # multi-token prediction: its embedding, projection, layer and loss head on the last stage; over PP the last
    # stage's output weight joins the embedding group's all-reduce
    "mtp_tp2_sp": dict(tp=2, sp=True, mtp=1),
    "mtp_tp2": dict(tp=2, mtp=1),
    "mtp_pp2": dict(pp=2, microbatches=3, mtp=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_measured_collectives_equal_prediction(name, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from estimator.comm import communication
    from estimator.static_memory import ParamInfo

    cfg, case = _case(**CASES[name])
    results = _run_case(case, tmp_path)
    chunks = {res["pp_rank"]: [[ParamInfo(*p) for p in res["params"]]] for res in results}
    report = communication(cfg, chunks_by_stage=chunks)
    for res in results:
        rank = res["rank"]
        first, second = (_measured_counter(it) for it in res["iterations"])
        assert first == second, f"rank {rank}: iterations differ"
        predicted = _predicted_counter(report, rank)
        missing, extra = predicted - first, first - predicted
        assert not missing and not extra, f"{name} rank {rank}: predicted-not-seen {dict(missing)} " \
                                          f"seen-not-predicted {dict(extra)}"


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), sys.argv[2])


def test_report_structure_and_ring_factors():
    """No processes: the JSON shape the report renders, and the wire-byte arithmetic on a 2x2x2 grid."""
    import subprocess as sp_

    cfg, _ = _case(tp=2, pp=2, dp=2, sp=True, dist_opt=True)
    from estimator.comm import communication, ring_factor

    rep = communication(cfg).to_dict()
    assert rep["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and rep["groups"]["pp"][0] == [0, 4]
    assert rep["groups"]["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for c in rep["collectives"]:
        assert c["wire_bytes_per_call"] == round(c["bytes"] * ring_factor(c["op"], c["group_size"])) or \
            c["direction"] == "recv"
        assert c["cluster_bytes_per_iteration"] == c["wire_bytes_per_iteration"] * len(c["ranks"])
    assert {"tp", "pp", "embedding", "optimizer"} <= set(rep["summary"])
    # The estimator side never imports torch or megatron.
    code = "import sys, estimator.comm, estimator.parallel; sys.exit('torch' in sys.modules or 'megatron' in sys.modules)"
    assert sp_.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
