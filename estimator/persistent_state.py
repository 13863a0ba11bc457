"""Tensors megatron-core keeps from one step to the next outside the weights, gradients and optimizer states, which
no op's segment sees allocated or freed once the first step ran (reported under `other`, like the local
attention's global buffer, static_memory.attention_buffer_bytes). Measured on CPU (megatron-core 0.16.1, torch
2.13.0) as the `other` bytes live at the second iteration's first forward:

- RotaryEmbedding.forward is an lru_cache: the rotary frequencies, [s, 1, 1, rotary dim] fp32, stay from the first
  forward on (4*s*d bytes with --rotary-percent 1, whatever the model's dtype).
- A MoE layer's router and token dispatcher keep tensors of the last microbatch on the module until the layer's
  next forward replaces them. With T = s*b/st router tokens on the rank:
  - all-to-all dispatcher: the routing probabilities and map ([T, E] fp32 + bool: 5*T*E) and the permutation's
    indices (8*T*k), plus per-expert split counts (at most 16*E + 40 bytes measured);
  - all-gather dispatcher, nothing gathered (TP = EP = 1): the routing map (T*E) and the top-k probabilities and
    indices (12*T*k); gathered over the TP x EP group (Tg = T * TP/ST-gathered * EP tokens): Tg*(E + 12k) without
    EP; with EP the measured bytes lie between Tg*(E + 4k) and that plus 4*T, which is taken.
"""
from __future__ import annotations

from typing import Any

from . import formulas as F


def _g(cfg: Any, name: str, default=None):
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def rotary_cache_bytes(cfg: Any) -> int:
    """Over the whole --seq-length (measured without context parallelism). (Multi-latent attention builds its own
    rotary embedding per layer instead: mla_rotary_bytes.)"""
    if _g(cfg, "position_embedding_type", "learned_absolute") not in ("rope", "yarn", "mrope") or \
            _g(cfg, "multi_latent_attention", False):
        return 0
    dim = int(F.variables(cfg)["d"] * float(_g(cfg, "rotary_percent", 1.0)))
    return 4 * int(_g(cfg, "seq_length", 0)) * dim


# MLATransformerConfig's original_max_position_embeddings (Megatron-LM 0.16.1 has no flag for it): YaRN's cos / sin
# cache is made at this length when the layer is built.
YARN_ORIGINAL_POSITIONS = 4096
# RotaryEmbedding.forward / YarnRotaryEmbedding.forward are one lru_cache(maxsize=32) per class, keyed by the layer's
# module: at most 32 layers' frequencies stay cached.
ROTARY_LRU = 32


def mla_rotary_bytes(cfg: Any, layers: int) -> int:
    """What `layers` multi-latent attention layers' own rotary embeddings keep (megatron-core 0.16.1), over the
    whole --seq-length s with rotary width dr:
    - YaRN (rope_type yarn, MLA's default) builds a cos and a sin cache of YARN_ORIGINAL_POSITIONS x dr per layer
      with the model (module buffers: a 16-bit model's Float16Module casts them to its dtype); with the fused RoPE
      the first forward replaces them by s x dr ones in the activations' dtype (get_cached_cos_sin), without it
      they stay; either way the layer's forward keeps its s x dr fp32 frequencies in the lru_cache;
    - plain RoPE (rope_type rope): the frequencies in the lru_cache only.
    Measured on CPU: the unfused YaRN layers' setup caches are what a run without them misses (0.5 MiB on two
    layers of rotary width 8)."""
    if not _g(cfg, "multi_latent_attention", False) or not layers:
        return 0
    s, dr = int(_g(cfg, "seq_length", 0)), int(_g(cfg, "qk_pos_emb_head_dim", 64))
    cached = min(layers, ROTARY_LRU) * 4 * s * dr
    if (_g(cfg, "rope_type", None) or "yarn") == "rope":
        return cached
    e = int(F.variables(cfg)["e"])
    if F.kernels(cfg)["fuse_rope"]:     # (the s x dr fp32 frequencies that built them stay in the lru_cache)
        return layers * 2 * s * dr * e + cached
    return layers * 2 * YARN_ORIGINAL_POSITIONS * dr * e + cached


def moe_layer_state_bytes(cfg: Any) -> int:
    """Bytes one MoE layer's router and dispatcher keep on the rank between its forwards."""
    v = F.variables(cfg)
    E, k, t, ep = int(v["E"]), int(v["k"]), int(v["t"]), int(v["ep"])
    if not E:
        return 0
    T = int(v["s"]) * int(v["b"]) // int(v["st"])
    if _g(cfg, "moe_token_dispatcher_type", "allgather") == "alltoall":
        return 5 * T * E + 8 * T * k + 16 * E + 40
    Tg = T * t * ep     # the all-gather dispatcher gathers over TP x EP (nothing at TP = EP = 1: Tg = T)
    return Tg * (E + 4 * k) + 4 * T if ep > 1 and t == 1 else Tg * (E + 12 * k)


def stage_bytes(cfg: Any, stage_chunks) -> int:
    """The persistent bytes of one pipeline stage: the rotary cache where it has layers, each MoE layer's state
    (multi-token prediction's transformer layers, on the loss's stage, are layers of the decoder's last kind)."""
    kinds = [k for c in stage_chunks for k in c.key[1]] + _mtp_kinds(cfg, stage_chunks)
    if not kinds:
        return 0
    return rotary_cache_bytes(cfg) + sum(map(bool, kinds)) * moe_layer_state_bytes(cfg) + \
        mla_rotary_bytes(cfg, len(kinds))


def _mtp_kinds(cfg: Any, stage_chunks) -> list:
    """The MoE flag of each MTP layer on the stage (none unless it holds the loss: a chunk key's `last`)."""
    n = int(_g(cfg, "mtp_num_layers", 0) or 0)
    if not n or not any(c.key[3] for c in stage_chunks):
        return []
    from .args import moe_layer_pattern
    return [bool(moe_layer_pattern(cfg)[-1])] * n
