"""The optimizer step's temporaries (estimator.static_memory.adam_step) against torch's own AdamW, measured with the
tracing allocator's CPU hook: the single-tensor step (what CPU runs take) and the multi-tensor foreach step (torch's
default on a GPU, which megatron-core falls back to without Transformer Engine or apex), on megatron-core's two
parameter groups (weight decay: 2-D weights; none: biases and norm weights), each in its own subprocess."""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from estimator.static_memory import ParamInfo, adam_step, foreach_step_transient_bytes, step_transient_bytes

ROOT = Path(__file__).resolve().parent.parent
# A small transformer's parameters in named_parameters order: (shape) per tensor.
SHAPES = [(1000, 64), (64,), (64,), (192, 64), (192,), (64, 64), (64,), (64,), (64,), (256, 64), (256,), (64, 256),
          (64,), (64,), (64,), (1000, 64)]


def _measured_step_transient(foreach: bool, tmp_path) -> int:
    code = textwrap.dedent(f"""
        import json, torch
        from tracer import allocator as A, cpu_hook
        torch.set_num_threads(1)
        cpu_hook.install("rank0")
        shapes = {SHAPES!r}
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        groups = [{{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1}},
                  {{"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}}]
        opt = torch.optim.AdamW(groups, lr=1e-3, foreach={foreach})
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()                      # the first step creates the state (exp_avg, exp_avg_sq)
        before = A.live_bytes()
        A.reset_peak()
        opt.step()
        print(json.dumps({{"before": before, "peak": A.peak_bytes(), "after": A.live_bytes()}}))
    """)
    script = tmp_path / f"step_{foreach}.py"
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _chunks():
    return [[ParamInfo(math.prod(s), ndim=len(s)) for s in SHAPES]]


@pytest.mark.parametrize("foreach", [False, True])
def test_step_transient_equals_torch_adamw(foreach, tmp_path):
    out = _measured_step_transient(foreach, tmp_path)
    model = (foreach_step_transient_bytes if foreach else step_transient_bytes)(_chunks(), False, 1, 1)
    # Up to the step's scalar tensors (4-byte step counters and factors; a GPU run keeps them on the CPU).
    assert 0 <= out["peak"] - out["before"] - model <= 64
    assert out["after"] == out["before"]     # temporaries only: the state was created by the first step
    # the two paths differ here: the foreach step holds the whole 2-D group at once
    assert foreach_step_transient_bytes(_chunks(), False, 1, 1) > step_transient_bytes(_chunks(), False, 1, 1)


def test_which_step_runs():
    class Cfg:
        optimizer = "adam"
        torch_adam = False
    assert adam_step(Cfg, "cuda") == "fused" and adam_step(Cfg, "cpu") == "single"
    Cfg.torch_adam = True
    assert adam_step(Cfg, "cuda") == "foreach"
    Cfg.optimizer = "sgd"
    assert adam_step(Cfg, "cuda") == "fused"


def test_torch_adam_reaches_the_estimate_and_the_search():
    """--torch-adam: a full-recompute config's peak moves to the step, static bytes plus the whole weight-decay
    group in fp32; the layout search honours it too."""
    from estimator import cli
    from estimator import formulas as F
    from estimator import search as S
    argv = ["--nproc_per_node", "1", "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1", "--vocab-size",
            "32000", "--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
    fused = cli.build_report(argv).estimate.ranks[0]
    torch_adam = cli.build_report(argv + ["--torch-adam"]).estimate.ranks[0]
    assert fused.static.optimizer_step == "fused" and torch_adam.static.optimizer_step == "foreach"
    assert torch_adam.peak_phase == "optimizer step"
    assert torch_adam.peak_bytes == torch_adam.static.total_bytes + torch_adam.bytes["gpu_runtime"] + \
        torch_adam.static.optimizer_step_transient_bytes > fused.peak_bytes

    megatron_argv = cli.split_own_options(argv)[0]
    peaks = [{tuple(sorted(x["layout"].items())): x["peak_bytes"]
              for x in S.to_json(S.search(megatron_argv, 1 << 40, F.load(F.DEFAULT_SET), progress=False, workers=1,
                                          torch_adam=t), 10_000)["layouts"]} for t in (False, True)]
    assert peaks[0].keys() == peaks[1].keys()
    assert all(peaks[1][k] >= peaks[0][k] for k in peaks[0]) and any(peaks[1][k] > peaks[0][k] for k in peaks[0])
