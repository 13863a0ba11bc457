"""python -m fit.gpu_campaign --wheels DIR [--out DIR] [--grid GRID] [--jobs N] [--budget-minutes M] [--resume]
                            [--install-only] [--dry-run]: the first GPU campaign, in one command.

On one GPU (world size 1), setup included, within the time budget (default 14 minutes):
  1. installs megatron-core, and Transformer Engine when its wheels are there, from the wheel directory only
     (`pip install --no-index --no-deps --target`, as on an air-gapped cluster), into <out>/site; torch is the
     machine's own (torch / nvidia-* / triton wheels in DIR are skipped). A Transformer Engine that does not import
     with this torch is reported and left out: the harness then runs the local spec with its kernel stand-ins;
  2. checks that torch sees a GPU and can take a pluggable allocator;
  3. profiles the grid (fit/grids/gpu_h100.json) with the CUDA tracing allocator under the built-in harness,
     N configs at once (python -m fit.campaign); no config starts once the budget's fitting reserve is reached;
  4. packs the traces xz-compressed with their configs (python -m fit.pack) and fits a composed formula set from the
     packed copy (python -m fit.programs).
Outputs under --out (default gpu_campaign_out): site/ (the installs and site/manifest.json), traces/<config>/ (raw),
packed/<config>/ (to commit, e.g. as fit/traces/gpu_h100), <grid name>.json (the formula set), summary.json.
Then: python -m fit.gpu_validate --campaign <out>.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from .campaign import GridError, _Parser, load_grid, run_cli

DEFAULT_GRID = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grids", "gpu_h100.json")
MANIFEST = "manifest.json"


def fit_reserve_seconds(n_runs: int, cores: int) -> float:
    """Time to keep for packing and python -m fit.programs: about 0.2 s per run (measured: 433 CPU runs in 88 s, 66
    H100 runs in 11 s, on one core), plus a minute for packing, parsing and start-up."""
    return 60.0 + 0.25 * n_runs

_MACHINE_OWN = ("torch", "triton", "nvidia_")   # the GPU machine's torch stack is used as it is


class CampaignError(Exception):
    """One-line failure: printed as `fit.gpu_campaign: error: ...`, exit code 2."""


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dist_name(wheel: str) -> str:
    """Normalised distribution name of a wheel file name (PEP 427: name-version[-build]-py-abi-plat.whl)."""
    return os.path.basename(wheel).split("-", 1)[0].lower().replace(".", "_")


def classify_wheels(wheel_dir: str) -> dict:
    """{"base": [...], "te": [...], "skipped": [...]} of the .whl files in `wheel_dir` (sorted paths)."""
    if not os.path.isdir(wheel_dir):
        raise CampaignError(f"--wheels {wheel_dir}: no such directory")
    out: dict = {"base": [], "te": [], "skipped": []}
    for f in sorted(os.listdir(wheel_dir)):
        if not f.endswith(".whl"):
            continue
        name, path = dist_name(f), os.path.join(wheel_dir, f)
        if name.startswith(_MACHINE_OWN):
            out["skipped"].append(path)
        elif name.startswith("transformer_engine"):
            out["te"].append(path)
        else:
            out["base"].append(path)
    if not any(dist_name(w) == "megatron_core" for w in out["base"]):
        raise CampaignError(f"--wheels {wheel_dir}: no megatron_core-*.whl there (download it with `pip download "
                            "--no-deps --only-binary=:all: megatron-core==0.16.1 ...`, see the README's GPU recipe)")
    return out


def pip_command(target: str, wheels: list) -> list:
    return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
            "--target", target, *wheels]


def _fingerprint(wheels: list) -> list:
    return [[os.path.basename(w), os.path.getsize(w)] for w in wheels]


def _install(target: str, wheels: list) -> None:
    """pip install into a fresh `target` (skipped when it already holds exactly these wheels)."""
    stamp = os.path.join(target, ".installed-from")
    want = json.dumps(_fingerprint(wheels))
    if os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as fh:
            if fh.read() == want:
                return
    if os.path.isdir(target):
        shutil.rmtree(target)
    res = subprocess.run(pip_command(target, wheels), capture_output=True, text=True)
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr + res.stdout).splitlines() if ln.strip()]
        raise CampaignError(f"pip could not install {', '.join(os.path.basename(w) for w in wheels)}: "
                            f"{lines[-1].strip() if lines else 'exit ' + str(res.returncode)}")
    with open(stamp, "w", encoding="utf-8") as fh:
        fh.write(want)


def probe(code: str, paths: list) -> tuple[bool, str]:
    """Run `code` in a fresh interpreter with `paths` first on PYTHONPATH: (ok, last line of its output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, _repo_root(), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=_repo_root())
    lines = [ln.strip() for ln in (res.stdout if res.returncode == 0 else res.stderr).splitlines() if ln.strip()]
    return res.returncode == 0, lines[-1] if lines else f"exit {res.returncode}"


