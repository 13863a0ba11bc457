"""The report's first screen: verdict, peak per pipeline stage with the allowances, largest categories, formula set.

Every line is at most WIDTH columns (tests/test_report_summary.py checks it over many configs).
"""
from __future__ import annotations

from estimator import verdict as V

WIDTH = 100
GiB = float(1 << 30)
_CATS = (("activations", "activations"), ("optimizer_states", "optimizer states"), ("gradients", "gradients"),
         ("parameters", "weights"), ("gpu_runtime", "GPU runtime buffers"), ("other", "transient"))


def g(n: float) -> str:
    return f"{n / GiB:,.2f}"


def _fit(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def measured_share(report) -> float:
    """Share of the worst stage's saved activation bytes that come from measured formulas (0 for a modelled set;
    a fitted set less its fallbacks to the modelled one; a composed set as its coverage says)."""
    fset, est = report.formula_set, report.estimate
    if fset.kind == "modelled":
        return 0.0
    if est.coverage:
        return float(est.coverage["measured_share"])
    per_op = next(r for r in est.ranks if r.pp_rank == est.max_peak_pp_rank).per_op
    total = sum(d["saved"] for d in per_op.values())
    fallen = {op for op, q in est.fallbacks if q == "saved"}
    measured = sum(d["saved"] for op, d in per_op.items() if op not in fallen)
    return measured / total if total else 1.0


def _headline(report) -> list[str]:
    cfg = report.cfg
    from estimator.model import model_total_params
    from estimator.report import human_count
    dtype = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"
    moe = ""
    if cfg.is_moe:
        from estimator.moe_tokens import routing
        moe = f", {cfg.num_experts} experts top-{cfg.moe_router_topk} ({routing(cfg).short()})"
    model = (f"Model     {human_count(model_total_params(cfg))} params: {cfg.num_layers} layers x {cfg.hidden_size}"
             f"{moe}, seq {cfg.seq_length}, {dtype}")
    par = f"TP {cfg.tensor_model_parallel_size} CP {cfg.context_parallel_size} PP {cfg.pipeline_model_parallel_size}"
    if cfg.virtual_pipeline_model_parallel_size:
        par += f" (x{cfg.virtual_pipeline_model_parallel_size} virtual)"
    par += f" DP {cfg.data_parallel_size}"
    if cfg.is_moe:
        par += f" EP {cfg.expert_model_parallel_size}"
    opts = [o for o, on in (("SP", cfg.sequence_parallel), ("dist-opt", cfg.use_distributed_optimizer)) if on]
    rec = cfg.recompute_granularity
    layout = (f"Layout    {cfg.world_size} GPUs = {par}" + (f"; {', '.join(opts)}" if opts else "")
              + f"; {cfg.num_microbatches} x mb {cfg.micro_batch_size}" + (f"; recompute {rec}" if rec else ""))
    return [_fit(model), _fit(layout)]


def _verdict(budget) -> list[str]:
    worst = budget.worst
    if budget.gpu is None:
        return [f"Verdict   needs {g(worst.total)} GiB per GPU (stage {worst.pp_rank}, allowances included); "
                "--gpu-memory GIB|NAME", "          for a fits / does-not-fit answer"]
    gpu = f"{budget.gpu.name} ({g(budget.gpu.bytes)} GiB)"
    tight = min(budget.stages, key=lambda s: s.headroom)
    if budget.fits:
        return [_fit(f"Verdict   FITS on {gpu}: {g(tight.headroom)} GiB headroom on the tightest stage "
                     f"({tight.pp_rank})")]
    bad = [s.pp_rank for s in budget.stages if not s.fits]
    where = f"stage {bad[0]}" if len(bad) == 1 else f"{len(bad)} of {len(budget.stages)} stages"
    return [_fit(f"Verdict   DOES NOT FIT on {gpu}: {where} over by {g(-tight.headroom)} GiB "
                 f"(worst: stage {tight.pp_rank})")]


def _stage_table(report, budget) -> list[str]:
    allow = budget.allowances
    header = ["stage", "PyTorch peak", "+CUDA ctx", "+NCCL", "+frag", "= total"]
    if budget.gpu is not None:
        header += ["headroom", ""]
    rows = []
    for s in budget.stages:
        row = [str(s.pp_rank), g(s.allocated), g(s.cuda_context), f"{g(s.nccl)} ({len(s.nccl_communicators)})",
               g(s.fragmentation), g(s.total)]
        if budget.gpu is not None:
            row += [g(s.headroom), "fits" if s.fits else "DOES NOT FIT"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                     for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    lines = ["Peak per pipeline stage (GiB per GPU; PyTorch peak = the estimate, the rest allowances)"]
    lines += [fmt(header)] + [fmt(r) for r in rows]
    frag = (f"{allow['fragmentation_percent']:g}% of the peak" if allow.get("fragmentation_percent") is not None
            else "modelled (below)")
    ctx = allow["cuda_context_gib"]
    measured = " (measured on H100 runs)" if ctx == V.DEFAULTS["cuda_context_gib"] else ""
    lines.append(f"  allowances: CUDA context and libraries {ctx:.2f} GiB{measured};")
    lines.append(f"    NCCL {allow['nccl_gib_per_communicator']:g} GiB x (communicators); fragmentation {frag}")
    return [_fit(x) for x in lines] + _reserved_lines(report)


def _reserved_lines(report) -> list[str]:
    """Modelled reserved memory per stage (estimator.reserved), beside the allocated peak."""
    res = getattr(report, "reserved", None)
    if res is None:
        return []
    from estimator.reserved import LABEL
    items = [f"stage {s.pp_rank} {g(s.reserved_bytes)} GiB (peak +{g(s.fragmentation_bytes)})" for s in res.stages]
    conf = res.conf.text if res.source != "defaults" else "defaults"
    return (_wrap("  reserved (max_memory_reserved):", items, 4)
            + _wrap(f"    {LABEL},", [f"allocator settings: {conf}"
                                         + (f" ({res.source})" if res.source != "defaults" else "")], 4))


def _wrap(first: str, items: list, indent: int = 10) -> list[str]:
    """`first` then the items joined by ', ', wrapped at WIDTH with continuation lines indented."""
    lines, cur = [], first
    for j, item in enumerate(items):
        piece = item + ("," if j < len(items) - 1 else "")
        if len(cur) + 1 + len(piece) > WIDTH and cur.strip():
            lines.append(cur.rstrip())
            cur = " " * indent
        cur += ("" if cur.endswith(" ") or not cur else " ") + piece
    lines.append(cur.rstrip())
    return [_fit(x) for x in lines]


def _largest(report) -> list[str]:
    est = report.estimate
    worst = next(r for r in est.ranks if r.pp_rank == est.max_peak_pp_rank)
    parts = sorted(((worst.bytes[k], label) for k, label in _CATS if worst.bytes[k] > 0), reverse=True)
    total = worst.peak_bytes or 1.0
    lines = _wrap(f"Largest   stage {worst.pp_rank} at its peak, {_fit(worst.peak_phase, 70)}:",
                  [f"{label} {g(b)} GiB ({100 * b / total:.0f}%)" for b, label in parts[:4]])
    ops = [(op, d["saved"]) for op, d in sorted(worst.per_op.items(), key=lambda kv: -kv[1]["saved"])[:3]
           if d["saved"] > 0]
    if ops:
        lines += _wrap("          saved per microbatch:", [f"{op} {g(b)} GiB" for op, b in ops])
    return lines


def measured_sources(report) -> list[str]:
    """Where a fitted set's measurements come from, for this config: GPU traces, or CPU traces (with the GPU's
    kernels on CPU stand-ins where the config runs any)."""
    backends = report.formula_set.provenance.get("backends") or []
    if backends == ["cuda"]:
        return ["from GPU traces"]
    where = "from CPU traces" if backends == ["cpu-hook"] else "from GPU and CPU traces"
    standins = (report.estimate.coverage or {}).get("standins")
    return [where] + (["the GPU's kernels on CPU stand-ins"] if standins else [])


def profiled_lines(fset) -> list[str]:
    """What a job's own set (fit.job_campaign) was profiled on, and so what it predicts."""
    prof = fset.profiled
    if not prof:
        return []
    v = prof.get("versions") or {}
    stack = ", ".join([str(prof.get("target", "?"))] + [f"{k.replace('_', '-')} {v[k]}" for k in
                                                         ("torch", "megatron_core") if k in v])
    if prof.get("device") == "cpu":
        return [f"profiled on CPU ({stack}): predicts CPU runs of its kernels, no GPU allowances"]
    return [f"profiled on {prof.get('device_name') or 'a GPU'} ({stack})"]


def _formulas(report) -> list[str]:
    from estimator.formulas import DEFAULT_SET
    fset = report.formula_set
    share = measured_share(report)
    name = fset.name + (" (default)" if fset.name == DEFAULT_SET else "")
    if fset.kind == "modelled":
        items = [f"{name}: MODELLED from published analysis, 0% measured"]
    else:
        items = [f"{name}: {100 * share:.1f}% of saved activation bytes measured"] + measured_sources(report)
        if share < 0.9995:
            items.append(f"{100 * (1 - share):.1f}% modelled or extrapolated")
    items += profiled_lines(fset)
    n_fb = len({op for op, _ in report.estimate.fallbacks})
    items += [f"{n_fb} ops fall back to the modelled set"] if n_fb else []
    return _wrap("Formulas  ", items)


def summary_lines(report, budget) -> list[str]:
    out = ["megatron-memtrace estimate", *_headline(report), *_verdict(budget), ""]
    out += _stage_table(report, budget)
    out += [""] + _largest(report) + _formulas(report)
    return out
