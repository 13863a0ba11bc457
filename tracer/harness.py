"""Built-in megatron-core training harness driven by a `TrainingConfig` (the same Megatron-LM flags).

Builds what Megatron-LM's pretrain_gpt.py builds, with megatron-core only: GPTModel (local spec, or the TE spec
when Transformer Engine is importable and selected), MoE, mock data, DDP, the Megatron optimizer (distributed or
not), `get_forward_backward_func()` (no pipelining / 1F1B / interleaved), recompute; then runs N iterations.
torch.distributed must already be initialised (tracer.profile does it). Scopes come from tracer.scopes.
"""
from __future__ import annotations

import gc

import dataclasses
import random
from dataclasses import dataclass, field
from functools import partial

import torch

from tracer import scopes

# Flags the harness needs that TrainingConfig does not carry (it lists them in `ignored_args`).
# dest -> (flag, type, default); defaults are Megatron-LM's, except lr (Megatron has none). The flags that shape
# TransformerConfig (fusions, softmax precision, ...) are TrainingConfig fields, parsed by estimator.args.
_EXTRA_FLAGS = {
    "lr": ("--lr", float, 1e-3),
    "min_lr": ("--min-lr", float, 0.0),
    "seed": ("--seed", int, 1234),
    "weight_decay": ("--weight-decay", float, 0.01),
    "clip_grad": ("--clip-grad", float, 1.0),
    "adam_beta1": ("--adam-beta1", float, 0.9),
    "adam_beta2": ("--adam-beta2", float, 0.999),
    "adam_eps": ("--adam-eps", float, 1e-8),
    "sgd_momentum": ("--sgd-momentum", float, 0.9),
    "init_method_std": ("--init-method-std", float, 0.02),
    "loss_scale": ("--loss-scale", float, None),
    "initial_loss_scale": ("--initial-loss-scale", float, 2.0 ** 32),
    "min_loss_scale": ("--min-loss-scale", float, 1.0),
    "loss_scale_window": ("--loss-scale-window", float, 1000),
    "hysteresis": ("--hysteresis", int, 2),
    "use_cpu_initialization": ("--use-cpu-initialization", bool, None),   # Megatron-LM: store_true, default None
    # Megatron-LM's manual garbage collection: automatic collection off (collected once before training), then a
    # collection every N iterations (0: never). Frees of cyclic garbage then no longer land at random points.
    "manual_gc": ("--manual-gc", bool, False),
    "manual_gc_interval": ("--manual-gc-interval", int, 0),
    # Megatron-LM makes gloo copies of the data-parallel groups (checkpointing) unless told not to; a fake process
    # group cannot host them (tracer.fake_world passes this flag).
    "disable_gloo_process_groups": ("--disable-gloo-process-groups", bool, False),
}


def extra_flags(ignored_args: list[str]) -> dict:
    """Values of the harness-only flags (see _EXTRA_FLAGS) found among TrainingConfig.ignored_args."""
    by_flag = {flag: (dest, typ) for dest, (flag, typ, _) in _EXTRA_FLAGS.items()}
    out = {dest: default for dest, (_, _, default) in _EXTRA_FLAGS.items()}
    toks = list(ignored_args)
    for i, tok in enumerate(toks):
        flag, eq, inline = tok.partition("=")
        if flag not in by_flag:
            continue
        dest, typ = by_flag[flag]
        if typ is bool:
            out[dest] = True
            continue
        raw = inline if eq else (toks[i + 1] if i + 1 < len(toks) else None)
        if raw is None:
            raise ValueError(f"argument {flag}: expected one argument")
        try:
            out[dest] = typ(raw)
        except ValueError:
            raise ValueError(f"argument {flag}: invalid {typ.__name__} value: {raw!r}") from None
    return out


@dataclass
class HarnessResult:
    losses: list                    # mean lm loss per iteration (last pipeline stage), else None entries
    coords: dict                    # {"tp","cp","ep","dp","pp"} of this rank
    iteration_seconds: list = field(default_factory=list)
    skipped_iterations: int = 0     # fp16 loss-scale skips
    kernels: dict = field(default_factory=dict)   # kernel family per switch (estimator.formulas.kernels)


def _dtype(cfg) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.params_dtype, torch.float32)


