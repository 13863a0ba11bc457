"""python -m fit.job_campaign --out DIR [--cpu] [--jobs N] [--iterations N] [--plan-only] -- [torchrun world flags]
[Megatron-LM flags]: profile a shrunk copy of one training job, fit its allocation programs, check them.

What `profile-training-info ... --campaign DIR` runs (tracer/launch.py). Steps, each said as it happens:
1. the plan (fit.job_plan): the job's model with few layers, four shapes, its own layout and a few others, each
   traced one rank per rank class on torch's fake process group, every run sized to fit the device (the
   estimator's default set decides); printed with its expected time before it runs;
2. the runs (fit.campaign), traces in DIR/traces/<run>/; an interrupted campaign resumes where it stopped;
3. the fit (fit.programs): DIR/formulas.json and its provenance, with the stack the runs had (device, kernels,
   versions, target) in the set's `profiled` field, so an estimate with it says what it predicts;
4. validation: the job's own layout and shape with more layers and microbatches than any traced run, traced the
   same way, its every traced rank's peak (the allocator's own counter) against the estimate from DIR/formulas.json.

Then `get-training-info <the job's line> --formulas DIR/formulas.json` predicts the whole job from the set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .campaign import Config, GridError, run_campaign, run_one
from .job_plan import Plan, PlanError, make_plan

SET_NAME = "formulas.json"
ITERATIONS = 3


def job_world(argv: list) -> tuple[int, list]:
    """(world size, Megatron flags) of a job's line as get-training-info takes it (torchrun world flags first)."""
    from estimator.args import ConfigError, parse_args
    from estimator.torchrun import split
    line = split(argv)
    try:
        cfg = parse_args(line.world_flags() + line.script_args)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    return int(cfg.world_size), list(line.script_args)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")


def profiled_stack(run_dirs: list, device: str, target: str) -> dict:
    """What the runs had, from their headers: device, kernel families, versions (the set records it)."""
    from .dataset import header_kernels, run_argv
    hdr = run_argv(run_dirs[0])[1]
    out = {"device": "cpu" if device == "cpu" else "cuda", "target": target,
           "kernels": header_kernels(hdr), "versions": dict(hdr.get("versions") or {}),
           "process_group": hdr.get("process_group", "fake")}
    if device != "cpu" and hdr.get("device"):
        out["device_name"] = str(hdr["device"])
    return out


def fit_set(run_dirs: list, out_path: str, profiled: dict) -> str:
    """Fit the program set of the plan's runs into out_path; the fit's summary."""
    from .programs.build import fit_set as fit
    summary, _ = fit(run_dirs, out_path, "job", f"Allocation programs of one job's ops, fitted from "
                                               f"{len(run_dirs)} runs of its shrunk copy (fit.job_campaign)", profiled)
    return summary


def validate(run_dir: str, set_path: str) -> list:
    """[(rank, pipeline stage, predicted bytes, measured bytes)] of a traced run against the set."""
    from estimator import formulas as F
    from .dataset import predicted_and_measured
    fset = F.load(set_path)
    return predicted_and_measured(run_dir, fset)


def rank_memory(device: str, jobs: int) -> float | None:
    """The memory one traced rank may take: 90% of the GPU's, or on CPU 80% of the host's share of the runs at
    once; None where it cannot be read."""
    if device != "cpu":
        try:
            import torch
            return 0.9 * torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        except ImportError:
            return None
    try:
        return 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(jobs, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _config(run) -> Config:
    return Config(run.name, list(run.argv), run.world, ranks=list(run.ranks))


def run(argv: list, out: str, device: str, jobs: int, iterations: int, plan_only: bool = False,
        target: str = "harness", stream=None) -> int:
    say = (lambda s: print(s, file=stream or sys.stdout, flush=True))
    if target != "harness":
        raise PlanError(f"--target {target}: --campaign traces one rank at a time on torch's fake process group, "
                        f"which the built-in harness drives; set --target harness (your own pretrain_gpt.py is not "
                        f"supported by --campaign yet)")
    out = os.path.abspath(out)
    world, flags = job_world(argv)
    plan: Plan = make_plan(flags, world, rank_memory(device, jobs), device)
    say(plan.describe(device, jobs))
    if plan_only:
        return 0
    os.makedirs(out, exist_ok=True)
    grid = plan.grid("job", device, iterations)
    grid["target"] = target
    grid_path = os.path.join(out, "plan.json")
    _write_json(grid_path, grid)
    t0 = time.time()
    _, dirs, failures = run_campaign(grid_path, os.path.join(out, "traces"), resume=True, jobs=jobs)
    for f in failures:
        say(f"FAILED {f}")
    if failures:
        raise GridError(f"{len(failures)} of {len(plan.runs)} runs failed (logs in {out}/traces); fix the cause and "
                        f"rerun the same command to resume")
    say(f"traced {len(dirs)} runs in {time.time() - t0:.0f} s")
    set_path = os.path.join(out, SET_NAME)
    say(fit_set(dirs, set_path, profiled_stack(dirs, device, target)))

    v = plan.validation
    vdir = os.path.join(out, "validation")
    os.makedirs(vdir, exist_ok=True)
    done = os.path.join(vdir, v.name)
    if not os.path.isdir(done):
        ok, why = run_one(_config(v), vdir, iterations, device, 1800.0, target)
        if not ok:
            raise GridError(f"validation run: {why}")
    rows = validate(done, set_path)
    say(f"validation ({v.layout}, s={v.shape[0]} b={v.shape[1]}; a config no traced run had), peak per rank:")
    worst = 0.0
    for rank, stage, pred, meas in rows:
        err = (pred - meas) / meas
        worst = max(worst, abs(err))
        say(f"  rank {rank} (stage {stage}): predicted {pred / 2**20:9.2f} MiB, measured {meas / 2**20:9.2f} MiB "
            f"(allocator peak), {100 * err:+.2f}%")
    say(f"done in {time.time() - t0:.0f} s. Predict the job: get-training-info <its line> --formulas {set_path}")
    return 0


def main(argv=None) -> int:
    from .campaign import run_cli
    ap = argparse.ArgumentParser(prog="python -m fit.job_campaign", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="campaign directory (plan, traces, formulas.json)")
    ap.add_argument("--cpu", action="store_true", help="trace on CPU (gloo semantics, CPU kernels)")
    ap.add_argument("--jobs", type=int, default=None, help="runs at once (default: 2 on CPU, 1 on a GPU)")
    ap.add_argument("--iterations", type=int, default=ITERATIONS)
    ap.add_argument("--target", default="harness")
    ap.add_argument("--plan-only", action="store_true", help="print the plan and stop")
    ap.add_argument("job", nargs=argparse.REMAINDER, help="-- then the job's torchrun world flags and Megatron flags")
    a = ap.parse_args(argv)
    job = a.job[1:] if a.job[:1] == ["--"] else a.job
    if not job:
        ap.error("give the job's flags after --")
    device = "cpu" if a.cpu else "cuda"
    jobs = a.jobs or (2 if a.cpu else 1)
    return run_cli(ap.prog, lambda: run(job, a.out, device, jobs, a.iterations, a.plan_only, a.target),
                   (GridError, PlanError, OSError))


if __name__ == "__main__":
    sys.exit(main())
