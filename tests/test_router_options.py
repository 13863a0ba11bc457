"""DeepSeek-style MoE router options, read as softmax top-k routing (their tensors are the router's own); the shared
experts' sigmoid gate and the probabilities applied on the experts' input (modelled rows)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "fit", "traces", "cpu_router_options")))
                         if os.path.isdir(os.path.join(ROOT, "fit", "traces", "cpu_router_options")) else [])
def test_deepseek_router_options_read_as_softmax_routing(name):
    """DeepSeek-style routing (sigmoid scores, expert bias, group-limited top-k, top-k scaling; never fitted) changes
    only the router's tokens x experts tensors: estimated as softmax top-k routing, every run within 0.2% of its
    allocator peak (fit/grids/make_cpu_router_options.py); and runs of shared experts behind their gate, and of
    top-1 routing with the probabilities on the experts' input (a modelled row: 0.7% to 1% under without it)."""
    from estimator import formulas as F
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from packed_runs import rank_peaks
    predicted, measured, argv = rank_peaks(os.path.join(ROOT, "fit", "traces", "cpu_router_options", name),
                                           F.load("cpu_compose"))
    assert {"--moe-router-score-function", "--moe-shared-expert-gate", "--moe-apply-probs-on-input"} & set(argv)
    for p, m in zip(predicted, measured):
        assert -0.002 <= (p - m) / m <= 0.002, (name, p, m)