def _use_te(cfg) -> bool:
    if cfg.transformer_impl != "transformer_engine" or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def model_parallel_kwargs(cfg) -> dict:
    """megatron-core's initialize_model_parallel arguments for a TrainingConfig."""
    return dict(tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
                context_parallel_size=cfg.context_parallel_size,
                expert_model_parallel_size=cfg.expert_model_parallel_size,
                expert_tensor_parallel_size=cfg.expert_tensor_parallel_size)


def init_parallel(cfg, seed: int, gloo_groups: bool = True) -> None:
    """megatron parallel_state + seeds, as Megatron-LM's initialize_megatron does."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(**model_parallel_kwargs(cfg), create_gloo_process_groups=gloo_groups)
    # Megatron-LM's _set_random_seed: offset by pipeline rank so stages differ.
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def coords() -> dict:
    from megatron.core import parallel_state as ps
    return {"tp": ps.get_tensor_model_parallel_rank(), "cp": ps.get_context_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank()}


def megatron_lm_kwargs(cfg, extra: dict) -> dict:
    """TransformerConfig arguments as Megatron-LM's core_transformer_config_from_args makes them from the same command
    line (megatron/training/arguments.py of megatron-core 0.16.1): every TransformerConfig field that is also an
    argparse dest is copied (TrainingConfig holds Megatron-LM's dests and their values after validate_args), then a
    few are set explicitly. Device-independent: transformer_config() turns off what this machine cannot run."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.enums import AttnBackend

    known = {f.name for f in dataclasses.fields(config_class(cfg))}
    kw = {k: v for k, v in dataclasses.asdict(cfg).items() if k in known}
    if cfg.rope_type is None:
        kw.pop("rope_type", None)    # as Megatron-LM: the config class's default (yarn under MLA, else rope)
    kw.update(
        # dests TrainingConfig names differently, or keeps as text / harness-only flags
        layernorm_epsilon=cfg.norm_epsilon,                 # --norm-epsilon (dest layernorm_epsilon there)
        attention_backend=AttnBackend[cfg.attention_backend],
        params_dtype=_dtype(cfg),
        init_method_std=extra["init_method_std"],
        use_cpu_initialization=extra["use_cpu_initialization"],
        inference_sampling_seed=extra["seed"],
        cp_comm_type="p2p",                                 # --cp-comm-type's default ['p2p'], unpacked
        # set explicitly by core_transformer_config_from_args
        persist_layer_norm=not cfg.no_persist_layer_norm,
        deallocate_pipeline_outputs=True,
        pipeline_dtype=_dtype(cfg),
        batch_p2p_comm=not cfg.overlap_p2p_comm,
        num_moe_experts=cfg.num_experts,
        num_layers_in_first_pipeline_stage=cfg.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=cfg.decoder_last_pipeline_num_layers,
        gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else squared_relu if cfg.squared_relu else F.gelu,
        bias_activation_fusion=cfg.bias_swiglu_fusion if cfg.swiglu else cfg.bias_gelu_fusion,
        num_query_groups=cfg.num_query_groups if cfg.group_query_attention else None,
    )
    return kw


# What transformer_config() sets differently from Megatron-LM, and only here. The one deliberate difference:
# fused kernels that cannot run on this machine are off (Megatron-LM would stop with an error; a GPU run has to
# pass the matching --no-* flag there). On CPU that is every fused CUDA kernel, so a CPU trace measures the unfused
# paths; the CPU run also creates weights on CPU and, over gloo, sends pipeline tensors without overlap.
CPU_OVERRIDES = dict(bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                     apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                     moe_permute_fusion=False, use_cpu_initialization=True,
                     # gloo sends read their buffer asynchronously, while the interleaved schedule's overlapped p2p
                     # frees (deallocate_pipeline_outputs) the sent output right away: the peer then receives
                     # garbage (NaN loss).
                     overlap_p2p_comm=False, batch_p2p_comm=True)


def _gpu_overrides(cfg) -> dict:
    """On a GPU: kernels whose extension megatron-core checks for when it builds the model."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel import layers

    out = {}
    if not layers._grad_accum_fusion_available:     # apex's fused_weight_gradient_mlp_cuda
        out["gradient_accumulation_fusion"] = False
    if not (_use_te(cfg) or gpt_layer_specs.HAVE_APEX):  # the local spec's torch norm refuses persist_layer_norm
        out["persist_layer_norm"] = False
    # TransformerConfig refuses RoPE fusion without TE's kernel, and megatron's softmax imports its extension when
    # it runs: built without them, the stand-ins (tracer.standins) turn them back on after construction.
    from tracer.standins import rope_kernel_present, softmax_kernel_present
    if not rope_kernel_present():
        out["apply_rope_fusion"] = False
    if not softmax_kernel_present():
        out["masked_softmax_fusion"] = False
    return out


def config_class(cfg):
    """TransformerConfig, or MLATransformerConfig under --multi-latent-attention (as Megatron-LM picks it)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    return MLATransformerConfig if cfg.multi_latent_attention else TransformerConfig


def transformer_config(cfg, extra: dict):
    """The TransformerConfig Megatron-LM builds for the same flags (megatron_lm_kwargs), less the kernels this
    machine cannot run (CPU_OVERRIDES / _gpu_overrides)."""
    kw = megatron_lm_kwargs(cfg, extra)
    kw.update(CPU_OVERRIDES if on_cpu() else _gpu_overrides(cfg))
    return config_class(cfg)(**kw)


def _layer_spec(cfg, tconfig, vp_stage, te: bool):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cfg.is_moe:
        return specs.get_gpt_decoder_block_spec(tconfig, use_transformer_engine=te,
                                                normalization=cfg.normalization, qk_l2_norm=cfg.qk_l2_norm,
                                                vp_stage=vp_stage)
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(None, False, cfg.qk_layernorm,
                                                                cfg.multi_latent_attention, qk_l2_norm=cfg.qk_l2_norm)
    return specs.get_gpt_layer_local_spec(None, False, cfg.qk_layernorm, cfg.multi_latent_attention,
                                          normalization=cfg.normalization, qk_l2_norm=cfg.qk_l2_norm)


def build_model(cfg, tconfig, te: bool | None = None) -> list:
    """One GPTModel per virtual pipeline chunk, wrapped like Megatron-LM: Float16Module, then DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    vp = cfg.virtual_pipeline_model_parallel_size
    with scopes.scope("setup:model"):
        te = _use_te(cfg) if te is None else te     # the TE spec: real, or stand-ins (tracer.standins)
        chunks = [_gpt_model(cfg, tconfig, i if vp else None, te) for i in range(vp or 1)]
        if not on_cpu():   # as Megatron-LM's get_model: modules built on CPU (position embeddings, stand-in norms)
            chunks = [m.cuda(torch.cuda.current_device()) for m in chunks]
        if cfg.bf16 or cfg.fp16:
            chunks = [Float16Module(tconfig, m) for m in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=cfg.overlap_grad_reduce, overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    with scopes.scope("setup:ddp"):   # DDP allocates the contiguous main_grad buffers
        return [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
                for i, m in enumerate(chunks)]


def _gpt_model(cfg, tconfig, stage, te: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = _layer_spec(cfg, tconfig, stage, te)
    # as pretrain_gpt.py: the MTP block (on the loss's stage) repeats the decoder's last layer spec
    mtp = get_gpt_mtp_block_spec(tconfig, spec, use_transformer_engine=te, vp_stage=stage) \
        if cfg.mtp_num_layers else None
    return GPTModel(
        config=tconfig, transformer_layer_spec=spec, mtp_block_spec=mtp,
        vocab_size=cfg.padded_vocab_size, max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        parallel_output=True,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type, rotary_percent=cfg.rotary_percent,
        vp_stage=stage)


def build_optimizer(cfg, extra: dict, model: list):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    oc = OptimizerConfig(
        optimizer=cfg.optimizer, lr=extra["lr"], min_lr=extra["min_lr"], weight_decay=extra["weight_decay"],
        adam_beta1=extra["adam_beta1"], adam_beta2=extra["adam_beta2"], adam_eps=extra["adam_eps"],
        sgd_momentum=extra["sgd_momentum"], fp16=cfg.fp16, bf16=cfg.bf16, params_dtype=_dtype(cfg),
        loss_scale=extra["loss_scale"], initial_loss_scale=extra["initial_loss_scale"],
        min_loss_scale=extra["min_loss_scale"], loss_scale_window=extra["loss_scale_window"],
        hysteresis=extra["hysteresis"], clip_grad=extra["clip_grad"],
        use_distributed_optimizer=cfg.use_distributed_optimizer, overlap_param_gather=cfg.overlap_param_gather)
    return get_megatron_optimizer(oc, model, use_gloo_process_groups=not extra["disable_gloo_process_groups"])


@dataclass(frozen=True)
class MockMicrobatch:
    """What the mock data iterator yields for one microbatch: which samples it holds. get_batch builds the tensors,
    as Megatron-LM's get_batch copies the data loader's batch to the device inside the forward step."""
    first_sample: int
    seed: int
    s: int
    b: int
    v: int


def mock_batches(cfg, seed: int, iteration: int, num_microbatches: int):
    """Deterministic learnable mock data: each sample counts up from a random start (next token = token + 1).
    Samples depend only on their index in the global batch, so TP/PP layouts see identical data, DP ranks disjoint
    data, and every iteration the same global batch (a falling loss then shows that training works)."""
    from megatron.core import parallel_state as ps

    s, b, v = cfg.seq_length, cfg.micro_batch_size, cfg.vocab_size or cfg.padded_vocab_size
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    for mb in range(num_microbatches):
        yield MockMicrobatch((mb * dp + dp_rank) * b, seed, s, b, v)


def _device():
    return "cpu" if on_cpu() else torch.cuda.current_device()


def get_batch(data_iterator, with_data: bool) -> dict:
    """The device tensors of Megatron-LM's get_batch (pretrain_gpt.py; TP rank 0 copies all five, contiguous, as
    the data loader collates them): tokens, labels, loss_mask, a [b, 1, s, s] causal attention mask (True = masked
    out; GPT datasets build it by default) and position_ids, for chunks that hold the embedding or the loss.

    Each is built inside a `data:<what>` scope, so the parser measures what the model keeps of the batch per
    microbatch (FORMATS 2.3): `data:tokens` (tokens, position ids: read by the embedding), `data:labels` (labels,
    loss mask: read by the loss), `data:mask`. Chunks holding neither get only the attention mask: Megatron-LM
    passes None there, but megatron-core then builds its default causal mask on "cuda", which cannot run on CPU."""
    dev = _device()
    mb = next(data_iterator)
    s, b, v = mb.s, mb.b, mb.v
    batch = dict.fromkeys(("tokens", "labels", "loss_mask", "position_ids"))
    if with_data:
        with scopes.scope("data:tokens"):
            g = torch.Generator().manual_seed(mb.seed * 1_000_003 + mb.first_sample)
            starts = torch.randint(0, v, (b, 1), generator=g).to(dev)
            batch["tokens"] = (starts + torch.arange(s, device=dev)) % v
            batch["position_ids"] = torch.arange(s, device=dev).repeat(b, 1)
        with scopes.scope("data:labels"):
            batch["labels"] = (batch["tokens"] + 1) % v
            batch["loss_mask"] = torch.ones(b, s, device=dev)
    with scopes.scope("data:mask"):
        batch["attention_mask"] = torch.ones(b, 1, s, s, dtype=torch.bool, device=dev).triu_(1)
    return batch


def _holds_data(model) -> bool:
    """Whether a (wrapped) model chunk holds the embedding or the loss: Megatron-LM's get_batch feeds only those."""
    while hasattr(model, "module"):
        model = model.module
    return bool(getattr(model, "pre_process", True) or getattr(model, "post_process", True))


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's pretrain_gpt loss: the masked loss sum, the microbatch's token count and the report [sum, tokens];
    the schedule divides the sum by the tokens and the microbatches unless --calculate-per-token-loss."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = get_batch(data_iterator, _holds_data(model))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"])    # as pretrain_gpt.py (read by multi-token prediction only)
    # The cross entropy runs inside GPTModel (compute_language_model_loss, scoped `loss` by tracer.scopes).
    return output, partial(loss_func, batch["loss_mask"])


