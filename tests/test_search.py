"""--search: every layout it lists is one the estimator's own validation accepts and that fits (with the verdict's
allowances), in rank order."""
import io
import json
import os
import shlex
import subprocess
import sys

import pytest

from estimator import comm as C
from estimator import formulas as F
from estimator import memory as MEM
from estimator import parallel as PAR
from estimator import search as S
from estimator import verdict as V
from estimator.args import ConfigError, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A small MoE model on 8 GPUs: every dimension (TP, PP, VPP, CP, EP, expert TP, micro batch, recompute,
# distributed optimizer) has more than one value, and some combinations are refused (6 heads: TP 4 and 8 fail).
BASE = shlex.split("--nproc_per_node 8 --num-layers 4 --hidden-size 192 --num-attention-heads 6 --seq-length 256 "
                   "--max-position-embeddings 256 --vocab-size 1000 --num-experts 4 --moe-router-topk 2 "
                   "--global-batch-size 16 --micro-batch-size 1 --bf16 --disable-bias-linear --swiglu "
                   "--tensor-model-parallel-size 2")   # the command line's own layout is replaced
GIB = 1 << 30


@pytest.fixture(scope="module")
def result():
    fset = F.load("modelled")
    everything = S.search(BASE, float("inf"), fset, progress=False, workers=1)
    # About half of them fit; whole bytes, as --gpu-memory gives (GiB * 2^30, truncated to an integer).
    limit = float(int(sorted(c.total_bytes for c in everything.fits)[len(everything.fits) // 2]))
    return everything, S.search(BASE, limit, fset, progress=False, workers=1), limit


def test_counts_and_every_dimension_varies(result):
    everything, fitting, limit = result
    assert everything.enumerated > everything.accepted == len(everything.fits) > len(fitting.fits) > 0
    assert fitting.accepted == everything.accepted
    lays = [c.layout for c in everything.fits]
    for dim in ("tp", "pp", "vpp", "cp", "ep", "etp", "mbs", "recompute", "dist_opt"):
        assert len({getattr(x, dim) for x in lays}) > 1, dim
    assert {x.tp for x in lays} == {1, 2}   # 6 heads: Megatron refuses TP 4 and 8


def test_every_listed_layout_is_accepted_by_the_validation_and_fits(result):
    _, fitting, limit = result
    fset = F.load("modelled")
    for c in fitting.fits:
        cfg = parse_args(BASE + c.layout.argv())   # the flags the search prints, through the user's path
        est = MEM.estimate(cfg, fset)
        assert est.max_peak_bytes == c.peak_bytes
        assert c.peak_bytes < c.total_bytes <= limit
        assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size,
                cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size, cfg.micro_batch_size,
                cfg.use_distributed_optimizer) == (c.layout.tp, c.layout.pp, c.layout.cp, c.layout.ep,
                                                   c.layout.etp, c.layout.mbs, c.layout.dist_opt)
        assert (cfg.virtual_pipeline_model_parallel_size or 1) == c.layout.vpp


def test_layouts_left_out_are_refused_or_do_not_fit(result):
    everything, fitting, limit = result
    kept = [c for c in everything.fits if c.total_bytes <= limit]
    assert len(kept) == len(fitting.fits)
    refused = 0
    for lay in S.enumerate_layouts(parse_args(BASE).to_dict() | {"micro_batch_size": 1}):
        try:
            parse_args(BASE + lay.argv())
        except ConfigError:
            refused += 1
    assert refused == everything.enumerated - everything.accepted > 0


def test_ranking_order_and_comm_against_a_direct_computation(result):
    _, fitting, _ = result
    keys = [S.rank_key(c) for c in fitting.fits]
    assert keys == sorted(keys)
    assert len({c.comm_bytes for c in fitting.fits}) > 3   # the order is decided by communication, not ties only
    # The search reuses per-iteration communication across micro batch sizes; the direct computation agrees.
    for c in fitting.fits[:: max(1, len(fitting.fits) // 25)]:
        cfg = parse_args(BASE + c.layout.argv())
        direct = C.communication(cfg, PAR.layout_from_config(cfg), MEM.all_param_chunks(cfg))
        assert c.comm_bytes == max(sum(b.values()) for b in direct.per_rank_bytes().values())
        assert c.bubble == (S.bubble(c.layout.pp, c.layout.vpp, cfg.num_microbatches))


def test_totals_are_the_verdicts(result):
    """A listed layout's total is the verdict's worst stage total for the same flags (same allowances: fragmentation
    as a percent of the peak, as the search takes it; a plain run models it by default, estimator.reserved)."""
    _, fitting, limit = result
    from estimator.cli import build_report
    for c in fitting.fits[:: max(1, len(fitting.fits) // 10)]:
        budget = build_report(BASE + c.layout.argv() + ["--formulas", "modelled", "--gpu-memory", repr(limit / GIB),
                                                        "--fragmentation-percent", "5"]).budget
        assert budget.worst.total == pytest.approx(c.total_bytes, rel=1e-12)
        assert budget.worst.pp_rank == c.total_stage and budget.fits
    # Other allowances: fewer layouts fit.
    tight = S.search(BASE, limit, F.load("modelled"), progress=False, workers=1,
                     allowances={"cuda_context_gib": 3.0, "fragmentation_percent": None})
    assert tight.allowances == dict(V.DEFAULTS, cuda_context_gib=3.0)
    assert len(tight.fits) < len(fitting.fits)
    assert all(c.total_bytes <= limit for c in tight.fits)


def test_workers_give_the_same_answer(result):
    _, fitting, limit = result
    par = S.search(BASE, limit, F.load("modelled"), progress=False, workers=2)
    assert [(c.layout, c.peak_bytes, c.comm_bytes) for c in par.fits] == \
        [(c.layout, c.peak_bytes, c.comm_bytes) for c in fitting.fits]


def test_progress_bar_only_after_a_second():
    out = io.StringIO()
    bar = S._Progress(100, out)
    bar.update(10)
    assert out.getvalue() == ""
    bar.start -= 2.0   # as if the search had run for two seconds
    bar.last -= 2.0
    bar.update(50)
    assert out.getvalue().startswith("\rsearch [###############...............] 50/100 layouts")
    bar.close()
    assert "100/100 layouts" in out.getvalue() and out.getvalue().endswith("\n")


def run_cli(*args):
    """The CLI on the fixture's set (the modelled one: the search's own logic is the subject, and it is fast)."""
    return subprocess.run([sys.executable, "get_training_info.py", *BASE, "--formulas", "modelled", *args],
                          cwd=ROOT, capture_output=True, text=True)


def test_cli_search_text_json_and_errors(result):
    _, fitting, limit = result
    gib = limit / GIB
    p = run_cli("--search", "--gpu-memory", repr(gib), "--top", "3", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["fits"] == len(fitting.fits) and len(doc["layouts"]) == 3
    assert doc["layouts"][0]["flags"] == fitting.fits[0].layout.argv()
    p = run_cli("--search", "--gpu-memory", repr(gib))
    assert p.returncode == 0
    best = p.stdout.split("Best layout's flags:\n")[1].split()
    assert best == fitting.fits[0].layout.argv()
    assert max(len(line) for line in p.stdout.splitlines()) <= 100
    p = run_cli("--search", "--gpu-memory", repr(gib), "--exit-code", "--cuda-context-gib", "1000")
    assert p.returncode == 1 and "No layout fits." in p.stdout
    for bad, msg in ((["--search"], "--search needs --gpu-memory"),
                     (["--search", "--gpu-memory", "x"], "neither a number of GiB nor a known GPU"),
                     (["--search", "--gpu-memory", "-3"], "must be a positive number"),
                     (["--search", "--gpu-memory", "80", "--top", "0"], "--top: must be at least 1")):
        p = run_cli(*bad)
        assert p.returncode == 2 and p.stderr.startswith("error: ") and msg in p.stderr, p.stderr
