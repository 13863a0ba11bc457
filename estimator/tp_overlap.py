"""--tp-comm-overlap: Transformer Engine's userbuffers for TP communication / GEMM overlap. Modelled, not measured.

Megatron-LM (initialize._initialize_tp_communicators) calls TE's initialize_ub with the buffer shape
[seq_length x micro_batch_size / CP, hidden] once per process. TE (2.7+) registers one communicator per
(GEMM, quantization mode): qkv/fc1 fprop and proj/fc2 dgrad (ring exchange), proj/fc2 fprop (pipelined
reduce-scatter), qkv/fc1 dgrad and wgrad (bulk), proj/fc2 wgrad (external): 12 buffers of that shape, each in the
activation dtype, except that with fp8 the 8 all-gather buffers hold fp8 (1 byte). fp8 with bf16 first/last
layers registers both modes. The cuBLAS workspace is repeated for 3 streams (2 x 32 MiB more than without).
Userbuffers are device memory outside PyTorch's allocator; they count in the peak under `other`.
"""
from __future__ import annotations

ALL_GATHER = 8      # buffers that take fp8 in an fp8 run
OTHER = 4           # reduce-scatter buffers, always in the activation dtype
EXTRA_WORKSPACE = 2 * 32 * (1 << 20)


def validate(cfg) -> None:
    from estimator.args import ConfigError
    if cfg.tp_comm_overlap and not cfg.sequence_parallel:
        raise ConfigError("Tensor parallel communication/GEMM overlap can happen only when sequence parallelism "
                          "is enabled")


def buffer_bytes(cfg) -> int:
    """Bytes of the userbuffers and extra workspace on every rank (0 without --tp-comm-overlap)."""
    if not cfg.tp_comm_overlap:
        return 0
    elements = cfg.seq_length * cfg.micro_batch_size // cfg.context_parallel_size * cfg.hidden_size
    e = 4 if cfg.params_dtype == "fp32" else 2
    modes = []
    if cfg.fp8 is not None:
        modes.append(ALL_GATHER * 1 + OTHER * e)
        if cfg.first_last_layers_bf16 and (cfg.num_layers_at_start_in_bf16 or cfg.num_layers_at_end_in_bf16):
            modes.append((ALL_GATHER + OTHER) * e)
    else:
        modes.append((ALL_GATHER + OTHER) * e)
    return elements * sum(modes) + EXTRA_WORKSPACE
