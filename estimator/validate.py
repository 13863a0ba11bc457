"""Type, range and size checks on every number the estimator reads from a command line or a HF config.

One layer for the rules, so a value the estimator cannot model is refused with one line naming its flag before it
turns into a traceback, a hang or a negative byte count. Where Megatron-LM, megatron-core or torch refuse the same
value with a message of their own, that message is used (megatron-core's TransformerConfig accepts some values --
negative sizes, zero heads -- that fail later when the model is built; those are refused here with our words).
Combination rules (divisibility, recompute, MoE routing) stay in `args.validate`; this module knows single values
and the sizes no machine can run.
"""
from __future__ import annotations

import math

# Beyond any machine that exists or is planned: refused with a clear error instead of a MemoryError or a hang.
COUNT_LIMIT = 10 ** 7            # GPUs, layers, experts, microbatches per iteration
DIM_LIMIT = 2 ** 31 - 1          # one dimension of a tensor (hidden, ffn, heads, sequence, vocabulary, batch)
INT64_MAX = 2 ** 63 - 1
# The estimator lists parameters per layer and per local expert: the deepest trained models have a few hundred
# layers and DeepSeek-V3 without expert parallelism holds ~15,000 experts per GPU. Past these bounds a model is
# no one's, and listing it would take the estimator seconds (20,000 layers: about 1 s on the CI machine).
LAYER_LIMIT = 20_000
EXPERTS_PER_GPU_LIMIT = 500_000   # layers on one stage x local experts

_ANY_NODE_GPUS = 8   # `--nproc_per_node gpu|auto`: the GPU count of the usual training node (DGX/HGX)

# dest -> (minimum, maximum) for integer fields; the minimum's own message where Megatron has one.
_INTS = {
    "num_layers": (1, LAYER_LIMIT), "hidden_size": (1, DIM_LIMIT), "ffn_hidden_size": (1, DIM_LIMIT),
    "num_attention_heads": (1, DIM_LIMIT), "num_query_groups": (1, DIM_LIMIT), "kv_channels": (1, DIM_LIMIT),
    "seq_length": (1, DIM_LIMIT), "max_position_embeddings": (1, DIM_LIMIT), "rotary_base": (1, INT64_MAX),
    "vocab_size": (1, DIM_LIMIT), "make_vocab_size_divisible_by": (1, DIM_LIMIT),
    "num_experts": (1, COUNT_LIMIT), "moe_router_topk": (1, COUNT_LIMIT), "moe_ffn_hidden_size": (1, DIM_LIMIT),
    "moe_shared_expert_intermediate_size": (1, DIM_LIMIT),
    # multi-latent attention's ranks and head widths, multi-token prediction's layers
    "q_lora_rank": (1, DIM_LIMIT), "kv_lora_rank": (1, DIM_LIMIT), "qk_head_dim": (1, DIM_LIMIT),
    "qk_pos_emb_head_dim": (1, DIM_LIMIT), "v_head_dim": (1, DIM_LIMIT), "mtp_num_layers": (1, LAYER_LIMIT),
    "tensor_model_parallel_size": (1, COUNT_LIMIT), "pipeline_model_parallel_size": (1, COUNT_LIMIT),
    "context_parallel_size": (1, COUNT_LIMIT), "expert_model_parallel_size": (1, COUNT_LIMIT),
    "expert_tensor_parallel_size": (1, COUNT_LIMIT),
    "num_layers_per_virtual_pipeline_stage": (1, COUNT_LIMIT), "num_virtual_stages_per_pipeline_rank": (1, COUNT_LIMIT),
    "decoder_first_pipeline_num_layers": (1, COUNT_LIMIT), "decoder_last_pipeline_num_layers": (1, COUNT_LIMIT),
    "ddp_bucket_size": (1, INT64_MAX), "ddp_num_buckets": (1, INT64_MAX),
    "num_distributed_optimizer_instances": (1, COUNT_LIMIT),
    "micro_batch_size": (1, DIM_LIMIT), "global_batch_size": (1, INT64_MAX),
    "recompute_num_layers": (0, COUNT_LIMIT),
    "nproc_per_node": (1, COUNT_LIMIT), "nnodes": (1, COUNT_LIMIT), "node_rank": (0, COUNT_LIMIT),
    "master_port": (0, 65535),
    # modelled features (estimator.fp8, offload, schedule); their combination rules live with their models
    "fp8_amax_history_len": (1, COUNT_LIMIT), "microbatch_group_size_per_vp_stage": (1, COUNT_LIMIT),
    "cpu_offloading_num_layers": (0, LAYER_LIMIT),
}
# Megatron's (megatron-core's) own words for a value below the minimum.
_BELOW_MINIMUM = {
    "num_experts": "num_moe_experts must be non-negative.",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size must be "
                                           "num_shared_experts * ffn_size_of_each_shared_expert, but got {v}",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage must be larger than 0",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage must be larger than 0",
    "ddp_num_buckets": "--ddp-num-buckets must be greater than 0",
}
# dest -> (minimum, maximum, minimum included) for float fields; all must be finite.
_FLOATS = {
    "hidden_dropout": (0.0, 1.0, True), "attention_dropout": (0.0, 1.0, True),
    "rotary_percent": (0.0, 1.0, False), "norm_epsilon": (0.0, math.inf, True),
    "moe_imbalance": (1.0, math.inf, True),   # a bound on routed tokens relative to balanced (estimator.moe_tokens)
    "rotary_scaling_factor": (0.0, math.inf, False), "mscale": (0.0, math.inf, True),
    "mscale_all_dim": (0.0, math.inf, True),
}


