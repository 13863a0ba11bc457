"""A HuggingFace `config.json` -> Megatron model fields (TrainingConfig dest names).

Covers the decoder families Megatron trains from HF checkpoints: Llama / Mistral / Qwen2 / Qwen3 (rope, RMSNorm,
swiglu, no linear biases, GQA), Mixtral, Qwen2-MoE and Qwen3-MoE (plus experts), DeepSeek-V2 / V3 (multi-latent
attention, dense then MoE layers with shared experts, multi-token prediction) and GPT-2 (learned positions,
LayerNorm, gelu, biases, tied embeddings). Only the fields that shape the model are returned; batch, parallelism
and precision stay flags.
"""
from __future__ import annotations

from typing import Any

import json
import math

from estimator import validate as V

_LLAMA_LIKE = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
_GPT2_LIKE = {"gpt2"}
# A config.json is a few KB; reading stops past this (a wrong path such as /dev/zero would never end).
MAX_BYTES = 16 << 20


def load_model_fields(path: str, error_cls: type[Exception] = ValueError) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise error_cls(f"--hf-config {path}: cannot read ({exc.strerror})") from None
    if len(raw) > MAX_BYTES:
        raise error_cls(f"--hf-config {path}: larger than {MAX_BYTES >> 20} MiB, not a HF config.json")
    try:
        hf = json.loads(raw)   # bytes: json detects UTF-8, UTF-16 and UTF-32 itself
    except UnicodeDecodeError:
        raise error_cls(f"--hf-config {path}: not UTF-8, UTF-16 or UTF-32 text") from None
    except json.JSONDecodeError as exc:
        raise error_cls(f"--hf-config {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise error_cls(f"--hf-config {path}: not valid JSON (nested too deeply)") from None
    if not isinstance(hf, dict):
        raise error_cls(f"--hf-config {path}: expected a JSON object")
    try:
        return model_fields(hf)
    except KeyError as exc:
        raise error_cls(f"--hf-config {path}: missing key {exc.args[0]!r}") from None
    except ValueError as exc:
        raise error_cls(f"--hf-config {path}: {exc}") from None


_REQUIRED = object()


def _num(hf: dict, key: str, dest: str, default: Any = _REQUIRED) -> Any:
    """hf[key] checked as the Megatron field `dest` is (type, range); `default` when absent or null."""
    value = hf[key] if default is _REQUIRED else hf.get(key)
    if value is None and default is not _REQUIRED:
        return default
    return V.check_value(dest, value, ValueError, where=repr(key))


def _count(hf: dict, key: str, default: int) -> int:
    """hf[key] as a count of layers (0 allowed); `default` when absent or null."""
    value = hf.get(key)
    if value is None:
        return default
    if value.__class__ is not int or value < 0:
        raise ValueError(f"{key!r} must be a non-negative integer, got {value!r}")
    return value


def _flag(hf: dict, key: str, default: bool) -> bool:
    value = hf.get(key, default)
    if value.__class__ is not bool:   # "false" is a true string: refused rather than read the wrong way
        raise ValueError(f"{key!r} must be true or false, got {value!r}")
    return value


def _name(hf: dict, key: str, default: Any) -> Any:
    value = hf.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {value!r}")
    return value


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    model_type = _name(hf, "model_type", None)
    if model_type in _GPT2_LIKE or (model_type is None and "n_embd" in hf):
        return _gpt2_fields(hf)
    if model_type in _DEEPSEEK_LIKE:
        return _deepseek_fields(hf)
    if model_type in _LLAMA_LIKE or (model_type is None and "num_hidden_layers" in hf):
        return _llama_fields(hf)
    raise ValueError(f"model_type {model_type!r} is not supported (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, "
                     f"qwen3_moe, deepseek_v2, deepseek_v3, gpt2)")


_DEEPSEEK_LIKE = {"deepseek_v2", "deepseek_v3"}
# DeepSeek's router options: they change only the router's transients (tokens x experts), which the estimate takes
# from softmax top-k routing; listed as unused (UNUSED_KEY)
_DEEPSEEK_ROUTING = ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")
UNUSED_KEY = "_hf_unused"   # the model fields' list of the file's keys the estimate does not use


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2 / V3 (multi-latent attention with latent norms, MoE after `first_k_dense_replace` dense layers,
    shared experts, multi-token prediction layers) as Megatron-LM's flags for them."""
    fields = _llama_fields(dict(hf, model_type="llama", num_key_value_heads=None, head_dim=None,
                                num_local_experts=None, num_experts=None))
    fields.update(
        group_query_attention=False, num_query_groups=None, multi_latent_attention=True, qk_layernorm=True,
        q_lora_rank=_num(hf, "q_lora_rank", "q_lora_rank", None),
        kv_lora_rank=_num(hf, "kv_lora_rank", "kv_lora_rank"),
        qk_head_dim=_num(hf, "qk_nope_head_dim", "qk_head_dim"),
        qk_pos_emb_head_dim=_num(hf, "qk_rope_head_dim", "qk_pos_emb_head_dim"),
        v_head_dim=_num(hf, "v_head_dim", "v_head_dim"))
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict) and (scaling.get("type") or scaling.get("rope_type")) == "yarn":
        fields.update(rope_type="yarn", rotary_scaling_factor=float(_num(scaling, "factor", "rotary_scaling_factor")),
                      mscale=float(_num(scaling, "mscale", "mscale", 1.0)),
                      mscale_all_dim=float(_num(scaling, "mscale_all_dim", "mscale_all_dim", 0.0)))
    else:
        fields["rope_type"] = "rope"
    experts = _num(hf, "n_routed_experts", "num_experts", None)
    if experts:
        moe_ffn = _num(hf, "moe_intermediate_size", "moe_ffn_hidden_size")
        dense, step = _count(hf, "first_k_dense_replace", 0), _count(hf, "moe_layer_freq", 1) or 1
        layers = fields["num_layers"]
        fields.update(num_experts=experts, moe_router_topk=_num(hf, "num_experts_per_tok", "moe_router_topk"),
                      moe_ffn_hidden_size=moe_ffn,
                      moe_layer_freq=[int(i >= dense and i % step == 0) for i in range(layers)])
        shared = _count(hf, "n_shared_experts", 0)
        if shared:
            fields["moe_shared_expert_intermediate_size"] = shared * moe_ffn
    mtp = _count(hf, "num_nextn_predict_layers", 0)
    if mtp:
        fields["mtp_num_layers"] = mtp
    fields[UNUSED_KEY] = [k for k in _DEEPSEEK_ROUTING if hf.get(k) is not None]
    return fields


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    model_type = hf.get("model_type")
    heads = _num(hf, "num_attention_heads", "num_attention_heads")
    kv_heads = _num(hf, "num_key_value_heads", "num_query_groups", heads)
    act = _name(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: only silu (swiglu) is supported for this family")
    intermediate = _num(hf, "intermediate_size", "ffn_hidden_size")
    fields: dict[str, Any] = {
        "num_layers": _num(hf, "num_hidden_layers", "num_layers"),
        "hidden_size": _num(hf, "hidden_size", "hidden_size"),
        "ffn_hidden_size": intermediate,
        "num_attention_heads": heads,
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads,
        "max_position_embeddings": _num(hf, "max_position_embeddings", "max_position_embeddings"),
        "vocab_size": _num(hf, "vocab_size", "vocab_size"),
        "position_embedding_type": "rope",
        "swiglu": True,
        "normalization": "RMSNorm",
        "add_bias_linear": False,
        # Qwen2 has biases on Q/K/V only; Llama may say so with attention_bias.
        "add_qkv_bias": model_type in ("qwen2", "qwen2_moe") or _flag(hf, "attention_bias", False),
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe"),
        "untie_embeddings_and_output_weights": not _flag(hf, "tie_word_embeddings", False),
        "hidden_dropout": 0.0,
        "attention_dropout": _num(hf, "attention_dropout", "attention_dropout", 0.0),
    }
    head_dim = _num(hf, "head_dim", "kv_channels", None)
    if head_dim:
        fields["kv_channels"] = head_dim
    theta = hf.get("rope_theta")
    if theta:   # absent, null or 0: Megatron's default
        if theta.__class__ is float and math.isfinite(theta):
            theta = int(theta)   # Megatron's --rotary-base is an int (configs write 500000.0)
        fields["rotary_base"] = V.check_value("rotary_base", theta, ValueError, where="'rope_theta'")
    if hf.get("rms_norm_eps"):
        fields["norm_epsilon"] = _num(hf, "rms_norm_eps", "norm_epsilon")
    # 0 experts (some dense configs carry the key) means no MoE, as absent does.
    key = "num_local_experts" if hf.get("num_local_experts") is not None else "num_experts"
    experts = None if hf.get(key) == 0 and hf[key].__class__ is int else _num(hf, key, "num_experts", None)
    if experts:
        fields["num_experts"] = experts
        fields["moe_router_topk"] = _num(hf, "num_experts_per_tok", "moe_router_topk")
        # Mixtral's experts use intermediate_size; Qwen-MoE names the expert size separately.
        fields["moe_ffn_hidden_size"] = _num(hf, "moe_intermediate_size", "moe_ffn_hidden_size", intermediate)
        shared = _num(hf, "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", None)
        if shared:
            fields["moe_shared_expert_intermediate_size"] = shared
            # Qwen2-MoE's shared expert sits behind a sigmoid gate (its shared_expert_gate, one row)
            fields["moe_shared_expert_gate"] = model_type == "qwen2_moe"
        step = _num(hf, "decoder_sparse_step", "num_layers", 1)   # a layer count: one MoE layer every `step`
        if step != 1:
            fields["moe_layer_freq"] = step
    return fields


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    hidden = _num(hf, "n_embd", "hidden_size")
    act = _name(hf, "activation_function", "gelu_new")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function {act!r}: only gelu is supported for gpt2")
    positions = _num(hf, "n_positions", "max_position_embeddings", None)
    return {
        "num_layers": _num(hf, "n_layer", "num_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": _num(hf, "n_inner", "ffn_hidden_size", 4 * hidden),
        "num_attention_heads": _num(hf, "n_head", "num_attention_heads"),
        "group_query_attention": False,
        "max_position_embeddings": positions or _num(hf, "n_ctx", "max_position_embeddings", 1024),
        "vocab_size": _num(hf, "vocab_size", "vocab_size"),
        "position_embedding_type": "learned_absolute",
        "swiglu": False,
        "normalization": "LayerNorm",
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": not _flag(hf, "tie_word_embeddings", True),
        "hidden_dropout": _num(hf, "resid_pdrop", "hidden_dropout", 0.1),
        "attention_dropout": _num(hf, "attn_pdrop", "attention_dropout", 0.1),
    }
