"""Renders a `cli.Report` as the text report or as the stable JSON document (README: "JSON output").

Text uses explicit binary units (MiB, GiB = 2^30 bytes); JSON carries plain integer bytes.
"""
from __future__ import annotations

from estimator import features, moe_tokens
from estimator.args import recompute_modules

JSON_FORMAT = "megatron-memtrace-estimate"
JSON_VERSION = 1
CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "gpu_runtime", "other")
CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_states": "optimizer states",
                   "activations": "activations", "gpu_runtime": "GPU runtime buffers (modelled)",
                   "other": "other (transient at peak)"}
MiB, GiB = float(1 << 20), float(1 << 30)


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def gib(n: float) -> str:
    return f"{n / GiB:,.2f}"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _table(rows: list[list[str]], header: list[str], right: set = frozenset()) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


# --- shared facts -----------------------------------------------------------------------------------------------

def _stage_of_rank(report) -> dict[int, object]:
    return {r.pp_rank: r for r in report.estimate.ranks}


def _ranks_by_stage(report) -> dict[int, list]:
    """Global ranks of each stage, ascending."""
    out: dict[int, list] = {}
    for r, p in enumerate(report.layout.columns["pp"]):
        out.setdefault(p, []).append(r)
    return out


def _op_rows(report, stage: int) -> list[dict]:
    """Model tree of one stage: one row per op kind (layers folded), with params and activation bytes."""
    cfg = report.cfg
    e_param = 2 if (cfg.bf16 or cfg.fp16) else 4
    rows: dict[str, dict] = {}
    for op in report.rank_params[stage].ops:
        row = rows.setdefault(op.op, {"op": op.op, "shapes": [list(s) for s in op.shapes], "instances": 0,
                                      "layers": 0, "params": 0, "param_bytes": 0, "expert": op.is_expert})
        row["layers"] += 1
        row["instances"] += op.count
        row["params"] += op.numel
        row["param_bytes"] += op.numel * e_param
    per_op = _stage_of_rank(report)[stage].per_op
    for name, act in per_op.items():
        row = rows.setdefault(name, {"op": name, "shapes": [], "instances": 0, "layers": act.get("count", 0),
                                     "params": 0, "param_bytes": 0, "expert": False})
        row["saved_bytes"] = act["saved"]
        row["fwd_peak_bytes"] = act["fwd_peak"]
        row["bwd_peak_bytes"] = act["bwd_peak"]
    return sorted(rows.values(), key=_tree_key([r["op"] for r in rows.values() if r["params"]]))


def _tree_key(param_ops: list[str]):
    """Module-tree order: an op sits at its first parameter-holding descendant (parents first); an op without
    parameters (core_attention, loss) sits after its parent's subtree; the input batch (`data.*`) comes first."""
    def under(parent: str, op: str) -> bool:
        return op == parent or op.startswith(parent + ".")

    def key(row: dict):
        name = row["op"]
        if name.startswith("data."):
            return (-1, 0)
        hits = [i for i, op in enumerate(param_ops) if under(name, op)]
        if hits:
            return (min(hits), name.count("."))
        parent = name
        while "." in parent:
            parent = parent.rsplit(".", 1)[0]
            hits = [i for i, op in enumerate(param_ops) if under(parent, op)]
            if hits:
                return (max(hits) + 0.5, name.count("."))
        return (len(param_ops) + (0 if name != "loss" else 1), 0)
    return key


# --- text -------------------------------------------------------------------------------------------------------

def _vocab(cfg) -> str:
    """The tokenizer's vocabulary as Megatron sizes it (GPT-2 BPE without --vocab-size; the null tokenizer's EOD)."""
    if cfg.vocab_size is None:
        return f"{cfg.padded_vocab_size}" if cfg.tokenizer_type != "GPT2BPETokenizer" else "50257 (GPT-2 BPE)"
    if cfg.tokenizer_type in ("NullTokenizer", "NullMultimodalTokenizer"):
        return f"{cfg.vocab_size} + EOD"
    return str(cfg.vocab_size)


def _biases(cfg) -> str:
    if cfg.add_bias_linear:
        return "linear biases"
    return "QKV bias only" if getattr(cfg, "add_qkv_bias", False) else "no linear biases"


