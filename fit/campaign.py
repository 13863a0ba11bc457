"""python -m fit.campaign GRID.json [--out DIR] [--resume] [--pack DIR] [-o SET.json]: profile a grid, then fit.

A grid file names a base Megatron command line and a list of configs, each a small change to it:

    {"name": "cpu_local", "description": "...", "device": "cpu", "iterations": 3,
     "base": ["--num-layers", "2", "--hidden-size", "64", ...],
     "configs": [{"name": "base"},
                 {"name": "tp2_sp", "set": {"--tensor-model-parallel-size": 2}, "flags": ["--sequence-parallel"]},
                 {"name": "no_bias", "unset": ["--add-bias-linear"], "nproc": 1}]}

`set` replaces (or adds) a flag's value, null removes it; `flags` adds switches; `unset` removes switches.
`nproc` defaults to TP x PP x CP. `ranks` traces only those ranks of a world of `nproc`, each alone on torch's fake
process group (`python -m tracer.profile --fake-world`, tracer/fake_world.py): a layout of any size at the cost
of its ranks. Each config's traces go to DIR/<name>/; a config is complete when every rank's
header carries the allocator's final counters. With --resume, complete configs are skipped (and a config whose
command line changed is an error, not a silent mix). Runs go through a `.partial` directory that is renamed when
the run succeeds, so an interrupted campaign never leaves a half-written config that looks complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

RUN_INFO = "campaign.json"


class GridError(ValueError):
    """A malformed grid file or an unusable output directory."""


# Profiler options a grid config may ask for (`launcher`): --gpu-kernels runs the GPU kernel stand-ins.
LAUNCHER_OPTIONS = {"--gpu-kernels"}


@dataclass
class Config:
    name: str
    argv: list
    nproc: int
    launcher: list = field(default_factory=list)
    ranks: list | None = None     # fake world: the ranks traced (None: every rank, on gloo)

    @property
    def traced_ranks(self) -> list:
        return list(range(self.nproc)) if self.ranks is None else list(self.ranks)


# ------------------------------------------------------------------------------------------------- grid
def _set_flag(argv: list, flag: str, value) -> list:
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            continue
        out.append(argv[i])
        i += 1
    if value is None:
        return out
    return out + [flag] + ([str(v) for v in value] if isinstance(value, list) else [str(value)])


def _flag_int(argv: list, flag: str, default: int = 1) -> int:
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


def load_grid(path: str) -> tuple[dict, list[Config]]:
    try:
        with open(path, encoding="utf-8") as fh:
            grid = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise GridError(f"{path}: cannot read grid: {exc}") from None
    if not isinstance(grid, dict) or not isinstance(grid.get("configs"), list) or not grid["configs"]:
        raise GridError(f"{path}: a grid is an object with a non-empty 'configs' list")
    base = [str(x) for x in grid.get("base", [])]
    configs, seen = [], set()
    for i, c in enumerate(grid["configs"]):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
            raise GridError(f"{path}: configs[{i}] needs a 'name'")
        if c["name"] in seen or "/" in c["name"] or c["name"].startswith("."):
            raise GridError(f"{path}: configs[{i}]: bad or duplicate name {c['name']!r}")
        seen.add(c["name"])
        unknown = set(c) - {"name", "set", "flags", "unset", "nproc", "note", "launcher", "ranks"}
        if unknown:
            raise GridError(f"{path}: configs[{i}] ({c['name']}): unknown keys {sorted(unknown)}")
        launcher = c.get("launcher") or []
        if not isinstance(launcher, list) or not set(launcher) <= LAUNCHER_OPTIONS:
            raise GridError(f"{path}: configs[{i}] ({c['name']}): 'launcher' is a list of "
                            f"{sorted(LAUNCHER_OPTIONS)}")
        argv, nproc = config_argv(base, c)
        ranks = c.get("ranks")
        if ranks is not None and (not isinstance(ranks, list) or not ranks
                                  or not all(isinstance(r, int) and 0 <= r < nproc for r in ranks)):
            raise GridError(f"{path}: configs[{i}] ({c['name']}): 'ranks' is a list of ranks below nproc ({nproc})")
        configs.append(Config(c["name"], argv, nproc, launcher=list(launcher),
                              ranks=sorted(set(ranks)) if ranks is not None else None))
    return grid, configs


def doc_description(doc: str) -> str:
    """A grid maker's description from its docstring's first paragraph, "Writes fit/grids/x.json: what it is"."""
    return doc.split("\n\n")[0].split(": ", 1)[1]


def write_grid(name: str, description: str, device: str, iterations: int, base: list, configs: list,
               maker: str) -> None:
    """Write the grid file <name>.json beside its maker script (fit/grids/make_*.py) and say how many configs it
    has."""
    grid = {"name": name, "description": description, "device": device, "iterations": iterations, "base": base,
            "configs": configs}
    path = os.path.join(os.path.dirname(os.path.abspath(maker)), f"{name}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(grid, fh, indent=1)
        fh.write("\n")
    print(f"wrote {path}: {len(grid['configs'])} configs")


def config_argv(base: list, c: dict) -> tuple[list, int]:
    """One grid entry's Megatron command line (base, then its `set`, `unset` and `flags`) and process count
    (`nproc`, else TP x PP x CP). The accuracy benchmark's held-out grid uses the same rules."""
    argv = list(base)
    for flag, value in (c.get("set") or {}).items():
        argv = _set_flag(argv, flag, value)
    for flag in c.get("unset") or []:
        argv = [a for a in argv if a != flag]
    argv += [f for f in c.get("flags") or [] if f not in argv]
    nproc = c.get("nproc") or (_flag_int(argv, "--tensor-model-parallel-size")
                               * _flag_int(argv, "--pipeline-model-parallel-size")
                               * _flag_int(argv, "--context-parallel-size"))
    return argv, int(nproc)


