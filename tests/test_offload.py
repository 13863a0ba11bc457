"""CPU offload (estimator.offload, modelled): optimizer states by fraction, activations of the first N layers."""
import shlex

import pytest

from estimator import memory as MEM
from estimator.args import ConfigError, parse_args

BASE = ("--nproc_per_node 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --vocab-size 500 --micro-batch-size 2 --bf16 --use-distributed-optimizer ")


def rank(extra):
    return MEM.estimate(parse_args(shlex.split(BASE + extra)), "modelled").ranks[0]


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_optimizer_offload_keeps_the_rest_on_the_gpu(fraction):
    plain = rank("--use-precision-aware-optimizer")
    off = rank(f"--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction {fraction}")
    assert off.bytes["optimizer_states"] == int(plain.bytes["optimizer_states"] * (1 - fraction))
    assert off.peak_bytes == pytest.approx(plain.peak_bytes - fraction * plain.bytes["optimizer_states"], abs=1)
    assert off.bytes["parameters"] == plain.bytes["parameters"] and off.bytes["gradients"] == plain.bytes["gradients"]


def test_activation_offload_moves_all_but_one_layer():
    assert rank("").per_op["layers.*"]["count"] == 4
    chunks = [MEM.estimate(parse_args(shlex.split(BASE + f"--cpu-offloading-num-layers {n}")), "modelled")
              for n in (0, 1, 2, 3)]
    peaks = [c.max_peak_bytes for c in chunks]
    assert peaks[0] == peaks[1]                       # one layer offloaded: it is also the buffer in flight
    assert peaks[1] > peaks[2] > peaks[3]             # equal layers: each further one takes a layer's bytes away
    assert peaks[1] - peaks[2] == pytest.approx(peaks[2] - peaks[3])


@pytest.mark.parametrize("extra,message", [
    ("--optimizer-cpu-offload", "must be used in conjunction with `--use-precision-aware-optimizer`"),
    ("--use-precision-aware-optimizer --optimizer sgd", "only supported with adam"),
    ("--cpu-offloading-num-layers 4", "only for layers less than 4"),
    ("--cpu-offloading-num-layers 1 --pipeline-model-parallel-size 2", "no support for Pipeline parallelism"),
    ("--cpu-offloading-num-layers 1 --recompute-activations", "does not work when activation recomputation"),
])
def test_offload_checks(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", ".")):
        parse_args(shlex.split(BASE + extra))


@pytest.mark.parametrize("flags,dtypes", [
    # (master copy, first moment, second moment): TE's FusedAdam keeps a bf16 parameter's fp32 master copy as the
    # 16 bits the parameter lacks (store_param_remainders)
    ("", ("int16", "float32", "float32")),
    ("--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", ("int16", "bfloat16", "bfloat16")),
    ("--main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16", ("float16", "uint8", "float16")),
])
def test_precision_aware_optimizer_keeps_its_states_in_their_dtypes(flags, dtypes):
    """--use-precision-aware-optimizer: the distributed optimizer's states per element of the rank's shard in the
    dtypes megatron-core 0.16.1 allocates them (distrib_optimizer's state shards: torch.int16 remainders or
    main_params_dtype, exp_avg_dtype, exp_avg_sq_dtype; fp8 moments as uint8), and no fp32 gradient copy."""
    import torch
    plain = rank("")
    aware = rank("--use-precision-aware-optimizer " + flags)
    elems = plain.static.optimizer_detail["state_elements"]
    per_element = sum(torch.empty(0, dtype=getattr(torch, d)).element_size() for d in dtypes)
    assert aware.bytes["optimizer_states"] == elems * per_element
    assert plain.bytes["optimizer_states"] == elems * (4 + 4 + 4)
    # 16-bit gradients: Megatron's optimizer copies them to fp32 in the step, TE's reads the buffer itself
    copies = [rank("--grad-reduce-in-bf16 " + f).static.optimizer_detail["fp32_grad_copy_bytes"]
              for f in ("", "--use-precision-aware-optimizer " + flags)]
    assert copies[1] == 0 < copies[0]


def test_state_dtypes_need_the_precision_aware_optimizer():
    with pytest.raises(ConfigError, match="exp_avg_dtype can only be fp32 when not using precision-aware optimizer"):
        parse_args(shlex.split(BASE + "--exp-avg-dtype bf16"))
