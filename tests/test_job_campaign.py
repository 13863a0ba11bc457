"""`profile-training-info ... --campaign DIR` (fit.job_campaign, fit.job_plan): a job's own formula set from a shrunk
copy of it, traced one rank per rank class on torch's fake process group.

The end-to-end test runs the README's workflow on a two-rank launch script (tiny Llama-style model, TP 2 + SP,
distributed optimizer) sed'd to the profiler, then predicts a config of the same model that no plan run had (more
layers, pipeline instead of tensor parallelism, more microbatches) and compares every rank with a real gloo run of
it, measured by the tracing allocator's own peak counter.
"""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.args import parse_args
from fit.campaign import _flag_int, _set_flag as _set
from fit.job_plan import PlanError, make_plan

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

LLAMA = ("--num-layers 4 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
         "--global-batch-size 8 --swiglu --normalization RMSNorm --position-embedding-type rope "
         "--disable-bias-linear --untie-embeddings-and-output-weights --bf16 --vocab-size 256 --hidden-dropout 0 "
         "--attention-dropout 0 --lr 1e-4 --train-iters 10 --use-distributed-optimizer")
JOB = LLAMA + " --tensor-model-parallel-size 2 --sequence-parallel --data-path /nowhere --save /nowhere"


def _flags(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_plan_keeps_the_model_and_varies_shapes_and_layouts():
    job = shlex.split(JOB)
    plan = make_plan(job, 2)
    layouts = {r.name.split("_s")[0] for r in plan.runs}
    assert layouts == {"job", "tp1", "pp2"}
    for r in plan.runs:
        cfg = parse_args(["--nproc_per_node", str(r.world)] + r.argv)
        # the model's widths and features are the job's
        for flag in ("--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
                     "--vocab-size"):
            assert _flags(r.argv, flag) == _flags(job, flag)
        assert "--use-distributed-optimizer" in r.argv and "--swiglu" in r.argv
        # layers: two per pipeline stage; a few microbatches; world = the layout's size
        assert cfg.num_layers == 2 * cfg.pipeline_model_parallel_size
        assert cfg.world_size == r.world == cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
        assert cfg.num_microbatches == max(2, cfg.pipeline_model_parallel_size)
        assert (cfg.seq_length, cfg.micro_batch_size) == r.shape
        # one traced rank per pipeline stage kind
        assert r.ranks == list(range(cfg.pipeline_model_parallel_size))
    # four shapes per layout: two sequences, one-sequence and larger micro-batches
    shapes = {r.shape for r in plan.runs}
    assert shapes == {(32, 1), (16, 1), (32, 2), (16, 3)}
    job_runs = [r for r in plan.runs if r.name.startswith("job")]
    assert all("--sequence-parallel" in r.argv and _flag_int(r.argv, "--tensor-model-parallel-size") == 2
               for r in job_runs)
    # the validation config is the job's layout and shape, with more layers than any traced run
    v = plan.validation
    assert v.shape == (32, 2) and _flag_int(v.argv, "--num-layers") > max(
        _flag_int(r.argv, "--num-layers") for r in job_runs)
    assert "--data-path" in v.argv   # the job's other flags are kept (the harness ignores data flags)


def test_plan_for_moe_pipeline_and_interleaving():
    job = shlex.split(LLAMA.replace("--num-layers 4", "--num-layers 16") + " --num-experts 8 --moe-router-topk 2 "
                      "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall "
                      "--moe-layer-freq ([0]*2+[1]*14) --tensor-model-parallel-size 2 --sequence-parallel "
                      "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2")
    plan = make_plan(_set(job, "--global-batch-size", 64), 64)
    for r in plan.runs:
        cfg = parse_args(["--nproc_per_node", str(r.world)] + r.argv)
        # expert parallelism fits: EP x expert TP divides TP x CP x DP
        assert (cfg.tensor_model_parallel_size * cfg.data_parallel_size) % \
            (cfg.expert_model_parallel_size * (cfg.expert_tensor_parallel_size or 1)) == 0
        pattern = cfg.moe_layer_pattern() if callable(getattr(cfg, "moe_layer_pattern", None)) else None
        if pattern is not None:
            assert pattern[0] == 0 and 1 in pattern   # both layer kinds, the dense one first as in the job
        pp = cfg.pipeline_model_parallel_size
        if r.name.startswith("job"):
            # interleaving: one layer per virtual chunk, four stages, first / middle / last traced
            assert cfg.virtual_pipeline_model_parallel_size == 2 and cfg.num_layers == pp * 2
            assert len(r.ranks) == 3
    # each parallel size has two values among the runs: TP, CP and PP off together, EP halved alone
    sizes = {r.name.split("_s")[0]: (parse_args(["--nproc_per_node", str(r.world)] + r.argv)) for r in plan.runs}
    assert set(sizes) == {"job", "tp1", "ep"}
    assert [(c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.expert_model_parallel_size)
            for c in (sizes["job"], sizes["tp1"], sizes["ep"])] == [(2, 4, 4), (1, 1, 4), (1, 1, 2)]


def test_plan_for_context_parallelism_varies_it_alone():
    job = shlex.split(LLAMA + " --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel")
    plan = make_plan(_set(job, "--global-batch-size", 16), 8)
    cp = {r.name.split("_s")[0]: parse_args(["--nproc_per_node", str(r.world)] + r.argv).context_parallel_size
          for r in plan.runs}
    assert cp == {"job": 2, "tp1": 1, "pp2": 1, "cp": 2}
    # sequences split over TP (SP) and CP's load-balanced chunks: multiples of 8, TP and 2 x CP
    assert all(r.shape[0] % 8 == 0 for r in plan.runs)


def test_plan_refuses_a_job_it_cannot_read():
    with pytest.raises(PlanError):
        make_plan(["--num-layers", "2", "--hidden-size", "64"], 2)


def _env(tmp_path, memtrace_args):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", MEMTRACE_ARGS=memtrace_args,
               HOME=str(tmp_path))
    env.pop("PYTHONPATH", None)
    return env