def launcher_flags(argv: list) -> list:
    """Profiler options a config needs besides its Megatron flags: MoE configs are traced with balanced routing
    (tracer/moe_routing.py), so their expert buffers are functions of the shapes that a formula can fit."""
    return ["--balanced-routing"] if _flag_int(argv, "--num-experts", 0) > 0 else []


# ------------------------------------------------------------------------------------------------- runs
def is_complete(run_dir: str, cfg: Config) -> bool:
    """Every traced rank's header is final (written after the run) and its trace file exists."""
    for r in cfg.traced_ranks:
        hdr = os.path.join(run_dir, f"rank{r}.json")
        if not (os.path.isfile(hdr) and os.path.isfile(os.path.join(run_dir, f"rank{r}.trace"))):
            return False
        try:
            with open(hdr, encoding="utf-8") as fh:
                if "allocator_peak_bytes" not in json.load(fh):
                    return False
        except (OSError, json.JSONDecodeError):
            return False
    return True


def recorded_argv(run_dir: str):
    """(Megatron argv, launcher flags) the run was traced with; (None, None) without a readable record."""
    try:
        with open(os.path.join(run_dir, RUN_INFO), encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None, None
    return info.get("argv"), info.get("launcher", [])


def profile_command(cfg: Config, out: str, iterations: int, device: str, target: str = "harness") -> list:
    cmd = [sys.executable, "-m", "tracer.profile", "--out", out, "--iterations", str(iterations),
           *(["--target", target] if target != "harness" else []), *launcher_flags(cfg.argv), *cfg.launcher]
    if cfg.ranks is not None:
        world = ["--fake-world", str(cfg.nproc), "--ranks", ",".join(map(str, cfg.ranks))]
        return cmd + (["--cpu"] if device == "cpu" else []) + world + ["--", *cfg.argv]
    if device == "cpu":
        return cmd + ["--cpu", "--nproc", str(cfg.nproc), "--", *cfg.argv]
    return cmd + ["--", "--nproc_per_node", str(cfg.nproc), *cfg.argv]


def run_one(cfg: Config, out_dir: str, iterations: int, device: str, timeout: float,
            target: str = "harness") -> tuple[bool, str]:
    final, partial = os.path.join(out_dir, cfg.name), os.path.join(out_dir, cfg.name + ".partial")
    if os.path.isdir(partial):
        shutil.rmtree(partial)  # our own leftover from an interrupted run
    os.makedirs(partial)
    log = os.path.join(out_dir, cfg.name + ".log")
    with open(log, "w", encoding="utf-8") as fh:
        try:
            rc = subprocess.run(profile_command(cfg, partial, iterations, device, target), stdout=fh,
                                stderr=subprocess.STDOUT, timeout=timeout, cwd=_repo_root(),
                                env={**os.environ, "PYTHONPATH": _repo_root() + os.pathsep
                                     + os.environ.get("PYTHONPATH", "")}).returncode
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f}s (log: {log})"
    if rc != 0 or not is_complete(partial, cfg):
        return False, f"profiler exit {rc}, traces incomplete (log: {log}): {_last_line(log)}"
    with open(os.path.join(partial, RUN_INFO), "w", encoding="utf-8") as fh:
        json.dump({"name": cfg.name, "argv": cfg.argv, "launcher": launcher_flags(cfg.argv) + cfg.launcher,
                   "nproc": cfg.nproc, "iterations": iterations,
                   **({"ranks": cfg.ranks, "process_group": "fake"} if cfg.ranks is not None else {})}, fh)
    os.replace(partial, final)
    return True, ""


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = [ln.strip() for ln in fh if ln.strip()]
        return lines[-1][:200] if lines else ""
    except OSError:
        return ""


