"""The committed H100 campaign traces (fit/traces/gpu_h100) and benchmarks/gpu_traces.py over them: the traces
parse whole on this CPU-only machine, the benchmark's measured column is the parser's replayed peak, and its
predicted column is the estimator's own JSON less exactly the GPU runtime items a tracing-allocator run cannot
hold."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "fit", "traces", "gpu_h100")
PICK = ["gpt_base_s1024_b2_h1024_a16", "llama_local_s1280_b2_h1280_a10"]   # TE stand-ins + flash; local spec


def test_committed_gpu_traces_are_whole_and_from_a_gpu():
    from tracer.parse import parse_run
    names = [d for d in os.listdir(TRACES) if os.path.isdir(os.path.join(TRACES, d))]
    assert len(names) >= 80
    for name in PICK:
        (pr,) = parse_run(os.path.join(TRACES, name))
        assert pr.header["backend"] == "cuda" and "H100" in pr.header["device"]
        assert not pr.header.get("error") and pr.header["iterations"] == 3
        # the replayed peak equals the allocator's own exact counter
        assert pr.peak_bytes == pr.header["allocator_peak_bytes"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_traces") / "rows.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_traces.py"), "--only", *PICK,
                          "--formulas", "cpu_compose", "--json", str(out)], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr
    with open(out) as fh:
        return res.stdout, json.load(fh)["rows"]


def test_rows_are_the_parser_and_the_estimator(bench):
    from fit.dataset import header_kernels
    from estimator import cli
    from estimator import report as R
    from tracer.parse import parse_run
    stdout, rows = bench
    assert [r["config"] for r in rows] == PICK
    for r in rows:
        d = os.path.join(TRACES, r["config"])
        (pr,) = parse_run(d)
        assert r["traced_peak_bytes"] == pr.peak_bytes
        with open(os.path.join(d, "campaign.json")) as fh:
            argv = json.load(fh)["argv"]
        # the kernels the run ran as the fitter reads them: an H100 trace's record predates `fuse_bda` and
        # `collectives`, which a GPU run has as its flags say (fused) and as NCCL (direct)
        kernels = header_kernels(pr.header)
        assert (kernels["fuse_bda"], kernels["collectives"]) == (True, "direct")
        doc = R.to_json(cli.build_report(["--nproc_per_node", "1"] + argv, formulas="cpu_compose", device="cuda",
                                         kernels=kernels))
        items = {i["name"]: i["bytes"] for i in doc["stages"][0]["gpu_runtime"]}
        # the campaign ran without Transformer Engine: its workspace and the caching allocator's rounding go
        left_out = items.get("512-byte block rounding", 0) + items.get("Transformer Engine GEMM workspace", 0)
        x = r["sets"]["cpu_compose"]
        assert x["gpu_runtime_left_out_bytes"] == left_out
        assert x["predicted_peak_bytes"] == doc["ranks"][0]["peak_bytes"] - left_out
        assert "torch cuBLAS workspaces" in items      # kept: the tracing allocator sees them (two 32 MiB blocks)
        assert r["config"] in stdout


def test_unknown_config_is_one_line_and_exit_2():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_traces.py"), "--only", "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "nope" in res.stderr


@pytest.mark.megatron
@pytest.mark.slow
def test_cpu_twin_of_an_h100_trace_matches_it(tmp_path):
    """benchmarks/standin_fidelity.py: the same flags profiled here on the CPU stand-ins peak where the H100 run
    did, less its two cuBLAS workspaces (the only GPU-only memory in such a trace), within 0.1%. The H100 run peaks
    in its second iteration, so two CPU iterations reach it. Slow (5-6 minutes: a CPU without AVX-512 BF16 runs the
    bf16 logits GEMM at well under a GFLOP/s), so `make test-all` only: tests/test_standins.py checks each stand-in's
    program against the H100 traces' in seconds."""
    out = tmp_path / "rows.json"
    name = "gpt_base_s768_b3_h512_a8"     # TE spec stand-ins, flash attention, fused bias-gelu, bf16
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "standin_fidelity.py"), "--only", name,
                          "--out", str(tmp_path / "runs"), "--json", str(out), "--iterations", "2"],
                         capture_output=True, text=True,
                         cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = json.load(open(out))["rows"]
    assert row["kernels_agree"] and row["gpu_kernels"]["attention"] == "flash"
    assert row["gpu_workspace_bytes"] == 2 * 32 * 2 ** 20
    assert abs(row["error_percent"]) < 0.1 and row["gpu_phase"] == row["cpu_phase"]


def test_gpu_set_is_fitted_from_the_committed_h100_traces_and_says_so():
    """fit/sets/gpu_h100.json: every trace it names is committed and is a GPU trace; a config that uses the TE
    spec and flash attention reports no CPU stand-ins with it (it does with the CPU-fitted set)."""
    import shlex
    from estimator import formulas as F
    from estimator import report as R
    from estimator.cli import build_report
    fset = F.load("gpu_h100")
    assert fset.measured_on_gpu and not F.load("cpu_compose").measured_on_gpu
    with open(fset.path[:-5] + ".provenance.json", encoding="utf-8") as fh:
        traces = json.load(fh)["traces"]
    assert len(traces) == 66
    for t in traces:
        with open(os.path.join(ROOT, t["path"], "rank0.json")) as fh:
            assert json.load(fh)["backend"] == "cuda"
    argv = shlex.split("--nproc_per_node 1 --num-layers 2 --hidden-size 1024 --num-attention-heads 16 --seq-length "
                       "1024 --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 2 "
                       "--vocab-size 32000 --bf16")
    gpu = R.to_json(build_report(argv + ["--formulas", "gpu_h100"]))["formula_set"]["coverage"]
    cpu = R.to_json(build_report(argv + ["--formulas", "cpu_compose"]))["formula_set"]["coverage"]
    assert gpu["standins"] == [] and gpu["measured_share"] > 0.9
    # the CPU set measured these kernels too (the GPU-kernel campaign), and names the stand-ins it measured them on
    assert "flash / fused attention" in cpu["standins"] and cpu["measured_share"] > 0.9


def test_a_cell_the_gpu_runs_never_had_is_extrapolated_and_named():
    """The H100 campaign ran TE's unfused attention only in fp32: a bf16 config on TE's unfused backend takes the
    attention's programs from the nearest cells, names those labels as extrapolated and counts their bytes as not
    measured; the same config with flash attention is measured in full."""
    import shlex
    from estimator import report as R
    from estimator.cli import build_report
    argv = shlex.split("--nproc_per_node 1 --num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
                       "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 4 --vocab-size 32000 "
                       "--bf16 --formulas gpu_h100")
    unfused = R.to_json(build_report(argv + ["--attention-backend", "unfused"]))["formula_set"]["coverage"]
    flash = R.to_json(build_report(argv))["formula_set"]["coverage"]
    assert "layers.*.self_attention.core_attention" in unfused["extrapolated"] and unfused["measured_share"] < 1.0
    assert flash["extrapolated"] == [] and flash["untraced"] == [] and flash["measured_share"] == 1.0
