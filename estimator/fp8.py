"""fp8 training with Transformer Engine (--fp8-format, --fp8-recipe, --fp8-param-gather): modelled, not measured
(no CPU kernel runs fp8).

Weights (per element of each fp8 GEMM weight: the transformer layers' linear_qkv, linear_proj, linear_fc1,
linear_fc2 and their expert / shared-expert twins; embedding, output layer, norms and router stay 16-bit):
- TE caches the quantized weight across microbatches in both layouts the GEMMs need: rowwise for forward and
  dgrad, columnwise (the transpose) for wgrad: 2 bytes beside the 16-bit parameter.
- --fp8-param-gather: the parameter itself is fp8 (1 byte instead of 2; the distributed optimizer keeps its fp32
  main copy) and only the transpose is cached (+1).
- mxfp8 keeps one 1-byte scale per 32 elements for each layout (+1/16); blockwise's 128x128 fp32 scales are
  negligible.
- delayed scaling keeps an amax history per fp8 module: (3 forward + 2 backward tensors) x history x fp32.
Activations (per transformer layer, against the 16-bit formulas): the inputs TE saves for the weight gradient are
quantized: the layer-norm outputs saved by linear_qkv and (dense) linear_fc1, and the activation output saved for
linear_fc2, take 1 byte instead of 2; linear_proj saves an fp8 copy of the attention output that flash attention
keeps in 16-bit anyway (+1 byte). Layers kept in bf16 (--first-last-layers-bf16) and the MoE expert path are
estimated with their 16-bit savings only (the estimate errs high there).
"""
from __future__ import annotations

from .transforms import layer_transform

FP8_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def active(cfg) -> bool:
    return getattr(cfg, "fp8", None) is not None


def validate(cfg) -> None:
    """megatron-core TransformerConfig's fp8 checks, in its words."""
    from estimator.args import ConfigError
    if cfg.fp8_param_gather and not active(cfg):
        raise ConfigError("fp8_param must be used together with fp8 mode.")
    if not active(cfg):
        return
    from estimator.static_memory import local_spec
    if cfg.attention_kernel == "unfused" and local_spec(cfg):
        raise ConfigError("--fp8-format needs --transformer-impl transformer_engine: the local spec has no fp8 "
                          "GEMMs")
    if cfg.fp8_recipe == "custom":
        raise ConfigError("fp8_quantizer_factory must be provided when fp8_recipe is 'custom'. Specify a Python "
                          "import path (e.g., package.module.quantizer_factory) via --fp8-quantizer-factory.")
    if cfg.first_last_layers_bf16 and cfg.fp8_recipe == "delayed":
        raise ConfigError("Delayed scaling does not support first / last layer in BF16.")
    per_stage = cfg.num_layers // cfg.pipeline_model_parallel_size
    for name in ("start", "end"):
        n = getattr(cfg, f"num_layers_at_{name}_in_bf16")
        if cfg.first_last_layers_bf16 and not 0 <= n <= per_stage:
            raise ConfigError(f"num_layers_at_{name}_in_bf16 ({n}) must be between 0 and number of layers per "
                              f"pipeline stage ({per_stage}).")
    if cfg.fp8_param_gather and not (cfg.use_distributed_optimizer or cfg.use_torch_fsdp2 or cfg.use_megatron_fsdp):
        raise ConfigError("--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron "
                          "fsdp, or inference mode")
    if cfg.optimizer_cpu_offload and cfg.fp8_param_gather and cfg.fp8_recipe != "delayed":
        raise ConfigError("When `--fp8-param-gather` is enabled, the optimizer cpu offload must be used in "
                          "conjunction with `--fp8-recipe delayed`.")


def bf16_layers(cfg) -> set:
    """Global indices of the layers --first-last-layers-bf16 keeps out of fp8."""
    if not cfg.first_last_layers_bf16:
        return set()
    n = cfg.num_layers
    return set(range(cfg.num_layers_at_start_in_bf16)) | set(range(n - cfg.num_layers_at_end_in_bf16, n))


