"""MoE routing benchmark: a fresh router's natural routing against the estimate's routing bound (--moe-imbalance).

    python benchmarks/moe_routing.py [--out DIR] [--formulas SET] [--reprofile] [--json FILE] [--counts]

Profiles every config of benchmarks/moe_routing.json on CPU twice (`python -m tracer.profile --cpu`): with the
router's own, natural routing (randomly initialised router, the harness's mock data) and with --balanced-routing.
Prints per rank: the measured peaks, the estimate (cpu_compose, the harness's CPU kernels) under balanced routing
(--moe-imbalance 1) and under the default bound, their errors against the natural run, and the smallest F for which
the estimate reaches the natural run's peak (`F needed`; '-' when F = 1 already does). The default
(estimator.moe_tokens.DEFAULT_IMBALANCE) must cover every rank: the estimate with it >= the natural peak.

`--counts` also runs each dropless natural config once more with megatron-core's TopKRouter.routing wrapped to log
its routing map's tokens per expert (every layer and step, every source rank), and prints the largest ratio of an EP
rank's routed tokens to balanced, and the F a single expert's excess needs ((tokens - balanced) / the rank's
balanced tokens + 1): the routing itself against the bound's definition (estimator/moe_tokens.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import accuracy as A  # noqa: E402

GRID = os.path.join(ROOT, "benchmarks", "moe_routing.json")
OUT = os.path.join(ROOT, "runs", "moe_routing")


def configs(grid: dict) -> list[dict]:
    """Each entry as accuracy.py's config dicts: the natural run and its --balanced-routing twin."""
    from fit.campaign import config_argv
    out = []
    for c in grid["configs"]:
        argv, nproc = config_argv(grid["base"], c)
        out.append({"name": c["name"], "argv": argv, "nproc": nproc, "launcher": []})
        out.append({"name": c["name"] + "_bal", "argv": argv, "nproc": nproc, "launcher": ["--balanced-routing"]})
    return out


def peaks(cfg: dict, formulas: str, imbalance: float | None) -> list[float]:
    """Predicted peak per rank (CPU run, CPU kernels) with --moe-imbalance `imbalance` (None: the default)."""
    extra = [] if imbalance is None else ["--moe-imbalance", repr(float(imbalance))]
    return [r["peak_bytes"] for r in A.predict({**cfg, "argv": cfg["argv"] + extra}, formulas)]


def needed(cfg: dict, formulas: str, rank: int, measured: int, hi: float = 8.0) -> float | None:
    """The smallest F (to 0.01) whose estimate for `rank` reaches `measured`; 1.0 when balanced does; None when
    not even `hi` does."""
    if peaks(cfg, formulas, 1.0)[rank] >= measured:
        return 1.0
    if peaks(cfg, formulas, hi)[rank] < measured:
        return None
    lo = 1.0
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if peaks(cfg, formulas, mid)[rank] >= measured else (mid, hi)
    return hi


# Loaded by every process of a --counts run (sitecustomize): wraps the router, changes nothing it computes.
_HOOK = """
import os
if os.environ.get("MOE_ROUTING_LOG"):
    try:
        from megatron.core.transformer.moe import router as _r
    except Exception:
        _r = None
    if _r is not None:
        _orig = _r.TopKRouter.routing
        def routing(self, logits, *args, **kwargs):
            probs, routing_map = _orig(self, logits, *args, **kwargs)
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_initialized() else 0
            with open(os.path.join(os.environ["MOE_ROUTING_LOG"], f"rank{rank}.log"), "a") as fh:
                fh.write(" ".join(str(int(x)) for x in routing_map.sum(0).tolist()) + "\\n")
            return probs, routing_map
        _r.TopKRouter.routing = routing
"""


