"""What of the GPU campaign (fit/gpu_campaign.py) and its validation (fit/gpu_validate.py) can be checked without a
GPU: the grids (loader, estimator, coverage of every switch, in sync with their generator), the offline install
against a local wheel directory (real pip, tiny wheels built here), the one-line refusals, and the validation
table on synthetic measurements against a real estimate."""
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from estimator.cli import build_report
from estimator.formulas import switches
from estimator.report_json import json_chunks
from fit.campaign import load_grid
from fit.gpu_validate import compare, predicted, table

ROOT = Path(__file__).resolve().parent.parent
GRIDS = ROOT / "fit" / "grids"


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, **(env or {})))


def _one_line_error(res, prefix):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1 and res.stderr.startswith(prefix), res.stderr


# ---------------------------------------------------------------------------------------------------- grids
@pytest.mark.parametrize("grid", ["gpu_h100.json", "gpu_validate.json", "gpu_layouts.json"])
def test_grid_loads_and_every_config_is_estimated(grid):
    g, configs = load_grid(str(GRIDS / grid))
    # one GPU: world size 1, or ranks of a larger world traced one at a time on the fake process group
    assert g["device"] == "cuda" and all(c.nproc == 1 or c.ranks for c in configs)
    seen: dict = {}
    for c in configs:
        report = build_report(["--nproc_per_node", str(c.nproc), *c.argv], reserved=False)   # argument validation
        assert report.estimate.max_peak_bytes > 0
        for k, v in switches(report.cfg).items():
            seen.setdefault(k, set()).add(v)
    if grid == "gpu_h100.json":   # every switch the GPU set must know, both ways (recompute all three)
        # The budget on one H100 host (16 cores): install and probes ~2 min, ~20 s per config with 6 at once, the fit's
        # reserve; all within the default 14 minutes, so the time guard does not have to cut the grid.
        from fit.gpu_campaign import fit_reserve_seconds
        assert 120 + len(configs) * 20 / 6 + fit_reserve_seconds(len(configs), 16) < 14 * 60
        for key, values in {"activation": {"gelu", "swiglu"}, "normalization": {"LayerNorm", "RMSNorm"},
                            "position": {"learned_absolute", "rope"}, "bias": {True, False}, "gqa": {True, False},
                            "tied": {True, False}, "dropout": {True, False},
                            "recompute": {"none", "selective", "full"}, "dtype": {"bf16", "fp32"},
                            "attention": {"flash", "unfused"}, "softmax_fp32": {True, False}}.items():
            assert values <= seen[key], (key, seen[key])
    if grid == "gpu_layouts.json":   # every layout dimension and the precisions, within the same budget
        from fit.gpu_campaign import fit_reserve_seconds
        ranks = sum(len(c.ranks) for c in configs)
        assert 120 + ranks * 20 / 6 + fit_reserve_seconds(ranks, 16) < 14 * 60
        for key, values in {"tp": {True, False}, "sp": {True, False}, "moe": {True, False}, "a2a": {True, False},
                            "dtype": {"bf16", "fp16", "fp32"}, "recompute": {"none", "selective", "full"},
                            "epx": {True, False}}.items():
            assert values <= seen[key], (key, seen[key])
        assert {c.nproc for c in configs} == {2, 4, 8}


def test_grids_match_their_generator():
    sys.path.insert(0, str(GRIDS))
    try:
        import make_gpu
    finally:
        sys.path.remove(str(GRIDS))
    sys.path.insert(0, str(GRIDS))
    try:
        import make_gpu_layouts
    finally:
        sys.path.remove(str(GRIDS))
    for name, cfgs in (("gpu_h100", make_gpu.configs()), ("gpu_validate", make_gpu.validate_configs()),
                       ("gpu_layouts", make_gpu_layouts.configs())):
        on_disk = json.loads((GRIDS / f"{name}.json").read_text())["configs"]
        assert [c["name"] for c in cfgs] == [c["name"] for c in on_disk], f"rerun fit/grids/make_gpu.py ({name})"
        assert [c["set"] for c in cfgs] == [c["set"] for c in on_disk]


# ---------------------------------------------------------------------------------------------------- install
def _wheel(d: Path, dist: str, version: str, files: dict) -> Path:
    """A minimal pure-Python wheel (PEP 427), enough for pip to install it."""
    info = f"{dist}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n"
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in [*files, f"{info}/RECORD"])
    path = d / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