_MCORE_PROBE = "from megatron.core import package_info; print(package_info.__version__)"
_TE_PROBE = "import transformer_engine.pytorch, transformer_engine as te; print(getattr(te, '__version__', '?'))"


def install(wheel_dir: str, site: str) -> dict:
    """Install and probe; writes and returns site/manifest.json: the PYTHONPATH entries every run gets and what
    was used."""
    wheels = classify_wheels(wheel_dir)
    base, te_dir = os.path.join(site, "base"), os.path.join(site, "te")
    _install(base, wheels["base"])
    ok, mcore = probe(_MCORE_PROBE, [base])
    if not ok:
        raise CampaignError(f"megatron-core from {wheel_dir} does not import: {mcore}")
    man = {"paths": [base], "wheel_dir": os.path.abspath(wheel_dir), "megatron_core": mcore,
           "installed": [os.path.basename(w) for w in wheels["base"]],
           "skipped": [os.path.basename(w) for w in wheels["skipped"]], "transformer_engine": None,
           "transformer_engine_note": "no transformer_engine wheels given: the local spec with kernel stand-ins"}
    if not wheels["te"]:
        ok, te = probe(_TE_PROBE, [base])   # e.g. an NGC container: the harness picks it up as it is
        if ok:
            man["transformer_engine"] = te
            man["transformer_engine_note"] = "already installed on this machine: the Transformer Engine spec"
    else:
        _install(te_dir, wheels["te"])
        ok, te = probe(_TE_PROBE, [te_dir, base])
        man["installed"] += [os.path.basename(w) for w in wheels["te"]]
        if ok:
            man["paths"].insert(0, te_dir)
            man["transformer_engine"] = te
            man["transformer_engine_note"] = "installed and imports: the Transformer Engine spec"
        else:
            man["transformer_engine_note"] = (f"installed but does not import with this torch ({te}): left out, "
                                              "the local spec with kernel stand-ins")
    with open(os.path.join(site, MANIFEST), "w", encoding="utf-8") as fh:
        json.dump(man, fh, indent=1)
    return man


def read_manifest(site: str) -> dict:
    try:
        with open(os.path.join(site, MANIFEST), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        raise CampaignError(f"{site}: no install manifest; run python -m fit.gpu_campaign --wheels DIR first") \
            from None


_GPU_PROBE = """
import json, torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
       "pluggable": hasattr(torch._C, "_cuda_customAllocator")}
if out["available"]:
    p = torch.cuda.get_device_properties(0)
    out.update(count=torch.cuda.device_count(), device=p.name, total_bytes=p.total_memory)
    import shutil, subprocess
    smi = shutil.which("nvidia-smi")   # compute mode: an exclusive GPU takes one process at a time
    if smi:
        out["compute_mode"] = subprocess.run([smi, "--query-gpu=compute_mode", "--format=csv,noheader", "-i", "0"],
                                             capture_output=True, text=True).stdout.strip()
print(json.dumps(out))
"""


def check_gpu(paths: list) -> dict:
    """What torch sees, in a child process (this one must not hold a CUDA context while the runs measure)."""
    ok, line = probe(_GPU_PROBE, paths)
    if not ok:
        raise CampaignError(f"cannot query torch.cuda: {line}")
    info = json.loads(line)
    if not info["available"]:
        raise CampaignError(f"no CUDA GPU visible to torch {info['torch']} (CUDA build: {info['cuda']}); this command "
                            "needs one GPU (on CPU: python -m fit.campaign fit/grids/cpu_compose.json)")
    if not info["pluggable"]:
        raise CampaignError(f"torch {info['torch']} has no pluggable CUDA allocator (torch._C._cuda_customAllocator)")
    return info


def with_paths(paths: list) -> None:
    """Every child (profiler runs, fit) imports the offline installs first."""
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])


