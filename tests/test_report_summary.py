"""The report's first screen and the verdict: 100 columns, allowances that add up, exit codes, detail levels."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from estimator import summary as SUM
from estimator import verdict as V
from estimator.cli import build_report
from estimator.report import to_json, to_text

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ["--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel",
           "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 1"
           " --use-distributed-optimizer --recompute-activations",
           "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 2"]


def _argv(preset: str, layout: str, extra: str = "") -> list:
    return shlex.split(f"--preset {preset} --nproc_per_node 8 --nnodes 8 --micro-batch-size 1 "
                       f"--global-batch-size 256 --bf16 {layout} {extra}")


def run_cli(args, **kw):
    return subprocess.run([sys.executable, "get_training_info.py", *args], cwd=ROOT, capture_output=True,
                          text=True, **kw)


@pytest.mark.parametrize("preset", ["gpt3_175b", "llama3_8b", "mixtral_8x7b", "qwen2.5_72b", "llama2_70b"])
def test_summary_fits_in_100_columns(preset):
    for layout in LAYOUTS:
        argv = _argv(preset, layout)
        if preset == "mixtral_8x7b":
            argv += ["--expert-model-parallel-size", "2"]
        report = build_report(argv)
        # the verdict without a GPU, one that fits and one that does not: build_report's budget for --gpu-memory
        for gpu in (None, "H100-80GB", "1"):
            report.budget = V.budget(report, V.parse_gpu(gpu) if gpu else None)
            text = to_text(report, detail=0)
            lines = text.splitlines()
            assert lines[0] == "megatron-memtrace estimate" and lines[3].startswith("Verdict")
            too_wide = [ln for ln in lines if len(ln) > SUM.WIDTH]
            assert not too_wide, too_wide
            stages = report.cfg.pipeline_model_parallel_size
            table = text.split("Peak per pipeline stage")[1].splitlines()[2:2 + stages]
            assert [row.split()[0] for row in table] == [str(p) for p in range(stages)]


def test_the_context_allowance_is_the_measured_memory_outside_the_allocator():
    """The verdict's default CUDA context and libraries allowance is the committed H100 runs' device memory outside
    PyTorch's allocator at the end of training (cudaMemGetInfo used - reserved), the largest of them."""
    import glob
    import json
    runs = glob.glob(str(ROOT / "fit" / "validation" / "h100" / "*" / "measured.json"))
    outside = []
    for path in runs:
        with open(path, encoding="utf-8") as fh:
            m = json.load(fh)
        assert m["outside_allocator_end"] == m["device_used_end"] - m["reserved_end"]
        outside.append(m["outside_allocator_end"])
    assert len(outside) == 12 and V.MEASURED_OUTSIDE == max(outside)
    assert V.DEFAULTS["cuda_context_gib"] * V.GiB == V.MEASURED_OUTSIDE


def test_allowances_add_up_and_the_verdict_follows_the_gpu():
    argv = _argv("llama3_8b", LAYOUTS[0])
    report = build_report(argv + ["--gpu-memory", "H100-80GB"])
    b = report.budget
    assert b.gpu.bytes == V.GPUS["H100-80GB"] << 20
    modelled = report.reserved.by_stage()   # fragmentation: the modelled reserved minus allocated by default
    percent = build_report(argv + ["--gpu-memory", "H100-80GB", "--fragmentation-percent", "5"]).budget
    for s, r, p in zip(b.stages, report.estimate.ranks, percent.stages):
        assert s.allocated == r.peak_bytes
        assert s.fragmentation == modelled[r.pp_rank].fragmentation_bytes > 0
        assert modelled[r.pp_rank].reserved_bytes == r.peak_bytes + s.fragmentation
        assert p.fragmentation == pytest.approx(0.05 * r.peak_bytes)
        assert s.cuda_context == V.MEASURED_OUTSIDE
        assert s.nccl == 0.5 * V.GiB * len(s.nccl_communicators)
        assert s.total == pytest.approx(s.allocated + s.cuda_context + s.nccl + s.fragmentation)
        assert s.headroom == pytest.approx(b.gpu.bytes - s.total)
    # TP 8 x PP 4 x DP 2: every stage talks in its TP, PP, DP (DDP uses dp-cp) groups and the world group.
    assert {"tp", "pp", "dp-cp", "world"} <= set(b.stages[0].nccl_communicators)
    worst = max(s.total for s in b.stages)
    # Just above the worst stage's total it fits with no headroom to speak of; 4 KiB below it does not.
    at = build_report(argv + ["--gpu-memory", repr((worst + 2) / V.GiB)]).budget
    assert at.fits and min(s.headroom for s in at.stages) == pytest.approx(0, abs=3)
    below = build_report(argv + ["--gpu-memory", repr((worst - 4096) / V.GiB)]).budget
    assert below.fits is False and sum(not s.fits for s in below.stages) >= 1


