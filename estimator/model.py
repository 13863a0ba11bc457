"""Per-op parameter shapes of megatron-core's GPTModel on one rank, without torch.

Op names are megatron-core's local-spec module paths with the layer index replaced by `*` (docs/FORMATS.md 2.3).
The Transformer Engine spec holds the same parameters (it fuses each layer norm into the following linear:
`input_layernorm` into `linear_qkv`, `pre_mlp_layernorm` into `linear_fc1`), so counts are spec independent.
All TP ranks hold the same shapes, and so do all EP ranks, so a rank's parameters depend only on its pipeline
rank and virtual stage. Sharding rules follow megatron-core 0.16: ColumnParallelLinear splits the output over TP,
RowParallelLinear the input (its bias is whole), norms and the MoE router are replicated, experts are split over
EP (whole experts) and expert-TP, shared experts over TP.
"""
from __future__ import annotations

from typing import Optional

from estimator._record import dataclass, field
from math import prod

from estimator.args import TrainingConfig
from estimator.formulas import qk_norm_of


@dataclass(frozen=True)
class OpParams:
    op: str  # e.g. "layers.*.mlp.linear_fc1", "embedding.word_embeddings"
    layer: Optional[int]  # global layer index (0-based), None for non-layer ops
    shapes: tuple  # parameter shapes held by one rank for one instance, e.g. ((out, in), (out,))
    count: int = 1  # instances on this rank (local experts), each with `shapes`
    is_expert: bool = False  # sharded over EP and expert-TP; reduced over expert-DP
    shared_embedding: bool = False  # kept equal over the embedding group: first / last stage (tied or MTP)

    @property
    def numel(self) -> int:
        return self.count * sum(prod(shape) for shape in self.shapes)


@dataclass
class RankParams:
    pp_rank: int
    vp_stage: Optional[int]
    ops: list = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(op.numel for op in self.ops)

    @property
    def expert(self) -> int:
        return sum(op.numel for op in self.ops if op.is_expert)

    @property
    def dense(self) -> int:
        return self.total - self.expert


# --- pipeline layout -----------------------------------------------------------------------------------------

def virtual_stages(cfg: TrainingConfig) -> int:
    return cfg.virtual_pipeline_model_parallel_size or 1


def layers_per_pp_rank(cfg: TrainingConfig, pp_rank: int) -> int:
    """Transformer layers on one pipeline rank over all its virtual stages (megatron-core get_num_layers_to_build)."""
    pp = cfg.pipeline_model_parallel_size
    if cfg.pipeline_model_parallel_layout is not None:
        return sum(_layers_per_chunk(cfg, pp_rank, vp) for vp in range(virtual_stages(cfg)))
    first, last = cfg.decoder_first_pipeline_num_layers, cfg.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        if pp_rank == 0 and first is not None:
            return first
        if pp_rank == pp - 1 and last is not None:
            return last
        middle_stages = pp - (first is not None) - (last is not None)
        return (cfg.num_layers - (first or 0) - (last or 0)) // middle_stages
    num_layers = cfg.num_layers + cfg.account_for_embedding_in_pipeline_split + cfg.account_for_loss_in_pipeline_split
    count = num_layers // pp
    # The embedding / loss "layer" occupies a slot on the first / last rank.
    if cfg.account_for_embedding_in_pipeline_split and pp_rank == 0:
        count -= 1
    if cfg.account_for_loss_in_pipeline_split and pp_rank == pp - 1:
        count -= 1
    return count


def stage_layers(cfg: TrainingConfig, pp_rank: int, vp_stage: Optional[int] = None) -> list[int]:
    """Global layer indices built on (pp_rank, vp_stage): contiguous blocks, interleaved over virtual stages."""
    pp, vpp = cfg.pipeline_model_parallel_size, virtual_stages(cfg)
    if pp == 1:
        return list(range(cfg.num_layers))
    # Walk the chunks in model order (vp stage major, pp rank minor), like megatron-core's layer offsets.
    start = 0
    for vp in range(vpp):
        for rank in range(pp):
            per_chunk = _layers_per_chunk(cfg, rank, vp)
            if rank == pp_rank and vp == (vp_stage or 0):
                return list(range(start, start + per_chunk))
            start += per_chunk
    raise ValueError(f"pp_rank {pp_rank} / vp_stage {vp_stage} out of range")


