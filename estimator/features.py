"""Which parts of an estimate are modelled rather than measured: one line per Megatron feature the config uses
whose memory comes from a model of its implementation (no trace measured it), and the flags estimated as if
absent. The report and the JSON list them."""
from __future__ import annotations

from estimator import fp8, fused_softmax, sharding, tp_overlap
from estimator.formulas import qk_norm_of


def modelled(cfg, fset=None) -> list[str]:
    """fset: the formula set of the estimate (a feature some of its runs had is measured, not listed)."""
    out = []
    if sharding.active(cfg):
        name = "torch FSDP2" if cfg.use_torch_fsdp2 else f"Megatron FSDP ({cfg.data_parallel_sharding_strategy})"
        out.append(f"{name}: sharded weights, gradients and optimizer states, two units' gathered buffers, "
                   "DP collectives")
    if fp8.active(cfg):
        param = ", fp8 parameters" if cfg.fp8_param_gather else ""
        out.append(f"fp8 ({cfg.fp8}, {cfg.fp8_recipe}): cached fp8 weights and transposes{param}, fp8 saved "
                   "GEMM inputs")
    if cfg.optimizer_cpu_offload:
        out.append(f"optimizer CPU offload: {cfg.optimizer_offload_fraction:g} of the optimizer states on the host")
    if cfg.cpu_offloading_num_layers:
        out.append(f"activation CPU offload: the first {cfg.cpu_offloading_num_layers} layers' saved activations "
                   "(one layer in flight)")
    if tp_overlap.buffer_bytes(cfg):
        out.append(f"TP comm overlap: {tp_overlap.buffer_bytes(cfg) / (1 << 30):.2f} GiB of userbuffers per GPU")
    if cfg.softmax_type != "vanilla":
        out.append(f"--softmax-type {cfg.softmax_type}: activations as the vanilla softmax's")
    if cfg.is_moe and cfg.moe_router_dtype:
        out.append(f"--moe-router-dtype {cfg.moe_router_dtype}: router logits and scores in that dtype")
    if cfg.fp32_residual_connection and cfg.params_dtype != "fp32":
        out.append("--fp32-residual-connection: the residual stream in fp32 (each layer's two norm inputs)")
    # (MLA's latent norms are in its traced programs; an L2 norm takes the layer norm's place, measured or refused)
    if qk_norm_of(cfg) == "layernorm" and (fset is None or not fset.measures("qk_norm", "layernorm")):
        out.append("--qk-layernorm: each layer keeps the query's and key's share of the QKV output for the norms")
    if cfg.multi_latent_attention and not cfg.qk_layernorm:
        out.append("multi-latent attention without --qk-layernorm: estimated with the latents' norms it was traced "
                   "with (errs high by their saved normalized latents)")
    if cfg.quick_geglu:
        out.append("--quick-geglu: activations from the swiglu formulas")
    if cfg.cross_entropy_loss_fusion:
        out.append("--cross-entropy-loss-fusion (native): one more fp32 copy of the logits in the loss's forward "
                   "(as H100 traces show)" if cfg.cross_entropy_fusion_impl != "te" else
                   "--cross-entropy-loss-fusion with --cross-entropy-fusion-impl te: estimated as the native "
                   "fused loss (TE's kernel not measured)")
    if fused_softmax.fallback_fp32(cfg):
        out.append("attention softmax in fp32 without the fused kernel: fp32 probabilities per layer (modelled)")
    for flag in cfg.conservative_args:
        if flag.startswith("--"):
            out.append(f"{flag.split('=')[0]}: estimated as if absent (errs high)")
    return out
