"""CPU offload: of the optimizer (--optimizer-cpu-offload, --optimizer-offload-fraction) and of activations
(--cpu-offloading-num-layers). Modelled, not measured.

Optimizer: megatron-core's HybridDeviceOptimizer moves the first parameters (in optimizer order) to the CPU until
their elements reach the fraction of the rank's shard; their fp32 main copies and Adam states live in pinned host
memory. The GPU keeps the rest: (1 - fraction) of the optimizer bytes (parameter granularity ignored).
Activations: Transformer Engine's CPU-offload context copies the saved activations of the first N layers of a
microbatch to the host while the next layer computes and brings each back before its backward, so one such
layer's saved bytes stay on the GPU (the buffer in flight) and the other N - 1 leave it.
"""
from __future__ import annotations

from .transforms import chunk_transform


def validate(cfg) -> None:
    """Megatron-LM's and megatron-core's checks, in their words."""
    from estimator.args import ConfigError
    if cfg.use_precision_aware_optimizer:
        if cfg.optimizer != "adam":
            raise ConfigError("--use-precision-aware-optimizer only supported with adam")
        if not cfg.use_distributed_optimizer:
            raise ConfigError("--use-precision-aware-optimizer only supported with distributed optimizer")
    else:   # megatron-core's OptimizerConfig
        for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(cfg, name) != "fp32":
                raise ConfigError(f"{name} can only be fp32 when not using precision-aware optimizer")
    if cfg.optimizer_cpu_offload and not cfg.use_precision_aware_optimizer:
        raise ConfigError("The optimizer cpu offload must be used in conjunction with "
                          "`--use-precision-aware-optimizer`, as the hybrid device optimizer reuses the code path "
                          "of this flag.")
    if not 0.0 <= cfg.optimizer_offload_fraction <= 1.0:
        raise ConfigError(f"--optimizer-offload-fraction must be between 0 and 1, got "
                          f"{cfg.optimizer_offload_fraction}")
    n = cfg.cpu_offloading_num_layers
    if n:
        if n < 0 or n >= cfg.num_layers:
            raise ConfigError(f"CPU offloading can be done only for layers less than {cfg.num_layers}")
        if cfg.pipeline_model_parallel_size > 1:
            raise ConfigError("Currently there is no support for Pipeline parallelism with CPU offloading")
        if cfg.recompute_granularity is not None:
            raise ConfigError("CPU offloading does not work when activation recomputation is enabled")


def optimizer_gpu_share(cfg) -> float:
    """The share of the optimizer's bytes left on the GPU."""
    return 1.0 - cfg.optimizer_offload_fraction if cfg.optimizer_cpu_offload else 1.0


@chunk_transform("activation CPU offload")
def activation_relief(cfg, layer_kept: list) -> float:
    """Saved bytes per microbatch that leave the GPU; layer_kept: each layer's saved bytes, in order."""
    n = cfg.cpu_offloading_num_layers
    if not n or not layer_kept:
        return 0.0
    first = layer_kept[:n]
    return sum(first) - max(first)
