"""The unfused attention's softmax on a GPU: the fused masked-softmax kernel, or torch's fp32 fallback.

The modelled formula set keeps a 16-bit model's probabilities in its dtype, as the fused kernel does whatever
--attention-softmax-in-fp32 says (build_modelled.py). The kernel runs only for some shapes and switches:
- local spec, megatron-core fusions/fused_softmax.py FusedScaleMaskSoftmax.is_kernel_available:
  --masked-softmax-fusion (Megatron-LM's default) and 16 < sk <= 4096 (sq, sk, b*heads multiples of 4); its
  fallback (forward_torch_softmax) runs in fp32 only with --attention-softmax-in-fp32 or
  --apply-query-key-layer-scaling;
- Transformer Engine's unfused backend, attention/dot_product_attention/softmax.py: NVTE_MASKED_SOFTMAX_FUSION
  (default 1) and 16 < sk < 16384; its fallback always runs in fp32 (softmax_in_fp32=True).
Where the fallback runs in fp32 it keeps the fp32 probabilities for backward and makes fp32 copies in the forward:
per layer and microbatch, in a*s^2*b/t bytes (S2), saved +4 (+2 with dropout, whose mask and output replace the
16-bit probabilities the kernel would save), forward peak +8 (+5), backward peak +6: the differences between the
CPU-measured torch path (megatron-core 0.16.1, bf16: saved 6 | 7, forward 12, backward 12) and the kernel's (2 | 5,
4 | 7, 6). A row on each layer, for the modelled set only (fitted sets measured the torch path on CPU already).
"""
from __future__ import annotations

import os

from .transforms import layer_transform


def fallback_fp32(cfg) -> bool:
    """Whether a 16-bit model's unfused attention softmax runs in torch's fp32 fallback on a GPU."""
    if getattr(cfg, "attention_kernel", "flash") != "unfused" or not (cfg.bf16 or cfg.fp16):
        return False
    s = cfg.seq_length // cfg.context_parallel_size
    if cfg.transformer_impl == "local":
        fused = cfg.masked_softmax_fusion and 16 < s <= 4096
        return not fused and bool(cfg.attention_softmax_in_fp32 or cfg.apply_query_key_layer_scaling)
    return not (os.environ.get("NVTE_MASKED_SOFTMAX_FUSION", "1") != "0" and 16 < s < 16384)


@layer_transform("fp32 softmax fallback", "layers.*.self_attention.core_attention_fp32_softmax")
def layer_row(cfg, env: dict, moe: bool, modelled: bool):
    """The row to append to each layer's rows, or None."""
    if not modelled or not fallback_fp32(cfg):
        return None
    s2 = env["a"] * env["s"] ** 2 * env["b"] / env["t"]
    drop = bool(cfg.attention_dropout)
    return ("layers.*.self_attention.core_attention_fp32_softmax", (2 if drop else 4) * s2, (5 if drop else 8) * s2,
            6 * s2)
