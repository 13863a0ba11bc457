"""One rank of a world on torch's fake process group (tracer/fake_world.py, `python -m tracer.profile --fake-world`):
real megatron-core runs on CPU, two gloo ranks against their fake-group twins traced one process at a time; every
label phase's allocation program of every rank is the same, event by event, except gloo's own buffers (worker-
thread pairs, staging copies a collective frees before it returns); and a rank of a world of 8 traces alone."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracer.fake_world import twin_difference

ROOT = Path(__file__).resolve().parents[1]
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --vocab-size 500 --transformer-impl local --seed 1234 --lr 1e-4 --train-iters 10 "
        "--disable-gloo-process-groups").split()
TWINS = {
    "tp2_sp": (["--global-batch-size", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"], []),
    "ep2_alltoall_distopt": (["--global-batch-size", "8", "--num-experts", "4", "--moe-router-topk", "2",
                              "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                              "--use-distributed-optimizer"], ["--balanced-routing"]),
}


def test_twin_difference_reads_staging_copies_and_workers_as_the_backend_s():
    fake = [("+", 32, ""), ("+", 16, ""), ("+", 32, ""), ("-", 32, "#0"), ("-", 64, "bwd:x#0"), ("-", 32, "#2")]
    # a staging copy freed inside the phase, after the next allocation; a worker pair
    real = [("+", 32, ""), ("+~", 32, "~0"), ("+", 16, ""), ("+", 32, ""), ("-~", 32, "~0"), ("+", 32, ""),
            ("-", 32, "#2"), ("-", 32, "#0"), ("-", 64, "bwd:x#3"), ("-", 32, "#3")]
    assert twin_difference(real, fake) == [32, 32]
    assert twin_difference(fake, fake) == []
    # an allocation the twin lacks that outlives the phase, a different size, a free out of order: not the backend's
    assert twin_difference(real + [("+", 8, "")], fake) is None
    assert twin_difference([("+", 48, "")] + real[2:], fake) is None
    assert twin_difference(real, [fake[0], fake[1], fake[2], fake[5], fake[4], fake[3]]) is None


def _profile(out: Path, extra: list, launcher: list) -> None:
    cmd = [sys.executable, "-m", "tracer.profile", "--cpu", "--out", str(out), "--iterations", "2", *launcher,
           "--", *BASE, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(TWINS))
def test_each_rank_is_its_fake_twin_event_by_event(tmp_path, name):
    from fit.programs.extract import run_programs
    from tracer.parse import parse_run
    extra, launcher = TWINS[name]
    _profile(tmp_path / "gloo", extra, launcher + ["--nproc", "2"])
    _profile(tmp_path / "fake", extra, launcher + ["--fake-world", "2", "--ranks", "0,1"])
    real, fake = parse_run(str(tmp_path / "gloo")), parse_run(str(tmp_path / "fake"))
    assert [r.header["coords"] for r in real] == [f.header["coords"] for f in fake]
    assert {f.header["process_group"] for f in fake} == {"fake"} and real[0].header["process_group"] == "gloo"
    for pr, pf in zip(real, fake):
        a = run_programs(str(tmp_path / "gloo"), [pr]).programs
        b = run_programs(str(tmp_path / "fake"), [pf]).programs
        assert set(a) == set(b) and len(a) > 50
        for key in a:
            extras = twin_difference([(e.op, e.size, e.ref) for e in a[key].events()],
                                     [(e.op, e.size, e.ref) for e in b[key].events()])
            assert extras is not None, f"rank {pr.rank} {key}: the programs differ beyond gloo's buffers"
        # the twin lacks only buffers the real backend frees at once: never a higher peak
        assert pf.peak_bytes <= pr.peak_bytes


def test_a_rank_of_a_world_of_eight_traces_alone(tmp_path):
    """TP 2 x PP 2 x DP 2 with the distributed optimizer: by default the first and the last stage of the first
    pipeline group, each alone in its process."""
    out = tmp_path / "w8"
    _profile(out, ["--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                   "2", "--use-distributed-optimizer"], ["--fake-world", "8"])
    headers = {p.name: json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(headers) == ["rank0.json", "rank4.json"]
    assert [headers[n]["coords"]["pp"] for n in sorted(headers)] == [0, 1]
    assert all(h["world_size"] == 8 and h["process_group"] == "fake" and "error" not in h for h in headers.values())


def test_fake_world_options_are_checked():
    for args, msg in ((["--ranks", "0"], "--ranks needs --fake-world"),
                      (["--fake-world", "2", "--ranks", "2"], "outside a world of 2"),
                      (["--fake-world", "0"], "must be >= 1")):
        proc = subprocess.run([sys.executable, "-m", "tracer.profile", "--cpu", *args, "--", *BASE], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 2 and msg in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_campaign_grid_traces_chosen_ranks_of_a_fake_world(tmp_path):
    from fit.campaign import GridError, is_complete, load_grid, profile_command
    _, configs = load_grid(str(ROOT / "fit" / "grids" / "cpu_layouts.json"))
    pp4 = next(c for c in configs if c.name.startswith("pp4_fp32"))
    cmd = profile_command(pp4, "OUT", 2, "cpu")
    assert cmd[cmd.index("--fake-world") + 1] == "4" and cmd[cmd.index("--ranks") + 1] == "0,1,3"
    assert "--nproc" not in cmd and not is_complete(str(tmp_path), pp4)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"configs": [{"name": "x", "nproc": 2, "ranks": [2]}]}))
    with pytest.raises(GridError, match="ranks below nproc"):
        load_grid(str(bad))


def test_committed_layout_runs_that_the_cpu_set_carries_exactly():
    """fit/traces/cpu_layouts: the grid's runs (ranks of worlds of 4 and 8 on the fake group), fitted into
    cpu_compose beside its gloo runs (the `collectives` switch keeps their programs apart). TP 4 and TP 8 with and
    without SP, PP 4 in fp32, interleaved or not, and TP x PP x DP are carried within 0.1% on every traced rank;
    the rest (bf16 pipelines, MoE over 4 and 8 expert ranks) within -0.6% .. +1.6% (a bf16 PP 4 last stage
    -0.59%: docs/ACCURACY.md)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from packed_runs import rank_peaks
    from estimator import formulas as F
    fset = F.load("cpu_compose")
    runs = ROOT / "fit" / "traces" / "cpu_layouts"
    names = sorted(p.name for p in runs.iterdir() if (p / "campaign.json").is_file())
    assert len(names) == 26
    for name in names:
        predicted, measured, _ = rank_peaks(str(runs / name), fset)
        assert len(measured) in (1, 2, 3)
        close = name.startswith(("tp4_", "tp8_", "pp4_fp32", "pp4_vpp2", "tp2_pp2"))
        for p, m in zip(predicted, measured):
            assert -(0.001 if close else 0.006) * m <= p - m <= (0.001 if close else 0.016) * m, (name, p, m)