def _step(cfg) -> str:
    """How the optimizer steps on a GPU (static_memory.adam_step): it decides the step's temporaries."""
    from .static_memory import adam_step
    if adam_step(cfg) == "foreach":
        return " (torch AdamW, multi-tensor step: --torch-adam)"
    return " (TE / apex FusedAdam assumed; --torch-adam without them)" if cfg.optimizer == "adam" else ""


def _describe(cfg) -> list[str]:
    moe = ""
    if cfg.is_moe:
        moe = (f", MoE {cfg.num_experts} experts top-{cfg.moe_router_topk} (expert ffn {cfg.moe_ffn_hidden_size}"
               + (f", shared {cfg.moe_shared_expert_intermediate_size}" if cfg.moe_shared_expert_intermediate_size
                  else "") + f", {cfg.moe_token_dispatcher_type} dispatcher)")
    dtype = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"
    recompute = cfg.recompute_granularity or "none"
    if recompute == "full":
        recompute += f" ({cfg.recompute_method}, {cfg.recompute_num_layers} layers)"
    elif recompute == "selective":
        recompute += f" ({', '.join(recompute_modules(cfg))})"
    vp = cfg.virtual_pipeline_model_parallel_size
    routing = [f"MoE routing  {moe_tokens.routing(cfg).describe()}"] if cfg.is_moe else []
    return [
        f"Model        {cfg.num_layers} layers, hidden {cfg.hidden_size}, ffn {cfg.ffn_hidden_size}, "
        f"heads {cfg.num_attention_heads} (query groups {cfg.num_query_groups}, head dim {cfg.kv_channels}), "
        f"seq {cfg.seq_length}, vocab {_vocab(cfg)} (padded {cfg.padded_vocab_size})",
        f"             {'swiglu' if cfg.swiglu else 'gelu'}, {cfg.normalization}, {cfg.position_embedding_type} "
        f"positions, {_biases(cfg)}, "
        f"{'untied' if cfg.untie_embeddings_and_output_weights else 'tied'} embeddings{moe}",
        f"Parallelism  world {cfg.world_size} = TP {cfg.tensor_model_parallel_size} x CP "
        f"{cfg.context_parallel_size} x PP {cfg.pipeline_model_parallel_size} x DP {cfg.data_parallel_size}"
        + (f" (virtual stages {vp})" if vp else "")
        + (f"; EP {cfg.expert_model_parallel_size}, expert-TP {cfg.expert_tensor_parallel_size}, "
           f"expert-DP {cfg.expert_data_parallel_size}" if cfg.is_moe else "")
        + f"; sequence parallel {'on' if cfg.sequence_parallel else 'off'}; distributed optimizer "
        f"{'on' if cfg.use_distributed_optimizer else 'off'}",
        f"Training     micro batch {cfg.micro_batch_size}, global batch {cfg.global_batch_size}, "
        f"{cfg.num_microbatches} microbatches per iteration; {dtype}; optimizer {cfg.optimizer}{_step(cfg)}; "
        f"recompute {recompute}; attention {cfg.attention_kernel}",
        *routing,
    ]


def _text_model_tree(report, stage: int) -> list[str]:
    rows = []
    for r in _op_rows(report, stage):
        shapes = " ".join("x".join(str(d) for d in s) for s in r["shapes"]) or "-"
        mult = f"x{r['layers']}" if r["layers"] > 1 else ""
        rows.append([r["op"] + (" [expert]" if r["expert"] else ""), mult, shapes, human_count(r["params"]),
                     mib(r["param_bytes"]), mib(r.get("saved_bytes", 0)), mib(r.get("fwd_peak_bytes", 0)),
                     mib(r.get("bwd_peak_bytes", 0))])
    return _table(rows, ["op", "count", "param shape (per instance)", "params", "param MiB", "act saved MiB",
                         "fwd peak MiB", "bwd peak MiB"], right={3, 4, 5, 6, 7})


def _text_memory(report) -> list[str]:
    est = report.estimate
    worst = _stage_of_rank(report)[est.max_peak_pp_rank]
    lines = [f"Per-GPU memory demand (worst rank class: pipeline stage {worst.pp_rank}; peak during "
             f"{worst.peak_phase})"]
    rows = [[CATEGORY_LABELS[c], gib(worst.bytes[c]), mib(worst.bytes[c])] for c in CATEGORIES]
    rows.append(["total (peak)", gib(worst.peak_bytes), mib(worst.peak_bytes)])
    lines += ["  " + s for s in _table(rows, ["category", "GiB", "MiB"], right={1, 2})]
    return lines + _text_gpu_runtime(report, worst)