def _flag(argv: list, name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def routing_counts(cfg: dict, iterations: int) -> tuple:
    """(largest EP-rank ratio to balanced, largest F one expert's excess needs, routing calls per rank) of a natural
    run, from the routing maps megatron-core's router produced."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w", encoding="utf-8") as fh:
            fh.write(_HOOK)
        log = os.path.join(tmp, "log")
        os.makedirs(log)
        env = {**os.environ, "MOE_ROUTING_LOG": log,
               "PYTHONPATH": os.pathsep.join([tmp, ROOT, os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", "tracer.profile", "--cpu", "--nproc", str(cfg["nproc"]), "--out",
                        os.path.join(tmp, "traces"), "--iterations", str(iterations), "--", *cfg["argv"]],
                       env=env, cwd=ROOT, capture_output=True, check=True, timeout=600)
        logs = []
        for r in range(cfg["nproc"]):
            with open(os.path.join(log, f"rank{r}.log"), encoding="utf-8") as fh:
                logs.append([[int(x) for x in line.split()] for line in fh if line.strip()])
    E, ep = _flag(cfg["argv"], "--num-experts", 0), _flag(cfg["argv"], "--expert-model-parallel-size", 1)
    n = E // ep
    rank_ratio = expert_f = 0.0
    for step in range(len(logs[0])):
        # every source rank sends to every EP rank (DP x EP = world here): sum the sources
        tokens = [sum(logs[r][step][e] for r in range(cfg["nproc"])) for e in range(E)]
        balanced = sum(tokens) / E
        rank_ratio = max(rank_ratio, max(sum(tokens[i * n:(i + 1) * n]) for i in range(ep)) / (balanced * n))
        expert_f = max(expert_f, 1 + (max(tokens) - balanced) / (balanced * n))
    return rank_ratio, expert_f, len(logs[0])


def main(argv: list[str] | None = None) -> int:
    from estimator.moe_tokens import DEFAULT_IMBALANCE
    ap = argparse.ArgumentParser(prog="benchmarks/moe_routing.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--formulas", default="cpu_compose")
    ap.add_argument("--reprofile", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--counts", action="store_true", help="also log natural routing's tokens per expert")
    args = ap.parse_args(argv)
    with open(GRID, encoding="utf-8") as fh:
        grid = json.load(fh)
    iterations = int(grid.get("iterations", 3))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    cfgs = configs(grid)
    for c in cfgs:
        run_dir = os.path.join(args.out, c["name"])
        if args.reprofile or not A.cached(run_dir, c, iterations):
            print(f"profiling {c['name']} ...", file=sys.stderr, flush=True)
            A.profile(c, args.out, iterations, 600)
    print(f"MoE routing: natural vs balanced routing, formula set {args.formulas}, default --moe-imbalance "
          f"{DEFAULT_IMBALANCE:g}")
    hdr = (f"{'config':26s} {'rank':>4s} {'natural KiB':>12s} {'balanced KiB':>13s} {'est F=1':>8s} "
           f"{'est default':>11s} {'F needed':>8s}")
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for nat, bal in zip(cfgs[::2], cfgs[1::2]):
        m_nat = A.measured(os.path.join(args.out, nat["name"]), nat["nproc"])
        m_bal = A.measured(os.path.join(args.out, bal["name"]), bal["nproc"])
        p1, pd = peaks(nat, args.formulas, 1.0), peaks(nat, args.formulas, None)
        for r in range(nat["nproc"]):
            mn, mb = int(m_nat[r]["allocator_peak_bytes"]), int(m_bal[r]["allocator_peak_bytes"])
            f = needed(nat, args.formulas, r, mn)
            row = {"config": nat["name"], "rank": r, "natural": mn, "balanced": mb, "est_f1": p1[r],
                   "est_default": pd[r], "err_f1": A._err(p1[r], mn), "err_default": A._err(pd[r], mn),
                   "err_balanced_run": A._err(p1[r], mb), "f_needed": f}
            rows.append(row)
            ok &= pd[r] >= mn
            print(f"{nat['name']:26s} {r:4d} {A._kib(mn):>12s} {A._kib(mb):>13s} {row['err_f1']:+7.2f}% "
                  f"{row['err_default']:+10.2f}% {'-' if f == 1.0 else 'none' if f is None else f'{f:.2f}':>8s}")
    counts = []
    if args.counts:
        print(f"\n{'config':26s} {'rank/balanced':>13s} {'F one expert':>12s} {'calls':>6s}")
        for nat in cfgs[::2]:
            if "--moe-expert-capacity-factor" in nat["argv"]:
                continue
            rank_ratio, expert_f, calls = routing_counts(nat, iterations)
            counts.append({"config": nat["name"], "rank_ratio": rank_ratio, "expert_f": expert_f, "calls": calls})
            ok &= max(rank_ratio, expert_f) <= DEFAULT_IMBALANCE
            print(f"{nat['name']:26s} {rank_ratio:13.3f} {expert_f:12.3f} {calls:6d}")
    worst = max((r["f_needed"] or 99.0 for r in rows), default=1.0)
    print(f"\nlargest F needed: {worst:.2f}; default {DEFAULT_IMBALANCE:g} covers every rank: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "counts": counts, "default": DEFAULT_IMBALANCE, "covered": ok}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