def _layers_per_chunk(cfg: TrainingConfig, pp_rank: int, vp_stage: int) -> int:
    vpp = virtual_stages(cfg)
    if cfg.pipeline_model_parallel_layout is not None:
        from estimator import pipeline_layout as PL
        stages = PL.stages(cfg.pipeline_model_parallel_layout)
        return PL.decoder_layers(stages, cfg.pipeline_model_parallel_size, pp_rank, vp_stage)
    per_rank = cfg.num_layers + cfg.account_for_embedding_in_pipeline_split + cfg.account_for_loss_in_pipeline_split
    if cfg.decoder_first_pipeline_num_layers is None and cfg.decoder_last_pipeline_num_layers is None:
        per_chunk = per_rank // cfg.pipeline_model_parallel_size // vpp
        # The embedding slot is the first chunk of rank 0, the loss slot the last chunk of the last rank.
        if cfg.account_for_embedding_in_pipeline_split and pp_rank == 0 and vp_stage == 0:
            per_chunk -= 1
        if (cfg.account_for_loss_in_pipeline_split and pp_rank == cfg.pipeline_model_parallel_size - 1
                and vp_stage == vpp - 1):
            per_chunk -= 1
        return per_chunk
    return layers_per_pp_rank(cfg, pp_rank) // vpp


def has_embedding(cfg: TrainingConfig, pp_rank: int, vp_stage: Optional[int] = None) -> bool:
    return pp_rank == 0 and (vp_stage or 0) == 0


def has_output(cfg: TrainingConfig, pp_rank: int, vp_stage: Optional[int] = None) -> bool:
    return pp_rank == cfg.pipeline_model_parallel_size - 1 and (vp_stage or 0) == virtual_stages(cfg) - 1


# --- per-op shapes ------------------------------------------------------------------------------------------

def _norm(cfg: TrainingConfig, size: int) -> tuple:
    return ((size,), (size,)) if cfg.normalization == "LayerNorm" else ((size,),)


def _linear(out_features: int, in_features: int, bias: bool, bias_size: Optional[int] = None) -> tuple:
    weight = ((out_features, in_features),)
    return weight + ((bias_size if bias_size is not None else out_features,),) if bias else weight


