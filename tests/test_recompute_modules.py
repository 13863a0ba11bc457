"""Selective recompute of megatron-core's modules (--recompute-modules), composed from the plain layer's programs.

`mlp`, `moe` and `shared_experts` checkpoint their module as `core_attn` does; `layernorm` and `moe_act` run their
module without saving and release its output once its consumer has run (megatron-core's CheckpointWithoutOutput).
No recompute run is fitted: the traced runs of fit/grids/make_cpu_recompute_modules.py judge the composition.
"""
import os
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "fit", "traces", "cpu_recompute_modules")


@pytest.mark.parametrize("name", sorted(os.listdir(TRACES)) if os.path.isdir(TRACES) else [])
def test_recompute_module_runs_within_one_percent(name):
    """Every traced rank of every run (each module alone and combined; one process, TP 2 + SP, PP 2, EP 4; dense,
    MoE with grouped-GEMM and sequential experts, shared experts, MLA) within 1% of its allocator peak."""
    from estimator import formulas as F
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from packed_runs import rank_peaks
    predicted, measured, argv = rank_peaks(os.path.join(TRACES, name), F.load("cpu_compose"))
    assert "--recompute-modules" in argv
    for p, m in zip(predicted, measured):
        assert -0.01 <= (p - m) / m <= 0.01, (name, p, m)


def test_each_module_lowers_the_estimate_and_the_modelled_set_refuses_them():
    """On a Qwen3-MoE-like layout, recomputing a module keeps less than keeping it: each module's estimate is
    below selective recompute of core attention alone, the whole MoE layer's the lowest; the per-op modelled
    set, which has core attention's recompute only, stops in one line."""
    from estimator.args import ConfigError
    from estimator.cli import build_report
    argv = shlex.split("--preset qwen3_30b_a3b --nproc_per_node 8 --tensor-model-parallel-size 2 "
                       "--expert-model-parallel-size 4 --sequence-parallel --bf16 --micro-batch-size 1 "
                       "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --num-layers 8 "
                       "--recompute-granularity selective --recompute-modules")

    def peak(modules, *extra):
        return build_report(argv + modules + list(extra), reserved=False).estimate.max_peak_bytes

    base = peak(["core_attn"])
    for modules in (["core_attn", "moe_act"], ["core_attn", "layernorm"], ["core_attn", "moe"]):
        assert peak(modules) < base, modules
    assert peak(["core_attn", "moe"]) < peak(["core_attn", "moe_act", "layernorm"])
    with pytest.raises(ConfigError, match="--recompute-modules moe_act changes memory .* 'modelled'") as err:
        peak(["core_attn", "moe_act"], "--formulas", "modelled")
    assert "\n" not in str(err.value)

