"""Megatron-LM / torchrun command lines -> a validated `TrainingConfig`.

Field names are Megatron-LM's argparse `dest` names (docs/FORMATS.md section 1); defaults, derived values and
validation messages follow Megatron-LM `megatron/training/arguments.py` and megatron-core 0.16 (TransformerConfig,
parallel_state, the microbatch calculator), so a config that Megatron would reject is rejected here with its words.
A hand-written parser instead of argparse: argparse abbreviates flags, exits on its own and cannot collect the
values of unknown flags reliably; here every unknown flag is kept in `ignored_args`.
"""
from __future__ import annotations

from typing import Any, Optional
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # ast is imported where it is used: slow to import, needed for MoE layer patterns only
    import ast

import math

from estimator import _record, flag_policy, validate as V
from estimator._record import dataclass, field
from estimator.static_memory import local_spec



class ConfigError(ValueError):
    """An invalid command line or combination; the message is one line meant for the user (exit code 2)."""


@dataclass
class TrainingConfig:
    # --- model shape ---
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # derived: 4h, or int(8h/3 / 64) * 64 with --swiglu
    num_attention_heads: Optional[int] = None
    group_query_attention: bool = False
    num_query_groups: Optional[int] = None  # derived: heads unless --group-query-attention
    kv_channels: Optional[int] = None  # derived: h / heads
    seq_length: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    qk_l2_norm: bool = False              # Llama-4's parameter-free L2 norm of queries and keys (megatron's L2Norm)
    attention_output_gate: bool = False   # Qwen3-Next's gate: linear_qkv also projects a gate; out * sigmoid(gate)
    # --- multi-latent attention (DeepSeek-V2/V3; megatron-core MLASelfAttention): Megatron-LM's defaults ---
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None     # None: the query is one projection (linear_q_proj), no down/up pair
    kv_lora_rank: int = 32
    qk_head_dim: int = 128                # the query/key head width without rope ("nope")
    qk_pos_emb_head_dim: int = 64         # the rotary part of the query/key heads
    v_head_dim: int = 128
    rope_type: Optional[str] = None       # rope | yarn (None: yarn under MLA, as MLATransformerConfig)
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # --- multi-token prediction (DeepSeek-V3; megatron-core MultiTokenPredictionBlock on the loss's stage) ---
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # --- numerics and kernel fusions: Megatron-LM copies these into TransformerConfig, where some defaults differ
    # (attention_softmax_in_fp32 defaults on there, the fusions off). Only the softmax precision changes the
    # estimate (formula switch softmax_fp32); the rest is recorded for the harness and the trace headers. ---
    attention_softmax_in_fp32: bool = False
    apply_query_key_layer_scaling: bool = False  # implies attention_softmax_in_fp32
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    rotary_interleaved: bool = False
    bias_gelu_fusion: bool = True  # derived: off without --add-bias-linear's biases
    bias_swiglu_fusion: bool = True
    masked_softmax_fusion: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True  # derived: off unless position_embedding_type is rope
    no_persist_layer_norm: bool = False
    gradient_accumulation_fusion: bool = True
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"
    calculate_per_token_loss: bool = False
    # --- vocabulary ---
    vocab_size: Optional[int] = None
    vocab_file: Optional[str] = None
    tokenizer_type: Optional[str] = None
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: Optional[int] = None  # derived, like Megatron's _vocab_size_with_padding
    # --- MoE ---
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # derived: ffn_hidden_size when MoE
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False    # a sigmoid gate (one weight row) on the shared experts' output
    moe_layer_freq: Any = 1  # int N (one MoE layer every N) or an explicit 0/1 list per layer
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # derived: TP
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_router_pre_softmax: bool = False
    moe_apply_probs_on_input: bool = False    # the routing probabilities scale the experts' input (top-1 only)
    moe_router_force_load_balancing: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_load_balancing_type: Any = "aux_loss"   # one type, or a list (Megatron-LM: nargs='+')
    moe_aux_loss_coeff: Any = 0.0   # one coefficient, or one per load-balancing type (nargs='+')
    moe_expert_capacity_factor: Optional[float] = None   # None (or negative): dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    # get-training-info's own option, not Megatron's: the dropless routing bound (estimator.moe_tokens); None: its
    # documented default
    moe_imbalance: Optional[float] = None
    # --- parallelism ---
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None  # derived (None = no interleaving)
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    overlap_p2p_comm: bool = True
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    ddp_bucket_size: Optional[int] = None  # elements per DDP bucket with --overlap-grad-reduce (None: megatron's default)
    ddp_num_buckets: Optional[int] = None  # Megatron-LM sets the bucket size from it (config_from)
    num_distributed_optimizer_instances: int = 1   # the distributed optimizer shards over DP x CP / N
    overlap_param_gather: bool = False
    # --- batch ---
    micro_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None  # derived: micro * DP when absent
    # --- precision ---
    bf16: bool = False
    fp16: bool = False
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False
    # --- recompute ---
    recompute_granularity: Optional[str] = None
    recompute_modules: Optional[list] = None    # selective recompute's modules (None: megatron-core's core_attn)
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_activations: bool = False
    distribute_saved_activations: bool = False
    # --- attention kernel ---
    use_flash_attn: bool = False
    transformer_impl: str = "transformer_engine"
    attention_backend: str = "auto"
    spec: Optional[list] = None
    # --- optimizer ---
    optimizer: str = "adam"
    use_precision_aware_optimizer: bool = False
    # the precision-aware optimizer's state dtypes (Transformer Engine's FusedAdam; fp32 without it)
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    # --- sharded data parallelism (estimator.fsdp) ---
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    use_torch_fsdp2: bool = False
    torch_fsdp2_reshard_after_forward: bool = True
    # --- fp8 (estimator.fp8) ---
    fp8: Optional[str] = None  # --fp8-format
    fp8_recipe: str = "delayed"
    fp8_amax_history_len: int = 1
    fp8_param_gather: bool = False
    fp8_wgrad: bool = True
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    keep_fp8_transpose_cache: bool = False
    # --- activation offload, TP comm overlap, pipeline layout ---
    cpu_offloading_num_layers: int = 0
    tp_comm_overlap: bool = False
    pipeline_model_parallel_layout: Optional[str] = None
    microbatch_group_size_per_vp_stage: Optional[int] = None
    quick_geglu: bool = False
    squared_relu: bool = False   # relu(x)**2 in the MLP (Nemotron-style; eager, no fused kernel)
    softmax_type: str = "vanilla"  # vanilla | off-by-one | learnable (a parameter per head)
    moe_router_dtype: Optional[str] = None  # None (the activation dtype) | fp32 | fp64
    # --- torchrun ---
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    # --- derived / bookkeeping (not Megatron flags) ---
    hf_config: Optional[str] = None
    world_size: int = 1
    data_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    num_microbatches: int = 1
    params_dtype: str = "fp32"  # fp32 | bf16 | fp16
    attention_kernel: str = "flash"  # unfused (local spec / TE unfused) | flash (TE flash or fused, flash-attn)
    # The kernel family per switch a trace recorded it ran (fit.dataset, from its header); None: what a GPU runs
    # for the flags (estimator.formulas.kernels).
    kernels: Optional[dict] = None
    # get-training-info --torch-adam: neither Transformer Engine nor apex installed, so megatron-core steps with
    # torch.optim.AdamW (static_memory.adam_step).
    torch_adam: bool = False
    ignored_args: list = field(default_factory=list)
    conservative_args: list = field(default_factory=list)  # flags modelled as without them (errs high)
    warnings: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return _record.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainingConfig":
        known = {f.name for f in _record.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown TrainingConfig fields: {', '.join(unknown)}")
        return cls(**values)

    # Small conveniences the other estimator modules share.
    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def moe_layer_pattern(self) -> list[int]:
        return moe_layer_pattern(self)


# ---------------------------------------------------------------------------------------------------------------
# Flag table: flag -> (dest, kind, choices). Kinds: int, float, str, true (store_true), false (store_false),
# list (nargs='*' strings), layer_freq (moe_freq_type).

_CHOICES = {
    "position_embedding_type": ["learned_absolute", "rope", "mrope", "relative", "none"],
    "normalization": ["LayerNorm", "RMSNorm"],
    "tokenizer_type": ["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                       "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                       "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"],
    "moe_token_dispatcher_type": ["allgather", "alltoall", "flex"],
    "moe_router_score_function": ["softmax", "sigmoid"],
    "recompute_granularity": ["full", "selective"],
    "recompute_method": ["uniform", "block"],
    "cross_entropy_fusion_impl": ["native", "te"],
    "transformer_impl": ["local", "transformer_engine", "inference_optimized"],
    "attention_backend": ["flash", "fused", "unfused", "local", "auto"],
    "optimizer": ["adam", "sgd", "muon", "dist_muon"],
    "data_parallel_sharding_strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"],
    "fp8": ["e4m3", "hybrid"],
    "softmax_type": ["vanilla", "off-by-one", "learnable"],
    "moe_router_dtype": ["fp32", "fp64"],
    "moe_token_drop_policy": ["probs", "position"],
    "fp8_recipe": ["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
    "main_params_dtype": ["fp32", "fp16"],
    "exp_avg_dtype": ["fp32", "fp16", "bf16", "fp8"],
    "exp_avg_sq_dtype": ["fp32", "fp16", "bf16", "fp8"],
}

_FLAGS: dict[str, tuple[str, str]] = {
    "--num-layers": ("num_layers", "int"),
    "--hidden-size": ("hidden_size", "int"),
    "--ffn-hidden-size": ("ffn_hidden_size", "int"),
    "--num-attention-heads": ("num_attention_heads", "int"),
    "--group-query-attention": ("group_query_attention", "true"),
    "--num-query-groups": ("num_query_groups", "int"),
    "--kv-channels": ("kv_channels", "int"),
    "--seq-length": ("seq_length", "int"),
    "--max-position-embeddings": ("max_position_embeddings", "int"),
    "--position-embedding-type": ("position_embedding_type", "str"),
    "--use-rotary-position-embeddings": ("_use_rotary_position_embeddings", "true"),
    "--no-position-embedding": ("_add_position_embedding", "false"),
    "--rotary-percent": ("rotary_percent", "float"),
    "--rotary-base": ("rotary_base", "int"),
    "--norm-epsilon": ("norm_epsilon", "float"),
    "--swiglu": ("swiglu", "true"),
    "--normalization": ("normalization", "str"),
    "--disable-bias-linear": ("add_bias_linear", "false"),
    "--add-qkv-bias": ("add_qkv_bias", "true"),
    "--qk-layernorm": ("qk_layernorm", "true"),
    "--qk-l2-norm": ("qk_l2_norm", "true"),
    "--attention-output-gate": ("attention_output_gate", "true"),
    "--multi-latent-attention": ("multi_latent_attention", "true"),
    "--q-lora-rank": ("q_lora_rank", "int"),
    "--kv-lora-rank": ("kv_lora_rank", "int"),
    "--qk-head-dim": ("qk_head_dim", "int"),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", "int"),
    "--v-head-dim": ("v_head_dim", "int"),
    "--rope-type": ("rope_type", "str"),
    "--rotary-scaling-factor": ("rotary_scaling_factor", "float"),
    "--mscale": ("mscale", "float"),
    "--mscale-all-dim": ("mscale_all_dim", "float"),
    "--mtp-num-layers": ("mtp_num_layers", "int"),
    "--mtp-loss-scaling-factor": ("mtp_loss_scaling_factor", "float"),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", "true"),
    "--hidden-dropout": ("hidden_dropout", "float"),
    "--attention-dropout": ("attention_dropout", "float"),
    "--attention-softmax-in-fp32": ("attention_softmax_in_fp32", "true"),
    "--apply-query-key-layer-scaling": ("apply_query_key_layer_scaling", "true"),
    "--fp32-residual-connection": ("fp32_residual_connection", "true"),
    "--apply-residual-connection-post-layernorm": ("apply_residual_connection_post_layernorm", "true"),
    "--rotary-interleaved": ("rotary_interleaved", "true"),
    "--no-bias-gelu-fusion": ("bias_gelu_fusion", "false"),
    "--no-bias-swiglu-fusion": ("bias_swiglu_fusion", "false"),
    "--no-masked-softmax-fusion": ("masked_softmax_fusion", "false"),
    "--no-bias-dropout-fusion": ("bias_dropout_fusion", "false"),
    "--no-rope-fusion": ("apply_rope_fusion", "false"),
    "--no-persist-layer-norm": ("no_persist_layer_norm", "true"),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", "false"),
    "--cross-entropy-loss-fusion": ("cross_entropy_loss_fusion", "true"),
    "--cross-entropy-fusion-impl": ("cross_entropy_fusion_impl", "str"),
    "--calculate-per-token-loss": ("calculate_per_token_loss", "true"),
    "--vocab-size": ("vocab_size", "int"),
    "--vocab-file": ("vocab_file", "str"),
    "--tokenizer-type": ("tokenizer_type", "str"),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", "int"),
    "--num-experts": ("num_experts", "int"),
    "--moe-router-topk": ("moe_router_topk", "int"),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", "int"),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", "int"),
    "--moe-shared-expert-gate": ("moe_shared_expert_gate", "true"),
    "--moe-layer-freq": ("moe_layer_freq", "layer_freq"),
    "--expert-model-parallel-size": ("expert_model_parallel_size", "int"),
    "--expert-tensor-parallel-size": ("expert_tensor_parallel_size", "int"),
    "--moe-grouped-gemm": ("moe_grouped_gemm", "true"),
    "--moe-token-dispatcher-type": ("moe_token_dispatcher_type", "str"),
    "--moe-router-pre-softmax": ("moe_router_pre_softmax", "true"),
    "--moe-apply-probs-on-input": ("moe_apply_probs_on_input", "true"),
    "--moe-router-force-load-balancing": ("moe_router_force_load_balancing", "true"),
    "--moe-router-score-function": ("moe_router_score_function", "str"),
    "--moe-router-load-balancing-type": ("moe_router_load_balancing_type", "list"),
    "--moe-aux-loss-coeff": ("moe_aux_loss_coeff", "list"),
    "--moe-expert-capacity-factor": ("moe_expert_capacity_factor", "float"),
    "--moe-pad-expert-input-to-capacity": ("moe_pad_expert_input_to_capacity", "true"),
    "--moe-token-drop-policy": ("moe_token_drop_policy", "str"),
    "--moe-imbalance": ("moe_imbalance", "float"),
    "--tensor-model-parallel-size": ("tensor_model_parallel_size", "int"),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", "int"),
    "--num-layers-per-virtual-pipeline-stage": ("num_layers_per_virtual_pipeline_stage", "int"),
    "--num-virtual-stages-per-pipeline-rank": ("num_virtual_stages_per_pipeline_rank", "int"),
    "--decoder-first-pipeline-num-layers": ("decoder_first_pipeline_num_layers", "int"),
    "--decoder-last-pipeline-num-layers": ("decoder_last_pipeline_num_layers", "int"),
    "--account-for-embedding-in-pipeline-split": ("account_for_embedding_in_pipeline_split", "true"),
    "--account-for-loss-in-pipeline-split": ("account_for_loss_in_pipeline_split", "true"),
    "--no-overlap-p2p-communication": ("overlap_p2p_comm", "false"),
    "--context-parallel-size": ("context_parallel_size", "int"),
    "--sequence-parallel": ("sequence_parallel", "true"),
    "--use-distributed-optimizer": ("use_distributed_optimizer", "true"),
    "--overlap-grad-reduce": ("overlap_grad_reduce", "true"),
    "--ddp-bucket-size": ("ddp_bucket_size", "int"),
    "--ddp-num-buckets": ("ddp_num_buckets", "int"),
    "--num-distributed-optimizer-instances": ("num_distributed_optimizer_instances", "int"),
    "--overlap-param-gather": ("overlap_param_gather", "true"),
    "--micro-batch-size": ("micro_batch_size", "int"),
    "--global-batch-size": ("global_batch_size", "int"),
    "--bf16": ("bf16", "true"),
    "--fp16": ("fp16", "true"),
    "--accumulate-allreduce-grads-in-fp32": ("accumulate_allreduce_grads_in_fp32", "true"),
    "--grad-reduce-in-bf16": ("grad_reduce_in_bf16", "true"),
    "--recompute-granularity": ("recompute_granularity", "str"),
    "--recompute-modules": ("recompute_modules", "list"),
    "--recompute-method": ("recompute_method", "str"),
    "--recompute-num-layers": ("recompute_num_layers", "int"),
    "--recompute-activations": ("recompute_activations", "true"),
    "--distribute-saved-activations": ("distribute_saved_activations", "true"),
    "--use-flash-attn": ("use_flash_attn", "true"),
    "--transformer-impl": ("transformer_impl", "str"),
    "--attention-backend": ("attention_backend", "str"),
    "--spec": ("spec", "list"),
    "--optimizer": ("optimizer", "str"),
    "--use-precision-aware-optimizer": ("use_precision_aware_optimizer", "true"),
    "--main-params-dtype": ("main_params_dtype", "str"),
    "--exp-avg-dtype": ("exp_avg_dtype", "str"),
    "--exp-avg-sq-dtype": ("exp_avg_sq_dtype", "str"),
    "--optimizer-cpu-offload": ("optimizer_cpu_offload", "true"),
    "--optimizer-offload-fraction": ("optimizer_offload_fraction", "float"),
    "--use-megatron-fsdp": ("use_megatron_fsdp", "true"),
    "--data-parallel-sharding-strategy": ("data_parallel_sharding_strategy", "str"),
    "--use-torch-fsdp2": ("use_torch_fsdp2", "true"),
    "--torch-fsdp2-no-reshard-after-forward": ("torch_fsdp2_reshard_after_forward", "false"),
    "--fp8-format": ("fp8", "str"),
    "--fp8-recipe": ("fp8_recipe", "str"),
    "--fp8-amax-history-len": ("fp8_amax_history_len", "int"),
    "--fp8-param-gather": ("fp8_param_gather", "true"),
    "--no-fp8-wgrad": ("fp8_wgrad", "false"),
    "--disable-fp8-wgrad": ("fp8_wgrad", "false"),
    "--first-last-layers-bf16": ("first_last_layers_bf16", "true"),
    "--num-layers-at-start-in-bf16": ("num_layers_at_start_in_bf16", "int"),
    "--num-layers-at-end-in-bf16": ("num_layers_at_end_in_bf16", "int"),
    "--keep-fp8-transpose-cache": ("keep_fp8_transpose_cache", "true"),
    "--cpu-offloading-num-layers": ("cpu_offloading_num_layers", "int"),
    "--tp-comm-overlap": ("tp_comm_overlap", "true"),
    "--pipeline-model-parallel-layout": ("pipeline_model_parallel_layout", "str"),
    "--microbatch-group-size-per-virtual-pipeline-stage": ("microbatch_group_size_per_vp_stage", "int"),
    "--quick-geglu": ("quick_geglu", "true"),
    "--squared-relu": ("squared_relu", "true"),
    "--softmax-type": ("softmax_type", "str"),
    "--moe-router-dtype": ("moe_router_dtype", "str"),
    "--hf-config": ("hf_config", "str"),
    # torchrun (both spellings torchrun accepts)
    "--nproc_per_node": ("nproc_per_node", "nproc"),
    "--nproc-per-node": ("nproc_per_node", "nproc"),
    "--nnodes": ("nnodes", "nnodes"),
    "--node_rank": ("node_rank", "int"),
    "--node-rank": ("node_rank", "int"),
    "--master_addr": ("master_addr", "str"),
    "--master-addr": ("master_addr", "str"),
    "--master_port": ("master_port", "int"),
    "--master-port": ("master_port", "int"),
}

