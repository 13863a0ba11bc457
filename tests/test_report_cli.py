"""`python -m tracer.report` on real host-backend traces: text, JSON, exports, bad input (exit 2, one line)."""
import json
import os
import subprocess
import sys

import pytest

from test_parse import training_like_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def report(*args):
    return subprocess.run([sys.executable, "-m", "tracer.report", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    peak = training_like_trace(str(d / "rank0"))
    return d, peak


def test_text_report(run_dir):
    d, peak = run_dir
    r = report(d)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"peak live memory: {peak / 2**20:.4f} MiB" in out
    assert "phase of the peak: optimizer step, iteration 0 in optim" in out
    for cat in ("parameter", "gradient", "optimizer", "temporary"):
        assert f"  {cat} " in out
    assert "layers.*.mlp" in out and "saved/layer/mb" in out and "layer total" in out


def test_json_report_matches_parser(run_dir):
    d, peak = run_dir
    r = report(d / "rank0.trace", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)["ranks"][0]
    assert j["peak_bytes"] == peak and j["peak_scope_path"] == ["iter:0", "optim"]
    assert sum(j["peak_by_category"].values()) == peak
    rows = j["op_stats"]
    assert set(rows[0]) == {"op", "layer", "microbatch", "iteration", "saved_bytes", "fwd_peak_bytes",
                            "bwd_peak_bytes"}
    assert sorted({r["saved_bytes"] for r in rows}) == [20, 300]
    total = [s for s in j["op_summary"] if s["op"].startswith("layer total")][0]
    assert total["saved_min_bytes"] == total["saved_max_bytes"] == 320


def test_exports_from_cli(run_dir, tmp_path):
    d, _ = run_dir
    r = report(d, "--snapshot", tmp_path / "s.pickle", "--png", tmp_path / "t.png")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s.pickle").stat().st_size > 0
    assert open(tmp_path / "t.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_truncated_trace_warns_and_reports(run_dir, tmp_path):
    d, _ = run_dir
    data = open(d / "rank0.trace", "rb").read()
    (tmp_path / "rank0.trace").write_bytes(data[:-100])
    (tmp_path / "rank0.names").write_bytes(open(d / "rank0.names", "rb").read())
    r = report(tmp_path)
    assert r.returncode == 0 and "truncated" in r.stderr and "peak live memory" in r.stdout


@pytest.mark.parametrize("make", ["missing", "empty_dir", "bad_magic", "bad_version", "bad_json", "no_rank"])
def test_bad_input_one_line_exit_2(run_dir, tmp_path, make):
    d, _ = run_dir
    target, extra = tmp_path, []
    data = open(d / "rank0.trace", "rb").read()
    if make == "missing":
        target = tmp_path / "nope" / "rank0.trace"
    elif make == "bad_magic":
        (tmp_path / "rank0.trace").write_bytes(b"GARBAGE!" + data[8:])
    elif make == "bad_version":
        (tmp_path / "rank0.trace").write_bytes(data[:8] + (9).to_bytes(4, "little") + data[12:])
    elif make == "bad_json":
        (tmp_path / "rank0.trace").write_bytes(data)
        (tmp_path / "rank0.json").write_text("{not json")
    elif make == "no_rank":
        target, extra = d, ["--rank", "5"]
    r = report(target, *extra)
    assert r.returncode == 2
    assert r.stderr.startswith("tracer.report: error:") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
