"""`python -m tracer.report TRACE_OR_DIR [--json] [--snapshot OUT.pickle] [--png OUT.png]`

Prints, per rank: the peak and the phase it happens in, the reserved peak PyTorch's caching allocator would have
had serving the traced stream (modelled: tracer.reserved; the tracing allocator does not cache), what is live at
the peak by category and by op, and per op the saved-for-backward bytes per layer per microbatch and the transient
forward/backward peaks. All sizes MiB
(2**20 bytes). Bad input: one line on stderr, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections import defaultdict

from .parse import CATEGORIES, ParsedRank, parse_run
from .trace_reader import TraceFormatError, signal_name

MiB = 1024 * 1024


def mib(b) -> str:
    return "-" if b is None else f"{b / MiB:.4f}"


def steady_iteration(pr: ParsedRank):
    """The last iteration with op statistics (first iterations allocate lazily created state)."""
    its = [r["iteration"] for r in pr.op_stats if r["iteration"] is not None]
    return max(its) if its else None


def op_summary(pr: ParsedRank, iteration=None) -> list[dict]:
    """Per op over one iteration: saved bytes per layer per microbatch (min/max across layers and microbatches),
    largest forward and backward transient peaks; plus a `layer total` row summing the layer ops."""
    it = steady_iteration(pr) if iteration is None else iteration
    rows = [r for r in pr.op_stats if r["iteration"] == it]
    by_op: dict = defaultdict(list)
    per_layer: dict = defaultdict(int)
    for r in rows:
        by_op[r["op"]].append(r)
        if r["layer"] is not None:
            per_layer[(r["layer"], r["microbatch"])] += r["saved_bytes"]
    out = []
    for op, rs in by_op.items():
        saved = [r["saved_bytes"] for r in rs]
        fwd = [r["fwd_peak_bytes"] for r in rs if r["fwd_peak_bytes"] is not None]
        bwd = [r["bwd_peak_bytes"] for r in rs if r["bwd_peak_bytes"] is not None]
        layers = sorted({r["layer"] for r in rs if r["layer"] is not None})
        out.append({"op": op, "layers": len(layers), "microbatches": len({r["microbatch"] for r in rs}),
                    "saved_min_bytes": min(saved), "saved_max_bytes": max(saved),
                    "fwd_peak_bytes": max(fwd) if fwd else None, "bwd_peak_bytes": max(bwd) if bwd else None})
    if per_layer:
        v = list(per_layer.values())
        out.append({"op": "layer total (sum of layers.* ops)", "layers": len({k[0] for k in per_layer}),
                    "microbatches": len({k[1] for k in per_layer}), "saved_min_bytes": min(v),
                    "saved_max_bytes": max(v), "fwd_peak_bytes": None, "bwd_peak_bytes": None})
    return out


def trace_state(pr: ParsedRank) -> dict:
    """How complete the rank's trace is (FORMATS 2.1): format, how the writer stopped, damage, cuts."""
    t = pr.trace
    problems = t.problems()
    return {"format_version": t.version, "end_state": t.end_state,
            "end_signal": signal_name(t.end_signal) if t.end_state == "signal" else None, "damage": t.damage,
            "cut_short": t.cut_short, "complete": not problems, "problems": problems}


def reserved_json(pr: ParsedRank, conf=None) -> dict:
    """The stream replayed through the caching-allocator model (tracer.reserved): modelled, not GPU-validated."""
    from .reserved import modelled_reserved
    r = modelled_reserved(pr, conf)
    return {"label": "modelled (caching-allocator replay of the traced stream; +0.2% / +1.1% on 2 H100 runs)",
            "settings": conf.text if conf is not None and conf.text else "defaults",
            "reserved_peak_bytes": r["peak_reserved_bytes"], "allocated_peak_bytes": r["peak_allocated_bytes"],
            "segments": r["peak_segments"]}