# Flags of get-training-info itself that configs carry (not Megatron-LM's): a HF config file, the MoE routing bound.
TOOL_FLAGS = ("--hf-config", "--moe-imbalance")

# Megatron flags removed long ago; Megatron refuses them with these messages.
_REFUSED = {
    "--batch-size": "--batch-size argument is no longer valid, use --micro-batch-size instead",
    "--model-parallel-size": "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead",
    "--checkpoint-activations": "--checkpoint-activations is no longer valid, use --recompute-activations, or, "
                                "for more control, --recompute-granularity and --recompute-method.",
}

# Tokenizers whose vocabulary size is fixed by a file we cannot read offline.
_GPT2_BPE_VOCAB = 50257


def _convert(flag: str, kind: str, raw: str, dest: str) -> Any:
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "nproc":
            return V.nproc_per_node(raw)   # (n, warning): torchrun also takes 'gpu' and 'auto'
        if kind == "nnodes":
            # torchrun accepts "N" or an elastic range "MIN:MAX"; the largest size is the one to plan for.
            return max(int(part) for part in raw.split(":"))
        if kind == "layer_freq":
            return _moe_freq(raw)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        expected = {"nproc": "int, gpu or auto", "nnodes": "int or MIN:MAX", "layer_freq": "int or list pattern"}.get(kind, kind)
        raise ConfigError(f"argument {flag}: invalid {expected} value: {raw!r}") from None
    if dest in _CHOICES and raw not in _CHOICES[dest]:
        choices = ", ".join(repr(c) for c in _CHOICES[dest])
        raise ConfigError(f"argument {flag}: invalid choice: {raw!r} (choose from {choices})")
    return raw