def test_allowances_can_be_set_to_zero_and_json_carries_them():
    argv = _argv("llama3_8b", LAYOUTS[1], "--cuda-context-gib 0 --nccl-gib-per-communicator 0 "
                                          "--fragmentation-percent 0 --gpu-memory 80")
    report = build_report(argv)
    doc = to_json(report)["memory_budget"]
    assert doc["allowances"]["modelled"] is True
    assert [s["total_bytes"] for s in doc["stages"]] == [s["allocated_peak_bytes"] for s in doc["stages"]]
    assert doc["max_total_bytes"] == to_json(report)["max_peak_bytes"]
    assert doc["gpu"] == {"name": "80 GiB", "bytes": 80 << 30}
    assert doc["min_headroom_bytes"] == (80 << 30) - doc["max_total_bytes"]


def test_single_gpu_needs_no_nccl():
    report = build_report(shlex.split("--preset llama2_7b --num-layers 2 --micro-batch-size 1 --bf16"))
    assert report.budget.stages[0].nccl_communicators == [] and report.budget.stages[0].nccl == 0


@pytest.mark.parametrize("gpu, rc", [("1", 1), ("B200", 0)])
def test_exit_code_option(gpu, rc):
    res = run_cli(_argv("llama3_8b", LAYOUTS[0], f"--gpu-memory {gpu} --exit-code --detail 0"))
    assert res.returncode == rc, res.stderr
    assert ("DOES NOT FIT" in res.stdout) == (rc == 1)


@pytest.mark.parametrize("args, message", [
    ("--exit-code", "--exit-code needs --gpu-memory"),
    ("--gpu-memory H1000", "neither a number of GiB nor a known GPU"),
    ("--gpu-memory -3", "positive number"),
    ("--detail 7", "--detail"),
    ("--fragmentation-percent x", "expected a number"),
])
def test_bad_verdict_options_are_one_line_exit_2(args, message):
    res = run_cli(_argv("llama3_8b", LAYOUTS[0], args))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert message in res.stderr


def test_detail_levels():
    report = build_report(_argv("llama3_8b", "--pipeline-model-parallel-size 4 --tensor-model-parallel-size 2"))
    levels = [to_text(report, detail=d) for d in range(4)]
    assert "Per-rank table" not in levels[0] and "Summary per dimension" not in levels[0]
    assert "Per-rank table" in levels[1] and "Summary per dimension" in levels[1]
    assert "Model tree" not in levels[1] and "Detail (one row per collective" not in levels[1]
    assert levels[2].count("Model tree, pipeline stage") == 1 and "Process groups" in levels[2]
    assert levels[3].count("Model tree, pipeline stage") == 4
    for lower, higher in zip(levels, levels[1:]):
        assert len(lower) < len(higher)


def test_describe_names_the_vocabulary_and_qkv_bias():
    gpt3 = to_text(build_report(shlex.split("--preset gpt3_175b --num-layers 2 --micro-batch-size 1")))
    assert "vocab 50257 (GPT-2 BPE) (padded 50304)" in gpt3 and "vocab None" not in gpt3
    qwen = to_text(build_report(shlex.split("--preset qwen2.5_72b --num-layers 2 --micro-batch-size 1")))
    assert "QKV bias only" in qwen and "no linear biases" not in qwen