def _cache_bytes_per_element(cfg) -> float:
    """Bytes TE keeps per fp8 weight element besides the parameter (cached quantized copies and scales)."""
    scales = 2 / 32 if cfg.fp8_recipe == "mxfp8" else 0.0
    return (1.0 if cfg.fp8_param_gather else 2.0) + scales


def _fp8_gemm_ops(cfg, pp_rank: int):
    """The fp8 GEMM ops (OpParams) of a pipeline stage's layers, bf16 layers left out."""
    from estimator import model as M
    skip = bf16_layers(cfg)
    for (rank, _), layers in M.chunk_layer_table(cfg).items():
        if rank != pp_rank:
            continue
        for layer in layers:
            if layer not in skip:
                yield from (op for op in M.layer_ops(cfg, layer) if op.op.rsplit(".", 1)[-1] in FP8_LINEARS)


def _weight_elements(op) -> int:
    return op.count * sum(x * y for x, y in (s for s in op.shapes if len(s) == 2))


def param_gather_share(cfg, pp_rank: int, chunks) -> float:
    """With --fp8-param-gather, the share of the stage's dense parameters that are fp8 GEMM weights (0 without)."""
    if not (active(cfg) and cfg.fp8_param_gather):
        return 0.0
    dense = sum(p[0] for c in chunks for p in c if not p[1])
    fp8_dense = sum(_weight_elements(op) for op in _fp8_gemm_ops(cfg, pp_rank) if not op.is_expert)
    return fp8_dense / dense if dense else 0.0


def stage_weight_bytes(cfg, pp_rank: int, param_bytes: int) -> tuple:
    """(bytes to add to the stage's weights, fp8 modules on it): caches, amax histories, and with fp8 parameters
    the 16-bit parameters' bytes given back (param_bytes: bytes per parameter element of the 16-bit model)."""
    ops = list(_fp8_gemm_ops(cfg, pp_rank))
    elements, modules = sum(_weight_elements(op) for op in ops), sum(op.count for op in ops)
    added = elements * _cache_bytes_per_element(cfg)
    if cfg.fp8_param_gather:
        added -= elements * (param_bytes - 1)  # the parameter is stored in fp8
    if cfg.fp8_recipe == "delayed":
        added += modules * (3 + 2) * cfg.fp8_amax_history_len * 4
    return int(added), modules


# The layer row layer_row returns: a signed correction of the 16-bit formulas' saved bytes (negative where fp8
# saves more than linear_proj's copy adds), not a formula of the set; the layer's total stays nonnegative.
SAVED_INPUTS_OP = "layers.*.fp8_saved_inputs"


def layer_row(cfg, env: dict, moe: bool) -> tuple:
    """(op, saved, fwd peak, bwd peak) to append to a transformer layer's rows: what fp8 changes in its saved
    activations against the 16-bit formulas (per microbatch)."""
    e, s, b, h, st, t = (env[k] for k in ("e", "s", "b", "h", "st", "t"))
    a, d, f = env["a"], env["d"], env["f"]
    copy = s * b * a * d / t                      # linear_proj's fp8 copy of the attention output
    saving = 0.0
    if not cfg.first_last_layers_bf16:
        saving += (e - 1) * s * b * h / st        # linear_qkv's layer-norm output
        if not moe:
            saving += (e - 1) * s * b * h / st    # linear_fc1's layer-norm output
            saving += (e - 1) * s * b * f / t     # linear_fc2's input (the activation output)
    delta = copy - saving
    return (SAVED_INPUTS_OP, delta, max(delta, 0.0), 0.0)


@layer_transform("fp8 saved inputs", SAVED_INPUTS_OP)
def _saved_inputs(cfg, env: dict, moe: bool, modelled: bool):
    return layer_row(cfg, env, moe) if active(cfg) else None
