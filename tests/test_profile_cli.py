"""`python -m tracer.profile` argument handling (no training run): launcher options vs Megatron flags, torchrun
flags, the user's pretrain_gpt.py command line, and clean errors (exit 2, one line, no traceback)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tracer import profile
from tracer.profile import UsageError, config_argv, parse_options, pretrain_argv, strip_flags, world_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--vocab-size", "128"]


def test_options_before_double_dash_and_megatron_flags_after():
    o = parse_options(["--cpu", "--nproc", "2", "--out", "d", "--iterations=5", "--", "--cpu-like", *MODEL])
    assert (o.cpu, o.nproc, o.out, o.iterations, o.target) == (True, 2, "d", 5, "harness")
    assert o.flags == ["--cpu-like", *MODEL]


def test_balanced_routing_is_a_launcher_option_not_a_megatron_flag():
    o = parse_options(["--cpu", "--balanced-routing", "--", *MODEL])
    assert o.balanced_routing and o.flags == MODEL
    assert not parse_options(["--", "--balanced-routing"]).balanced_routing


def test_crosscheck_is_a_launcher_option_for_cpu_runs():
    o = parse_options(["--cpu", "--crosscheck", "--", *MODEL])
    assert o.crosscheck and o.flags == MODEL
    with pytest.raises(UsageError, match="--crosscheck needs --cpu"):
        parse_options(["--crosscheck", "--", *MODEL])


def test_options_mixed_with_flags_without_double_dash():
    o = parse_options([*MODEL[:4], "--cpu", "--iterations", "2", *MODEL[4:]])
    assert o.cpu and o.iterations == 2 and o.flags == MODEL


def test_after_double_dash_everything_is_megatron():
    o = parse_options(["--", "--out", "x"])
    assert o.out == "memtrace_out" and o.flags == ["--out", "x"]


@pytest.mark.parametrize("argv, msg", [
    (["--nproc"], "expected one argument"),
    (["--nproc", "two"], "invalid int value"),
    (["--iterations", "0"], "must be >= 1"),
    (["--target", "/no/such/pretrain_gpt.py"], "no such file"),
])
def test_bad_options(argv, msg):
    with pytest.raises(UsageError, match=msg):
        parse_options(argv)


def test_world_size_from_nproc_or_torchrun_flags(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world_size(parse_options(["--nproc", "3", *MODEL])) == 3
    assert world_size(parse_options(["--nproc_per_node", "4", "--nnodes", "2", *MODEL])) == 8
    assert world_size(parse_options(["--nproc-per-node=2", *MODEL])) == 2
    assert world_size(parse_options(MODEL)) == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert world_size(parse_options(MODEL)) == 4


def test_torchrun_flags_are_replaced_by_the_actual_world_size():
    o = parse_options(["--nproc_per_node", "8", "--nnodes", "1", "--node_rank", "0", "--master_addr", "h",
                       "--master_port", "6000", *MODEL])
    argv = config_argv(o, 2)
    assert argv[:4] == ["--nproc_per_node", "2", "--nnodes", "1"] and argv[4:] == MODEL


def test_config_from_the_estimators_parser():
    cfg = profile.load_config(parse_options(["--nproc", "2", *MODEL, "--tensor-model-parallel-size", "2",
                                             "--lr", "1e-3"]), 2)
    assert cfg.world_size == 2 and cfg.tensor_model_parallel_size == 2 and cfg.data_parallel_size == 1
    assert cfg.hidden_size == 64


def test_bad_harness_only_flag_is_a_usage_error():
    with pytest.raises(UsageError, match="--lr"):
        profile.load_config(parse_options([*MODEL, "--lr", "fast"]), 1)


def test_pretrain_argv_forces_a_short_side_effect_free_run():
    flags = ["--nproc_per_node", "8", *MODEL, "--train-iters", "500000", "--save", "/ckpt", "--save-interval",
             "1000", "--eval-iters", "10", "--eval-interval", "1000", "--load", "/ckpt", "--profile"]
    argv = pretrain_argv("/m/pretrain_gpt.py", flags, 3)
    assert argv[0] == "/m/pretrain_gpt.py"
    assert "--nproc_per_node" not in argv and "--save" not in argv and "--profile" not in argv
    assert argv[argv.index("--train-iters") + 1] == "3" and argv.count("--train-iters") == 1
    assert argv[argv.index("--eval-iters") + 1] == "0"
    assert "--load" in argv and argv[1:1 + len(MODEL)] == MODEL


def test_strip_flags_with_inline_values():
    assert strip_flags(["--a=1", "--b", "2", "--c"], {"--a", "--b"}) == ["--c"]


def test_pretrain_target_without_megatron_lm_says_so(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('should not run')\n")
    o = parse_options(["--target", str(script), *MODEL])
    assert not o.is_harness
    saved = list(sys.path)
    try:
        with pytest.raises(RuntimeError, match="megatron.training"):
            profile._run_pretrain(o, lambda: None, lambda i: None)
    finally:
        sys.path[:] = saved


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "tracer.profile", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_cli_invalid_megatron_config_exits_2_without_traceback(tmp_path):
    r = _cli("--cpu", "--out", str(tmp_path), "--", *MODEL, "--tensor-model-parallel-size", "3")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("tracer.profile: ")
    assert not list(tmp_path.iterdir())    # nothing was spawned


def test_cli_help():
    r = _cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m tracer.profile")


def test_cli_without_cuda_asks_for_cpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = _cli("--out", str(tmp_path), "--", *MODEL)
    assert r.returncode == 2 and "pass --cpu" in r.stderr and "Traceback" not in r.stderr