@pytest.fixture
def wheels(tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    _wheel(d, "megatron_core", "0.0.1+stub", {"megatron/__init__.py": "", "megatron/core/__init__.py": "",
                                              "megatron/core/package_info.py": "__version__ = '0.0.1+stub'\n"})
    # A Transformer Engine built for another torch: installs, then fails to import.
    _wheel(d, "transformer_engine", "9.9", {
        "transformer_engine/__init__.py": "__version__ = '9.9'\n",
        "transformer_engine/pytorch/__init__.py": "raise ImportError('undefined symbol: built for torch 1.0')\n"})
    (d / "torch-9.9-cp312-cp312-linux_x86_64.whl").write_bytes(b"not opened: the machine's torch is used")
    return d


def test_offline_install_uses_the_wheels_and_reports_what_it_used(wheels, tmp_path):
    out = tmp_path / "out"
    res = _run("fit.gpu_campaign", "--wheels", str(wheels), "--out", str(out), "--install-only")
    assert res.returncode == 0, res.stderr
    assert "megatron-core 0.0.1+stub" in res.stdout
    assert "does not import with this torch (ImportError: undefined symbol: built for torch 1.0)" in res.stdout
    assert "skipped torch-9.9-cp312-cp312-linux_x86_64.whl" in res.stdout
    man = json.loads((out / "site" / "manifest.json").read_text())
    assert man["paths"] == [str(out / "site" / "base")] and man["transformer_engine"] is None
    assert (out / "site" / "base" / "megatron" / "core" / "package_info.py").is_file()
    assert (out / "site" / "te" / "transformer_engine" / "pytorch" / "__init__.py").is_file()
    # The same wheels again: nothing reinstalled.
    stamp = out / "site" / "base" / ".installed-from"
    before = stamp.stat().st_mtime_ns
    assert _run("fit.gpu_campaign", "--wheels", str(wheels), "--out", str(out), "--install-only").returncode == 0
    assert stamp.stat().st_mtime_ns == before


def test_dry_run_prints_the_offline_pip_commands(wheels, tmp_path):
    res = _run("fit.gpu_campaign", "--wheels", str(wheels), "--out", str(tmp_path / "o"), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "-m pip install --no-index --no-deps --disable-pip-version-check --target" in res.stdout
    assert "megatron_core-0.0.1+stub-py3-none-any.whl" in res.stdout and "would profile 86 configs" in res.stdout
    assert not (tmp_path / "o").exists()


def test_refusals_are_one_line(wheels, tmp_path):
    campaign, validate = "python -m fit.gpu_campaign: error: ", "python -m fit.gpu_validate: error: "
    _one_line_error(_run("fit.gpu_campaign", "--wheels", str(tmp_path / "nope")), campaign + "--wheels")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(_run("fit.gpu_campaign", "--wheels", str(empty)), campaign + "--wheels")
    # No GPU here (CPU torch): refused before anything is installed.
    res = _run("fit.gpu_campaign", "--wheels", str(wheels), "--out", str(tmp_path / "o"),
               env={"CUDA_VISIBLE_DEVICES": ""})
    _one_line_error(res, campaign + "no CUDA GPU visible to torch")
    assert not (tmp_path / "o").exists()
    # The validation: without a campaign, then with one but no GPU.
    _one_line_error(_run("fit.gpu_validate", "--campaign", str(tmp_path / "none")), validate + "no formula")
    camp = tmp_path / "camp"
    (camp / "site").mkdir(parents=True)
    (camp / "summary.json").write_text(json.dumps({"formula_set": str(ROOT / "fit" / "sets" / "cpu_compose.json")}))
    (camp / "site" / "manifest.json").write_text(json.dumps({"paths": []}))
    res = _run("fit.gpu_validate", "--campaign", str(camp), env={"CUDA_VISIBLE_DEVICES": ""})
    _one_line_error(res, validate + "no CUDA GPU visible to torch")


def test_no_config_starts_after_the_budget(tmp_path):
    """The campaign's time budget: configs not started by then are failures that say so (a --resume finishes
    them); nothing is run, nothing half-written is left."""
    from fit.campaign import run_campaign
    _, dirs, failures = run_campaign(str(GRIDS / "ci_tiny.json"), str(tmp_path), resume=False, jobs=3,
                                     start_by=time.time() - 1)
    assert dirs == [] and len(failures) == 6
    assert all(f.endswith(": not started: the time budget ran out") for f in failures)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------- table
def _estimate(argv):
    return json.loads("".join(json_chunks(build_report(["--nproc_per_node", "1", *argv]))))


def test_validation_rows_and_table_from_a_real_estimate():
    _, configs = load_grid(str(GRIDS / "gpu_validate.json"))
    est = _estimate(configs[0].argv)
    alloc = est["stages"][0]["peak_bytes"]
    reserved = est["stages"][0]["reserved_bytes"]     # the estimator's modelled reserved peak
    assert predicted(est) == {"allocated": alloc, "reserved": reserved, "reserved_key": "stages.reserved_bytes",
                              "formula_set": est["formula_set"]["name"]}
    measured = {"peak_allocated": int(alloc / 1.04), "peak_reserved": alloc + (64 << 20),
                "iteration_seconds": [5.0, 0.010, 0.012, 0.011]}
    traced = {"allocator_peak_bytes": measured["peak_allocated"] - 1000, "iteration_seconds": [9.0, 0.05, 0.06, 0.04]}
    row = compare("a", est, measured, traced)
    assert row["err_allocated"] == pytest.approx(alloc / measured["peak_allocated"] - 1) and row["err_allocated"] > 0
    assert row["pred_reserved"] == reserved
    assert row["err_reserved"] == pytest.approx(reserved / measured["peak_reserved"] - 1)
    assert row["iter_s"] == 0.011 and row["traced_iter_s"] == 0.05 and row["slowdown"] == pytest.approx(0.05 / 0.011)
    assert row["traced_vs_allocated"] < 0

    # A modelled reserved figure per stage (the key another part of the estimator may add): read and compared.
    est["stages"][0]["reserved_bytes"] = measured["peak_reserved"] - (1 << 20)
    row2 = compare("b", est, measured, None)
    assert row2["reserved_key"] == "stages.reserved_bytes"
    assert row2["err_reserved"] == pytest.approx(-(1 << 20) / measured["peak_reserved"])
    assert row2["slowdown"] is None and row2["traced_peak"] is None
    # A failed run: its columns n/a, the row still printed.
    row3 = compare("c", None, None, None)

    text = table([row, row2, row3])
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["config", "alloc", "pred", "alloc"] and len(lines) == 5
    assert f"{alloc / 2**20:.1f}" in lines[1] and f"{100 * row['err_allocated']:+.2f}%" in lines[1]
    assert f"{100 * row['err_reserved']:+.2f}%" in lines[1] and "4.5x" in lines[1]
    assert f"{100 * row2['err_reserved']:+.2f}%" in lines[2]
    assert lines[3].split()[1:] == ["n/a"] * 11
    assert lines[4].startswith(f"allocated: median |err| {100 * row['err_allocated']:+.2f}%")
    assert "worst under-prediction none" in lines[4] and "median 4.5x" in lines[4]


def test_trace_and_fit_pipeline_on_cpu(tmp_path):
    """The campaign's pipeline after the GPU check (profile N at once, pack, composed fit, summary), on two tiny CPU
    configs: the same code path the GPU grid takes, with the CPU harness in place of the CUDA allocator."""
    from estimator.formulas import load
    from fit.gpu_campaign import trace_and_fit
    grid = json.loads((GRIDS / "ci_tiny.json").read_text())
    grid.update(name="tiny2", iterations=2, configs=grid["configs"][:2])
    path = tmp_path / "tiny2.json"
    path.write_text(json.dumps(grid))
    out = tmp_path / "out"
    summary = trace_and_fit(str(path), str(out), jobs=2)
    assert summary["failures"] == [] and summary["fit_exit"] == 0
    assert sorted(summary["configs"]) == ["base", "s64_b1"]
    for name, row in summary["configs"].items():
        header = json.loads((out / "packed" / name / "rank0.json").read_text())
        assert row["peak_bytes"] == header["allocator_peak_bytes"] > 0 and len(row["iteration_seconds"]) == 2
        assert (out / "packed" / name / "rank0.trace.xz").is_file()
    fset = load(summary["formula_set"])
    assert fset.name == "tiny2" and summary["formula_set"] == str(out / "tiny2.json")
    # the set says what it was fitted from, read from the trace headers
    assert json.loads(Path(summary["formula_set"]).read_text())["description"].startswith(
        "Allocation programs fitted from 2 traces (CPU)")


def test_a_broken_setup_stops_the_campaign_early(tmp_path):
    """When the first configs to finish all fail (here: a flag Megatron-LM does not have), the rest do not start."""
    from fit.campaign import run_campaign
    grid = {"name": "broken", "device": "cpu", "iterations": 1, "base": ["--no-such-megatron-flag"],
            "configs": [{"name": f"c{i}", "set": {"--seq-length": 16 * (i + 1)}} for i in range(5)]}
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(grid))
    _, dirs, failures = run_campaign(str(path), str(tmp_path / "out"), resume=False, jobs=1, give_up_after=2)
    assert dirs == [] and len(failures) == 5
    assert all("profiler exit 2" in f for f in failures[:2]), failures
    assert all(f.endswith("not started: the first 2 configs all failed") for f in failures[2:]), failures