class Progress:
    """One status line on stderr, redrawn per config: bar, count, current config, elapsed and ETA."""

    def __init__(self, total: int, stream=None, jobs: int = 1):
        self.total, self.done, self.t0, self.stream = total, 0, time.time(), stream or sys.stderr
        self.jobs = max(1, jobs)
        self.run_times: list[float] = []

    def show(self, label: str) -> None:
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        el = time.time() - self.t0
        eta = (sum(self.run_times) / len(self.run_times)) * (self.total - self.done) / self.jobs \
            if self.run_times else None
        tail = f" eta {eta:4.0f}s" if eta is not None else ""
        end = "\r" if self.stream.isatty() else "\n"
        self.stream.write(f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {label:<28} "
                          f"{el:5.0f}s{tail}{end}")
        self.stream.flush()

    def step(self, seconds: float | None = None) -> None:
        self.done += 1
        if seconds is not None:
            self.run_times.append(seconds)


def run_campaign(grid_path: str, out_dir: str, resume: bool, only: list | None = None, timeout: float = 600.0,
                 jobs: int = 1, start_by: float | None = None,
                 give_up_after: int = 0) -> tuple[dict, list[str], list[str]]:
    """Profile every config not already complete; returns (grid, complete run dirs, failure lines).

    `jobs` configs run at once (each is its own process; on one GPU their traces are unaffected, but device
    readings then include the other processes' memory). No config starts after time.time() `start_by` (a time
    budget): those are reported as failures "not started", so a rerun with --resume can finish them. With
    `give_up_after` k > 0, no config starts once the first k to finish have all failed (a broken setup, not a bad
    config: say so in seconds instead of failing the whole grid)."""
    grid, configs = load_grid(grid_path)
    if only:
        configs = [c for c in configs if c.name in set(only)]
    os.makedirs(out_dir, exist_ok=True)
    todo, dirs = [], []
    for c in configs:
        d = os.path.join(out_dir, c.name)
        if os.path.isdir(d):
            if not resume:
                raise GridError(f"{d} exists: pass --resume to continue this campaign, or choose another --out")
            argv, launcher = recorded_argv(d)
            if argv is not None and (argv, launcher) != (c.argv, launcher_flags(c.argv) + c.launcher):
                raise GridError(f"{d} was traced with a different command line than the grid now gives; "
                                f"move it away or use another --out")
            if is_complete(d, c):
                dirs.append(d)
                continue
            raise GridError(f"{d} exists but is incomplete; move it away and --resume")
        todo.append(c)
    iterations, device = int(grid.get("iterations", 3)), grid.get("device", "cpu")
    target = str(grid.get("target", "harness"))     # a job's own training script (fit.job_campaign)
    prog = Progress(len(configs), jobs=jobs)
    prog.done = len(configs) - len(todo)
    failures = []

    finished = []   # ok flags of the configs run so far, in completion order

    def one(c):
        if start_by is not None and time.time() > start_by:
            return c, False, "not started: the time budget ran out", None
        if give_up_after and len(finished) >= give_up_after and not any(finished[:give_up_after]):
            return c, False, f"not started: the first {give_up_after} configs all failed", None
        t = time.time()
        ok, why = run_one(c, out_dir, iterations, device, timeout, target)
        finished.append(ok)   # here, not in the loop below: the worker's next config must see it
        return c, ok, why, time.time() - t

    # Threads only wait on the profiler subprocesses; results are handled here, in completion order.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pending = [pool.submit(one, c) for c in todo]
        if todo:
            prog.show(todo[0].name)
        for fut in as_completed(pending):
            c, ok, why, seconds = fut.result()
            prog.step(seconds)
            prog.show(c.name)
            if ok:
                dirs.append(os.path.join(out_dir, c.name))
            else:
                failures.append(f"{c.name}: {why}")
    prog.show("done")
    order = {c.name: i for i, c in enumerate(configs)}
    dirs.sort(key=lambda d: order.get(os.path.basename(d), 0))
    return grid, dirs, failures