def _text_gpu_runtime(report, worst) -> list[str]:
    """The GPU runtime buffers (inside the peak) and what lies outside PyTorch's allocator (beside it)."""
    lines = [f"  GPU runtime buffers (modelled, persistent, in the peak above; after the optimizer step "
             f"{gib(worst.after_step_bytes)} GiB stay allocated):"]
    lines += [f"    {it.name}: {mib(it.bytes)} MiB" + (f" ({it.count} x)" if it.count > 1 else "") + f"; {it.source}"
              for it in worst.gpu_runtime]
    sb = next((s for s in _budget(report).stages if s.pp_rank == worst.pp_rank), None)
    if sb is not None:
        lines.append(f"  Outside PyTorch's allocator (allowances, not in the peak): CUDA context and libraries "
                     f"{gib(sb.cuda_context)} GiB (the default measured on H100 runs), NCCL {gib(sb.nccl)} GiB "
                     f"({len(sb.nccl_communicators)} communicators, modelled from a published figure)")
    return _wrap(lines)


def _rank_list(layout, ranks: list) -> str:
    """GPU names of global ranks `ranks` (ascending), the first and the last when more than three."""
    if len(ranks) <= 3:
        return ", ".join(layout.name(r) for r in ranks)
    return f"{layout.name(ranks[0])} .. {layout.name(ranks[-1])} ({len(ranks)} GPUs)"


def _text_rank_table(report) -> list[str]:
    by_stage = _ranks_by_stage(report)
    rows = []
    for r in report.estimate.ranks:
        rows.append([str(r.pp_rank), _rank_list(report.layout, by_stage[r.pp_rank]), human_count(r.params),
                     *(gib(r.bytes[c]) for c in CATEGORIES), gib(r.peak_bytes), str(r.in_flight_max), r.peak_phase])
    return _table(rows, ["pp", "GPUs", "params", "weights", "grads", "optim", "activ", "gpu-rt", "other",
                         "peak GiB", "in flight", "peak phase"], right={2, 3, 4, 5, 6, 7, 8, 9, 10})


def _text_comm(report, detail: bool = True) -> list[str]:
    colls = report.comm.collectives
    if not colls:
        return ["(no communication: a single GPU)"]
    summary = report.comm.summary()
    rows = [[dim, ", ".join(d["ops"]), f"{d['calls_per_iteration']:,}", mib(d["max_rank_bytes_per_iteration"]),
             gib(d["cluster_bytes_per_iteration"]), "modelled" if d["modelled"] else "checked"]
            for dim, d in summary.items()]
    lines = ["Summary per dimension"]
    lines += ["  " + s for s in _table(rows, ["dim", "collectives", "calls/iter", "wire MiB/rank/iter",
                                              "cluster GiB/iter", "source"], right={2, 3, 4})]
    if not detail:
        return lines
    rows = []
    for c in _merge_equal_rows(colls):
        shape = "x".join(str(d) for d in c.shape)
        ranks = c.ranks
        who = _rank_list(report.layout, ranks)
        rows.append([c.dim, c.op + (f" ({c.direction})" if c.direction else ""), c.what, c.phase,
                     f"{c.group} ({c.group_size})", f"{shape} {c.dtype}", mib(c.bytes), str(c.per_microbatch) if c.per_microbatch else "-",
                     str(c.per_iteration), mib(c.wire_bytes_per_iteration), gib(c.cluster_bytes_per_iteration),
                     who + (" *" if c.modelled else "")])
    lines += ["", "Detail (one row per collective and rank class; * = modelled, not checked against a measured run)"]
    lines += ["  " + s for s in _table(rows, ["dim", "op", "what", "phase", "group (size)", "message", "msg MiB",
                                              "/mb", "/iter", "wire MiB/rank/iter", "cluster GiB/iter", "ranks"],
                                       right={6, 7, 8, 9, 10})]
    for note in report.comm.notes:
        lines.append(f"note: {note}")
    return lines


