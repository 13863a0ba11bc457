"""A HuggingFace `config.json` -> Megatron model fields (TrainingConfig dest names).

Covers the decoder families Megatron trains from HF checkpoints: Llama / Mistral / Qwen2 (rope, RMSNorm, swiglu,
no linear biases, GQA), Mixtral and Qwen2-MoE (plus experts), and GPT-2 (learned positions, LayerNorm, gelu, biases,
tied embeddings). Only the fields that shape the model are returned; batch, parallelism and precision stay flags.
"""
from __future__ import annotations

import json

_LLAMA_LIKE = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
_GPT2_LIKE = {"gpt2"}


def load_model_fields(path: str, error_cls: type[Exception] = ValueError) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            hf = json.load(fh)
    except OSError as exc:
        raise error_cls(f"--hf-config {path}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise error_cls(f"--hf-config {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(hf, dict):
        raise error_cls(f"--hf-config {path}: expected a JSON object")
    try:
        return model_fields(hf)
    except KeyError as exc:
        raise error_cls(f"--hf-config {path}: missing key {exc.args[0]!r}") from None
    except ValueError as exc:
        raise error_cls(f"--hf-config {path}: {exc}") from None


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    model_type = hf.get("model_type")
    if model_type in _GPT2_LIKE or (model_type is None and "n_embd" in hf):
        return _gpt2_fields(hf)
    if model_type in _LLAMA_LIKE or (model_type is None and "num_hidden_layers" in hf):
        return _llama_fields(hf)
    raise ValueError(f"model_type {model_type!r} is not supported (llama, mistral, mixtral, qwen2, qwen2_moe, gpt2)")


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r}: only silu (swiglu) is supported for this family")
    fields: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads,
        "max_position_embeddings": hf["max_position_embeddings"],
        "vocab_size": hf["vocab_size"],
        "position_embedding_type": "rope",
        "swiglu": True,
        "normalization": "RMSNorm",
        "add_bias_linear": False,
        # Qwen2 has biases on Q/K/V only; Llama may say so with attention_bias.
        "add_qkv_bias": hf.get("model_type") in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias", False)),
        "qk_layernorm": hf.get("model_type") in ("qwen3", "qwen3_moe"),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
    }
    if hf.get("head_dim"):
        fields["kv_channels"] = hf["head_dim"]
    if hf.get("rope_theta"):
        fields["rotary_base"] = int(hf["rope_theta"])   # Megatron's --rotary-base is an int
    if hf.get("rms_norm_eps"):
        fields["norm_epsilon"] = float(hf["rms_norm_eps"])
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts:
        fields["num_experts"] = experts
        fields["moe_router_topk"] = hf["num_experts_per_tok"]
        # Mixtral's experts use intermediate_size; Qwen-MoE names the expert size separately.
        fields["moe_ffn_hidden_size"] = hf.get("moe_intermediate_size") or hf["intermediate_size"]
        if hf.get("shared_expert_intermediate_size"):
            fields["moe_shared_expert_intermediate_size"] = hf["shared_expert_intermediate_size"]
        if hf.get("decoder_sparse_step", 1) not in (None, 1):
            fields["moe_layer_freq"] = hf["decoder_sparse_step"]
    return fields


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    hidden = hf["n_embd"]
    if hf.get("activation_function", "gelu_new") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function {hf['activation_function']!r}: only gelu is supported for gpt2")
    return {
        "num_layers": hf["n_layer"],
        "hidden_size": hidden,
        "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
        "num_attention_heads": hf["n_head"],
        "group_query_attention": False,
        "max_position_embeddings": hf.get("n_positions", hf.get("n_ctx", 1024)),
        "vocab_size": hf["vocab_size"],
        "position_embedding_type": "learned_absolute",
        "swiglu": False,
        "normalization": "LayerNorm",
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
        "hidden_dropout": float(hf.get("resid_pdrop", 0.1)),
        "attention_dropout": float(hf.get("attn_pdrop", 0.1)),
    }