def flag_name(dest: str) -> str:
    """The command-line spelling of a TrainingConfig field (its first flag in args' table)."""
    from estimator.args import _FLAGS  # noqa: PLC0415 -- args imports this module
    for flag, (d, _) in _FLAGS.items():
        if d == dest:
            return flag
    return "--" + dest.replace("_", "-")


def check_value(dest: str, value, error_cls, where: str | None = None):
    """`value` for field `dest` if it has the field's type and range; else error_cls with one line. `where` names
    the value's source (default: the flag)."""
    name = where or flag_name(dest)
    if dest in _INTS:
        lo, hi = _INTS[dest]
        if value.__class__ is not int:
            raise error_cls(f"{name}: expected an integer, got {value!r}")
        if value < lo:
            own = _BELOW_MINIMUM.get(dest)
            if own and where is None:
                raise error_cls(own.format(v=value))
            raise error_cls(f"{name} must be {'positive' if lo == 1 else f'at least {lo}'}, got {value}")
        if value > hi:
            raise error_cls(f"{name} {value} is beyond any model or machine (at most {hi:,})")
    elif dest in _FLOATS:
        lo, hi, lo_incl = _FLOATS[dest]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error_cls(f"{name}: expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:   # an integer past any float (a HF config may hold 10**400)
            raise error_cls(f"{name} must be a finite number, got {value}") from None
        if dest.endswith("_dropout") and not 0.0 <= value <= 1.0:
            # torch.nn.Dropout's own message (NaN fails it too)
            raise error_cls(f"{name}: dropout probability has to be between 0 and 1, but got {value}")
        if not math.isfinite(value) or value > hi or value < lo or (value == lo and not lo_incl):
            shown = f"{'[' if lo_incl else '('}{lo}, {hi if math.isfinite(hi) else 'inf'}" + ("]" if math.isfinite(hi) else ")")
            raise error_cls(f"{name} must be a finite number in {shown}, got {value}")
    return value


def check_fields(cfg, error_cls) -> None:
    """Every numeric field of a TrainingConfig as given (flags and HF config merged), before derivation.
    None (not given) passes; MoE fields count only with experts; fields not in the tables (flags another part of
    the estimator records) need only be finite, so no NaN or Infinity reaches the JSON report. The loops test the
    common case inline (this runs for every estimate); check_value words any failure."""
    values = vars(cfg)
    moe = bool(values.get("num_experts"))
    for name, (lo, hi) in _INTS.items():
        value = values.get(name)
        if value is None or (value.__class__ is int and lo <= value <= hi) or (name[:4] == "moe_" and not moe):
            continue
        check_value(name, value, error_cls)
    for name in _FLOATS:
        value = values.get(name)
        if value is not None and not (name[:4] == "moe_" and not moe):
            check_value(name, value, error_cls)
    for name, value in values.items():
        if value.__class__ is float and value - value != 0.0 and name not in _FLOATS:   # NaN or +-inf
            raise error_cls(f"{flag_name(name)} must be a finite number, got {value}")


def check_scale(cfg, error_cls) -> None:
    """Derived sizes no machine can run: refused before any per-rank, per-layer or per-step work starts."""
    if cfg.world_size > COUNT_LIMIT:
        raise error_cls(f"world size {cfg.world_size:,} GPUs (nproc_per_node {cfg.nproc_per_node} x nnodes "
                        f"{cfg.nnodes}) is beyond any machine (at most {COUNT_LIMIT:,})")
    if cfg.num_microbatches > COUNT_LIMIT:
        raise error_cls(f"{cfg.num_microbatches:,} microbatches per iteration (global batch {cfg.global_batch_size} "
                        f"/ (micro batch {cfg.micro_batch_size} x DP {cfg.data_parallel_size})) is beyond any "
                        f"training run (at most {COUNT_LIMIT:,})")
    pp = cfg.pipeline_model_parallel_size
    stage_layers = max(cfg.decoder_first_pipeline_num_layers or 0, cfg.decoder_last_pipeline_num_layers or 0,
                       -(-cfg.num_layers // pp))
    local_experts = -(-(cfg.num_experts or 0) // cfg.expert_model_parallel_size)
    if stage_layers * local_experts > EXPERTS_PER_GPU_LIMIT:
        raise error_cls(f"one GPU would hold {stage_layers:,} layers x {local_experts:,} local experts = "
                        f"{stage_layers * local_experts:,} experts: beyond any model the estimator covers (at most "
                        f"{EXPERTS_PER_GPU_LIMIT:,}; use pipeline or expert parallelism)")


def nproc_per_node(raw: str) -> tuple:
    """torchrun's --nproc_per_node: an integer, or 'gpu' / 'auto' (torchrun counts the node's GPUs at launch).
    Offline there is no node to count: those two assume an 8-GPU node, and say so. (n, warning or None)."""
    if raw in ("gpu", "auto"):
        return _ANY_NODE_GPUS, (f"--nproc_per_node {raw}: torchrun counts the GPUs of the node at launch; this "
                                f"offline estimate assumes {_ANY_NODE_GPUS} per node (pass a number to change it)")
    if raw in ("cpu", "xpu"):
        raise ValueError(raw)   # a CPU or XPU training job is not what the estimator models: the caller says so
    return int(raw), None