def test_hf_config_reads_rope_theta(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
           "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 1024,
           "vocab_size": 1000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    report = build_report(["--hf-config", str(path), "--seq-length", "512", "--micro-batch-size", "1"])
    assert report.cfg.rotary_base == 1000000 and report.cfg.norm_epsilon == 1e-6


def test_no_shared_expert_row_without_shared_experts():
    base = "--preset mixtral_8x7b --num-layers 2 --micro-batch-size 1 --bf16 --nproc_per_node 2 " \
           "--expert-model-parallel-size 2"
    ops = {o["op"] for o in to_json(build_report(shlex.split(base)))["stages"][0]["ops"]}
    assert "layers.*.mlp.experts" in ops and "layers.*.mlp.shared_experts" not in ops
    shared = to_json(build_report(shlex.split(base + " --moe-shared-expert-intermediate-size 2048")))
    row = next(o for o in shared["stages"][0]["ops"] if o["op"] == "layers.*.mlp.shared_experts")
    assert row["saved_bytes"] > 0


def test_pipeline_rows_count_calls_per_microbatch():
    report = build_report(_argv("llama3_8b", "--pipeline-model-parallel-size 4"))
    m = report.cfg.num_microbatches
    pp_rows = [c for c in report.comm.collectives if c.dim == "pp"]
    assert pp_rows and all(c.per_microbatch * m == c.per_iteration and c.per_microbatch > 0 for c in pp_rows)


PNG_ARGV = _argv("llama2_7b", "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
                              "--num-layers-per-virtual-pipeline-stage 4", "--global-batch-size 64")


def test_png_is_the_stream_at_tensor_resolution():
    """The picture's layers are the predicted stream's live bytes by category after every event: they add up to
    the stream's level, whose peak is the estimate's (less the 512-byte block rounding the replay adds), with the
    modelled reserved line never below them; every forward and backward is drawn tensor by tensor."""
    import numpy as np
    from estimator.plot import LAYERS, stage_series
    report = build_report(PNG_ARGV)
    est = report.estimate
    for rank in est.ranks:
        data = stage_series(report.cfg, report.formula_set, est, rank.pp_rank, report.reserved.conf)
        stacked = sum(data["series"][name] for name, _ in LAYERS)
        assert np.array_equal(stacked, data["total"])
        rounding = sum(it.bytes for it in rank.gpu_runtime if it.count == 0)
        peak = data["total"][data["peak_index"]]
        assert rank.peak_bytes - rounding - 1 <= peak <= rank.peak_bytes - rounding + len(data["phases"])
        assert (data["reserved"] >= data["total"]).all()
        assert set(data["phases"]) == {"start-up", "F", "B", "optimizer"}
        # a sawtooth: within one forward step the level moves with every tensor, many times
        first_f = data["phases"].index("F")
        f_len = next(i for i in range(first_f, len(data["phases"])) if data["phases"][i] != "F") - first_f
        assert f_len > 10 and len(set(data["total"][first_f:first_f + f_len].tolist())) > 5


def test_png_is_written_without_torch(tmp_path):
    png = tmp_path / "pred.png"
    res = subprocess.run([sys.executable, "-X", "importtime", "get_training_info.py", *PNG_ARGV, "--png", str(png),
                          "--detail", "0"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in res.stderr.splitlines() if ln.startswith("import time:")]
    assert "matplotlib" in imported and not [m for m in imported if m.split(".")[0] in ("torch", "megatron")]


def test_png_without_matplotlib_is_one_line(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from estimator.cli import main; "
            f"sys.exit(main({PNG_ARGV + ['--png', str(tmp_path / 'x.png')]!r}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip() == "error: --png needs matplotlib (pip install matplotlib)"


def test_prose_wraps_at_100_columns_keeping_every_word():
    from estimator.report import _wrap
    report = build_report(_argv("qwen2.5_72b", LAYOUTS[0], "--lr 1e-4 --data-path /a/very/long/path " * 6))
    text = to_text(report, detail=1)
    config = text[text.index("\nModel        "):text.index("\nActivation formulas")].strip("\n").splitlines()
    ignored = text[text.index("Ignored ("):].splitlines()[:-2]
    for block in (config, ignored):
        assert all(len(line) <= 100 for line in block), block
    assert config[1].startswith(" " * 13) and not config[1][13].isspace()   # under the text after "Model"
    line = "Label        " + " ".join(f"word{i}" for i in range(60))
    wrapped = _wrap([line])
    assert all(len(x) <= 100 for x in wrapped) and len(wrapped) > 1
    assert " ".join(wrapped).split() == line.split()