def _merge_equal_rows(colls: list) -> list:
    """DP buckets of equal size on the same ranks read better as one row with their calls summed."""
    merged: dict[tuple, object] = {}
    for c in colls:
        key = (c.dim, c.op, c.what, c.phase, c.group, tuple(c.shape), c.dtype, tuple(c.ranks), c.direction)
        if key in merged:
            m = merged[key]
            m.per_iteration += c.per_iteration
            m.per_microbatch += c.per_microbatch
        else:
            m = merged[key] = object.__new__(type(c))  # a shallow copy, without importing copy
            m.__dict__.update(c.__dict__)
    return list(merged.values())


def _text_groups(report) -> list[str]:
    lines = []
    layout = report.layout
    dims = ("tp", "cp", "dp", "pp") + (("ep", "expert-tp", "expert-dp") if report.cfg.is_moe else ()) + ("embedding",)
    for dim in dims:
        groups = layout.groups.get(dim, [])
        if not groups or all(len(g) == 1 for g in groups):
            continue
        shown = groups[:4]
        text = "  ".join("[" + " ".join(layout.name(r) for r in g) + "]" for g in shown)
        more = f"  ... ({len(groups)} groups)" if len(groups) > len(shown) else ""
        lines.append(f"  {dim:<10} {text}{more}")
    return lines or ["  (every group has one member)"]


def _fallback_lines(fallbacks) -> list[str]:
    if not fallbacks:
        return []
    by_op: dict = {}
    for op, q in sorted(fallbacks):
        by_op.setdefault(op, []).append(q)
    whole = [op for op, qs in by_op.items() if len(qs) == 3]
    part = [f"{op} ({', '.join(qs)})" for op, qs in by_op.items() if len(qs) < 3]
    lines = []
    if whole:
        lines.append(f"  {len(whole)} ops have no fitted formula for this config's switches and use the modelled "
                     f"set: {', '.join(whole)}")
    if part:
        lines.append(f"  quantities the fit could not determine, taken from the modelled set: {', '.join(part)}")
    return lines


def _coverage_lines(cov) -> list[str]:
    if not cov:
        return []
    out = [f"  composed from per-op segment formulas: {100 * cov['measured_share']:.1f}% of the saved activation "
           f"bytes from formulas measured for this config's switches"]
    if cov["extrapolated"]:
        out.append(f"  extrapolated (no formula measured for these switches; the largest of the label's nearest "
                   f"formulas is used): {', '.join(cov['extrapolated'])}")
    if cov["untraced"]:
        out.append(f"  not in any traced run, composed without them: {', '.join(cov['untraced'])}")
    if cov.get("modelled"):
        out.append(f"  modelled, no traced run had them (estimator transforms, docs/ESTIMATE.md): "
                   f"{', '.join(cov['modelled'])}")
    if cov.get("modelled_difference"):
        out.append(f"  for {', '.join(cov['modelled_difference'])}: the modelled set's difference to the traced value "
                   f"added")
    if cov.get("standins"):
        out.append(f"  GPU kernels measured on CPU stand-ins (docs/STANDINS.md): {', '.join(cov['standins'])}")
    return out


PROSE_WIDTH = 100