def _mean_loss(losses_reduced: list):
    """Mean lm loss per token over microbatches and data-parallel ranks (as Megatron-LM reports it); last stage only."""
    from megatron.core import parallel_state as ps
    if not losses_reduced:
        return None
    total = torch.stack([d["lm loss"] for d in losses_reduced]).sum(dim=0)   # [loss sum, tokens]
    torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(total[0] / total[1])


def run(cfg, iterations: int = 3, extra: dict | None = None, on_setup=None,
        gpu_kernels: bool | None = None) -> HarnessResult:
    """Set up the model and optimizer, then train `iterations` iterations with iter/fwd/bwd/... scopes.
    gpu_kernels: run the kernel families a GPU runs for these flags, stand-ins where the real kernel is missing
    (tracer.standins); else the local spec without fused kernels (estimator.formulas.CPU_KERNELS). None (default):
    the device's own, so a GPU run always runs the GPU's kernels, traced or not."""
    import time

    from megatron.core import parallel_state as ps
    from megatron.core import distributed as mdist
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core.pipeline_parallel import get_forward_backward_func

    extra = extra if extra is not None else extra_flags(cfg.ignored_args)
    scopes.patch_megatron()
    # Setup: weights, DDP grad buffers and optimizer state are allocated here (before the setup_done mark);
    # setup:* scopes let the parser tell them apart.
    init_parallel(cfg, extra["seed"], not extra["disable_gloo_process_groups"])
    if nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        init_num_microbatches_calculator(torch.distributed.get_rank(), None, cfg.global_batch_size,
                                         cfg.micro_batch_size, ps.get_data_parallel_world_size())
    tconfig = transformer_config(cfg, extra)
    from estimator.formulas import CPU_KERNELS, collectives
    kernels = dict(CPU_KERNELS)
    if gpu_kernels or (gpu_kernels is None and not on_cpu()):
        from tracer import standins
        kernels = standins.install(tconfig, cfg, on_gpu=not on_cpu())
    kernels["fuse_bda"] = bool(tconfig.bias_dropout_fusion)    # what runs (CPU_OVERRIDES turn it off on CPU)
    # gloo stages its own buffers; NCCL and the fake process group work on the tensors they are handed
    kernels["collectives"] = collectives(torch.distributed.get_backend())
    model = build_model(cfg, tconfig, kernels["spec"] == "te")
    with scopes.scope("setup:optimizer"):
        optimizer = scopes.wrap_optimizer(build_optimizer(cfg, extra, model))
    tconfig.grad_scale_func = optimizer.scale_loss
    # patch_megatron() already scoped megatron.core.distributed.finalize_model_grads as `grad_sync`.
    tconfig.finalize_model_grads_func = mdist.finalize_model_grads
    if cfg.overlap_grad_reduce:
        nsf = [m.no_sync for m in model]
        tconfig.no_sync_func = nsf[0] if len(nsf) == 1 else nsf
    scopes.mark("setup_done")
    result = HarnessResult(losses=[], coords=coords(), kernels=kernels)
    if on_setup is not None:
        on_setup(result)

    fwd_bwd = get_forward_backward_func()
    nmb = cfg.num_microbatches
    if extra["manual_gc"]:
        gc.disable()
        gc.collect()
    for it in range(iterations):
        if extra["manual_gc"] and extra["manual_gc_interval"] and it and it % extra["manual_gc_interval"] == 0:
            gc.collect()
        t0 = time.perf_counter()
        scopes.new_iteration()
        with scopes.scope(f"iter:{it}"):
            for m in model:
                m.train()
                m.zero_grad_buffer()
            optimizer.zero_grad()
            data = [mock_batches(cfg, extra["seed"], it, nmb) for _ in model]
            losses = fwd_bwd(forward_step_func=forward_step,
                             data_iterator=data if len(model) > 1 else data[0],
                             model=model if len(model) > 1 else model[0],
                             num_microbatches=nmb, seq_length=cfg.seq_length,
                             micro_batch_size=cfg.micro_batch_size, forward_only=False)
            ok, _grad_norm, _ = optimizer.step()
        scopes.mark(f"iter_end:{it}")
        result.skipped_iterations += 0 if ok else 1
        result.losses.append(_mean_loss(losses) if ps.is_pipeline_last_stage(ignore_virtual=True) else None)
        result.iteration_seconds.append(time.perf_counter() - t0)
    return result
