"""Sharded data parallelism: Megatron FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy) and torch FSDP2
(--use-torch-fsdp2). Modelled, not measured (no CPU trace covers them).

Megatron FSDP (megatron-core 0.16.1, megatron_fsdp.param_and_grad_buffer): one buffer each for the model weights
(param dtype), the main weights (fp32, 16-bit models) and the gradients (fp32 with fp32 reduction, else the param
dtype); the strategy says which are sharded over the data-parallel (x context-parallel) group:
  no_shard: none; optim: main weights (and the optimizer states on them); optim_grads: + gradients;
  optim_grads_params: + model weights, gathered per FSDP unit (a transformer layer, the embedding, the output layer)
  into temporary buckets just before use.
Torch FSDP2 (Megatron-LM's TorchFullyShardedDataParallel): fully_shard on each layer and the embedding, the
parameters (param dtype) and their gradients (param dtype) sharded; the Megatron optimizer keeps fp32 main params
and Adam states for the local shards (and, during the step, fp32 copies of 16-bit gradients). Expert parameters
shard over the expert-data-parallel group.

Temporaries (modelled, compute_bytes): while a unit computes, the next one is prefetched, so two units' gathered
weights are live from the first forward to the last backward and, in each backward, two units' unsharded gradients
(before their reduce-scatter); without resharding after forward (FSDP2) every unit's gathered weights stay from the
forward to its backward. None of them is left after the optimizer step.
"""
from __future__ import annotations

from estimator.static_memory import DTYPE_BYTES, StaticMemory, optimizer_bytes_per_param, precision

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def active(cfg) -> bool:
    return bool(getattr(cfg, "use_megatron_fsdp", False) or getattr(cfg, "use_torch_fsdp2", False))


def strategy(cfg) -> str:
    """What is sharded: FSDP2 shards everything (as optim_grads_params)."""
    return "optim_grads_params" if cfg.use_torch_fsdp2 else cfg.data_parallel_sharding_strategy


