"""Replay a trace: live-bytes timeline, scope tree, categories, what is live at the peak, per-op statistics.

Everything per record is vectorised numpy; Python loops run only over distinct names, scope-tree depth levels
and op-statistics rows (a few thousand). See docs/FORMATS.md sections 2 and 3.

Category rules (one per allocation, first match wins; "scope" means the innermost enclosing scope of that kind):
  communication  allocated inside grad_sync / param_gather / pp_send / pp_recv (innermost phase scope)
  optimizer      allocated inside `optim` and still live when that `optim` scope closes (Adam moments, fp32 copies),
                 or allocated before the first iteration inside a setup scope whose name contains "optim"
  temporary      allocated inside `optim` and freed before it closes
  gradient       allocated before the first iteration inside a setup scope whose name contains "ddp"/"grad"
                 (DDP main_grad buffers; with the distributed optimizer DDP also allocates a contiguous param
                 buffer there, recognised by the weights freed right after it: that one is a parameter), or allocated in backward (bwd/bwdlayer) and still live after its
                 iteration closes (param.grad created by the first backward)
  parameter      allocated before the first iteration inside a setup scope whose name contains "model" and
                 still live when the last iteration closes; when the trace has no such scope (a user's
                 pretrain_gpt.py), any allocation before the first iteration that lives to the end (weights,
                 and then also unlabelled DDP buffers)
  saved          allocated in forward (fwd, or recompute in backward) and still live when that microbatch's
                 fwd scope (or the recompute scope) closes, but freed by the end of its iteration
  temporary      allocated inside an iteration and freed before the end of it (in forward, before the fwd scope
                 closes; in backward, before the iteration closes)
  other          everything else: setup allocations freed before training ends, allocations that outlive their
                 iteration without being gradients, allocations after the last iteration
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from .trace_reader import (DEVICE_MEM, FREE, MALLOC, MALLOC_FAIL, MARK, RECORD_DTYPE, SCOPE_POP, SCOPE_PUSH, Trace,
                           find_traces, read_trace, write_trace)

CATEGORIES = ["parameter", "gradient", "optimizer", "saved", "temporary", "communication", "other"]
PARAMETER, GRADIENT, OPTIMIZER, SAVED, TEMPORARY, COMMUNICATION, OTHER = range(len(CATEGORIES))

# Scope kinds, from the name prefixes of FORMATS 2.3.
K_OTHER, K_ITER, K_FWD, K_BWD, K_MOD, K_BWDLAYER, K_RECOMPUTE, K_OPTIM, K_COMM, K_LOSS, K_DATA = range(11)
_OP_KINDS = (K_MOD, K_LOSS, K_DATA)   # scopes that name an op (FORMATS 2.3)
_COMM_NAMES = {"grad_sync", "param_gather", "pp_send", "pp_recv"}
_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")
_EXPERT_RE = re.compile(r"\.local_experts\.\d+(?=\.|$)")


def normalise_op(path: str) -> tuple[str, int | None]:
    """`module.decoder.layers.7.mlp.linear_fc1` -> (`layers.*.mlp.linear_fc1`, 7); `decoder.final_layernorm` ->
    (`final_layernorm`, None); `...mlp.experts.local_experts.5.linear_fc1` -> `...mlp.experts.local_experts.*.linear_fc1`;
    `decoder` -> `decoder` (the TransformerBlock itself).
    Leading wrapper segments (`module`, chunk indices, `decoder`) are dropped."""
    parts = path.split(".") if path else []
    while parts and (parts[0] == "module" or parts[0].isdigit()):
        parts.pop(0)
    if parts == ["decoder"]:
        return "decoder", None      # the TransformerBlock's own code (between layers, its final norm)
    if parts and parts[0] == "decoder":
        parts.pop(0)
    rest = ".".join(parts)
    m = _LAYER_RE.search(rest)
    if m is None:
        return (rest or "model"), None
    layer = int(m.group(2))
    # a SequentialMLP's local experts are one op, `local_experts.*`, run once per local expert (op statistics roll
    # it up into `experts`, summed over local experts, as parameters do)
    op = _EXPERT_RE.sub(".local_experts.*", rest[: m.start(2)] + "*" + rest[m.end(2):])
    return op, layer


def _classify_name(name: str) -> tuple[int, int, str | None, int | None]:
    """Scope name -> (kind, number, op, layer); number is the iteration or microbatch index, else -1."""
    head, _, rest = name.partition(":")
    if head == "iter" and rest.isdigit():
        return K_ITER, int(rest), None, None
    if head in ("fwd", "bwd") and rest.split(":")[0].isdigit():
        return (K_FWD if head == "fwd" else K_BWD), int(rest.split(":")[0]), None, None
    if head == "mod":
        return (K_MOD, -1, *normalise_op(rest))
    if head == "bwdlayer":
        return (K_BWDLAYER, -1, *normalise_op(rest))
    if head == "recompute":
        return (K_RECOMPUTE, -1, *normalise_op(rest))
    if name == "optim":
        return K_OPTIM, -1, None, None
    if name in _COMM_NAMES:
        return K_COMM, -1, None, None
    if name in ("loss", "mtp_head.loss"):    # (a multi-token prediction layer's loss head: tracer.scopes)
        return K_LOSS, -1, name, None
    if head == "data" and rest:   # the microbatch's input batch, built in the forward step (op `data.<what>`)
        return K_DATA, -1, f"data.{rest}", None
    return K_OTHER, -1, None, None


@dataclass
class Scopes:
    """One row per scope instance, in push order."""
    id: np.ndarray         # instance id (SCOPE_PUSH `size`)
    tag: np.ndarray        # name id
    parent: np.ndarray     # parent row, -1 at the root
    depth: np.ndarray      # 1 for top-level scopes
    open: np.ndarray       # record index of the push
    close: np.ndarray      # record index of the pop (n_records if never closed)
    kind: np.ndarray       # K_* code of the name


@dataclass
class ParsedRank:
    rank: int
    trace: Trace
    header: dict
    t_ns: np.ndarray                # per record
    live: np.ndarray                # live bytes after each record (int64)
    peak_bytes: int
    peak_index: int                 # first record at which the peak is reached (-1 for an empty trace)
    scopes: Scopes
    allocs: dict                    # struct of arrays over MALLOC records (see _allocations)
    op_stats: list = field(default_factory=list)
    peak_by_category: dict = field(default_factory=dict)   # category -> bytes live at the peak
    peak_by_op: list = field(default_factory=list)         # [{"op", "category", "bytes"}] largest first
    peak_phase: str = ""
    peak_scope_path: list = field(default_factory=list)    # scope names, outermost first
    marks: list = field(default_factory=list)              # [(record index, t_ns, name)]
    counter_peak_bytes: int = 0    # the allocator counter's view: max live after the last `reset_peak` MARK
    # CUDA backend: cudaMemGetInfo at marks, [{"index", "mark", "device", "free", "total", "live"}]; total - free -
    # live is device memory no PyTorch allocator holds (CUDA context, NCCL buffers), as the tracer does not cache
    device_readings: list = field(default_factory=list)
    malloc_failures: list = field(default_factory=list)    # [{"index", "size", "device"}]: allocations refused

    @property
    def n_events(self) -> int:
        return len(self.t_ns)

    def scope_name(self, row: int) -> str:
        return self.trace.name(int(self.scopes.tag[row])) if row >= 0 else ""

    def scope_path(self, row: int) -> list[str]:
        out = []
        while row >= 0:
            out.append(self.scope_name(row))
            row = int(self.scopes.parent[row])
        return out[::-1]


# ---------------------------------------------------------------------------------------------------- replay
def replay(kind: np.ndarray, ptr: np.ndarray, size: np.ndarray):
    """Pair each FREE with the MALLOC of its pointer (vectorised) and return (live, malloc_idx, free_idx).

    Stable-sorting memory events by pointer keeps file order within a pointer; a FREE is matched when the event
    just before it for the same pointer is a MALLOC; a MALLOC right after a MALLOC of the same pointer ends the
    earlier one (as in the core's counter). Unmatched FREEs (memory from before tracing, double frees)
    change nothing, as in the allocator's counter. free_idx is len(kind) for allocations never freed."""
    n = len(kind)
    is_malloc = kind == MALLOC
    mem = np.flatnonzero(is_malloc | (kind == FREE))
    pm = ptr[mem]
    order = np.argsort(pm, kind="stable")
    idx_s = mem[order]
    k_s, p_s = kind[idx_s], pm[order]
    pair = (k_s[1:] == FREE) & (k_s[:-1] == MALLOC) & (p_s[1:] == p_s[:-1])   # pair[j]: j is MALLOC, j+1 frees it
    # a MALLOC of a pointer still live replaces the old allocation (the core's counter applies the same rule)
    pair |= (k_s[1:] == MALLOC) & (k_s[:-1] == MALLOC) & (p_s[1:] == p_s[:-1])
    m_of, f_of = idx_s[:-1][pair], idx_s[1:][pair]
    delta = np.where(is_malloc, size, 0).astype(np.int64)
    delta[f_of] -= np.where(is_malloc, size, 0)[m_of].astype(np.int64)
    live = np.cumsum(delta)
    free_of = np.full(n, n, np.int64)
    free_of[m_of] = f_of
    malloc_idx = np.flatnonzero(is_malloc)
    return live, malloc_idx, free_of[malloc_idx]


def build_scopes(kind: np.ndarray, size: np.ndarray, tag: np.ndarray, names: list[str]) -> Scopes:
    """Rebuild the scope tree from SCOPE_PUSH/POP with the depth trick: a push's parent is the latest earlier push
    one level up, a pop closes the latest earlier push at its level (valid for a well-nested stack)."""
    n = len(kind)
    ev = np.flatnonzero((kind == SCOPE_PUSH) | (kind == SCOPE_POP))
    is_push = kind[ev] == SCOPE_PUSH
    depth_after = np.cumsum(np.where(is_push, 1, -1))
    if len(ev) and depth_after.min() < 0:      # stray pops (a trace started mid-scope): drop them
        ev, is_push, depth_after = _drop_stray_pops(ev, is_push)
    push, pdepth = ev[is_push], depth_after[is_push]
    key = pdepth.astype(np.int64) * (n + 1) + push          # sorted by (depth, position)
    korder = np.argsort(key, kind="stable")
    skey = key[korder]

    def latest(d, pos):  # latest push at depth d strictly before pos, as a row, or -1
        j = np.searchsorted(skey, d.astype(np.int64) * (n + 1) + pos) - 1
        ok = j >= 0
        row = np.where(ok, korder[np.maximum(j, 0)], -1)
        return np.where(ok & (pdepth[np.maximum(row, 0)] == d), row, -1)

    parent = latest(pdepth - 1, push)
    close = np.full(len(push), n, np.int64)
    pops = ev[~is_push]
    closed = latest(depth_after[~is_push] + 1, pops)
    close[closed[closed >= 0]] = pops[closed >= 0]
    kinds = np.array([_classify_name(nm)[0] for nm in names] or [K_OTHER], np.int8)
    t = tag[push].astype(np.int64)
    return Scopes(id=size[push].astype(np.int64), tag=t, parent=parent, depth=pdepth.astype(np.int64),
                  open=push, close=close, kind=kinds[np.minimum(t, len(kinds) - 1)])


def _drop_stray_pops(ev, is_push):
    keep, d = np.ones(len(ev), bool), 0
    for i, p in enumerate(is_push):          # rare path: only for malformed traces
        if p:
            d += 1
        elif d == 0:
            keep[i] = False
        else:
            d -= 1
    ev, is_push = ev[keep], is_push[keep]
    return ev, is_push, np.cumsum(np.where(is_push, 1, -1))


def current_scope(sc: Scopes, idx: np.ndarray) -> np.ndarray:
    """Row of the innermost scope open at each record index in idx (-1 outside all scopes)."""
    if len(sc.open) == 0:
        return np.full(len(idx), -1, np.int64)
    # Scopes open at idx are those with open < idx < close... a nested stack means the innermost open one is the
    # latest-opened scope that has not closed; walk up from the latest push before idx (few levels).
    row = np.searchsorted(sc.open, idx, side="left") - 1
    for _ in range(int(sc.depth.max()) + 1):
        bad = (row >= 0) & (sc.close[np.maximum(row, 0)] <= idx)
        if not bad.any():
            break
        row = np.where(bad, sc.parent[np.maximum(row, 0)], row)
    return row


def inherit(sc: Scopes, mask: np.ndarray) -> np.ndarray:
    """For every scope row, the innermost row (itself included) whose mask is set, else -1; one pass per depth."""
    out = np.where(mask, np.arange(len(mask)), -1)
    for d in range(2, int(sc.depth.max(initial=0)) + 1):
        rows = np.flatnonzero((sc.depth == d) & ~mask)
        out[rows] = out[sc.parent[rows]]
    return out


def iteration_of(pr: "ParsedRank", row: int) -> int:
    """The iteration number of an `iter:<i>` scope row, -1 for no row or another scope."""
    if row < 0:
        return -1
    name = pr.scope_name(row)
    return int(name[5:]) if name.startswith("iter:") and name[5:].isdigit() else -1


def at_rows(v: np.ndarray, rows: np.ndarray, fill=-1) -> np.ndarray:
    """v[rows] with `fill` where rows is -1 (and for an empty v)."""
    if len(v) == 0:
        return np.full(len(rows), fill, np.int64)
    return np.where(rows >= 0, v[np.maximum(rows, 0)], fill)


def range_max(a: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(a[lo:hi+1]) for each pair (nested ranges allowed), with one ufunc.reduceat."""
    if len(lo) == 0:
        return np.zeros(0, a.dtype)
    hi = np.minimum(hi, len(a) - 1)
    a2 = np.append(a, a[-1])                   # so hi+1 is always a valid index
    bounds = np.empty(2 * len(lo), np.int64)
    bounds[0::2], bounds[1::2] = lo, hi + 1
    return np.maximum.reduceat(a2, bounds)[0::2]


# ---------------------------------------------------------------------------------------------------- parse
def parse_trace(trace: Trace) -> ParsedRank:
    r = trace.records
    kind = np.ascontiguousarray(r["kind"])        # contiguous copies: fancy indexing strided fields is slow
    size = np.ascontiguousarray(r["size"])
    n = len(kind)
    live, m_idx, f_idx = replay(kind, np.ascontiguousarray(r["ptr"]), size)
    peak_index = int(np.argmax(live)) if n else -1
    peak = int(live[peak_index]) if n else 0
    sc = build_scopes(kind, size, np.ascontiguousarray(r["tag"]), trace.names)
    allocs = _allocations(sc, m_idx, f_idx, size[m_idx].astype(np.int64), n, trace.names)
    pr = ParsedRank(rank=trace.rank, trace=trace, header=trace.header, t_ns=np.asarray(r["t_ns"]), live=live,
                    peak_bytes=peak, peak_index=peak_index, scopes=sc, allocs=allocs)
    pr.op_stats = _op_stats(pr)
    _peak_breakdown(pr)
    marks = np.flatnonzero(kind == MARK)
    pr.marks = [(int(i), int(pr.t_ns[i]), trace.name(int(r["tag"][i]))) for i in marks]
    resets = [i for i, _, nm in pr.marks if nm == "reset_peak"]
    pr.counter_peak_bytes = int(live[resets[-1]:].max()) if resets else peak
    pr.device_readings = _device_readings(r, kind, marks, live, trace)
    pr.malloc_failures = [{"index": int(i), "size": int(size[i]), "device": int(r["device"][i])}
                          for i in np.flatnonzero(kind == MALLOC_FAIL)]
    return pr


def _device_readings(r, kind, marks, live, trace) -> list:
    """DEVICE_MEM records (ptr = free bytes, size = total), each named by the MARK before it (allocator.mark logs
    the reading right after its mark)."""
    dm = np.flatnonzero(kind == DEVICE_MEM)
    before = np.searchsorted(marks, dm, side="right") - 1
    return [{"index": int(i), "mark": trace.name(int(r["tag"][marks[j]])) if j >= 0 else "",
             "device": int(r["device"][i]), "free": int(r["ptr"][i]), "total": int(r["size"][i]),
             "live": int(live[i])} for i, j in zip(dm, before)]


def _allocations(sc: Scopes, m_idx, f_idx, size, n, names) -> dict:
    """Per-allocation scope context and category (rules in the module docstring)."""
    row = current_scope(sc, m_idx)
    k = sc.kind
    phase_row = inherit(sc, np.isin(k, (K_FWD, K_BWD, K_BWDLAYER, K_RECOMPUTE, K_OPTIM, K_COMM)))
    ctx = {
        "op": inherit(sc, np.isin(k, _OP_KINDS)),
        "fwd": inherit(sc, k == K_FWD),
        "iter": inherit(sc, k == K_ITER),
        "phase": phase_row,
        "label": inherit(sc, k == K_OTHER),
    }
    at = {name: at_rows(v, row) for name, v in ctx.items()}
    ph = at["phase"]
    ph_kind = at_rows(k, ph)
    ph_close = at_rows(sc.close, ph, n)
    it = at["iter"]
    it_close = at_rows(sc.close, it, n)
    iters = np.flatnonzero(k == K_ITER)
    first_iter = int(sc.open[iters].min()) if len(iters) else n
    last_iter_end = int(sc.close[iters].max()) if len(iters) else n
    pre = m_idx < first_iter
    lab = at["label"]
    lab_tag = at_rows(sc.tag, lab, 0)
    low = [nm.lower() for nm in names] or [""]
    lab_optim = np.array(["optim" in nm for nm in low])[lab_tag] & (lab >= 0)
    lab_grad = np.array([("ddp" in nm or "grad" in nm) for nm in low])[lab_tag] & (lab >= 0)
    is_model_tag = np.array(["model" in nm for nm in low])
    lab_model = is_model_tag[lab_tag] & (lab >= 0)
    has_model_scope = bool(is_model_tag[sc.tag[sc.kind == K_OTHER]].any()) if len(sc.tag) else False
    outlives_it = (it >= 0) & (f_idx > it_close)
    in_fwd = np.isin(ph_kind, (K_FWD, K_RECOMPUTE))
    in_bwd = np.isin(ph_kind, (K_BWD, K_BWDLAYER))
    conds = [
        ph_kind == K_COMM,
        (ph_kind == K_OPTIM) & (f_idx > ph_close),
        ph_kind == K_OPTIM,
        pre & lab_optim,
        pre & lab_grad,
        in_bwd & outlives_it,
        pre & (f_idx >= last_iter_end) & (first_iter < n) & (lab_model | (not has_model_scope)),
        in_fwd & (f_idx > ph_close) & ~outlives_it,
        (it >= 0) & ~outlives_it,
    ]
    cats = [COMMUNICATION, OPTIMIZER, TEMPORARY, OPTIMIZER, GRADIENT, GRADIENT, PARAMETER, SAVED, TEMPORARY]
    category = np.select(conds, cats, OTHER)
    _split_ddp_param_buffers(sc, m_idx, f_idx, n, lab, pre & lab_grad, is_model_tag, category)
    return {"idx": m_idx, "free": f_idx, "size": size, "scope": row, "category": category,
            **{f"{name}_row": v for name, v in at.items()}}


def _split_ddp_param_buffers(sc, m_idx, f_idx, n, lab, in_ddp, tag_is_model, category) -> None:
    """With the distributed optimizer, megatron's DDP allocates per buffer a contiguous param buffer, then the grad
    buffer, then frees the weights built by the model (copied into the param buffer). So inside a ddp scope,
    an allocation followed by one more allocation and then by frees of setup:model allocations is a parameter
    buffer. Without such frees (no param buffer) every ddp allocation stays a gradient buffer."""
    ddp = np.flatnonzero(in_ddp)
    if len(ddp) < 2:
        return
    lab_tag = at_rows(sc.tag, lab, 0)
    model_frees = np.sort(f_idx[(lab >= 0) & tag_is_model[lab_tag] & (f_idx < n)])
    ddp = ddp[np.argsort(m_idx[ddp])]
    for d_row in np.unique(lab[ddp]):
        rows = ddp[lab[ddp] == d_row]
        close = sc.close[d_row]
        ends = np.append(m_idx[rows][2:], close)     # a pair (i, i+1) must see model frees before alloc i+2
        for i in range(len(rows) - 1):
            lo, hi = m_idx[rows[i + 1]], ends[i]
            n_between = np.searchsorted(model_frees, hi) - np.searchsorted(model_frees, lo)
            n_inside = np.searchsorted(model_frees, m_idx[rows[i + 1]]) - np.searchsorted(model_frees, m_idx[rows[i]])
            if n_between and not n_inside and category[rows[i]] == GRADIENT:
                category[rows[i]] = PARAMETER


def saved_mask(pr: ParsedRank) -> np.ndarray:
    """Allocations counted as saved by their op: allocated inside an op scope (innermost) within a `fwd:` scope,
    still live when that fwd scope closes, and freed by the end of their iteration (buffers that outlive it,
    e.g. megatron's global memory buffer or cached masks, are not saved-for-backward activations)."""
    a, sc = pr.allocs, pr.scopes
    fr = a["fwd_row"]
    fwd_close = at_rows(sc.close, fr, -1)
    it_close = at_rows(sc.close, a["iter_row"], pr.n_events)
    return (a["op_row"] >= 0) & (fr >= 0) & (a["free"] > fwd_close) & ((a["free"] <= it_close) | (a["iter_row"] < 0))


def _op_stats(pr: ParsedRank) -> list[dict]:
    """FORMATS 3 rows: per (op, layer, microbatch, iteration), saved bytes and transient peaks."""
    sc, a, names = pr.scopes, pr.allocs, pr.trace.names
    if len(sc.open) == 0:
        return []
    fwd_row = inherit(sc, sc.kind == K_FWD)
    mb_row = inherit(sc, (sc.kind == K_FWD) | (sc.kind == K_BWD))
    it_row = inherit(sc, sc.kind == K_ITER)
    rec_row = inherit(sc, sc.kind == K_RECOMPUTE)
    # saved: allocations attributed (innermost op scope) to a forward op instance, live when its fwd scope closes
    keep = saved_mask(pr)
    saved = np.bincount(a["op_row"][keep], weights=a["size"][keep], minlength=len(sc.open))
    base = pr.live[sc.open]
    peak = range_max(pr.live, sc.open, sc.close) - base
    info = {t: _classify_name(nm) for t, nm in enumerate(names)}
    num = lambda row: info[int(sc.tag[row])][1] if row >= 0 else None   # noqa: E731
    rows: dict[tuple, dict] = {}
    fwd_ops = np.flatnonzero(np.isin(sc.kind, _OP_KINDS) & (fwd_row >= 0) & (rec_row < 0))
    for i in fwd_ops:
        _, _, op, layer = info[int(sc.tag[i])]
        key = (op, layer, num(mb_row[i]), num(it_row[i]))
        row = rows.setdefault(key, {"op": op, "layer": layer, "microbatch": key[2], "iteration": key[3],
                                    "saved_bytes": 0, "fwd_peak_bytes": 0, "bwd_peak_bytes": None})
        row["saved_bytes"] += int(saved[i])
        row["fwd_peak_bytes"] = max(row["fwd_peak_bytes"], int(peak[i]))
    for i in np.flatnonzero(sc.kind == K_BWDLAYER):
        _, _, op, layer = info[int(sc.tag[i])]
        key = (op, layer, num(mb_row[i]), num(it_row[i]))
        row = rows.setdefault(key, {"op": op, "layer": layer, "microbatch": key[2], "iteration": key[3],
                                    "saved_bytes": 0, "fwd_peak_bytes": None, "bwd_peak_bytes": 0})
        bwd_peak = int(peak[i]) + _bwd_residual(pr, int(mb_row[i]), i)
        row["bwd_peak_bytes"] = max(row["bwd_peak_bytes"] or 0, bwd_peak)
    return list(rows.values())


def _bwd_residual(pr: ParsedRank, bwd_row: int, layer_row: int) -> int:
    """Bytes allocated earlier in the same microbatch's backward and still live when this layer's backward starts.

    These are gradients in flight (the incoming hidden-state gradient, what the loss and output layer's backward
    left). A layer's backward peak counts them, so it is measured above the bytes saved for backward rather than
    above the entry level: that is the baseline the estimator's schedule adds it to."""
    sc, a = pr.scopes, pr.allocs
    if bwd_row < 0:
        return 0
    start, entry = int(sc.open[bwd_row]), int(sc.open[layer_row])
    lo, hi = np.searchsorted(a["idx"], [start, entry])  # allocations are in record order
    live = a["free"][lo:hi] > entry
    return int(a["size"][lo:hi][live].sum())


def op_label(pr: ParsedRank, alloc_rows: np.ndarray) -> list[str]:
    """Human label for allocations: their op, else their innermost scope name, else `(outside scopes)`."""
    a = pr.allocs
    out = []
    for op_row, scope_row in zip(a["op_row"][alloc_rows], a["scope"][alloc_rows]):
        if op_row >= 0:
            op, layer = _classify_name(pr.scope_name(op_row))[2:]
            out.append(op)
        elif scope_row >= 0:
            out.append(pr.scope_name(scope_row))
        else:
            out.append("(outside scopes)")
    return out


def _peak_breakdown(pr: ParsedRank, top: int = 200) -> None:
    a = pr.allocs
    if pr.peak_index < 0:
        return
    live = np.flatnonzero((a["idx"] <= pr.peak_index) & (a["free"] > pr.peak_index))
    by_cat = np.bincount(a["category"][live], weights=a["size"][live], minlength=len(CATEGORIES))
    pr.peak_by_category = {c: int(b) for c, b in zip(CATEGORIES, by_cat)}
    # group by (scope row of the op or innermost scope, category): few groups, then label each group once
    key_row = np.where(a["op_row"][live] >= 0, a["op_row"][live], a["scope"][live])
    labels = np.array(op_label(pr, live), object) if len(live) < 200_000 else None
    if labels is None:
        labels = np.array([pr.scope_name(r) or "(outside scopes)" for r in key_row], object)
    uniq, inv = np.unique(labels.astype(str), return_inverse=True)
    code = inv * len(CATEGORIES) + a["category"][live]
    sums = np.bincount(code, weights=a["size"][live], minlength=len(uniq) * len(CATEGORIES))
    counts = np.bincount(code, minlength=len(uniq) * len(CATEGORIES))
    nz = np.flatnonzero(sums)
    nz = nz[np.argsort(-sums[nz], kind="stable")][:top]
    pr.peak_by_op = [{"op": str(uniq[c // len(CATEGORIES)]), "category": CATEGORIES[c % len(CATEGORIES)],
                      "bytes": int(sums[c]), "count": int(counts[c])} for c in nz]
    row = int(current_scope(pr.scopes, np.array([pr.peak_index]))[0])
    pr.peak_scope_path = pr.scope_path(row)
    pr.peak_phase = describe_phase(pr.peak_scope_path)


def describe_phase(path: list[str]) -> str:
    """Scope path -> `backward of microbatch 3, iteration 1 (bwdlayer:decoder.layers.1)`."""
    it = next((p.split(":")[1] for p in path if p.startswith("iter:")), None)
    phase = "outside iterations (setup)" if it is None else "iteration body"
    for p in path:
        k, num, _, _ = _classify_name(p)
        if k == K_FWD:
            phase = f"forward of microbatch {num}"
        elif k == K_BWD:
            phase = f"backward of microbatch {num}"
        elif k == K_OPTIM:
            phase = "optimizer step"
        elif k == K_COMM:
            phase = p
        elif k == K_RECOMPUTE:
            phase = phase + " (recompute)"
    where = f", iteration {it}" if it is not None else ""
    inner = f" in {path[-1]}" if path else ""
    return f"{phase}{where}{inner}"


def parse_file(path: str) -> ParsedRank:
    return parse_trace(read_trace(path))


def parse_run(path: str) -> list[ParsedRank]:
    """A run directory (rank<R>.trace files) or a single trace -> one ParsedRank per rank, sorted by rank."""
    return [parse_file(p) for p in find_traces(path)]


# ---------------------------------------------------------------------------------------------------- speed
def synthetic_records(n_events: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """A trace-shaped event stream: blocks of push, 3 mallocs, 3 frees (one of the previous block), pop; pointers
    recycled from a pool so pairing must handle reuse. Used by the benchmark and the speed test."""
    nb = max(1, n_events // 8)
    names = ["", "iter:0", "fwd:0"] + [f"mod:decoder.layers.{i}.mlp.linear_fc{j}" for i in range(8) for j in (1, 2)]
    rec = np.zeros((nb, 8), RECORD_DTYPE)
    b = np.arange(nb)
    pool = lambda k: 0x10000 + ((3 * b + k) % 3000) * 4096                     # noqa: E731
    rec["kind"] = [SCOPE_PUSH, MALLOC, MALLOC, MALLOC, FREE, FREE, FREE, SCOPE_POP]
    for j, k in ((1, 0), (2, 1), (3, 2), (4, 0), (6, 1)):
        rec["ptr"][:, j] = pool(k)
    rec["ptr"][:, 5] = np.roll(pool(2), 1)        # free the previous block's third allocation
    rng = np.random.default_rng(seed)
    sz = rng.integers(1, 1 << 20, size=(nb, 3)) * 512
    rec["size"][:, 1:4] = sz
    rec["size"][:, 4], rec["size"][:, 6] = sz[:, 0], sz[:, 1]
    rec["size"][:, 5] = np.roll(sz[:, 2], 1)
    rec["size"][:, 0] = b + 1                      # scope instance id
    rec["tag"][:, 0] = 3 + b % 16
    rec["scope"][:, 1:7] = (b + 1)[:, None]
    rec = rec.reshape(-1)
    rec["t_ns"] = np.arange(len(rec)) * 50
    return rec, names


def bench_parse(n_events: int = 2_000_000) -> float:
    """Events per second of read_trace + parse_trace on a synthetic trace of n_events records written to disk."""
    rec, names = synthetic_records(n_events)
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "rank0")
        write_trace(prefix, rec, names, header={"rank": 0})
        t = time.perf_counter()
        pr = parse_file(prefix + ".trace")
        dt = time.perf_counter() - t
    assert pr.n_events == len(rec)
    return len(rec) / dt
