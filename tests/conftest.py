"""Shared pytest helpers: build the real megatron-core GPTModel on CPU and count its parameters per op.

Real process groups, no faked rank coordinates: `run_on_gloo_world` spawns `world` processes with gloo, each runs
megatron's parallel_state.initialize_model_parallel for every case and builds its own model chunks with the local
spec (the only spec that builds without Transformer Engine). `use_cpu_initialization=True` keeps weight creation
on CPU, which is all megatron-core 0.16.1 needs to build (not train) a model without CUDA.
"""
from __future__ import annotations

import os
import queue
import re
import socket
import traceback



def pytest_collection_modifyitems(config, items):
    """Tests that drive megatron-core (seconds to minutes each) first, in their order: the workers hand tests out
    in this order, so the long runs start at once and the thousands of quick ones fill the end (on two workers
    the suite otherwise ended with one of them running a minutes-long test alone)."""
    items.sort(key=lambda item: item.get_closest_marker("megatron") is None)


_LAYER_PATH = re.compile(r"^(?:module\.)*(?:decoder\.)?layers\.(\d+)\.(.*)$")
_EXPERT_PATH = re.compile(r"^mlp\.experts\.local_experts\.\d+\.(.*)$")
_MTP_PATH = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Transformer Engine's spec fuses a norm into the linear after it (its layer_norm_weight / layer_norm_bias); the
# estimator names such a norm as the local spec's module (estimator.model).
_TE_FUSED_NORMS = {"self_attention.linear_qkv": "input_layernorm", "mlp.linear_fc1": "pre_mlp_layernorm",
                   "self_attention.linear_q_up_proj": "self_attention.q_layernorm",
                   "self_attention.linear_kv_up_proj": "self_attention.kv_layernorm"}


def op_of_param(name: str, chunk_layers: list[int], num_layers: int = 0) -> tuple[str, int | None]:
    """'decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight' -> ('layers.*.mlp.experts.linear_fc1', L)."""
    module, param = name.rsplit(".", 1)
    for linear, norm in _TE_FUSED_NORMS.items():
        if param.startswith("layer_norm_") and module.endswith("." + linear):
            module = module[:-len(linear)] + norm
    module = re.sub(r"^(?:module\.)+", "", module)
    mtp = _MTP_PATH.match(module)
    if mtp:     # multi-token prediction's layers, numbered after the decoder's (estimator.model.mtp_ops)
        rest = mtp.group(2)
        expert = _EXPERT_PATH.match(rest.replace("transformer_layer.", "", 1))
        if expert:
            rest = "transformer_layer.mlp.experts." + expert.group(1)
        return "mtp.layers.*." + rest, num_layers + int(mtp.group(1))
    match = _LAYER_PATH.match(module)
    if not match:
        return module.replace("decoder.", ""), None
    local_index, rest = int(match.group(1)), match.group(2)
    expert = _EXPERT_PATH.match(rest)
    if expert:
        rest = "mlp.experts." + expert.group(1)
    return "layers.*." + rest, chunk_layers[local_index]