def _wrap(lines: list[str], width: int = PROSE_WIDTH) -> list[str]:
    """Prose lines wrapped at spaces to `width`; continuation lines are indented under the text that follows a
    leading label padded with two or more spaces ("Model        ..."), else by two more spaces."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        gap = line.find("  ", len(line) - len(line.lstrip(" ")))
        if 0 < gap < 16:
            start = len(line) - len(line[gap:].lstrip(" "))
        else:
            start = len(line) - len(line.lstrip(" "))
            gap = -1
        head, words = line[:start], line[start:].split(" ")
        cont = " " * (start if gap > 0 else start + 2)
        cur = head
        for word in words:
            if len(cur) > len(cont) and len(cur) + 1 + len(word) > width:
                out.append(cur.rstrip())
                cur = cont
            cur += word if cur in (head, cont) else " " + word
        out.append(cur.rstrip())
    return out


def _section_config(report) -> list[str]:
    return _wrap(_describe(report.cfg))


def _section_formulas(report) -> list[str]:
    from estimator.summary import profiled_lines   # summary imports this module's helpers
    modelled = report.formula_set.kind == "modelled"
    return _wrap([f"Activation formulas: {report.formula_set.name} ({report.formula_set.kind})"
            + (" -- activations are MODELLED from published analysis, not measured" if modelled else
               " -- fitted from measured traces"),
            *profiled_lines(report.formula_set),
            *_fallback_lines(report.estimate.fallbacks),
            *_coverage_lines(report.estimate.coverage)])


def _model_tree_section(report, stage: int) -> list[str]:
    from estimator.model import model_total_params
    out = [f"Model tree, pipeline stage {stage} (one TP/EP rank; activation bytes per microbatch summed over its "
           f"layers)"]
    out += ["  " + s for s in _text_model_tree(report, stage)]
    out += [f"  model parameters (unsharded, tied weights once): {human_count(model_total_params(report.cfg))}; "
            f"on one GPU of this stage: {human_count(report.rank_params[stage].total)}"]
    return out


def _section_model_tree(report) -> list[str]:
    return _model_tree_section(report, report.estimate.max_peak_pp_rank)


def _section_all_trees(report) -> list[str]:
    out: list = []
    for r in report.estimate.ranks:
        if r.pp_rank != report.estimate.max_peak_pp_rank:
            out += ([""] if out else []) + _model_tree_section(report, r.pp_rank)
    return out


def _section_ranks(report) -> list[str]:
    est = report.estimate
    out = _text_memory(report)
    out[0:1] = _wrap(out[0:1])
    out += ["", f"Per-rank table ({est.schedule} schedule; every GPU of a pipeline stage holds the same shapes; "
                f"GiB)"]
    out += ["  " + s for s in _text_rank_table(report)]
    out += ["", f"Maximum peak: {gib(est.max_peak_bytes)} GiB on pipeline stage {est.max_peak_pp_rank}"]
    return out


_RING_NOTE = ("Communication per iteration (bytes on the wire per rank, ring factors: all-reduce 2(n-1)/n, "
              "all-gather / reduce-scatter (n-1)/n)")


def _section_comm_summary(report) -> list[str]:
    return _wrap([_RING_NOTE]) + ["  " + s for s in _text_comm(report, detail=False)]


def _section_comm_detail(report) -> list[str]:
    return _wrap([_RING_NOTE]) + ["  " + s for s in _text_comm(report, detail=True)]


def _section_groups(report) -> list[str]:
    return ["Process groups (megatron-core rank order " + report.layout.order + "; n<node>_g<gpu>)"] + \
        _text_groups(report)


def _section_warnings(report) -> list[str]:
    """What the estimate assumed in place of the command line (e.g. 8 GPUs per node for `--nproc_per_node gpu`):
    at every detail level, since it changes the answer."""
    return _wrap([f"warning: {w}" for w in getattr(report.cfg, "warnings", []) or []])


def _section_notes(report) -> list[str]:
    cfg = report.cfg
    if not cfg.ignored_args:
        return []
    from estimator.flag_policy import newer_release
    tokens = [f"{t} [{newer_release(t)}]" if newer_release(t) else t for t in cfg.ignored_args]
    note = "; [the newer Megatron-LM release a flag comes from]" if tokens != cfg.ignored_args else ""
    return _wrap([f"Ignored (no effect on memory or communication{note}): " + " ".join(tokens)])


def _section_modelled(report) -> list[str]:
    """Features the config uses whose memory is modelled from Megatron's implementation, not measured."""
    notes = features.modelled(report.cfg, report.formula_set)
    return _wrap(["Modelled, not measured:"] + ["  " + n for n in notes]) if notes else []


def _section_summary(report) -> list[str]:
    from estimator import summary
    return summary.summary_lines(report, _budget(report))


# The text report, in order: (lowest --detail that shows it, renderer). A new section is one more entry.
SECTIONS = [
    (0, _section_summary),
    (0, _section_warnings),
    (0, _section_modelled),
    (1, _section_config),
    (1, _section_formulas),
    (2, _section_model_tree),
    (3, _section_all_trees),
    (1, _section_ranks),
    (1, _section_comm_summary),
    (2, _section_comm_detail),
    (2, _section_groups),
    (1, _section_notes),
]


def to_text(report, detail: int = 1) -> str:
    """Summary first (at most 100 columns), then the sections up to `detail`; the level-1 communication summary
    is replaced by the full tables at level 2."""
    out: list = []
    for level, render in SECTIONS:
        if level > detail or (render is _section_comm_summary and detail >= 2):
            continue
        lines = render(report)
        if lines:
            out += ([""] if out else []) + lines
    if detail == 0:
        out += ["", "(--detail 1: categories, per-rank table, communication; 2: model tree, every collective)"]
    elif detail == 1:
        out += ["", "(--detail 2: model tree, every collective, process groups; --json: every number)"]
    return "\n".join(out) + "\n"