def rank_json(pr: ParsedRank, top: int = 20, conf=None) -> dict:
    i = pr.peak_index
    return {"rank": pr.rank, "coords": pr.header.get("coords"), "events": pr.n_events, "trace": trace_state(pr),
            "truncated_bytes": pr.trace.truncated_bytes, "peak_bytes": pr.peak_bytes, "peak_event": i,
            "peak_time_s": float(pr.t_ns[i]) / 1e9 if i >= 0 else None, "peak_phase": pr.peak_phase,
            "peak_scope_path": pr.peak_scope_path, "allocator_peak_bytes": pr.header.get("allocator_peak_bytes"),
            "final_live_bytes": int(pr.live[-1]) if pr.n_events else 0,
            "peak_by_category": pr.peak_by_category, "peak_by_op": pr.peak_by_op[:top],
            "steady_iteration": steady_iteration(pr), "op_summary": op_summary(pr), "op_stats": pr.op_stats,
            "modelled_reserved": reserved_json(pr, conf)}


def segment_rows(pr: ParsedRank) -> list[dict]:
    """The per-op segments (tracer.segments, FORMATS 3.1) of the steady iteration's first microbatch (all its chunks),
    forward then backward, with the level each leaves above the phase's entry."""
    from .segments import rank_segments
    segs = rank_segments(pr)
    if not segs:
        return []
    it = max(s.iteration for s in segs)
    out = []
    for phase in ("fwd", "bwd"):
        run = [s for s in segs if s.iteration == it and s.microbatch == 0 and s.phase == phase]
        level = 0
        for s in run:
            level += s.delta
            out.append({"phase": phase, "iteration": it, "chunk": s.chunk, "label": s.label, "layer": s.layer,
                        "delta_bytes": s.delta, "peak_bytes": s.peak, "level_bytes": level})
    return out


def format_segments(pr: ParsedRank) -> str:
    rows = [r for r in segment_rows(pr) if r["delta_bytes"] or r["peak_bytes"]]
    L = [f"segments of microbatch 0, iteration {rows[0]['iteration'] if rows else '-'} (MiB; level = after the "
         f"segment, above the phase's entry; segments that allocate nothing left out):",
         f"  {'phase':<5}  {'delta':>10}  {'peak':>10}  {'level':>10}  {'layer':>5}  segment"]
    for r in rows:
        L.append(f"  {r['phase']:<5}  {mib(r['delta_bytes']):>10}  {mib(r['peak_bytes']):>10}  "
                 f"{mib(r['level_bytes']):>10}  {'' if r['layer'] is None else r['layer']:>5}  {r['label']}")
    return "\n".join(L)


