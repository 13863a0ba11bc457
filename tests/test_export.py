"""Exports: the snapshot pickle loads in torch's own memory_viz tools and replays to the same peak; the PNG."""
import os
import pickle
import subprocess
import sys

import pytest
from torch.cuda import _memory_viz as mv

from test_parse import training_like_trace
from tracer.export import plot_timeline, save_snapshot, to_snapshot
from tracer.parse import parse_run


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    training_like_trace(str(d / "rank0"))
    return parse_run(str(d))


def test_snapshot_structure_and_replay(parsed):
    snap = to_snapshot(parsed)
    pr = parsed[0]
    assert len(snap["device_traces"]) == 1
    level, peak = 0, 0
    for e in snap["device_traces"][0]:
        assert {"action", "addr", "size", "stream", "time_us", "frames"} <= set(e)
        level += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, level)
    assert peak == pr.peak_bytes
    assert level == sum(s["total_size"] for s in snap["segments"]) == int(pr.live[-1])
    # frames are the scope stack, innermost first
    fr = [e["frames"] for e in snap["device_traces"][0] if e["action"] == "alloc" and e["size"] == 300][0]
    assert [f["filename"] for f in fr] == ["mod:decoder.layers.0.mlp", "mod:decoder.layers.0", "fwd:0", "iter:0"]


def test_torch_memory_viz_reads_snapshot(parsed, tmp_path):
    path = tmp_path / "snap.pickle"
    save_snapshot(parsed, str(path))
    snap = pickle.load(open(path, "rb"))
    assert "total_allocated" in mv.segsum(snap)
    text = mv.trace(snap)
    assert "Device 0" in text and "cudaMalloc" in text and "free completed" in text
    # blocks still live at the end (weights, grad buffer, Adam state) with their scope stacks
    flame = mv.segments(snap, format_flamegraph=lambda s: s) + mv.memory(snap, format_flamegraph=lambda s: s)
    assert "setup:model" in flame and "optim" in flame and "active_allocated" in flame
    assert "snapshot.pickle" in mv.trace_plot(snap) and mv.segment_plot(snap)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for kind in ("trace_plot", "segment_plot"):
        out = tmp_path / f"{kind}.html"
        r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", kind, str(path), "-o", str(out)],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        assert out.stat().st_size > 1000


def test_png_timeline(parsed, tmp_path):
    out = tmp_path / "t.png"
    plot_timeline(parsed, str(out))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    plot_timeline(parsed, str(out), x="events")
