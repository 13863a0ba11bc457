"""python -m fit.gpu_validate [--campaign DIR] [--formulas SET.json] [--grid GRID] [--out FILE] [--only NAME...]
                            [--no-traced] [--events] [--timeout S]: check the fitted GPU set against real runs,
                            and measure the tracer's cost.

For every config of the grid (default fit/grids/gpu_validate.json: held-out shapes, 3 layers), one after another on
one GPU (never concurrently: the iteration times are compared):
  * an untraced run under PyTorch's normal caching allocator (the built-in harness, same flags): peak
    torch.cuda.max_memory_allocated() and max_memory_reserved() over the whole process, setup included, as
    Megatron-LM logs them (its "max allocated" is never reset after setup); the setup and training-only peaks are
    kept in the JSON too, with the device memory outside the allocator (cudaMemGetInfo used - reserved: CUDA
    context, NCCL, cuBLAS handles) at the end;
  * the same config traced with the CUDA tracing allocator (python -m tracer.profile), for the slowdown per
    iteration (median over iterations after the first, traced / untraced) and the traced peak;
  * the estimator on the same command line: get-training-info --nproc_per_node 1 FLAGS --formulas SET --json, with
    what the install implies (install_adjustments: without Transformer Engine, --torch-adam and no TE workspace).
Prints predicted vs measured, allocated and reserved (the estimate's modelled reserved figure when its JSON has
one, else n/a), and writes every number to --out (default <campaign>/validation.json).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from estimator.gpu_runtime import TE_ITEMS

from .campaign import GridError, _Parser, _last_line, load_grid, run_cli
from .gpu_campaign import CampaignError, _repo_root, check_gpu, read_manifest, with_paths

DEFAULT_GRID = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grids", "gpu_validate.json")
# Where a modelled reserved figure may sit in the estimate's JSON, per stage (first match wins); else any integer
# field of a stage whose name has "reserved" in it.
RESERVED_KEYS = ("reserved_bytes", "reserved_peak_bytes", "peak_reserved_bytes", "max_reserved_bytes",
                 "predicted_reserved_bytes")


# ------------------------------------------------------------------------------------------------ comparison
def _stage_reserved(stage: dict):
    for key in RESERVED_KEYS:
        if isinstance(stage.get(key), int):
            return stage[key], key
    for key, val in stage.items():
        if "reserved" in key and isinstance(val, int) and not isinstance(val, bool):
            return val, key
    return None, None


def predicted(estimate: dict, pp_rank: int = 0, drop: tuple = ()) -> dict:
    """The estimate's allocated peak and, when present, its modelled reserved figure for one pipeline stage, less
    the GPU runtime items named in `drop` (persistent buffers the measured run cannot have: install_adjustments)."""
    stages = {s.get("pp_rank", i): s for i, s in enumerate(estimate.get("stages") or [])}
    stage = stages.get(pp_rank, {})
    dropped = sum(i.get("bytes", 0) for i in stage.get("gpu_runtime") or [] if i.get("name") in drop)
    alloc = stage.get("peak_bytes", estimate.get("max_peak_bytes"))
    alloc = None if alloc is None else alloc - dropped
    reserved, where = _stage_reserved(stage)
    if reserved is None:   # the budget's per-stage rows are the other place a stage's totals live
        budget = {s.get("pp_rank", i): s for i, s in enumerate((estimate.get("memory_budget") or {}).get("stages")
                                                                or [])}
        reserved, where = _stage_reserved(budget.get(pp_rank, {}))
        where = f"memory_budget.stages.{where}" if where else None
    else:
        where = f"stages.{where}"
    reserved = None if reserved is None else reserved - dropped
    return {"allocated": alloc, "reserved": reserved, "reserved_key": where,
            "formula_set": (estimate.get("formula_set") or {}).get("name")}


def _err(pred, meas):
    return None if pred is None or not meas else (pred - meas) / meas


def _steady(seconds):
    """Median iteration time after the first (warm-up: cuBLAS/TE initialisation, first optimizer step)."""
    xs = [x for x in (seconds or [])[1:] if x is not None]
    return statistics.median(xs) if xs else None


def compare(name: str, estimate: dict | None, measured: dict | None, traced: dict | None, drop: tuple = ()) -> dict:
    """One table row from the three runs' JSON (any of them None when that run failed)."""
    pred = predicted(estimate, drop=drop) if estimate else {"allocated": None, "reserved": None, "reserved_key": None}
    meas = measured or {}
    t_un, t_tr = _steady(meas.get("iteration_seconds")), _steady((traced or {}).get("iteration_seconds"))
    row = {"config": name,
           "pred_allocated": pred["allocated"], "meas_allocated": meas.get("peak_allocated"),
           "pred_reserved": pred["reserved"], "meas_reserved": meas.get("peak_reserved"),
           "reserved_key": pred["reserved_key"],
           "traced_peak": (traced or {}).get("allocator_peak_bytes"),
           "iter_s": t_un, "traced_iter_s": t_tr,
           "slowdown": t_tr / t_un if t_un and t_tr else None}
    req = [meas.get(k) for k in ("setup_peak_requested", "train_peak_requested")]
    row["meas_requested"] = max(req) if None not in req else None   # the caching allocator's unrounded peak
    row["err_allocated"] = _err(row["pred_allocated"], row["meas_allocated"])
    row["err_reserved"] = _err(row["pred_reserved"], row["meas_reserved"])
    row["traced_vs_allocated"] = _err(row["traced_peak"], row["meas_allocated"])
    row["traced_vs_requested"] = _err(row["traced_peak"], row["meas_requested"])
    return row


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def _pct(x):
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def _ms(x):
    return "n/a" if x is None else f"{1000 * x:.1f}"


