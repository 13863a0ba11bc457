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
    """Over the whole --seq-length (measured without context parallelism)."""
    if _g(cfg, "position_embedding_type", "learned_absolute") not in ("rope", "yarn", "mrope"):
        return 0
    dim = int(F.variables(cfg)["d"] * float(_g(cfg, "rotary_percent", 1.0)))
    return 4 * int(_g(cfg, "seq_length", 0)) * dim


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
    """The persistent bytes of one pipeline stage: the rotary cache where it has layers, each MoE layer's state."""
    kinds = [k for c in stage_chunks for k in c.key[1]]
    if not kinds:
        return 0
    return rotary_cache_bytes(cfg) + sum(map(bool, kinds)) * moe_layer_state_bytes(cfg)