def transformer_config(cfg):
    """megatron-core TransformerConfig for a TrainingConfig (what Megatron-LM's core_transformer_config_from_args
    sets for the fields that shape parameters)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias,
        normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size, sequence_parallel=cfg.sequence_parallel,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
        num_layers_in_first_pipeline_stage=cfg.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=cfg.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=cfg.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=cfg.account_for_loss_in_pipeline_split,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if cfg.swiglu:
        kwargs.update(activation_func=F.silu, gated_linear_unit=True)
    if cfg.quick_geglu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        kwargs.update(activation_func=quick_gelu, gated_linear_unit=True)
    if cfg.squared_relu:
        from megatron.core.activations import squared_relu
        kwargs.update(activation_func=squared_relu)
    if cfg.softmax_type != "vanilla":
        kwargs.update(softmax_type=cfg.softmax_type)
    if cfg.attention_output_gate:
        kwargs.update(attention_output_gate=True)
    if cfg.pipeline_model_parallel_layout is not None:
        kwargs.update(pipeline_model_parallel_layout=cfg.pipeline_model_parallel_layout)
    if cfg.mtp_num_layers:
        kwargs.update(mtp_num_layers=cfg.mtp_num_layers)
    if cfg.num_experts:
        kwargs.update(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
                      moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_layer_freq=cfg.moe_layer_freq,
                      moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                      moe_shared_expert_gate=cfg.moe_shared_expert_gate,
                      moe_grouped_gemm=False,
                      # Dispatchers hold no parameters; alltoall's constructor needs a CUDA stream, allgather's not.
                      moe_token_dispatcher_type="allgather")
    if cfg.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        kwargs.update(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                      qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
                      v_head_dim=cfg.v_head_dim)
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


TP_REPLICATED = ("<grads all-reduced over TP>", None)   # a key of megatron_param_counts beside the ops'


def megatron_param_counts(cfg, pp_rank: int) -> dict:
    """{(op, layer): numel} over every model chunk this process builds for pipeline rank `pp_rank`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = transformer_config(cfg)
    # MLA only builds with Transformer Engine's spec (megatron-core's local attention takes no k_channels): its
    # modules' CPU stand-ins (tracer.standins) hold TE's parameters
    te = cfg.multi_latent_attention or cfg.transformer_impl == "transformer_engine"
    if te:
        from tracer.standins import _install_te_spec
        _install_te_spec()
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    last_pp = cfg.pipeline_model_parallel_size - 1
    counts: dict = {}
    for vp in range(vpp):
        vp_stage = vp if cfg.virtual_pipeline_model_parallel_size else None
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=cfg.normalization,
                                          qk_l2_norm=cfg.qk_l2_norm, vp_stage=vp_stage, pp_rank=pp_rank)
        # as pretrain_gpt.py: the MTP block (on the loss's stage) repeats the decoder's last layer spec
        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=te, vp_stage=vp_stage, pp_rank=pp_rank) \
            if cfg.mtp_num_layers else None
        model = GPTModel(mtp_block_spec=mtp,
            config=config, transformer_layer_spec=spec, vocab_size=cfg.padded_vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=pp_rank == 0 and vp == 0, post_process=pp_rank == last_pp and vp == vpp - 1,
            share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type, vp_stage=vp_stage,
        )
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        chunk_layers = [offset + i for i in range(get_num_layers_to_build(config, vp_stage, pp_rank))]
        for name, param in model.named_parameters():
            key = op_of_param(name, chunk_layers, cfg.num_layers)
            counts[key] = counts.get(key, 0) + param.numel()
            # the gradients megatron-core all-reduces over TP after the backward (finalize_model_grads.
            # _allreduce_non_tensor_model_parallel_grads; summed where sequence parallelism or qk-layernorm tags them)
            if cfg.tensor_model_parallel_size > 1 and param.requires_grad and (
                    (config.sequence_parallel and getattr(param, "sequence_parallel", False))
                    or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))):
                counts[TP_REPLICATED] = counts.get(TP_REPLICATED, 0) + param.numel()
    return counts


def _worker(rank: int, world: int, port: int, cases: list, results) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tracer.harness import model_parallel_kwargs

    # The one CUDA call on the build path: LanguageModule moves the tied embedding copy to CUDA before its
    # first-stage/last-stage all-reduce. This process only builds models, so a no-op .cuda() is enough
    # (tracer/megatron_compat.py is the full shim for training).
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # The learnable softmax offset is created on torch.cuda.current_device(): build it on the CPU.
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case_id, cfg in cases:
            parallel_state.initialize_model_parallel(**model_parallel_kwargs(cfg))
            coords = {"tp": parallel_state.get_tensor_model_parallel_rank(),
                      "pp": parallel_state.get_pipeline_model_parallel_rank(),
                      "ep": parallel_state.get_expert_model_parallel_rank()}
            try:
                counts = megatron_param_counts(cfg, coords["pp"])
                results.put((case_id, rank, coords, counts, None))
            except Exception:  # reported to the parent test, which fails with it
                results.put((case_id, rank, coords, None, traceback.format_exc(limit=-4)))
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run_on_gloo_world(world: int, cases: list) -> list:
    """Build every (case_id, TrainingConfig) on a real `world`-process gloo group; one result per rank and case."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, cases, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    collected = []
    while len(collected) < world * len(cases):
        try:
            collected.append(results.get(timeout=5))
        except queue.Empty:
            # A worker that died (import error, crash) would otherwise leave the parent waiting forever.
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a gloo worker died with exit code {dead[0]}")
    for proc in procs:
        proc.join(timeout=60)
    return collected
