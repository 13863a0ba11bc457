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
    assert "WARNING: truncated: the last block is cut short" in r.stdout


def test_damaged_block_is_reported_in_text_and_json(run_dir, tmp_path):
    from tracer.trace_reader import read_trace, write_trace
    d, _ = run_dir
    t = read_trace(d / "rank0.trace")
    write_trace(str(tmp_path / "rank0"), t.records, t.names, header=t.header, block_records=10)
    data = bytearray((tmp_path / "rank0.trace").read_bytes())
    data[64 + 48 * 11 * 2 + 48 * 3 + 9] ^= 4        # a pointer in block 2
    (tmp_path / "rank0.trace").write_bytes(bytes(data))
    r = report(tmp_path)
    assert r.returncode == 0 and "damaged" in r.stderr
    assert "WARNING: damaged: checksum mismatch in the block at slot 22; read the 20 records" in r.stdout
    j = json.loads(report(tmp_path, "--json").stdout)["ranks"][0]
    assert j["events"] == 20 and j["trace"]["complete"] is False and "slot 22" in j["trace"]["damage"]
    assert j["trace"]["end_state"] == "clean" and j["trace"]["format_version"] == 2
    clean = json.loads(report(d, "--json").stdout)["ranks"][0]["trace"]
    assert clean["complete"] is True and clean["problems"] == [] and clean["damage"] is None


def test_killed_run_is_reported(run_dir, tmp_path):
    from tracer.trace_reader import END_SIGNAL, read_trace, write_trace
    d, _ = run_dir
    t = read_trace(d / "rank0.trace")
    write_trace(str(tmp_path / "rank0"), t.records, t.names, end_state=END_SIGNAL, end_signal=9,
                header={"config": {}, "rank": 0})
    r = report(tmp_path)
    assert r.returncode == 0 and "WARNING: the run was killed by signal SIGKILL" in r.stdout
    assert "WARNING: the rank's header has no final allocator counters: the run was cut short" in r.stdout
    j = json.loads(report(tmp_path, "--json").stdout)["ranks"][0]["trace"]
    assert j["end_state"] == "signal" and j["end_signal"] == "SIGKILL" and len(j["problems"]) == 2


@pytest.mark.parametrize("make", ["missing", "empty_dir", "bad_magic", "bad_version", "bad_json", "no_rank",
                                  "no_names", "bad_names", "short_names"])
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
        (tmp_path / "rank0.names").write_bytes(open(d / "rank0.names", "rb").read())
        (tmp_path / "rank0.json").write_text("{not json")
    elif make.endswith("names"):
        (tmp_path / "rank0.trace").write_bytes(data)
        lines = open(d / "rank0.names", "rb").read().splitlines(keepends=True)
        if make == "bad_names":
            (tmp_path / "rank0.names").write_bytes(b"".join(lines[:2] + [b"\xff\t\n"] + lines[3:]))
        elif make == "short_names":
            (tmp_path / "rank0.names").write_bytes(b"".join(lines[:3]))
    elif make == "no_rank":
        target, extra = d, ["--rank", "5"]
    r = report(target, *extra)
    assert r.returncode == 2
    assert r.stderr.startswith("tracer.report: error:") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
    want = {"no_names": "rank0.names: missing", "bad_names": "damaged string table",
            "short_names": "the string table ends at id 2"}.get(make)
    assert want is None or want in r.stderr, r.stderr


@pytest.mark.parametrize("mode", ["--json", "--segments"])
def test_closed_pipe_ends_quietly(run_dir, mode):
    """The reader goes away before the report is written (`... | head -1` on a long report): exit 0, and no
    '[Errno 32] Broken pipe' error line or traceback on stderr."""
    d, _ = run_dir
    p = subprocess.Popen([sys.executable, "-m", "tracer.report", str(d), mode], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err == "", err