def _config_summary(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, "rank0.json"), encoding="utf-8") as fh:
            h = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return {}
    return {"peak_bytes": h.get("allocator_peak_bytes"), "iteration_seconds": h.get("iteration_seconds"),
            "losses": h.get("losses"), "device": h.get("device")}


def grid_hash(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def run(args) -> int:
    t0 = time.time()
    grid, configs = load_grid(args.grid)
    if any(c.nproc != 1 and c.ranks is None for c in configs):
        raise CampaignError(f"{args.grid}: one GPU runs world size 1, or chosen ranks of a larger world on the fake "
                            f"process group (a config's 'ranks'); configs "
                            f"{', '.join(c.name for c in configs if c.nproc != 1 and c.ranks is None)} need more")
    name = grid.get("name") or os.path.splitext(os.path.basename(args.grid))[0]
    site, traces, packed = (os.path.join(args.out, d) for d in ("site", "traces", "packed"))
    set_path = os.path.join(args.out, f"{name}.json")
    wheels = classify_wheels(args.wheels)
    if args.dry_run:
        print(f"would install into {site}/base: " + " ".join(pip_command(os.path.join(site, "base"), wheels["base"])))
        if wheels["te"]:
            print(f"would install into {site}/te: " + " ".join(pip_command(os.path.join(site, "te"), wheels["te"])))
        for w in wheels["skipped"]:
            print(f"would skip {os.path.basename(w)} (the machine's own torch stack is used)")
        print(f"would profile {len(configs)} configs of {args.grid} ({args.jobs} at once) into {traces}, pack them "
              f"into {packed}, fit {set_path}; budget {args.budget_minutes:g} min, of which "
              f"{fit_reserve_seconds(len(configs), os.cpu_count() or 1) / 60:.1f} kept for the fit on "
              f"{os.cpu_count()} cores")
        return 0
    if not args.install_only:
        gpu = check_gpu([])
        print(f"GPU: {gpu['device']} ({gpu['total_bytes'] / 2**30:.0f} GiB), torch {gpu['torch']}, CUDA {gpu['cuda']}")
        if "exclusive" in gpu.get("compute_mode", "").lower() and args.jobs > 1:
            print(f"the GPU's compute mode is {gpu['compute_mode']}: one config at a time (--jobs 1)")
            args.jobs = 1
    os.makedirs(args.out, exist_ok=True)
    man = install(args.wheels, site)
    print(f"megatron-core {man['megatron_core']}; Transformer Engine: {man['transformer_engine_note']}")
    print(f"installed {', '.join(man['installed'])} into {site}" +
          (f"; skipped {', '.join(man['skipped'])}" if man["skipped"] else ""))
    if args.install_only:
        return 0
    with_paths(man["paths"])
    reserve = 60.0 if args.no_fit else fit_reserve_seconds(len(configs), os.cpu_count() or 1)
    summary = trace_and_fit(args.grid, args.out, jobs=args.jobs, start_by=t0 + 60.0 * args.budget_minutes - reserve,
                            resume=args.resume, timeout=args.timeout, fit=not args.no_fit)
    summary.update(gpu=gpu, install=man, budget_minutes=args.budget_minutes, seconds=round(time.time() - t0, 1))
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    print(f"{len(summary['configs'])}/{len(configs)} configs traced ({len(summary['failures'])} failed or not "
          f"started) in {summary['seconds'] / 60:.1f} min; packed traces in {packed}; "
          + (f"formula set {summary['formula_set']}" if summary["formula_set"] else
             "not fitted (--no-fit)" if args.no_fit else "no formula set (fit failed)")
          + f"; summary {os.path.join(args.out, 'summary.json')}")
    return 0 if ((summary["formula_set"] or args.no_fit) and not summary["failures"]) else 1


def trace_and_fit(grid_path: str, out: str, jobs: int, start_by: float | None = None, resume: bool = False,
                  timeout: float = 300.0, fit: bool = True) -> dict:
    """Profile the grid into <out>/traces, pack the complete configs into <out>/packed, fit <out>/<grid name>.json
    from the packed copy. Returns the summary (per config peak and iteration times, failures, the set or None)."""
    from .campaign import run_campaign
    from .pack import PackError, pack
    grid, dirs, failures = run_campaign(grid_path, os.path.join(out, "traces"), resume, timeout=timeout, jobs=jobs,
                                        start_by=start_by, give_up_after=max(jobs, 3))
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    name = grid.get("name") or os.path.splitext(os.path.basename(grid_path))[0]
    set_path, packed = os.path.join(out, f"{name}.json"), os.path.join(out, "packed")
    names = [os.path.basename(d) for d in dirs]
    fit_rc = None
    if dirs:
        try:
            pack(os.path.join(out, "traces"), packed, names)
        except PackError as exc:
            raise CampaignError(str(exc)) from None
        cmd = [sys.executable, "-m", "fit.programs", *[os.path.join(packed, n) for n in names], "-o", set_path,
               "--name", name]
        print("fitting: " + " ".join(cmd[1:]), flush=True)
        if fit:
            fit_rc = subprocess.call(cmd, cwd=_repo_root())
        else:
            print("not fitted (--no-fit); on any machine: " + " ".join(["python", *cmd[1:]]), flush=True)
    return {"grid": os.path.abspath(grid_path), "grid_sha256_16": grid_hash(grid_path), "jobs": jobs,
            "configs": {n: _config_summary(d) for n, d in zip(names, dirs)}, "failures": failures,
            "formula_set": os.path.abspath(set_path) if fit_rc == 0 else None, "fit_exit": fit_rc}


def main(argv=None) -> int:
    ap = _Parser(prog="python -m fit.gpu_campaign", description=__doc__.split("\n\n")[0].split(": ", 1)[-1])
    ap.add_argument("--wheels", required=True, metavar="DIR", help="directory of wheels (megatron-core, optionally "
                    "transformer_engine*, and any dependency the machine lacks)")
    ap.add_argument("--out", default="gpu_campaign_out", help="output directory (default gpu_campaign_out)")
    ap.add_argument("--grid", default=DEFAULT_GRID, help="grid file (default fit/grids/gpu_h100.json)")
    ap.add_argument("--jobs", type=int, default=6, help="configs profiled at once on the GPU (default 6)")
    ap.add_argument("--budget-minutes", type=float, default=14.0,
                    help="no config starts after this minus a fitting reserve (default 14)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per config (default 300)")
    ap.add_argument("--resume", action="store_true", help="keep configs already traced in <out>/traces")
    ap.add_argument("--no-fit", action="store_true", help="trace and pack only (fit the packed traces elsewhere, "
                    "e.g. where the GPU's time is scarce); the budget then keeps one minute for packing")
    ap.add_argument("--install-only", action="store_true", help="install and probe the wheels, then stop (no GPU "
                    "needed)")
    ap.add_argument("--dry-run", action="store_true", help="print what would run; run nothing")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    return run_cli(ap.prog, lambda: run(args), (CampaignError, GridError))


if __name__ == "__main__":
    sys.exit(main())