def _moe_freq(raw: str) -> Any:
    """Megatron's moe_freq_type: an int N, or a Python list expression such as "([1]*3+[0])*2"."""
    if "[" not in raw:
        return int(raw)
    import ast
    pattern = _eval_list_expression(ast.parse(raw, mode="eval").body)
    if not all(v in (0, 1) for v in pattern):
        raise ValueError(raw)
    return pattern


def _eval_list_expression(node: ast.AST) -> Any:
    # Only list literals, ints, + and * : enough for Megatron's patterns, without eval().
    import ast  # imported on use: it is slow to import and only MoE layer patterns need it
    if isinstance(node, ast.List):
        return [_eval_list_expression(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_list_expression(node.left), _eval_list_expression(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            # a pattern longer than any model is refused before it is built (a MemoryError or a hang otherwise)
            length, times = (len(left), right) if isinstance(left, list) else (len(right), left)
            if length * times > V.COUNT_LIMIT:
                raise ValueError("pattern too long")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("unsupported pattern")


def _other_flag(argv: list[str], i: int, token: str, flag: str, eq: str, inline: str, ignored: list[str],
                conservative: list[str]) -> int:
    """A token that is not a TrainingConfig flag: a stray positional (such as "pretrain_gpt.py") is ignored; a
    Megatron-LM or torchrun flag is ignored, or kept as modelled without it (flag_policy.CONSERVATIVE), or refused;
    anything else is Megatron's "unrecognized arguments" error. Returns the index after the flag's values."""
    if not token.startswith("-") or token == "-":
        ignored.append(token)
        return i
    if not flag_policy.known(flag):
        raise ConfigError(flag_policy.unknown_message(flag, tuple(_FLAGS)))
    taken = flag_policy.values_taken(flag)
    values = [inline] if eq else []
    if not eq and taken != 0:
        most = taken if isinstance(taken, int) else (1 if taken == "?" else len(argv))
        while len(values) < most and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if taken in (1, "+") and not values:
            raise ConfigError(f"argument {flag}: expected {'one argument' if taken == 1 else 'at least one argument'}")
    reason = flag_policy.refusal(flag, values)
    if reason is not None and flag_policy.newer_release(flag):
        raise ConfigError(f"{flag} cannot be estimated: {reason}, and what it does to memory is not modelled")
    if reason is not None:
        raise ConfigError(f"{flag} changes memory or communication and cannot be estimated: {reason}")
    (conservative if flag in flag_policy.CONSERVATIVE else ignored).extend([token] if eq else [token] + values)
    return i


def _tokenize(argv: list[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Split argv into explicitly given {dest: value}, the ignored tokens (Megatron flags that change neither memory
    nor communication, with their values) and the flags modelled as if absent (errs high)."""
    given: dict[str, Any] = {}
    ignored: list[str] = []
    conservative: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        flag, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        if flag in _REFUSED:
            raise ConfigError(_REFUSED[flag])
        if flag not in _FLAGS:
            i = _other_flag(argv, i, token, flag, eq, inline, ignored, conservative)
            continue
        dest, kind = _FLAGS[flag]
        if kind in ("true", "false"):
            if eq:
                raise ConfigError(f"argument {flag}: ignored explicit argument {inline!r}")
            given[dest] = kind == "true"
        elif kind == "list":
            values = [inline] if eq else []
            while not eq and i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            given[dest] = values
        else:
            if not eq:
                if i >= len(argv) or (argv[i].startswith("--")):
                    raise ConfigError(f"argument {flag}: expected one argument")
                inline = argv[i]
                i += 1
            value = _convert(flag, kind, inline, dest)
            if kind == "nproc":   # (n, warning): torchrun also takes 'gpu' and 'auto'; the last flag given wins
                value, given["_nproc_warning"] = value
            given[dest] = value
    return given, ignored, conservative


def parse_args(argv: list[str]) -> TrainingConfig:
    """Parse a `get_training_info.py $DISTRIBUTED_ARGS $GPT_ARGS ...` tail, derive Megatron's values, validate."""
    return config_from(*tokenize(argv))


def tokenize(argv: list[str]) -> tuple:
    """(given {dest: value}, ignored tokens, conservative tokens): the parse without derivation, which
    config_from finishes; a layout search tokenizes once and builds one config per layout from edited copies.
    The HF config file, if any, is read here, once."""
    given, ignored, conservative = _tokenize(list(argv))
    if "hf_config" in given:
        # The HF file describes the model; flags given explicitly on the command line still win.
        from estimator import hf_config  # only with --hf-config
        fields = hf_config.load_model_fields(given["hf_config"], ConfigError)
        # the file's keys the estimate does not use are listed with the ignored flags
        ignored = ignored + [f"{given['hf_config']}:{k}" for k in fields.pop(hf_config.UNUSED_KEY, [])]
        given = {**fields, **given}
    return given, ignored, conservative


def config_from(given: dict, ignored: list, conservative: list) -> TrainingConfig:
    """A validated TrainingConfig from tokenize's parts (`given` is not changed)."""
    given = dict(given)
    cfg = TrainingConfig()
    nproc_warning = given.pop("_nproc_warning", None)   # `--nproc_per_node gpu|auto` (validate.nproc_per_node)
    if nproc_warning:
        cfg.warnings.append(nproc_warning)
    use_rope = given.pop("_use_rotary_position_embeddings", False)
    add_position_embedding = given.pop("_add_position_embedding", True)
    for dest, value in given.items():
        setattr(cfg, dest, value)
    cfg.ignored_args = list(ignored)
    cfg.conservative_args = list(conservative)
    if use_rope:
        cfg.position_embedding_type = "rope"
    if not add_position_embedding and cfg.position_embedding_type != "rope":
        raise ConfigError("--no-position-embedding is deprecated, use --position-embedding-type")
    V.check_fields(cfg, ConfigError)
    derive(cfg)
    validate(cfg)
    V.check_scale(cfg, ConfigError)
    if cfg.ddp_num_buckets is not None:
        _derive_bucket_size(cfg)
    return cfg


def _derive_bucket_size(cfg: TrainingConfig) -> None:
    """--ddp-num-buckets N: Megatron-LM's get_model makes the DDP bucket size the rank's parameter count // N (the
    first stage's counts: only its first model chunk is bucketed)."""
    if cfg.ddp_bucket_size is not None:
        raise ConfigError("Cannot specify both --ddp-num-buckets and --ddp-bucket-size")
    from estimator.memory import param_chunks   # the parameter model imports this module
    chunks = param_chunks(cfg, 0, cfg.virtual_pipeline_model_parallel_size or 1)
    # a size of 0 (more buckets than parameters) buckets each parameter alone in megatron-core, as a size of 1 does
    cfg.ddp_bucket_size = max(1, sum(p[0] for chunk in chunks for p in chunk) // cfg.ddp_num_buckets)


def _require(cfg: TrainingConfig, dest: str) -> None:
    if getattr(cfg, dest) is None:
        flag = "--" + dest.replace("_", "-")
        raise ConfigError(f"{dest} argument is None (pass {flag})")


def derive(cfg: TrainingConfig) -> None:
    """Fill Megatron's derived values in place (the parts of validate_args that set rather than check)."""
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                 "seq_length", "micro_batch_size"):
        _require(cfg, dest)

    cfg.world_size = cfg.nproc_per_node * cfg.nnodes
    model_size = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.context_parallel_size
    if cfg.world_size % model_size != 0:
        raise ConfigError(f"world size ({cfg.world_size}) is not divisible by total_model_size "
                          f"(total_model_size={model_size})")
    cfg.data_parallel_size = cfg.world_size // model_size
    if cfg.expert_tensor_parallel_size is None:
        cfg.expert_tensor_parallel_size = cfg.tensor_model_parallel_size

    if cfg.recompute_activations:
        cfg.recompute_granularity = "selective"
    if cfg.global_batch_size is None:
        cfg.global_batch_size = cfg.micro_batch_size * cfg.data_parallel_size

    if cfg.ffn_hidden_size is None:
        if cfg.swiglu:
            cfg.ffn_hidden_size = int((4 * cfg.hidden_size * 2 / 3) / 64) * 64
        else:
            cfg.ffn_hidden_size = 4 * cfg.hidden_size
    if cfg.kv_channels is None:
        if cfg.hidden_size % cfg.num_attention_heads != 0:
            raise ConfigError(f"hidden_size ({cfg.hidden_size}) must be divisible by num_attention_heads "
                              f"({cfg.num_attention_heads}) unless --kv-channels is given")
        cfg.kv_channels = cfg.hidden_size // cfg.num_attention_heads
    # Megatron passes num_query_groups to the model only with --group-query-attention; otherwise MHA.
    if not cfg.group_query_attention or cfg.num_query_groups is None:
        cfg.num_query_groups = cfg.num_attention_heads

    if cfg.tensor_model_parallel_size == 1 and cfg.sequence_parallel:
        cfg.warnings.append("Disabling sequence parallelism because tensor model parallelism is disabled")
        cfg.sequence_parallel = False
    if cfg.add_bias_linear:
        cfg.add_qkv_bias = True  # Megatron keeps the two in sync: a bias everywhere includes QKV
    else:
        cfg.bias_gelu_fusion = False  # no bias, no fused bias-gelu (the swiglu fusion stays as given)
    if cfg.position_embedding_type != "rope":
        cfg.apply_rope_fusion = False
    if cfg.apply_query_key_layer_scaling:
        cfg.attention_softmax_in_fp32 = True  # as megatron-core's TransformerConfig sets it too
    balancing = cfg.moe_router_load_balancing_type
    if isinstance(balancing, list) and len(balancing) == 1:
        cfg.moe_router_load_balancing_type = balancing[0]
    _derive_aux_loss_coeff(cfg)
    if cfg.num_experts is not None and cfg.moe_ffn_hidden_size is None:
        cfg.moe_ffn_hidden_size = cfg.ffn_hidden_size
    if cfg.expert_model_parallel_size > 1 and cfg.tensor_model_parallel_size > 1 and not cfg.sequence_parallel:
        cfg.warnings.append("When using expert parallelism and tensor parallelism for training, "
                            "sequence parallelism must be used")

    _derive_precision(cfg)
    _derive_virtual_pipeline(cfg)
    cfg.padded_vocab_size = _padded_vocab_size(cfg)
    cfg.attention_kernel = _attention_kernel(cfg)

    etp_ep_pp = cfg.expert_tensor_parallel_size * cfg.expert_model_parallel_size * cfg.pipeline_model_parallel_size
    if cfg.world_size % etp_ep_pp != 0:
        raise ConfigError(f"world_size ({cfg.world_size}) is not divisible by expert_tensor_model_pipeline_parallel "
                          f"size ({etp_ep_pp})")
    cfg.expert_data_parallel_size = cfg.world_size // etp_ep_pp
    micro_times_dp = cfg.micro_batch_size * cfg.data_parallel_size
    cfg.num_microbatches = max(1, cfg.global_batch_size // micro_times_dp)


def _derive_aux_loss_coeff(cfg: TrainingConfig) -> None:
    """--moe-aux-loss-coeff (nargs='+', floats): one value becomes a number, as Megatron-LM unpacks it."""
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if getattr(cfg, dest) == []:
            raise ConfigError(f"argument {V.flag_name(dest)}: expected at least one argument")
    coeff = cfg.moe_aux_loss_coeff
    if isinstance(coeff, list):
        try:
            coeff = [float(c) for c in coeff]
        except ValueError:
            raise ConfigError(f"argument --moe-aux-loss-coeff: invalid float value: {coeff!r}") from None
        if not all(math.isfinite(c) for c in coeff):
            raise ConfigError(f"--moe-aux-loss-coeff must be finite numbers, got {coeff}")
        cfg.moe_aux_loss_coeff = coeff[0] if len(coeff) == 1 else coeff


def _derive_precision(cfg: TrainingConfig) -> None:
    if cfg.fp16 and cfg.bf16:
        raise ConfigError(f"Only one of self.fp16: {cfg.fp16} and self.bf16 {cfg.bf16} should be True.")
    cfg.params_dtype = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"
    if cfg.bf16:
        # bf16 accumulates and all-reduces gradients in fp32 unless told to reduce in bf16.
        cfg.accumulate_allreduce_grads_in_fp32 = not cfg.grad_reduce_in_bf16


def _derive_virtual_pipeline(cfg: TrainingConfig) -> None:
    given = [cfg.num_layers_per_virtual_pipeline_stage, cfg.num_virtual_stages_per_pipeline_rank,
             cfg.pipeline_model_parallel_layout]
    if sum(x is not None for x in given) > 1:
        raise ConfigError("No more than one of the following arguments can be set at the same time: "
                          "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank,"
                          "--pipeline-model-parallel-layout.")
    pp = cfg.pipeline_model_parallel_size
    if cfg.pipeline_model_parallel_layout is not None:
        _derive_layout(cfg)
        return
    uneven = cfg.decoder_first_pipeline_num_layers is not None or cfg.decoder_last_pipeline_num_layers is not None
    num_layers = cfg.num_layers + int(cfg.account_for_embedding_in_pipeline_split) \
        + int(cfg.account_for_loss_in_pipeline_split)
    vpp = None
    if cfg.num_layers_per_virtual_pipeline_stage is not None:
        if uneven:
            raise ConfigError("please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline "
                              "parallel degree when enable uneven pipeline parallelism")
        if num_layers % pp != 0:
            raise ConfigError("number of layers of the model must be divisible pipeline model parallel size")
        if (num_layers // pp) % cfg.num_layers_per_virtual_pipeline_stage != 0:
            raise ConfigError("number of layers per pipeline stage must be divisible number of layers per "
                              "virtual pipeline stage")
        vpp = (num_layers // pp) // cfg.num_layers_per_virtual_pipeline_stage
    elif cfg.num_virtual_stages_per_pipeline_rank is not None:
        vpp = cfg.num_virtual_stages_per_pipeline_rank
    elif not uneven and num_layers % pp != 0:
        raise ConfigError("Number of layers should be divisible by the pipeline-model-parallel size")
    cfg.virtual_pipeline_model_parallel_size = vpp if vpp != 1 else None
    if cfg.virtual_pipeline_model_parallel_size is None:
        cfg.overlap_p2p_comm = False  # Megatron: no p2p overlap without the interleaved schedule


def _derive_layout(cfg: TrainingConfig) -> None:
    """The virtual-pipeline size a --pipeline-model-parallel-layout implies, with megatron-core's checks."""
    from estimator import pipeline_layout as PL  # only with a layout
    pp = cfg.pipeline_model_parallel_size
    try:
        stages = PL.stages(cfg.pipeline_model_parallel_layout)
        if len(stages) % pp != 0:
            raise PL.LayoutError(f"The length of pipeline_model_parallel_layout must be divisible by "
                                 f"pipeline_model_parallel_size (num_stages={len(stages)}, "
                                 f"args.pipeline_model_parallel_size={pp})")
        if (cfg.decoder_first_pipeline_num_layers is not None or cfg.decoder_last_pipeline_num_layers is not None
                or cfg.account_for_embedding_in_pipeline_split or cfg.account_for_loss_in_pipeline_split):
            raise PL.LayoutError("pipeline_model_parallel_layout cannot be set with other pipeline layout "
                                 "arguments.")
        PL.validate(cfg, stages)
    except PL.LayoutError as exc:
        raise ConfigError(str(exc)) from None
    vpp = len(stages) // pp
    cfg.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    if cfg.virtual_pipeline_model_parallel_size is None:
        cfg.overlap_p2p_comm = False  # Megatron: no p2p overlap without the interleaved schedule


def _padded_vocab_size(cfg: TrainingConfig) -> int:
    if cfg.tokenizer_type == "GPT2BPETokenizer" and cfg.vocab_size is None:
        vocab = _GPT2_BPE_VOCAB
    elif cfg.vocab_size is None:
        which = f"--tokenizer-type {cfg.tokenizer_type}" if cfg.tokenizer_type else "no --tokenizer-type"
        raise ConfigError(f"the vocabulary size is unknown with {which}: the tokenizer file cannot be read "
                          "offline, pass --vocab-size N (or --hf-config config.json)")
    elif cfg.tokenizer_type in ("NullTokenizer", "NullMultimodalTokenizer"):
        vocab = cfg.vocab_size + 1  # Megatron's null tokenizer appends an EOD token
    else:
        vocab = cfg.vocab_size
    multiple = cfg.make_vocab_size_divisible_by * cfg.tensor_model_parallel_size
    return int(math.ceil(vocab / multiple) * multiple)


def _attention_kernel(cfg: TrainingConfig) -> str:
    local = local_spec(cfg)
    if cfg.attention_backend == "local" and not local:
        raise ConfigError("--attention-backend local is only supported with --spec local")
    if local:
        if cfg.use_flash_attn:
            cfg.warnings.append("--use-flash-attn has no effect with the local spec: megatron-core's local "
                                "DotProductAttention is used")
        return "unfused"
    # Transformer Engine: 'auto', 'flash' and 'fused' (cuDNN) keep only softmax statistics, like flash attention;
    # both kernels take only 16-bit inputs, so in fp32 'auto' falls back to TE's unfused attention.
    if not (cfg.bf16 or cfg.fp16):
        if cfg.attention_backend not in ("flash", "fused"):
            return "unfused"
        # the CPU stand-in runs it (the campaign traces flash in fp32); Transformer Engine on a GPU has no kernel
        cfg.warnings.append(f"--attention-backend {cfg.attention_backend} without --bf16/--fp16: flash and fused "
                            "attention take only 16-bit inputs, so a GPU run may find no attention backend; "
                            "estimated with flash attention")
    return "unfused" if cfg.attention_backend == "unfused" else "flash"


def validate(cfg: TrainingConfig) -> None:
    """Raise ConfigError with Megatron's own message for a combination Megatron would refuse."""
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    model_size = tp * pp * cp
    if cfg.world_size % model_size != 0:
        raise ConfigError(f"world size ({cfg.world_size}) is not divisible by total_model_size "
                          f"(total_model_size={model_size})")
    n = cfg.num_distributed_optimizer_instances
    if n > 1:   # megatron-core's DistributedDataParallel and initialize_model_parallel, in their words
        if not cfg.use_distributed_optimizer:
            raise ConfigError("Partial DistOpt cannot be used without DistOpt")
        from estimator.parallel import ParallelConfigError, check_dist_opt_instances
        try:
            check_dist_opt_instances(cfg.data_parallel_size * cp, cfg.expert_data_parallel_size, n)
        except ParallelConfigError as exc:
            raise ConfigError(str(exc)) from None
        if cfg.use_megatron_fsdp or cfg.use_torch_fsdp2:
            raise ConfigError("--num-distributed-optimizer-instances with sharded data parallelism (hybrid "
                              "sharding) cannot be estimated: it is not modelled")
    micro_times_dp = cfg.micro_batch_size * cfg.data_parallel_size
    if cfg.global_batch_size <= 0:
        raise ConfigError("global_batch_size must be positive")
    if cfg.global_batch_size % micro_times_dp != 0:
        raise ConfigError(f"global batch size ({cfg.global_batch_size}) is not divisible by micro batch size "
                          f"({cfg.micro_batch_size}) times data parallel size ({cfg.data_parallel_size})")
    if cfg.num_attention_heads % tp != 0:
        raise ConfigError(f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                          f"tensor_model_parallel_size ({tp}).")
    groups = cfg.num_query_groups
    if groups % tp != 0 and tp % groups != 0:
        raise ConfigError(f"num_query_groups ({groups}) must be a multiple or divisor of "
                          f"tensor_model_parallel_size ({tp}).")
    if cfg.num_attention_heads % groups != 0:
        raise ConfigError(f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                          f"num_query_groups ({groups}).")
    if cfg.ffn_hidden_size % tp != 0:
        raise ConfigError(f"ffn_hidden_size ({cfg.ffn_hidden_size}) is not divisible by "
                          f"tensor_model_parallel_size ({tp})")
    if cp > 1 and cfg.seq_length % (cp * 2) != 0:
        raise ConfigError("seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1.")
    if cfg.max_position_embeddings < cfg.seq_length:
        raise ConfigError(f"max_position_embeddings ({cfg.max_position_embeddings}) must be greater than or "
                          f"equal to seq_length ({cfg.seq_length}).")
    if cfg.optimizer in ("muon", "dist_muon"):
        raise ConfigError(f"--optimizer {cfg.optimizer} changes memory or communication and cannot be estimated: "
                          "Muon's states and Newton-Schulz temporaries are not modelled")
    if cfg.quick_geglu and cfg.swiglu:
        raise ConfigError("--quick-geglu and --swiglu cannot be used together (Megatron-LM asserts not swiglu)")
    if cfg.squared_relu and (cfg.swiglu or cfg.quick_geglu):
        raise ConfigError("--squared-relu cannot be used with --swiglu or --quick-geglu (Megatron-LM asserts not "
                          "swiglu)")
    if cfg.squared_relu and cfg.bias_gelu_fusion:
        raise ConfigError("--squared-relu with the bias-GeLU fusion on (linear biases and no --no-bias-gelu-fusion): "
                          "megatron-core's TransformerConfig refuses a fused bias-activation other than gelu, swiglu "
                          "or quick-geglu; add --no-bias-gelu-fusion")
    _validate_mla(cfg)
    _validate_mtp(cfg)
    if cfg.fp32_residual_connection and not (cfg.fp16 or cfg.bf16):
        raise ConfigError("residual connection in fp32 only supported when using fp16 or bf16.")
    if cfg.position_embedding_type in ("mrope", "relative"):
        raise ConfigError(f"--position-embedding-type {cfg.position_embedding_type} is not modelled by the "
                          "estimator (learned_absolute, rope, none)")
    _validate_pipeline(cfg)
    _validate_recompute(cfg)
    _validate_moe(cfg)
    from estimator import fp8, offload, sharding, tp_overlap  # a modelled feature's checks live with its model
    for feature in (sharding, fp8, offload, tp_overlap):
        feature.validate(cfg)
    if cfg.overlap_param_gather:
        if not (cfg.use_distributed_optimizer or cfg.use_megatron_fsdp):
            raise ConfigError("--overlap-param-gather only supported with distributed optimizer or megatron fsdp")
        if not cfg.overlap_grad_reduce:
            raise ConfigError("Must use --overlap-param-gather with --overlap-grad-reduce")


def _validate_mla(cfg: TrainingConfig) -> None:
    """Multi-latent attention as Megatron-LM and megatron-core accept it."""
    if cfg.rope_type not in (None, "rope", "yarn"):
        raise ConfigError(f"--rope-type {cfg.rope_type}: choose from rope, yarn")
    if not cfg.multi_latent_attention:
        if cfg.rope_type == "yarn":
            raise ConfigError('Common attention only support rope_type="rope", but got yarn (--rope-type yarn '
                              'needs --multi-latent-attention)')
        return
    if cfg.group_query_attention:
        raise ConfigError("Group query attention is mutually exclusive with multi latent attention.")
    # megatron-core 0.16.1's words (gpt_layer_specs, MLATransformerConfig)
    if cfg.qk_l2_norm:
        raise ConfigError("qk_l2_norm is not supported with MLA.")
    if cfg.attention_output_gate:
        raise ConfigError("Output gate is not supported for MLA yet.")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank <= 0:
        raise ConfigError(f"--q-lora-rank must be positive, got {cfg.q_lora_rank}")
    if cfg.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim ({cfg.qk_pos_emb_head_dim}) must be even (rotary embedding)")
    if local_spec(cfg):
        raise ConfigError("--multi-latent-attention needs the Transformer Engine spec: megatron-core 0.16.1's local "
                          "spec cannot build it (its DotProductAttention takes no k_channels / v_channels)")


def _validate_mtp(cfg: TrainingConfig) -> None:
    """Multi-token prediction as megatron-core 0.16.1 builds it (its layers on the loss's stage:
    pipeline_layout.validate refuses a layout that places them elsewhere)."""
    n = cfg.mtp_num_layers
    if n is None:
        return
    if n <= 0:
        raise ConfigError(f"--mtp-num-layers must be positive, got {n}")


def _validate_pipeline(cfg: TrainingConfig) -> None:
    pp, vpp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    first, last = cfg.decoder_first_pipeline_num_layers, cfg.decoder_last_pipeline_num_layers
    if vpp is not None:
        if cfg.overlap_p2p_comm and pp <= 1:
            raise ConfigError("When interleaved schedule is used, pipeline-model-parallel size should be greater "
                              "than 1")
        if not cfg.overlap_p2p_comm and pp <= 2:
            raise ConfigError("When interleaved schedule is used and p2p communication overlap is disabled, "
                              "pipeline-model-parallel size should be greater than 2 to avoid having multiple "
                              "p2p sends and recvs between same 2 ranks per communication batch")
    if first is None and last is None:
        if vpp is not None and cfg.num_virtual_stages_per_pipeline_rank is not None:
            num_layers = cfg.num_layers + int(cfg.account_for_embedding_in_pipeline_split) \
                + int(cfg.account_for_loss_in_pipeline_split)
            if num_layers % pp != 0 or (num_layers // pp) % vpp != 0:
                raise ConfigError(f"num_layers_per_pipeline_rank {num_layers // pp} should be divisible by "
                                  f"vp_size {vpp}")
        return
    if cfg.account_for_embedding_in_pipeline_split or cfg.account_for_loss_in_pipeline_split:
        raise ConfigError("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be "
                          "set at the same time with account_for_embedding_in_pipeline_split and "
                          "account_for_loss_in_pipeline_split")
    middle_layers, middle_stages = cfg.num_layers, pp
    for name, count in (("first", first), ("last", last)):
        if count is None:
            continue
        if count <= 0:
            raise ConfigError(f"num_layers_in_{name}_pipeline_stage must be larger than 0")
        if vpp is not None and count % vpp != 0:
            raise ConfigError(f"number of layers at {name} stage: {count} must be divisible by virtual pipeline "
                              f"parallel degree {vpp}")
        middle_layers -= count
        middle_stages -= 1
    if middle_stages < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        raise ConfigError(f"Mismatch: {middle_layers} middle layers remaining but {middle_stages} middle PP "
                          "stages available.")
    if middle_stages and middle_layers % middle_stages != 0:
        raise ConfigError(f"number of layers at middle stage: {middle_layers} must be divisible by the middle "
                          f"pipeline model parallel size {middle_stages}")
    if middle_stages and vpp is not None and (middle_layers // middle_stages) % vpp != 0:
        raise ConfigError(f"number of layers on each middle pipeline rank: {middle_layers // middle_stages} must "
                          f"be divisible by virtual pipeline parallel degree {vpp}")


# megatron-core 0.16.1's selective recompute modules (TransformerConfig.recompute_modules), and those the estimator
# composes (estimator.compose): the others stop in one line
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
MODELLED_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts")


def field_reader(cfg):
    """get(name, default) over a TrainingConfig or its dict form (trace headers, the fitter's configs)."""
    return cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)


def moe_layer_pattern(cfg) -> list[int]:
    """1 for a MoE layer, 0 for a dense one, per global layer index (megatron-core's moe_layer_freq rule)."""
    get = field_reader(cfg)
    n, freq = get("num_layers"), get("moe_layer_freq", 1)
    if not get("num_experts"):
        return [0] * n
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(n)]
    return list(freq)


def recompute_modules(cfg) -> tuple:
    """The modules selective recompute re-runs (megatron-core's default: core attention); none without it."""
    get = field_reader(cfg)
    if get("recompute_granularity") != "selective":
        return ()
    return tuple(get("recompute_modules") or ("core_attn",))


def _validate_recompute_modules(cfg: TrainingConfig) -> None:
    """megatron-core's checks of --recompute-modules (TransformerConfig.__post_init__), then what is modelled."""
    if cfg.recompute_modules is None:
        return
    bad = sorted(set(cfg.recompute_modules) - set(RECOMPUTE_MODULES))
    if bad:
        raise ConfigError(f"Invalid choices for recompute_modules: {bad}. Allowed modules are: "
                          f"{list(RECOMPUTE_MODULES)}")
    if cfg.recompute_granularity != "selective":
        return
    if "moe_act" in cfg.recompute_modules and not cfg.moe_grouped_gemm:
        raise ConfigError("moe_act in recompute_modules is only supported with moe_grouped_gemm.")
    if "mla_up_proj" in cfg.recompute_modules and not cfg.multi_latent_attention:
        raise ConfigError("mla_up_proj in recompute_modules is only supported with multi_latent_attention.")
    unmodelled = [m for m in cfg.recompute_modules if m not in MODELLED_RECOMPUTE_MODULES]
    if unmodelled:
        raise ConfigError(f"--recompute-modules {' '.join(unmodelled)} changes memory and cannot be estimated: "
                          f"selective recompute of {', '.join(unmodelled)} is not modelled")


def _validate_recompute(cfg: TrainingConfig) -> None:
    _validate_recompute_modules(cfg)
    if cfg.distribute_saved_activations:
        if cfg.tensor_model_parallel_size <= 1:
            raise ConfigError("can distribute recomputed activations only across tensor model parallel groups")
        if cfg.recompute_granularity != "full":
            raise ConfigError("distributed recompute activations is only application to full recompute "
                              "granularity")
        if cfg.recompute_method is None:
            raise ConfigError("for distributed recompute activations to work you need to use a recompute method")
    if cfg.recompute_granularity == "full":
        if cfg.recompute_method is None:
            raise ConfigError('Using recompute_granularity: full so recompute_method must be "block" or "uniform"')
        if cfg.recompute_num_layers is None:
            raise ConfigError("When using recompute_granularity: full recompute_num_layers must be between 1 and "
                              f"num_layers_per_pipeline_rank: {cfg.num_layers // cfg.pipeline_model_parallel_size}")
    if cfg.recompute_granularity == "selective" and cfg.recompute_num_layers is not None:
        raise ConfigError("When using recompute_granularity: selective recompute_num_layers must be None.")
    if cfg.recompute_granularity is not None and cfg.distribute_saved_activations and cfg.sequence_parallel:
        raise ConfigError(f"distribute_saved_activations: {cfg.distribute_saved_activations} must be false when "
                          f"sequence parallel is enabled: {cfg.sequence_parallel}")
    if cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform" and cfg.recompute_num_layers == 0:
        # megatron-core's config accepts it, but its uniform checkpointing loop then never advances (a hung run)
        raise ConfigError("--recompute-num-layers 0 with --recompute-method uniform: megatron-core's uniform "
                          "recompute loop never advances; use --recompute-method block to recompute no layer")


def _validate_capacity(cfg: TrainingConfig) -> None:
    """Token dropping: megatron-core 0.16.1's TransformerConfig checks, and the padded all-to-all it cannot run."""
    factor = cfg.moe_expert_capacity_factor
    if factor is not None:
        kinds = cfg.moe_router_load_balancing_type
        if any(x not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
               for x in (kinds if isinstance(kinds, list) else [kinds])):
            raise ConfigError("moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, global_aux_loss "
                              "or none load balancing")
    if cfg.moe_pad_expert_input_to_capacity and (factor is None or factor < 0):
        # a negative factor is dropless there (None), so the same check fails
        raise ConfigError("moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity")
    if cfg.moe_pad_expert_input_to_capacity and cfg.moe_token_dispatcher_type == "alltoall":
        from estimator import moe_tokens
        r = moe_tokens.routing(cfg)
        if r.capacity > r.tokens:
            # the router then keeps every token for every expert, and the padded permute's view(experts, capacity)
            # fails (moe_utils.permute with drop_and_pad)
            raise ConfigError(f"--moe-pad-expert-input-to-capacity with the alltoall dispatcher: capacity "
                              f"{r.capacity} exceeds the {r.tokens} tokens per rank, which megatron-core's padded "
                              f"permute cannot reshape (lower --moe-expert-capacity-factor)")


def _validate_moe(cfg: TrainingConfig) -> None:
    if cfg.moe_apply_probs_on_input and cfg.num_experts and cfg.moe_router_topk != 1:
        raise ConfigError("`moe_apply_probs_on_input` only works with `moe_router_topk`=1.")   # megatron-core's
    balancing, coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
    if isinstance(balancing, list) and not (isinstance(coeff, list) and len(coeff) == len(balancing)):
        raise ConfigError("moe_aux_loss_coeff must be a list of the same length as "
                          "moe_router_load_balancing_type")   # megatron-core's TransformerConfig check
    ep = cfg.expert_model_parallel_size
    if ep > 1:
        if cfg.num_experts is None:
            raise ConfigError("num_experts must be non None to use expert model parallelism")
        if cfg.num_experts % ep != 0:
            raise ConfigError("Number of experts should be a multiple of expert model parallel_size.")
    if not cfg.is_moe:
        return
    if cfg.moe_token_dispatcher_type == "flex":
        # megatron-core's flex dispatcher runs DeepEP or HybridEP, whose communication buffers no trace measured:
        # refused, never estimated as another dispatcher
        raise ConfigError("--moe-token-dispatcher-type flex changes memory or communication and cannot be "
                          "estimated: the DeepEP / HybridEP dispatch buffers are not measured (allgather or alltoall "
                          "are)")
    if cfg.add_bias_linear and cfg.expert_tensor_parallel_size != 1:
        raise ConfigError("Bias in Moe is only supported when ETP==1")   # megatron-core's own check
    if (cfg.moe_router_topk == 1 and cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax
            and cfg.moe_router_load_balancing_type != "sinkhorn"):
        raise ConfigError("Please use --moe-router-pre-softmax when topk is 1.")   # megatron-core's own check
    if cfg.moe_router_topk > cfg.num_experts:
        raise ConfigError(f"moe_router_topk ({cfg.moe_router_topk}) must not exceed num_experts "
                          f"({cfg.num_experts})")
    if isinstance(cfg.moe_layer_freq, list) and len(cfg.moe_layer_freq) != cfg.num_layers:
        raise ConfigError(f"Invalid length of moe_layer_pattern: {len(cfg.moe_layer_freq)}, expected "
                          f"{cfg.num_layers}, current moe layer pattern: {cfg.moe_layer_freq}")
    if isinstance(cfg.moe_layer_freq, int) and cfg.moe_layer_freq <= 0:
        raise ConfigError(f"moe_layer_freq must be positive, got {cfg.moe_layer_freq}")
    _validate_capacity(cfg)
    if cfg.moe_ffn_hidden_size % cfg.expert_tensor_parallel_size != 0:
        raise ConfigError(f"moe_ffn_hidden_size ({cfg.moe_ffn_hidden_size}) is not divisible by "
                          f"expert_tensor_parallel_size ({cfg.expert_tensor_parallel_size})")