def format_rank(pr: ParsedRank, top: int = 15, conf=None) -> str:
    j = rank_json(pr, top, conf)
    L = []
    coords = " ".join(f"{k}={v}" for k, v in (j["coords"] or {}).items())
    L.append(f"== rank {pr.rank}  {coords}  ({pr.n_events:,} events, backend {pr.trace.backend})")
    for p in j["trace"]["problems"]:
        L.append(f"   WARNING: {p}")
    L.append(f"peak live memory: {mib(pr.peak_bytes)} MiB at t={j['peak_time_s'] or 0:.4f} s (event {pr.peak_index})")
    L.append(f"  phase of the peak: {pr.peak_phase}")
    if j["allocator_peak_bytes"] is not None:
        same = "equal" if j["allocator_peak_bytes"] == pr.peak_bytes else "DIFFERENT"
        L.append(f"  allocator's own peak counter: {mib(j['allocator_peak_bytes'])} MiB ({same} to the replay)")
    res = j["modelled_reserved"]
    L.append(f"  reserved had PyTorch's caching allocator served this stream: {mib(res['reserved_peak_bytes'])} MiB "
             f"(allocated {mib(res['allocated_peak_bytes'])} MiB in 512 B blocks, {res['segments']} segments; "
             f"settings {res['settings']}; {res['label']})")
    L.append("live at the peak by category (MiB):")
    for c in CATEGORIES:
        b = pr.peak_by_category.get(c, 0)
        if b:
            L.append(f"  {c:<14} {mib(b):>12}  {100 * b / max(pr.peak_bytes, 1):5.1f}%")
    L.append(f"top {top} contributors live at the peak (op or innermost scope, category):")
    L.append(f"  {'MiB':>12}  {'tensors':>7}  {'category':<13} op")
    for r in pr.peak_by_op[:top]:
        L.append(f"  {mib(r['bytes']):>12}  {r['count']:>7}  {r['category']:<13} {r['op']}")
    summ = j["op_summary"]
    if summ:
        L.append(f"per op, iteration {j['steady_iteration']} (MiB; saved = per layer per microbatch, min..max):")
        L.append(f"  {'saved/layer/mb':>22}  {'fwd peak':>10}  {'bwd peak':>10}  {'layers':>6}  {'mbs':>4}  op")
        for r in summ:
            lo, hi = r["saved_min_bytes"], r["saved_max_bytes"]
            s = mib(lo) if lo == hi else f"{mib(lo)}..{mib(hi)}"
            L.append(f"  {s:>22}  {mib(r['fwd_peak_bytes']):>10}  {mib(r['bwd_peak_bytes']):>10}  "
                     f"{r['layers']:>6}  {r['microbatches']:>4}  {r['op']}")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tracer.report", description=__doc__.split("\n\n")[1])
    ap.add_argument("path", help="a run directory with rank<R>.trace files, or one rank<R>.trace")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON (bytes) instead of text")
    ap.add_argument("--snapshot", metavar="OUT.pickle", help="write a PyTorch memory snapshot (rank R = device R)")
    ap.add_argument("--png", metavar="OUT.png", help="write a live-memory timeline plot, one panel per rank")
    ap.add_argument("--rank", type=int, action="append", help="only these ranks (repeatable)")
    ap.add_argument("--top", type=int, default=15, help="contributors listed at the peak (default 15)")
    ap.add_argument("--segments", action="store_true",
                    help="also list microbatch 0's per-op segments, forward and backward (FORMATS 3.1)")
    ap.add_argument("--cuda-alloc-conf", metavar="CONF", default="",
                    help="caching-allocator settings (as PYTORCH_CUDA_ALLOC_CONF) for the modelled reserved peak")
    a = ap.parse_args(argv)
    try:
        from estimator.caching_allocator import parse_alloc_conf
        conf = parse_alloc_conf(a.cuda_alloc_conf)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ranks = parse_run(a.path)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        if a.rank:
            ranks = [r for r in ranks if r.rank in a.rank]
            if not ranks:
                raise TraceFormatError(f"{a.path}: no rank among {a.rank}")
        if a.json:
            docs = [rank_json(r, a.top, conf) for r in ranks]
            if a.segments:
                for d, r in zip(docs, ranks):
                    d["segments"] = segment_rows(r)
            _print(json.dumps({"ranks": docs}, indent=1))
        else:
            _print("\n\n".join(format_rank(r, a.top, conf) + ("\n" + format_segments(r) if a.segments else "")
                                 for r in ranks))
        if a.snapshot:
            from .export import save_snapshot
            save_snapshot(ranks, a.snapshot)
            print(f"wrote {a.snapshot}: open with https://pytorch.org/memory_viz or "
                  f"python -m torch.cuda._memory_viz trace_plot {a.snapshot} -o trace.html", file=sys.stderr)
        if a.png:
            from .export import plot_timeline
            plot_timeline(ranks, a.png)
            print(f"wrote {a.png}", file=sys.stderr)
    except (TraceFormatError, OSError, ValueError, KeyError) as e:
        print(f"tracer.report: error: {e}", file=sys.stderr)
        return 2
    return 0


def _print(text: str) -> None:
    """print(text); a reader that went away (`--json | head -1`) ends the output without a word: stdout then
    points at /dev/null, so the interpreter's flush at exit stays quiet too, and the exports still get written."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