def _scripts(tmp_path):
    (tmp_path / "launch.sh").write_text(f"#!/bin/bash\ntorchrun --nproc_per_node 2 pretrain_gpt.py {JOB} \"$@\"\n")
    for word, name in (("profile-training-info", "profile.sh"), ("get-training-info", "estimate.sh")):
        text = (tmp_path / "launch.sh").read_text().replace("torchrun", word)
        (tmp_path / name).write_text(text)


def test_campaign_with_the_users_own_script_is_refused_in_one_line(tmp_path):
    _scripts(tmp_path)
    (tmp_path / "pretrain_gpt.py").write_text("")
    res = subprocess.run(["bash", "profile.sh"], cwd=tmp_path, capture_output=True, text=True,
                         env=_env(tmp_path, "--campaign camp --cpu"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--target harness" in res.stderr and "Traceback" not in res.stderr


def test_campaign_dry_run_names_the_job_campaign(tmp_path):
    _scripts(tmp_path)
    res = subprocess.run(["bash", "profile.sh"], cwd=tmp_path, capture_output=True, text=True,
                         env=_env(tmp_path, "--campaign camp --cpu --target harness --dry-run"))
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert cmd[1:3] == ["-m", "fit.job_campaign"] and "--cpu" in cmd
    assert cmd[cmd.index("--") + 1:cmd.index("--") + 3] == ["--nproc_per_node", "2"]


@pytest.mark.megatron
def test_campaign_end_to_end_predicts_another_layout_of_the_job(tmp_path):
    _scripts(tmp_path)
    res = subprocess.run(["bash", "profile.sh"], cwd=tmp_path, capture_output=True, text=True,
                         env=_env(tmp_path, "--campaign camp --cpu --target harness"), timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert out.startswith("plan: 12 runs") and "label phases exact to the byte" in out and "0 not reproduced" in out
    errs = [float(ln.rsplit(",", 1)[1].strip().rstrip("%")) for ln in out.splitlines() if "(allocator peak)" in ln]
    assert errs and all(abs(e) <= 1.0 for e in errs), out
    doc = json.loads((tmp_path / "camp" / "formulas.json").read_text())
    assert doc["profiled"]["device"] == "cpu" and doc["profiled"]["versions"]["megatron_core"]

    # The set predicts the job's own line, and says it was profiled on CPU.
    res = subprocess.run(["bash", "estimate.sh"], cwd=tmp_path, capture_output=True, text=True,
                         env=_env(tmp_path, "--formulas camp/formulas.json --json"))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["formula_set"]["profiled"]["device"] == "cpu"
    assert report["formula_set"]["coverage"]["measured_share"] == 1.0

    # Another config of the same model, run for real on gloo: 8 layers, PP 2 instead of TP 2, 8 microbatches.
    other = shlex.split(JOB.replace("--tensor-model-parallel-size 2 --sequence-parallel",
                                    "--pipeline-model-parallel-size 2")
                        .replace("--num-layers 4", "--num-layers 8").replace("--global-batch-size 8",
                                                                             "--global-batch-size 16"))
    run = tmp_path / "gloo_pp2"
    res = subprocess.run([sys.executable, "-m", "tracer.profile", "--cpu", "--nproc", "2", "--out", str(run),
                          "--", *other], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    from estimator import formulas as F
    from fit.dataset import predicted_and_measured
    rows = predicted_and_measured(str(run), F.load(str(tmp_path / "camp" / "formulas.json")))
    assert [r for r, *_ in rows] == [0, 1]
    for rank, stage, predicted, measured in rows:
        assert abs(predicted - measured) / measured <= 0.01, (rank, predicted, measured)


def test_plan_fits_each_run_on_the_device():
    """A Llama-3-70B-shaped job (TP 8 + SP, PP 4, sequence 8192) planned for one 80 GB GPU: the runs that would take
    TP 1 take the smallest TP that fits (the estimator's default set decides), and every run and the validation
    fit; with a smaller device the sequences are halved first."""
    from fit.job_plan import _peak
    job = shlex.split("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
                      "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
                      "--micro-batch-size 1 --global-batch-size 128 --vocab-size 128256 --bf16 --swiglu --normalization "
                      "RMSNorm --position-embedding-type rope --disable-bias-linear "
                      "--untie-embeddings-and-output-weights --tensor-model-parallel-size 8 "
                      "--pipeline-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer")
    limit = 0.9 * 80 * 2 ** 30
    plan = make_plan(job, 256, limit, "cuda")
    tps = {parse_args(["--nproc_per_node", str(r.world)] + r.argv).tensor_model_parallel_size for r in plan.runs}
    assert tps == {8, 2} and {r.name.split("_s")[0] for r in plan.runs} == {"job", "tp2"}
    for r in plan.runs + [plan.validation]:
        assert _peak(r.argv, r.world, "cuda") <= limit
    # without a limit the same plan would trace TP 1 (which does not fit)
    free = make_plan(job, 256)
    one = next(r for r in free.runs if r.name == "tp1_s8192_b2")
    assert _peak(one.argv, one.world, "cuda") > limit
    # a 40 GB device: TP 4 for those runs; a 12 GiB one: the job's own layout needs shorter sequences first
    mid = make_plan(job, 256, 0.9 * 40 * 2 ** 30, "cuda")
    assert {r.name.split("_s")[0] for r in mid.runs} == {"job", "tp4"}
    small = make_plan(job, 256, 12 * 2 ** 30, "cuda")
    assert max(r.shape[0] for r in small.runs) == 4096 and any("sequences up to 4096" in n for n in small.notes)
    for r in small.runs + [small.validation]:
        assert _peak(r.argv, r.world, "cuda") <= 12 * 2 ** 30
