"""--memory-snapshot: the predicted allocation stream as the pickle torch.cuda.memory._snapshot() writes. Torch's
own snapshot readers (torch.cuda._memory_viz, what memory_viz runs) read it; it carries the estimate's stream
and the reserved model's segments; on a packed CPU run it sits beside the run's own exported snapshot
(tracer.export.to_snapshot) with the same peak and activation allocations."""
import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.cuda import _memory_viz as MV

from estimator import alloc_stream as AS
from estimator import snapshot as SN
from estimator.cli import build_report
from estimator.memory import estimate
from test_reserved_stream import _live

ROOT = Path(__file__).resolve().parents[1]
ARGS = ("--nproc_per_node 8 --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
        "--max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 32 --bf16 "
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --vocab-size 8000 "
        "--use-distributed-optimizer")


def _identity(text):
    return text


def _replayed(trace) -> tuple:
    """(allocations, peak live bytes) of a device trace."""
    live = peak = n = 0
    for e in trace:
        if e["action"] == "alloc":
            n += 1
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= e["size"]
    return n, peak


@pytest.mark.parametrize("fset", ["modelled", "cpu_compose"])
def test_cli_writes_a_snapshot_torch_reads(tmp_path, fset):
    out = tmp_path / "pred.pickle"
    proc = subprocess.run([sys.executable, str(ROOT / "get_training_info.py"), *shlex.split(ARGS), "--formulas", fset,
                           "--memory-snapshot", str(out), "--detail", "0"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    with open(out, "rb") as f:
        snap = pickle.load(f)
    # torch's readers: the segment summary checks each segment's blocks add up to its size
    assert "segments: " in MV.segsum(snap)
    text = MV.trace(snap)
    assert "cudaMalloc" in text and "del " in text
    assert MV.segments(snap, format_flamegraph=_identity) and MV.memory(snap, format_flamegraph=_identity)
    assert "MemoryViz.js" in MV.trace_plot(snap) and "MemoryViz.js" in MV.segment_plot(snap)
    assert len(snap["device_traces"]) == 2      # one device per pipeline stage
    # every tensor says what it is
    names = {e["frames"][0]["name"] for t in snap["device_traces"] for e in t if e["action"] == "alloc"}
    assert {"parameters", "gradients", "optimizer states"} <= names
    if fset == "cpu_compose":   # a program set's tensors carry the label of the segment whose program made them
        assert any(n.startswith("layers.*") for n in names) and any(n.endswith("(backward)") for n in names)


def test_snapshot_carries_the_stream_and_the_reserved_model():
    rep = build_report(shlex.split(ARGS + " --formulas cpu_compose"))
    snap = SN.predicted_snapshot(rep.cfg, rep.formula_set, rep.estimate, rep.reserved.conf)
    for r, trace in zip(rep.estimate.ranks, snap["device_traces"]):
        events = AS.stage_stream_events(rep.cfg, rep.formula_set, rep.estimate, r.pp_rank)
        n, peak = _replayed(trace)
        assert n == sum(1 for e in events if e[0] == "a")
        assert peak == _live(events)[0]
        stage = next(s for s in rep.reserved.stages if s.pp_rank == r.pp_rank)
        segs = [s for s in snap["segments"] if s["device"] == r.pp_rank]
        # no memory limit: no segment is ever released, so the end state holds the reserved peak
        assert sum(s["total_size"] for s in segs) == stage.replay_reserved_bytes
        assert all(sum(b["size"] for b in s["blocks"]) == s["total_size"] for s in segs)


@pytest.mark.parametrize("run", ["gpt_base_s48_b3_h128_a8", "gpt_base_s128_b1_h64_a8"])
def test_a_packed_run_beside_its_own_snapshot(run):
    """The prediction's snapshot of a packed CPU run (real megatron-core, traced) beside the run's own exported
    snapshot: the same peak within 2% and, outside the optimizer step (torch AdamW's per-parameter scalars and
    the gradient-norm pass, not programs yet), the same number of allocations within 10%."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import reserved_model as RM
    from tracer.export import to_snapshot
    path = os.path.join(RM.PACKED, run)
    cfg, hdr = RM.run_config(path)
    est = estimate(cfg, "cpu_compose", device="cpu")
    real = to_snapshot(RM.parse_run(path))["device_traces"][0]
    pred = SN.predicted_snapshot(cfg, "cpu_compose", est, iterations=hdr["iterations"])["device_traces"][0]
    (_, real_peak), (_, pred_peak) = _replayed(real), _replayed(pred)
    assert abs(pred_peak - real_peak) <= 0.02 * real_peak
    real_n = sum(1 for e in real if e["action"] == "alloc" and e["category"] != "optimizer"
                 and not (e["frames"] and e["frames"][0]["name"] in ("optim", "optimizer")))
    pred_n = sum(1 for e in pred if e["action"] == "alloc"
                 and e["frames"][0]["name"] not in ("optimizer step", "optimizer states"))
    assert abs(pred_n - real_n) <= 0.10 * real_n, (pred_n, real_n)