def table(rows: list) -> str:
    """Predicted vs measured (MiB), allocated and reserved, the traced peak, iteration times and the slowdown."""
    head = ["config", "alloc pred", "alloc meas", "err", "resv pred", "resv meas", "err", "traced", "vs alloc",
            "iter ms", "traced ms", "slowdown"]
    body = [[r["config"], _mib(r["pred_allocated"]), _mib(r["meas_allocated"]), _pct(r["err_allocated"]),
             _mib(r["pred_reserved"]), _mib(r["meas_reserved"]), _pct(r["err_reserved"]), _mib(r["traced_peak"]),
             _pct(r["traced_vs_allocated"]), _ms(r["iter_s"]), _ms(r["traced_iter_s"]),
             "n/a" if r["slowdown"] is None else f"{r['slowdown']:.1f}x"] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths)))
             for line in [head, *body]]
    errs = [abs(r["err_allocated"]) for r in rows if r["err_allocated"] is not None]
    under = [r["err_allocated"] for r in rows if r["err_allocated"] is not None and r["err_allocated"] < 0]
    slow = [r["slowdown"] for r in rows if r["slowdown"] is not None]
    lines.append(f"allocated: median |err| {_pct(statistics.median(errs)) if errs else 'n/a'}, worst "
                 f"{_pct(max(errs)) if errs else 'n/a'}, worst under-prediction {_pct(min(under)) if under else 'none'}"
                 f"; tracing slowdown per iteration: median "
                 f"{f'{statistics.median(slow):.1f}x' if slow else 'n/a'}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ allocator events
def snapshot_events(snapshot: dict) -> list:
    """The caching allocator's own request stream from torch.cuda.memory._snapshot(): ("a", id, requested bytes)
    and ("f", id), ids numbered by first use (addresses are reused), in the order the allocator applied them."""
    traces = snapshot.get("device_traces") or [[]]
    if len(traces) != 1 or len({e.get("stream") for e in traces[0]}) > 1:
        raise CampaignError("the snapshot has more than one device or stream; the event format holds one")
    ids: dict = {}
    out = []
    n = 0
    for e in traces[0]:
        if e["action"] == "alloc":
            ids[e["addr"]], n = n, n + 1
            out.append(("a", ids[e["addr"]], e["size"]))
        elif e["action"] == "free_completed" and e["addr"] in ids:
            out.append(("f", ids.pop(e["addr"])))
    return out


def write_events(path: str, events: list) -> None:
    """One event per line ("a ID BYTES" / "f ID"), xz-compressed: small enough to commit."""
    import lzma
    with lzma.open(path, "wt", encoding="ascii") as fh:
        fh.writelines(f"a {e[1]} {e[2]}\n" if e[0] == "a" else f"f {e[1]}\n" for e in events)


def read_events(path: str) -> list:
    """write_events' file back as ("a", id, bytes) / ("f", id) tuples (estimator.caching_allocator.replay's input)."""
    import lzma
    out = []
    with lzma.open(path, "rt", encoding="ascii") as fh:
        for n, line in enumerate(fh, 1):
            f = line.split()
            if f[:1] == ["a"] and len(f) == 3:
                out.append(("a", int(f[1]), int(f[2])))
            elif f[:1] == ["f"] and len(f) == 2:
                out.append(("f", int(f[1])))
            else:
                raise CampaignError(f"{path}:{n}: not an allocator event: {line.strip()!r}")
    return out


# ------------------------------------------------------------------------------------------------ runs
def worker(out: str, flags: list, iterations: int, events: str | None = None) -> int:
    """One untraced rank under the caching allocator (world size 1); writes its measurements to `out`, and with
    `events` the allocator's own request stream (torch.cuda.memory._snapshot, no stacks; write_events)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from tracer import harness
    from tracer.profile import Options, _init_distributed, free_port, load_config, versions
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch
    cfg = load_config(Options(flags=flags), 1)
    _init_distributed(False, 0, 1)
    rec: dict = {"device": torch.cuda.get_device_name(), "versions": versions(),
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if events:
        torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=2_000_000)

    def requested_peak():   # bytes asked for, before the allocator's 512 B rounding and block reuse
        return torch.cuda.memory_stats().get("requested_bytes.all.peak")

    def on_setup(_result=None):
        # Peaks of setup alone, then restart them so the training-only peak is known too.
        rec["setup_peak_allocated"] = torch.cuda.max_memory_allocated()
        rec["setup_peak_reserved"] = torch.cuda.max_memory_reserved()
        rec["setup_peak_requested"] = requested_peak()
        torch.cuda.reset_peak_memory_stats()

    res = harness.run(cfg, iterations, on_setup=on_setup)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    rec.update(train_peak_allocated=torch.cuda.max_memory_allocated(),
               train_peak_reserved=torch.cuda.max_memory_reserved(), train_peak_requested=requested_peak(),
               reserved_end=torch.cuda.memory_reserved(), device_used_end=total - free, device_total=total,
               outside_allocator_end=total - free - torch.cuda.memory_reserved(),
               num_alloc_retries=stats.get("num_alloc_retries", 0), num_ooms=stats.get("num_ooms", 0),
               iteration_seconds=res.iteration_seconds, losses=res.losses, kernels=res.kernels)
    # Whole process, as Megatron-LM logs it: the larger of the setup and the training peak.
    rec["peak_allocated"] = max(rec["setup_peak_allocated"], rec["train_peak_allocated"])
    rec["peak_reserved"] = max(rec["setup_peak_reserved"], rec["train_peak_reserved"])
    if events:
        write_events(events, snapshot_events(torch.cuda.memory._snapshot()))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(rec, fh, indent=1)
    torch.distributed.destroy_process_group()
    return 0


def _child(cmd: list, log: str, timeout: float) -> int:
    with open(log, "w", encoding="utf-8") as fh:
        try:
            return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=_repo_root()).returncode
        except subprocess.TimeoutExpired:
            return -1


def _load(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


def install_adjustments(install: dict) -> tuple:
    """(estimator options, GPU runtime items to take out) that the install implies. Without Transformer Engine
    (the campaign installs no apex either) megatron-core steps with torch's AdamW (get-training-info --torch-adam),
    and the TE spec runs on stand-ins, which allocate no TE workspace."""
    if install.get("transformer_engine"):
        return [], ()
    return ["--torch-adam"], TE_ITEMS


def validate_one(cfg, work: str, formulas: str, iterations: int, traced: bool, timeout: float,
                 events: bool = False, adjust: tuple = ((), ())) -> dict:
    d = os.path.join(work, cfg.name)
    os.makedirs(d, exist_ok=True)
    est_path, meas_path = os.path.join(d, "estimate.json"), os.path.join(d, "measured.json")
    with open(est_path, "w", encoding="utf-8") as fh, open(os.path.join(d, "estimate.log"), "w") as err:
        try:
            subprocess.run([sys.executable, os.path.join(_repo_root(), "get_training_info.py"), "--nproc_per_node",
                            "1", *cfg.argv, *adjust[0], "--formulas", formulas, "--json"], stdout=fh, stderr=err,
                           cwd=_repo_root(), timeout=timeout)
        except subprocess.TimeoutExpired:
            err.write(f"the estimator took over {timeout:.0f} s\n")
    _child([sys.executable, "-m", "fit.gpu_validate", "--worker", meas_path, "--iterations", str(iterations),
            *(["--events", os.path.join(d, "allocator_events.txt.xz")] if events else []), "--", *cfg.argv],
           os.path.join(d, "untraced.log"), timeout)
    tr = None
    if traced:
        tdir = os.path.join(d, "traced")
        _child([sys.executable, "-m", "tracer.profile", "--out", tdir, "--iterations", str(iterations), "--",
                "--nproc_per_node", "1", *cfg.argv], os.path.join(d, "traced.log"), timeout)
        tr = _load(os.path.join(tdir, "rank0.json"))
    row = compare(cfg.name, _load(est_path), _load(meas_path), tr, adjust[1])
    row["measured"], row["traced_header_error"] = _load(meas_path), (tr or {}).get("error")
    # Why a column is n/a: the last line of that run's log (the estimator's one-line error, a run's exception).
    for key, missing, log in (("estimate_error", row["pred_allocated"] is None, "estimate.log"),
                              ("untraced_error", row["meas_allocated"] is None, "untraced.log"),
                              ("traced_error", traced and tr is None, "traced.log")):
        if missing:
            row[key] = _last_line(os.path.join(d, log))
    return row


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:   # internal: one untraced run (see worker)
        sep = argv.index("--") if "--" in argv else len(argv)
        head = argv[:sep]
        return worker(argv[1], argv[sep + 1:], int(head[head.index("--iterations") + 1]),
                      head[head.index("--events") + 1] if "--events" in head else None)
    ap = _Parser(prog="python -m fit.gpu_validate", description=__doc__.split("\n\n")[0].split(": ", 1)[-1])
    ap.add_argument("--campaign", default="gpu_campaign_out", help="the GPU campaign's --out (its site/ installs "
                    "and its fitted set; default gpu_campaign_out)")
    ap.add_argument("--formulas", help="formula set (default: the campaign's fitted set)")
    ap.add_argument("--grid", default=DEFAULT_GRID, help="configs (default fit/grids/gpu_validate.json)")
    ap.add_argument("--out", help="result JSON (default <campaign>/validation.json)")
    ap.add_argument("--only", nargs="+", metavar="CONFIG")
    ap.add_argument("--no-traced", action="store_true", help="skip the traced runs (no slowdown figures)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    ap.add_argument("--events", action="store_true", help="keep the caching allocator's request stream of each "
                    "untraced run (<runs>/<config>/allocator_events.txt.xz) for offline checks of the allocator model")
    args = ap.parse_args(argv)
    return run_cli(ap.prog, lambda: run(args), (CampaignError, GridError))


def run(args) -> int:
    grid, configs = load_grid(args.grid)
    if args.only:
        missing = set(args.only) - {c.name for c in configs}
        if missing:
            raise CampaignError(f"--only: no such config(s) in {args.grid}: {', '.join(sorted(missing))}")
        configs = [c for c in configs if c.name in set(args.only)]
    if any(c.nproc != 1 for c in configs):
        raise CampaignError(f"{args.grid}: one GPU runs world size 1 only")
    formulas = args.formulas or (_load(os.path.join(args.campaign, "summary.json")) or {}).get("formula_set")
    if not formulas or not os.path.isfile(formulas):
        raise CampaignError(f"no formula set: {args.campaign}/summary.json names none (run python -m "
                            "fit.gpu_campaign first) and --formulas was not given or does not exist")
    man = read_manifest(os.path.join(args.campaign, "site"))
    gpu = check_gpu(man["paths"])
    with_paths(man["paths"])
    iterations = max(3, int(grid.get("iterations", 5)))
    out = args.out or os.path.join(args.campaign, "validation.json")
    work = tempfile.mkdtemp(prefix="runs_", dir=os.path.dirname(os.path.abspath(out)))
    rows = []

    def write(text=None):   # after every config too, so a run cut short keeps what it measured
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"gpu": gpu, "install": man, "formulas": os.path.abspath(formulas), "grid": args.grid,
                       "iterations": iterations, "peak_definition": "whole process, setup included (as Megatron-LM "
                       "logs max allocated/reserved)", "rows": rows, "table": text, "runs": work,
                       "complete": text is not None}, fh, indent=1)

    for i, c in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] {c.name}", file=sys.stderr, flush=True)
        rows.append(validate_one(c, work, formulas, iterations, not args.no_traced, args.timeout, args.events,
                                 install_adjustments(man)))
        write()
    text = table(rows)
    print(text, end="")
    for r in rows:
        for key in ("estimate_error", "untraced_error", "traced_error"):
            if r.get(key):
                print(f"{r['config']}: {key.split('_')[0]} run failed: {r[key]}")
    write(text)
    print(f"results in {out} (runs and logs in {work})")
    return 0 if all(r["meas_allocated"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