# --- JSON -------------------------------------------------------------------------------------------------------

def _int(x: float) -> int:
    return int(round(x))


def rank_record(rc, r) -> dict:
    """The JSON record of global rank `rc` (parallel.RankCoords), whose stage's estimate is `r`."""
    return {"rank": rc.rank, "name": rc.name,
            "coords": {"tp": rc.tp, "cp": rc.cp, "ep": rc.ep, "dp": rc.dp, "pp": rc.pp, "etp": rc.etp, "edp": rc.edp},
            "params": r.params, "expert_params": r.expert_params,
            "bytes": {c: _int(r.bytes[c]) for c in CATEGORIES},
            "peak_bytes": _int(r.peak_bytes), "peak_phase": r.peak_phase}


def worst_rank(report) -> int:
    """The first global rank whose (rounded) peak is the highest: ranks of a stage share their peak, so this is
    the first rank of the first stage with the highest one."""
    peaks = {r.pp_rank: _int(r.peak_bytes) for r in report.estimate.ranks}
    top = max(peaks.values())
    worst = {p for p, b in peaks.items() if b == top}
    return next(r for r, p in enumerate(report.layout.columns["pp"]) if p in worst)


def to_json(report, ranks=None, groups=None, communication=None) -> dict:
    """The JSON document. `ranks`, `groups`, `communication`: stand-ins for those members (report_json writes
    them itself, fast)."""
    cfg, est, layout = report.cfg, report.estimate, report.layout
    if ranks is None:
        stage = _stage_of_rank(report)
        ranks = [rank_record(rc, stage[rc.pp]) for rc in layout.ranks]
    stages = []
    reserved = report.reserved.by_stage() if getattr(report, "reserved", None) is not None else {}
    for r in est.ranks:
        ops = []
        for row in _op_rows(report, r.pp_rank):
            ops.append({k: (_int(v) if k.endswith("_bytes") else v) for k, v in row.items()})
        stages.append({"pp_rank": r.pp_rank, "params": r.params, "expert_params": r.expert_params,
                       "bytes": {c: _int(r.bytes[c]) for c in CATEGORIES}, "peak_bytes": _int(r.peak_bytes),
                       "peak_phase": r.peak_phase, "in_flight_max": r.in_flight_max,
                       "after_step_bytes": _int(r.after_step_bytes),
                       "gpu_runtime": [it.to_dict() for it in r.gpu_runtime], "ops": ops})
        if r.pp_rank in reserved:   # modelled (estimator.reserved); the settings under `reserved_model`
            stages[-1]["reserved_bytes"] = _int(reserved[r.pp_rank].reserved_bytes)
    return {
        "format": JSON_FORMAT, "version": JSON_VERSION,
        "formula_set": {"name": report.formula_set.name, "kind": report.formula_set.kind,
                        "path": report.formula_set.path,
                        **({"profiled": report.formula_set.profiled} if report.formula_set.profiled else {}),
                        "fallbacks": [{"op": op, "quantity": q} for op, q in sorted(report.estimate.fallbacks)],
                        **({"coverage": report.estimate.coverage} if report.estimate.coverage else {})},
        "config": cfg.to_dict(),
        "ignored_args": list(cfg.ignored_args),
        "modelled_features": features.modelled(cfg, report.formula_set),
        # the routing assumption the expert-side activations were estimated under (estimator.moe_tokens)
        **({"moe_routing": moe_tokens.routing(cfg).to_json()} if cfg.is_moe else {}),
        "schedule": est.schedule,
        "max_peak_bytes": _int(est.max_peak_bytes),
        "max_peak_rank": worst_rank(report),
        "max_peak_pp_rank": est.max_peak_pp_rank,
        "ranks": ranks,
        "stages": stages,
        "groups": groups if groups is not None else {k: [list(g) for g in v] for k, v in layout.groups.items()},
        "communication": communication if communication is not None else report.comm.to_dict(),
        "memory_budget": _budget(report).to_dict(),
        **({"reserved_model": report.reserved.to_dict()} if getattr(report, "reserved", None) is not None else {}),
    }


def _budget(report):
    from estimator import verdict
    return report.budget or verdict.budget(report)