def validate(cfg) -> None:
    """Megatron-LM's checks (validate_args) for the two FSDP implementations, in its words."""
    from estimator.args import ConfigError  # args validates through this module
    if cfg.use_torch_fsdp2:
        checks = [
            (cfg.pipeline_model_parallel_size == 1, "--use-torch-fsdp2 is not supported with pipeline parallelism"),
            (cfg.expert_model_parallel_size == 1, "--use-torch-fsdp2 is not supported with expert parallelism"),
            (not cfg.use_distributed_optimizer, "--use-torch-fsdp2 is not supported with MCore's distributed "
                                                "optimizer"),
            (not cfg.gradient_accumulation_fusion, "--use-torch-fsdp2 is not supported with gradient accumulation "
                                                   "fusion"),
            (cfg.untie_embeddings_and_output_weights, "--use-torch-fsdp2 requires "
                                                      "--untie-embeddings-and-output-weights"),
            (not cfg.fp16, "--use-torch-fsdp2 not supported with fp16 yet"),
            (not cfg.use_megatron_fsdp, "--use-torch-fsdp2 and --use-megatron-fsdp cannot be used together"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if cfg.fp8_param_gather:
            # Megatron-LM turns it off with a warning (Transformer Engine >= 2.0 has no FSDP2 fp8 gather).
            cfg.fp8_param_gather = False
            cfg.warnings.append("FSDP2 FP8 param gather is not supported yet in TE 2.0, will fallback to bf16 "
                                "all_gather instead, turning off fp8_param_gather")


def units_in_flight(cfg) -> int:
    """Elements of the two largest FSDP units on a rank (a transformer layer, dense or MoE; the embedding; the final
    norm with the output layer, whose weight under tied embeddings on one stage is the embedding's): a unit computes
    while the next is prefetched, so at most two are gathered (or their gradients unsharded) at once. A bound over
    the whole model as this rank holds it (TP / EP shards), erring high for a stage that lacks the largest."""
    from estimator import model as M
    units = []
    pattern = [bool(x) for x in cfg.moe_layer_pattern()]
    for moe in (False, True):
        if moe in pattern:   # one unit per layer kind, at most two of it
            units += [sum(op.numel for op in M.layer_ops(cfg, pattern.index(moe)))] * min(pattern.count(moe), 2)
    units.append(sum(op.numel for op in M.head_ops(cfg, True)))
    units.append(sum(op.numel for op in M.tail_ops(cfg, cfg.pipeline_model_parallel_size == 1, True)))
    return sum(sorted(units)[-2:])


def _dtypes(cfg) -> tuple:
    """(param dtype, gradient dtype): FSDP2 has no main-grad buffer, its gradients are in the params' dtype."""
    pd, gd = precision(cfg)
    return (pd, pd) if cfg.use_torch_fsdp2 else (pd, gd)


def _reshards(cfg) -> bool:
    """Whether gathered weights are freed after each unit's forward (and gathered again for its backward)."""
    return not (cfg.use_torch_fsdp2 and not cfg.torch_fsdp2_reshard_after_forward)


def fsdp2_local_elements(cfg) -> int:
    """Parameter elements on the data-parallel rank that holds the most under torch FSDP2 (PP = 1): fully_shard
    splits every parameter on dim 0 into world chunks of ceil(rows / d) rows (torch.chunk), the first ranks' full."""
    from estimator import model as M
    d = cfg.data_parallel_size * cfg.context_parallel_size
    total = 0
    for op in M.rank_params(cfg, 0).ops:
        for shape in op.shapes:
            rest = 1
            for x in shape[1:]:
                rest *= x
            total += op.count * -(-shape[0] // d) * rest
    return total


def compute_bytes(cfg, chunks) -> tuple:
    """(bytes of gathered weights live while forward and backward run, bytes of unsharded gradients a backward
    adds on top): the temporary buckets, which megatron-core frees after use (TemporaryBucketAllocator), so none is
    left after the optimizer step (H100: a Megatron FSDP optim_grads_params run's allocated bytes after the step
    are its shards and runtime buffers alone, docs/ACCURACY.md). (0, 0) without sharded data parallelism."""
    if not active(cfg):
        return 0, 0
    pd, gd = _dtypes(cfg)
    how = strategy(cfg)
    two = units_in_flight(cfg)
    weights = grads = 0
    if how == "optim_grads_params":
        whole = sum(p[0] for chunk in chunks for p in chunk)
        weights = (two if _reshards(cfg) else whole) * DTYPE_BYTES[pd]
    if how in ("optim_grads", "optim_grads_params"):
        grads = two * DTYPE_BYTES[gd]
    return weights, grads


def apply(cfg, st: StaticMemory, chunks) -> StaticMemory:
    """The stage's static memory under sharded data parallelism (replaces the DDP buffers' numbers)."""
    pd, gd = _dtypes(cfg)
    pb, gb = DTYPE_BYTES[pd], DTYPE_BYTES[gd]
    how = strategy(cfg)
    dense = expert = 0
    for chunk in chunks:
        for p in chunk:
            if p[1]:
                expert += p[0]
            else:
                dense += p[0]
    d_dense = cfg.data_parallel_size * cfg.context_parallel_size
    d_expert = cfg.expert_data_parallel_size

    def sharded(on: bool) -> int:
        """Elements this rank keeps of a buffer sharded (or not) over the data-parallel groups."""
        if not on:
            return dense + expert
        if cfg.use_torch_fsdp2:
            return fsdp2_local_elements(cfg)
        return -(-dense // d_dense) + -(-expert // d_expert)

    weights = sharded(how == "optim_grads_params") * pb
    grads = sharded(how in ("optim_grads", "optim_grads_params")) * gb
    # fp32 main params of 16-bit weights, an fp32 copy of 16-bit gradients, Adam's two states (SGD: momentum).
    _, per_param = optimizer_bytes_per_param(cfg)
    # 16-bit gradients' fp32 copies exist during the step only (static_memory): in its transient
    copy = 4 if precision(cfg)[1] != "fp32" else 0
    per_param -= copy
    if cfg.use_torch_fsdp2 and pd != "fp32" and precision(cfg)[1] == "fp32":
        per_param += 4  # FSDP2's gradients are 16-bit: the optimizer keeps an fp32 copy of the shard
    state_elems = sharded(how != "no_shard")
    name = "torch FSDP2" if cfg.use_torch_fsdp2 else "Megatron FSDP"
    detail = dict(st.optimizer_detail, state_elements=state_elems, sharding=f"{name} {how} (modelled)",
                  fp32_grad_copy_bytes=copy * state_elems)
    update = st.optimizer_step_transient_bytes - st.optimizer_detail.get("fp32_grad_copy_bytes", 0)
    return StaticMemory(st.params, st.expert_params, int(weights), int(grads), int(per_param * state_elems), detail,
                        st.grad_buffer_numel, st.padding_elements, int(update + copy * state_elems))


def comm_rows(cfg, add_row, stage_params: dict) -> None:
    """The data-parallel collectives of one iteration under FSDP. add_row(op, what, group, elements, dtype,
    per_microbatch, per_iteration, stage, phase) appends one row; stage_params: stage -> (dense, expert)
    elements."""
    pd, gd = _dtypes(cfg)
    how = strategy(cfg)
    reshard = _reshards(cfg)
    for p, (dense, expert) in stage_params.items():
        for n, group, kind in ((dense, "dp-cp", ""), (expert, "expert-dp", "expert ")):
            if not n:
                continue
            if how == "optim_grads_params":
                add_row("all-gather", f"{kind}params before forward (FSDP)", group, n, pd, 1, None, p, "fwd")
                if reshard:
                    add_row("all-gather", f"{kind}params before backward (FSDP)", group, n, pd, 1, None, p, "bwd")
            elif how != "no_shard":
                add_row("all-gather", f"{kind}params after step (FSDP)", group, n, pd, 0, 1, p, "step")
            if how in ("optim_grads", "optim_grads_params"):
                add_row("reduce-scatter", f"{kind}grads (FSDP)", group, n, gd, 1, None, p, "bwd")
            elif how == "optim":
                add_row("reduce-scatter", f"{kind}grads (FSDP)", group, n, gd, 0, 1, p, "step")
            else:
                add_row("all-reduce", f"{kind}grads (FSDP)", group, n, gd, 0, 1, p, "step")