def _mla_ops(cfg: TrainingConfig, layer: int) -> list[OpParams]:
    """megatron-core's MLASelfAttention with the Transformer Engine spec (the local spec cannot build it): a query
    projection (or a down / up pair through q_lora_rank), a key-value down projection to kv_lora_rank plus the
    shared rotary key, its up projection to every head's key and value, the output projection. The down
    projections are replicated on every TP rank (TELinear, parallel_mode "duplicated"); with --qk-layernorm the
    latents' norms are fused into the up projections (TELayerNormColumnParallelLinear). No biases but the
    output projection's."""
    t, h, a = cfg.tensor_model_parallel_size, cfg.hidden_size, cfg.num_attention_heads
    q_head = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    pre = "layers.*.self_attention."

    ops = [OpParams("layers.*.input_layernorm", layer, _norm(cfg, h))]

    def up(name: str, norm: str, rank: int, out: int) -> None:
        if cfg.qk_layernorm:    # named as its own module, as the input norm is (module docstring)
            ops.append(OpParams(pre + norm, layer, _norm(cfg, rank)))
        ops.append(OpParams(pre + name, layer, _linear(out, rank, False)))

    if cfg.q_lora_rank is None:
        ops.append(OpParams(pre + "linear_q_proj", layer, _linear(a * q_head // t, h, False)))
    else:
        ops.append(OpParams(pre + "linear_q_down_proj", layer, _linear(cfg.q_lora_rank, h, False)))
        up("linear_q_up_proj", "q_layernorm", cfg.q_lora_rank, a * q_head // t)
    ops.append(OpParams(pre + "linear_kv_down_proj", layer,
                        _linear(cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, h, False)))
    up("linear_kv_up_proj", "kv_layernorm", cfg.kv_lora_rank, a * (cfg.qk_head_dim + cfg.v_head_dim) // t)
    if cfg.softmax_type == "learnable":
        ops.append(OpParams(pre + "core_attention", layer, ((a // t,),)))
    ops.append(OpParams(pre + "linear_proj", layer, _linear(h, a * cfg.v_head_dim // t, cfg.add_bias_linear)))
    ops.append(OpParams("layers.*.pre_mlp_layernorm", layer, _norm(cfg, h)))
    return ops


def _attention_ops(cfg: TrainingConfig, layer: int) -> list[OpParams]:
    if cfg.multi_latent_attention:
        return _mla_ops(cfg, layer)
    t, h, d = cfg.tensor_model_parallel_size, cfg.hidden_size, cfg.kv_channels
    # (the output gate's projection rides in linear_qkv: one more head-width column per attention head)
    gate = cfg.num_attention_heads if cfg.attention_output_gate else 0
    qkv_out = d * (cfg.num_attention_heads + 2 * cfg.num_query_groups + gate) // t
    ops = [
        OpParams("layers.*.input_layernorm", layer, _norm(cfg, h)),
        OpParams("layers.*.self_attention.linear_qkv", layer, _linear(qkv_out, h, cfg.add_qkv_bias)),
    ]
    if qk_norm_of(cfg) == "layernorm":    # (megatron's L2Norm, which the spec takes instead, has no weights)
        ops.append(OpParams("layers.*.self_attention.q_layernorm", layer, _norm(cfg, d)))
        ops.append(OpParams("layers.*.self_attention.k_layernorm", layer, _norm(cfg, d)))
    if cfg.softmax_type == "learnable":
        # A learnable offset per attention head of this rank (megatron-core DotProductAttention.softmax_offset).
        ops.append(OpParams("layers.*.self_attention.core_attention", layer, ((cfg.num_attention_heads // t,),)))
    proj_in = d * cfg.num_attention_heads // t
    ops.append(OpParams("layers.*.self_attention.linear_proj", layer, _linear(h, proj_in, cfg.add_bias_linear)))
    ops.append(OpParams("layers.*.pre_mlp_layernorm", layer, _norm(cfg, h)))
    return ops


def _mlp_ops(cfg: TrainingConfig, prefix: str, layer: int, ffn: int, tp: int, count: int = 1,
             is_expert: bool = False) -> list[OpParams]:
    h, gated = cfg.hidden_size, 2 if (cfg.swiglu or cfg.quick_geglu) else 1  # gated linear units
    fc1 = _linear(gated * ffn // tp, h, cfg.add_bias_linear)
    fc2 = _linear(h, ffn // tp, cfg.add_bias_linear)
    return [OpParams(f"{prefix}.linear_fc1", layer, fc1, count, is_expert),
            OpParams(f"{prefix}.linear_fc2", layer, fc2, count, is_expert)]


def _moe_ops(cfg: TrainingConfig, layer: int) -> list[OpParams]:
    experts, h = cfg.num_experts, cfg.hidden_size
    router = ((experts, h), (experts,)) if cfg.add_bias_linear else ((experts, h),)
    ops = [OpParams("layers.*.mlp.router", layer, router)]
    local_experts = experts // cfg.expert_model_parallel_size
    ops += _mlp_ops(cfg, "layers.*.mlp.experts", layer, cfg.moe_ffn_hidden_size, cfg.expert_tensor_parallel_size,
                    count=local_experts, is_expert=True)
    if cfg.moe_shared_expert_intermediate_size:
        if cfg.moe_shared_expert_gate:     # SharedExpertMLP.gate_weight [1, h], replicated
            ops.append(OpParams("layers.*.mlp.shared_experts", layer, ((1, cfg.hidden_size),)))
        ops += _mlp_ops(cfg, "layers.*.mlp.shared_experts", layer, cfg.moe_shared_expert_intermediate_size,
                        cfg.tensor_model_parallel_size)
    return ops


def layer_ops(cfg: TrainingConfig, layer: int) -> list[OpParams]:
    """The parameters of global layer `layer` on one rank."""
    ops = _attention_ops(cfg, layer)
    if cfg.moe_layer_pattern()[layer]:
        ops += _moe_ops(cfg, layer)
    else:
        ops += _mlp_ops(cfg, "layers.*.mlp", layer, cfg.ffn_hidden_size, cfg.tensor_model_parallel_size)
    return ops


def rank_params(cfg: TrainingConfig, pp_rank: int = 0, vp_stage: Optional[int] = None) -> RankParams:
    """Parameters of one model chunk (pp_rank, vp_stage); vp_stage None means all virtual stages of the rank."""
    if vp_stage is None and virtual_stages(cfg) > 1:
        merged = RankParams(pp_rank, None)
        for vp in range(virtual_stages(cfg)):
            merged.ops += rank_params(cfg, pp_rank, vp).ops
        return merged
    result = RankParams(pp_rank, vp_stage)
    first, last = has_embedding(cfg, pp_rank, vp_stage), has_output(cfg, pp_rank, vp_stage)
    result.ops += head_ops(cfg, first, last)
    for layer in stage_layers(cfg, pp_rank, vp_stage):
        result.ops += layer_ops(cfg, layer)
    result.ops += tail_ops(cfg, first, last)
    return result


def _shared_copies(cfg: TrainingConfig) -> bool:
    """Whether the first stage's word embedding and the last stage's output weight are kept equal by the
    embedding group (flagged `shared_embedding`: their own DDP bucket): tied weights, or multi-token prediction,
    over more than one pipeline stage (megatron-core's LanguageModule.setup_embeddings_and_output_layer)."""
    return cfg.pipeline_model_parallel_size > 1 and (not cfg.untie_embeddings_and_output_weights
                                                     or bool(cfg.mtp_num_layers))


def head_ops(cfg: TrainingConfig, first: bool, last: bool = False) -> list[OpParams]:
    """Embedding parameters of a chunk: the model's first chunk's, and multi-token prediction's own copy on the
    loss's chunk when that is another (GPTModel builds one wherever the MTP block is)."""
    if not (first or (last and cfg.mtp_num_layers)):
        return []
    h, vocab_shard = cfg.hidden_size, cfg.padded_vocab_size // cfg.tensor_model_parallel_size
    ops = [OpParams("embedding.word_embeddings", None, ((vocab_shard, h),),
                    shared_embedding=first and _shared_copies(cfg))]
    if cfg.position_embedding_type == "learned_absolute":
        ops.append(OpParams("embedding.position_embeddings", None, ((cfg.max_position_embeddings, h),)))
    return ops


def tail_ops(cfg: TrainingConfig, first: bool, last: bool) -> list[OpParams]:
    """Final norm and output layer of a chunk (none unless it is the model's last chunk)."""
    if not last:
        return []
    h, vocab_shard = cfg.hidden_size, cfg.padded_vocab_size // cfg.tensor_model_parallel_size
    ops = [OpParams("final_layernorm", None, _norm(cfg, h))]
    ops += mtp_ops(cfg)
    tied = not cfg.untie_embeddings_and_output_weights
    # Tied: the chunk that also holds the embedding reuses its weight; any other last chunk keeps a copy
    # that is kept equal by an all-reduce over the embedding group.
    if not tied or not first:
        ops.append(OpParams("output_layer", None, ((vocab_shard, h),),
                            shared_embedding=not first and _shared_copies(cfg)))
    return ops


def mtp_ops(cfg: TrainingConfig) -> list[OpParams]:
    """Multi-token prediction's layers (megatron-core MultiTokenPredictionLayer), numbered after the decoder's:
    the embedding's and the hidden state's norms, the projection of both joined (2h -> h, column-parallel, no
    bias), a transformer layer of the decoder's last layer's spec, a final norm."""
    h, t, last = cfg.hidden_size, cfg.tensor_model_parallel_size, cfg.num_layers - 1
    ops = []
    for layer in range(cfg.num_layers, cfg.num_layers + (cfg.mtp_num_layers or 0)):
        ops += [OpParams("mtp.layers.*.enorm", layer, _norm(cfg, h)),
                OpParams("mtp.layers.*.hnorm", layer, _norm(cfg, h)),
                OpParams("mtp.layers.*.eh_proj", layer, _linear(h // t, 2 * h, False))]
        ops += [OpParams(MTP_LAYER + op.op[len("layers.*"):], layer, op.shapes, op.count, op.is_expert)
                for op in layer_ops(cfg, last)]
        ops.append(OpParams("mtp.layers.*.final_layernorm", layer, _norm(cfg, h)))
    return ops


MTP_LAYER = "mtp.layers.*.transformer_layer"


def chunk_layer_table(cfg: TrainingConfig) -> dict:
    """{(pp_rank, vp_stage): stage_layers(cfg, pp_rank, vp_stage)} for every chunk, in one walk (vp_stage 0..vpp-1)."""
    pp, vpp = cfg.pipeline_model_parallel_size, virtual_stages(cfg)
    if pp == 1:
        return {(0, vp): list(range(cfg.num_layers)) for vp in range(vpp)}
    table, start = {}, 0
    for vp in range(vpp):
        for rank in range(pp):
            per_chunk = _layers_per_chunk(cfg, rank, vp)
            table[(rank, vp)] = list(range(start, start + per_chunk))
            start += per_chunk
    return table


def all_rank_params(cfg: TrainingConfig) -> list[RankParams]:
    """One entry per pipeline rank (all virtual stages merged): the distinct rank classes."""
    return [rank_params(cfg, pp_rank) for pp_rank in range(cfg.pipeline_model_parallel_size)]


def model_total_params(cfg: TrainingConfig) -> int:
    """Unique parameters of the whole model (no TP/EP sharding, tied copy counted once)."""
    unsharded = TrainingConfig.from_dict({**cfg.to_dict(), "tensor_model_parallel_size": 1,
                                          "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
                                          "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size":
                                          None, "decoder_first_pipeline_num_layers": None,
                                          "decoder_last_pipeline_num_layers": None,
                                          "account_for_embedding_in_pipeline_split": False,
                                          "account_for_loss_in_pipeline_split": False})
    return rank_params(unsharded, 0).total