# ------------------------------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_cli(prog: str, fn, errors: tuple) -> int:
    """fn()'s exit code; an expected error is one line `<prog>: error: ...` and exit 2, Ctrl-C a resume hint."""
    try:
        return fn()
    except errors as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: rerun with --resume to continue", file=sys.stderr)
        return 130


def main(argv=None) -> int:
    ap = _Parser(prog="python -m fit.campaign", description=__doc__.split("\n")[0])
    ap.add_argument("grid", help="grid JSON (see fit/grids/)")
    ap.add_argument("--out", help="trace directory (default: campaign_<grid name>)")
    ap.add_argument("--resume", action="store_true", help="skip configs whose traces are complete")
    ap.add_argument("-o", "--output", help="formula set to write (default: <out>/<grid name>.json)")
    ap.add_argument("--name", help="formula-set name (default: the grid's name)")
    ap.add_argument("--only", nargs="+", metavar="CONFIG", help="profile only these configs")
    ap.add_argument("--no-fit", action="store_true", help="profile only")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per config (default 600)")
    ap.add_argument("--jobs", type=int, default=1, help="configs profiled at once (default 1)")
    ap.add_argument("--pack", metavar="DIR",
                    help="after profiling, pack the complete configs xz-compressed into DIR (python -m fit.pack) and "
                         "fit from DIR, so the set's provenance names the packed traces (e.g. fit/traces/<grid>)")
    args = ap.parse_args(argv)
    return run_cli(ap.prog, lambda: _run(args), (GridError,))


def _run(args) -> int:
    grid, _ = load_grid(args.grid)
    name = args.name or grid.get("name") or os.path.splitext(os.path.basename(args.grid))[0]
    out = args.out or f"campaign_{name}"
    grid, dirs, failures = run_campaign(args.grid, out, args.resume, args.only, args.timeout,
                                         jobs=args.jobs)
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    print(f"{len(dirs)} config(s) traced in {out}" + (f", {len(failures)} failed" if failures else ""))
    if args.no_fit:
        return 1 if failures else 0
    if args.pack:
        from .pack import PackError, pack
        try:
            pack(out, args.pack, [os.path.basename(d) for d in dirs])
        except PackError as exc:
            raise GridError(str(exc)) from None
        dirs = [os.path.join(args.pack, os.path.basename(d)) for d in dirs]
        print(f"packed {len(dirs)} config(s) into {args.pack}")
    if not dirs:
        raise GridError("no complete traces to fit")
    from .programs.build import main as fit_main
    rc = fit_main([*dirs, "-o", args.output or os.path.join(out, f"{name}.json"), "--name", name,
                   "--description", grid.get("description", "")])
    return rc or (1 if failures else 0)


if __name__ == "__main__":
    sys.exit(main())
