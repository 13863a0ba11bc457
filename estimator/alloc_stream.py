"""The predicted allocation stream of a pipeline stage: the estimate as individual tensors, in schedule order, for
the caching-allocator model (estimator.caching_allocator) to turn into reserved memory.

What becomes a tensor (megatron-core 0.16.1, checked in its code):
- weights: one tensor per parameter, built with the model; with the distributed optimizer DDP then allocates one
  contiguous param buffer per model chunk and dense|expert group (_ParamAndGradBuffer: torch.zeros(numel)), copies
  each parameter into it and frees the original; the grad buffer is one more contiguous tensor per group;
- optimizer: fp32 master copies per parameter (or per shard with the distributed optimizer) at construction when
  the parameters are 16-bit, each made as `clone().float()` (a 16-bit clone freed once the copy exists); Adam's
  exp_avg / exp_avg_sq (SGD's momentum) per parameter or shard, created by the first step (torch creates
  optimizer state lazily), in the step's parameter order
  (static_memory.optimizer_groups); what the per-parameter split does not cover (fp8 weights, sharded data
  parallelism, a distributed-optimizer shard rounding) is one more tensor;
- the optimizer step's transient: the fp32 copies of 16-bit gradients (one per parameter or shard, freed after
  the step), then torch AdamW's per-parameter temporaries (two of a parameter's size while the previous
  parameter's denominator is alive) on the local spec, one block otherwise;
- activations, per microbatch and model chunk: each segment of the composed walk allocates its saved bytes as
  one tensor per term of its formula (compose.term_tensors; one tensor where a term is negative or the value
  extrapolated; each op of a per-op set likewise, from its selected formula), and its transient above them as
  temporaries no larger than the largest term of the phase's formulas, allocated together and freed at once (on
  the packed CPU runs the per-term split brings the synthesized stream's reserved-above-allocated from about
  twice the real stream's to within 1.5 points of it); a segment that frees bytes
  frees the microbatch's most recent tensors (splitting the last one); the backward replays the segments in
  reverse; full-recompute groups keep their input and re-run their forward in the backward;
- pipeline p2p tensors (schedule.p2p_counts) as hidden-state-sized tensors, the local attention's global buffer
  from the first forward on;
- GPU runtime buffers (estimator.gpu_runtime) from start-up, but torch's two cuBLAS workspaces, which each thread's
  first GEMM makes: the first forward's first linear layer, the first backward's (H100 request streams).
Sharded data parallelism's buffers are one tensor each; offloaded activations are not taken off the stream (its
allocated peak is then above the estimate's). Three iterations are replayed (the first creates the optimizer state
after its activations, the second runs with it, the third repeats the second tensor for tensor: on H100 runs the
allocator still reserved new segments in it). Microbatches past the first few repeat the steady 1F1B pattern,
so a stage replays at most MAX_GROUPS microbatch groups (a group: pp microbatches) plus the last partial one: the
allocated peak is unchanged by that and the reserved one moved by under 2% of its excess over allocated on 70B
layouts (against 8 groups), at a quarter of the cost. Fragmentation is
the product: the stream's tensor sizes and order are a decomposition of the formulas, so the modelled reserved
figure is as good as that decomposition (benchmarks/reserved_model.py compares it with the real streams of the
packed CPU traces); on 12 H100 runs the allocator model replaying their real streams is exact
(benchmarks/gpu_validation.py), so the error of the predicted reserved figure there (docs/ACCURACY.md) is this
stream's.
"""
from __future__ import annotations

from typing import Optional

from . import activations as A
from . import schedule as S
from .compose import ckpt_keeps, grad_due
from .static_memory import DTYPE_BYTES, chunk_buffer, dp_layout, optimizer_groups, precision

MAX_GROUPS = 1       # microbatch groups replayed before the last partial one (the steady state repeats after)
ITERATIONS = 3   # the third settles the allocator's segments (H100: reserved still grew in it)


class Stream:
    """Events ("a", id, bytes) / ("f", id), the input of caching_allocator.replay. labelled: also keep what each
    tensor is (`tags`: id -> the `tag` set when it was allocated: a category or a segment's label), for a memory
    snapshot (estimator.snapshot)."""
    __slots__ = ("events", "_n", "tag", "tags", "marks", "at_gemm")

    def __init__(self, labelled: bool = False):
        self.events: list = []
        self._n = 0
        self.at_gemm: list = []     # bytes to allocate before the next GEMM's program (a thread's cuBLAS workspace)
        self.tag = "other"
        self.tags: Optional[dict] = {} if labelled else None
        self.marks: Optional[list] = [] if labelled else None   # (event index, phase) where a phase starts

    def mark(self, phase: str) -> None:
        if self.marks is not None:
            self.marks.append((len(self.events), phase))

    def alloc(self, nbytes) -> Optional[int]:
        n = int(-(-nbytes // 1)) if nbytes > 0 else 0
        if n <= 0:
            return None
        self._n += 1
        self.events.append(("a", self._n, n))
        if self.tags is not None:
            self.tags[self._n] = self.tag
        return self._n

    def free(self, i: Optional[int]) -> None:
        if i is not None:
            self.events.append(("f", i))

    def spike(self, nbytes) -> None:
        """A transient: allocated and freed at once."""
        self.free(self.alloc(nbytes))

    def repeat(self, start: int, carried: dict, live: list) -> list:
        """Append a copy of the events from `start` on, each tensor with a fresh id (and its tag and the phase
        marks); a free of a tensor from before `start` frees the one `carried` maps it to. Returns `live` (ids
        alive at the copied part's end) as the copy's ids."""
        end, fresh = len(self.events), {}
        for e in self.events[start:end]:
            if e[0] == "a":
                self._n += 1
                fresh[e[1]] = self._n
                self.events.append(("a", self._n, e[2]))
                if self.tags is not None:
                    self.tags[self._n] = self.tags[e[1]]
            else:
                self.events.append(("f", fresh.get(e[1]) or carried[e[1]]))
        if self.marks is not None:
            self.marks += [(k - start + end, phase) for k, phase in self.marks if start <= k < end]
        return [fresh.get(i) or carried.get(i, i) for i in live]

    def before(self, label: str) -> None:
        """Called before a segment's program plays: what waits for a GEMM is allocated before a linear layer's."""
        if self.at_gemm and _is_gemm(label):
            self.gemm_buffers()

    def gemm_buffers(self) -> None:
        """Allocate what waits for the next GEMM (at_gemm), now."""
        tag, self.tag = self.tag, "gpu runtime"
        for nbytes in self.at_gemm:
            self.alloc(nbytes)
        self.at_gemm, self.tag = [], tag


def _is_gemm(label: str) -> bool:
    """A segment label of a module whose forward and backward are GEMMs (megatron's linear layers, the router)."""
    last = label.rsplit(".", 1)[-1]
    return "@" not in last and (last.startswith("linear") or last in ("output_layer", "router"))


class _Stack:
    """One microbatch's live activation tensors on one chunk (id -> bytes, most recent last); a recompute's stack
    has the stack it runs on as `parent` (its backward frees the checkpoint's inputs, which live there)."""
    __slots__ = ("st", "items", "by_size", "parent")

    def __init__(self, st: Stream, parent: Optional["_Stack"] = None):
        self.st, self.items, self.parent = st, {}, parent
        self.by_size: dict = {}     # bytes -> ids pushed with that size (stale ids skipped on lookup)

    def move(self, delta: float, peak: float, parts: Optional[list] = None, cap: float = 0.0) -> None:
        """A segment: the level reaches +peak and ends at +delta (bytes relative to where it starts). parts: the
        tensors a positive delta is made of (used when they are all positive and add up to it); cap: the largest
        tensor the transient is made of (a transient is the op's temporaries, not one block; 0: one block)."""
        if delta >= 0:
            if parts and min(parts) > 0 and abs(sum(parts) - delta) <= 1e-6 * delta:
                for p in parts:
                    self.push(p)
            else:
                self.push(delta)
            if peak > delta:
                self.spike(peak - delta, cap)
        else:
            if peak > 0:
                self.spike(peak, cap)
            self.pop(-delta)

    def play(self, events: list) -> None:
        """A segment's allocation program at the config's sizes ([(op, bytes, ref)], estimator.programs): its own
        tensors in their own order. A free of this segment's allocation frees that tensor; a free of one made
        elsewhere frees the most recent live tensor of its size (else bytes from the most recent tensors)."""
        # Stream.alloc / free and _add inlined: a large layout's stream is 10^5 - 10^6 of these events per stage.
        st = self.st
        append, tags, tag = st.events.append, st.tags, st.tag
        items, by_size = self.items, self.by_size
        local: list = []
        workers: dict = {}
        for op, size, ref in events:
            if op == "+":
                if size > 0:
                    st._n = i = st._n + 1
                    append(("a", i, int(-(-size // 1))))
                    if tags is not None:
                        tags[i] = tag
                    items[i] = size
                    same = by_size.get(size)
                    if same is None:
                        by_size[size] = [i]
                    else:
                        same.append(i)
                    local.append(i)
                else:
                    local.append(None)
            elif op == "+~":
                workers[ref] = st.alloc(size)
            elif op == "-~":
                i = workers.pop(ref, None)
                if i is not None:
                    append(("f", i))
            elif ref[0] == "#":
                i = local[int(ref[1:])]
                if i is not None and items.pop(i, None) is not None:
                    append(("f", i))
                elif i is not None:     # a free of another segment's tensor of its size took it: free that one
                    self.release(size)
            elif size > 0:
                self.release(size)

    def release(self, nbytes: float) -> None:
        """Free a tensor of `nbytes` made elsewhere: the most recent live one of that size here or in a parent
        stack; else `nbytes` from the most recent tensors here, then the parent's."""
        stack = self
        while stack is not None:
            if stack._free_sized(nbytes):
                return
            stack = stack.parent
        stack = self
        while nbytes > 0 and stack is not None:
            nbytes = stack.pop(nbytes)
            stack = stack.parent

    def _add(self, i: int, nbytes: float) -> None:
        self.items[i] = nbytes
        self.by_size.setdefault(nbytes, []).append(i)

    def _free_sized(self, nbytes: float) -> bool:
        ids = self.by_size.get(nbytes)
        while ids:
            i = ids.pop()
            if self.items.pop(i, None) is not None:
                self.st.free(i)
                return True
        return False

    def spike(self, nbytes: float, cap: float) -> None:
        st = self.st
        n = int(-(-nbytes // cap)) if cap > 0 else 1
        ids = [st.alloc(nbytes / n) for _ in range(n)]
        for i in ids:
            st.free(i)

    def push(self, nbytes: float) -> None:
        i = self.st.alloc(nbytes)
        if i is not None:
            self._add(i, nbytes)

    def pop(self, nbytes: float) -> float:
        """Free `nbytes` from the most recent tensors; the last one freed is replaced by what it keeps. Returns what
        is left to free (the stack ran out)."""
        while nbytes > 0 and self.items:
            i, n = self.items.popitem()
            self.st.free(i)
            if n > nbytes:
                self.push(n - nbytes)
            nbytes -= n
        return max(nbytes, 0.0)

    def clear(self) -> None:
        while self.items:
            self.st.free(self.items.popitem()[0])


# ---- chunk programs: ("seg", fd, fp, bd, bp[, (fparts, fcap, bparts, bcap)]) | ("ckpt", [items], kept, freed[,
# grad, after[, retains, received]]) (a checkpoint keeps `kept` bytes across the forward and frees `freed` at the end of its backward; a
# composed one holds `grad` bytes, its output's gradient, once `after` of its backward segments ran: compose.py)
def chunk_program(cache, moe_flags, first: bool, last: bool, recv_input: bool) -> list:
    """A chunk's forward as segments (forward delta / peak, backward delta / peak above the level)."""
    h = cache.hidden
    prog: list = [("seg", h, h, -h, 0.0)] if recv_input else []
    if isinstance(cache, A.LayerCache):
        units, kinds, _ = A.chunk_units(cache, moe_flags, first, last, recv_input)
        layer_sws = iter(_layer_switches(cache, moe_flags))
        for u, k in zip(units, kinds):
            if k[0] == "recv":
                continue
            sws = [None] * len(u[4]) if k[0] == "model" else next(layer_sws)
            rows = [_row_seg(cache, row, sw) for row, sw in zip(u[4], sws)]
            if k[0] == "model":
                prog += rows
                continue
            held = k[1]
            body = [("ckpt", rows, h, h)] if k[0] == "ckpt" else rows
            # The backward holds `held` bytes from before the unit while its ops run (LayerCache.held_bwd).
            prog += [("seg", 0.0, 0.0, -held, 0.0)] + body + [("seg", 0.0, 0.0, held, 0.0)]
            if len(k) == 3:
                prog.append(("seg", -h, 0.0, k[2], 0.0))
        return prog
    prog += _composed(cache.sequence(moe_flags, first, last), h, cache)
    if not last:
        # The stage output is sent and pseudo-freed; its gradient arrives in its place (activations._composed_chunk).
        prog.append(("seg", -h, 0.0, h, 0.0))
    return prog


def _layer_switches(cache, moe_flags) -> list:
    """Per layer unit of a chunk (activations.chunk_units), each row's (moe, recompute) switches, as
    activations._group_unit picks the rows: one layer's under the layer's recompute, a checkpoint group's layers'
    under none."""
    sel = "selective" if cache.sw["recompute"] == "selective" else "none"
    out = []
    for lo, hi, ckpt in A.recomputed_groups(cache.cfg, len(moe_flags)):
        rec = ("none" if ckpt else sel) if hi - lo == 1 else "none"
        sws: list = []
        for m in moe_flags[lo:hi]:
            sws += [(bool(m), rec)] * len(cache.layer_rows(bool(m), rec))
        out.append(sws)
    return out


def _row_seg(cache, row, sw) -> tuple:
    """A per-op row (op, saved, fwd peak, bwd peak) as a segment, its saved bytes as its formula's terms."""
    op, s, f, b = row
    key = ("stream parts", op, sw)
    parts = cache.units.get(key, False)
    if parts is False:
        parts = cache.units[key] = _formula_parts(cache, op, sw)
    return ("seg", s, f, -s, b, parts) if parts else ("seg", s, f, -s, b)


def _formula_parts(cache, op: str, sw) -> Optional[tuple]:
    """(saved tensors, forward cap, None, backward cap) from the op's selected formula's terms (compose.term_tensors);
    None where the set has no formula for it (rows the estimator adds itself: fp8, router)."""
    from . import formulas as F
    from .compose import term_tensors
    switches = cache.sw if sw is None else dict(cache.sw, moe=sw[0], recompute=sw[1])
    fo = F.select(cache.fset, op, switches)
    if fo is None:
        return None
    try:
        saved = term_tensors(fo.saved, cache.env)
        fcap = max(term_tensors(fo.fwd_peak, cache.env) + saved, default=0.0)
        bcap = max(term_tensors(fo.bwd_peak, cache.env) + saved, default=0.0)
    except (KeyError, ZeroDivisionError):
        return None
    return (saved, fcap, None, bcap)


def _composed(items: list, h: float, cache) -> list:
    out = []
    for it in items:
        if it[0] == "run" and len(it) > 2:     # a layer holding its output's gradient (compose._decoder)
            out.append(("run", _composed(it[1], h, cache), it[2], it[3]))
        elif it[0] == "run":
            out += _composed(it[1], h, cache)
        elif it[0] == "ckpt":
            out.append(("ckpt", _composed(it[1], h, cache), *it[2:]))
        else:
            fd, fp, bd, bp = it[1][:4]
            events = cache.events(it[1])
            if events is not None:      # a program set: the segment's own tensors, in order
                out.append(("prog", fd, fp, bd, bp, events, it[0]))
                continue
            parts = cache.parts(it[1])
            if any(parts):
                # Temporaries are cut into tensors no larger than the phase's largest term, else the segment's.
                top = max((max(p) for p in parts if p), default=0.0)
                fcap = max(max(parts[1] or [0.0]), max(parts[0] or [0.0])) or top
                bcap = max(max(parts[3] or [0.0]), max(parts[2] or [0.0])) or top
                out.append(("seg", fd, fp, bd, bp, (parts[0], fcap, parts[2], bcap)))
            else:
                out.append(("seg", fd, fp, bd, bp))
    return out


def _forward(prog: list, stack: _Stack) -> None:
    for it in prog:
        if it[0] == "prog":
            stack.st.before(it[6])
            stack.st.tag = it[6]
            stack.play(it[5][0])
        elif it[0] == "seg":
            stack.st.tag = "activations"
            if len(it) > 5:
                stack.move(it[1], it[2], it[5][0], it[5][1])
            else:
                stack.move(it[1], it[2])
        elif it[0] == "run":
            _forward(it[1], stack)
        else:   # a checkpointed group: runs, keeps only its input
            inner = _Stack(stack.st)
            _forward(it[1], inner)
            inner.clear()
            stack.push(it[2])


def _backward(prog: list, stack: _Stack, hold: Optional[list] = None) -> None:
    """hold: [bytes, n] a checkpoint's output gradient, allocated once n of its group's backward segments ran
    (compose._replay_backward); the block's id is appended."""
    above_retains = False   # as compose._replay_backward: an MoE checkpoint keeps its input and its gradient
    for it in reversed(prog):
        if it[0] != "ckpt":
            above_retains = False
        if it[0] in ("prog", "seg"):
            if it[0] == "prog":
                stack.st.before(it[6])
                stack.st.tag = it[6] + " (backward)"
                stack.play(it[5][1])
            elif len(it) > 5:
                stack.move(it[3], it[4], it[5][2], it[5][3])
            else:
                stack.move(it[3], it[4])
            due = grad_due(hold)
            if due:
                hold.append(stack.st.alloc(due))
        elif it[0] == "run":    # its held gradient stays allocated to the chunk's end
            held = [it[2], it[3]]
            _backward(it[1], stack, held)
            if len(held) > 2 and held[2] is not None:
                stack._add(held[2], it[2])      # freed with the chunk's other tensors
        else:   # recompute the group's forward, run its backward, then its input goes
            inner = _Stack(stack.st, stack)
            _forward(it[1], inner)
            grad = [it[4], it[5]] if len(it) > 4 else None    # composed: held as compose._replay_backward holds it
            _backward(it[1], inner, grad)
            inner.clear()
            retains, received = ckpt_keeps(it)
            if grad and len(grad) > 2:
                if above_retains or received:
                    stack._add(grad[2], it[4])   # freed with the chunk's other tensors at its end
                else:
                    stack.st.free(grad[2])
            if not retains:
                stack.pop(it[3])
            above_retains = retains


# ---- static memory ---------------------------------------------------------------------------------------------
def _g(cfg, name, default=None):
    v = cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)
    return default if v is None else v


def _init_static(cfg, st: Stream, chunks, pp_rank: int, static) -> int:
    """Weights, DDP buffers and optimizer master copies as built at start-up; returns the bytes allocated."""
    from . import sharding
    if sharding.active(cfg):   # sharded data parallelism: its own buffers (estimator.sharding), one block each
        st.tag = "parameters"
        st.alloc(static.weights_bytes)
        st.tag = "gradients"
        st.alloc(static.grad_buffer_bytes)
        st.tag = "parameters"   # the gathered weights' buckets: one block, live throughout (in the estimate's level)
        st.alloc(sharding.compute_bytes(cfg, chunks)[0])
        return static.weights_bytes + static.grad_buffer_bytes
    pd, gd = precision(cfg)
    pb, gb = DTYPE_BYTES[pd], DTYPE_BYTES[gd]
    dist_opt, dp_dense, dp_expert, bucket = dp_layout(cfg)
    total = 0
    weights = []
    st.tag = "parameters"
    for chunk in chunks:
        ids = [(st.alloc(p[0] * pb), bool(p[1])) for p in chunk]
        weights.append(ids)
        total += sum(p[0] for p in chunk) * pb
    for ci, chunk in enumerate(chunks):
        bsize = bucket if (pp_rank == 0 and ci == 0) else None
        for is_exp, dp in ((False, dp_dense), (True, dp_expert)):
            numels, lay = chunk_buffer(chunk, is_exp, dp, dist_opt, bsize)
            if not numels:
                continue
            if dist_opt:   # the param buffer, then the parameters move into it
                st.tag = "parameters"
                st.alloc(lay.numel * pb)
                total += lay.numel * pb - sum(numels) * pb
            st.tag = "gradients"
            st.alloc(lay.numel * gb)
            total += lay.numel * gb
            if dist_opt:
                for i, e in weights[ci]:
                    if e == is_exp:
                        st.free(i)
    if pd != "fp32":   # fp32 master copies, made by the optimizer's constructor (those on the GPU: offload)
        st.tag = "optimizer states"
        budget = static.optimizer_bytes
        for n in _step_order(cfg, chunks, pp_rank):
            if 4 * n <= budget:
                # megatron-core builds each as `param.clone().float()` (shard.clone().float() with the distributed
                # optimizer): a 16-bit clone, freed once the fp32 copy exists; its hole is where later tensors go
                clone = st.alloc(n * pb)
                st.alloc(4 * n)
                st.free(clone)
                total += 4 * n
                budget -= 4 * n
    return total


def _step_order(cfg, chunks, pp_rank) -> list:
    """Elements per parameter (or shard) in the optimizer's step order, on the DP rank holding the most."""
    cands = optimizer_groups(chunks, *dp_layout(cfg), pp_rank)
    best = max(cands, key=lambda g: sum(map(sum, g.values())), default={})
    return [n for v in best.values() for n in v]


def _first_step_state(cfg, st: Stream, chunks, pp_rank: int, remaining: int) -> None:
    """Optimizer state created by the first step, and what the per-parameter split does not cover."""
    opt = _g(cfg, "optimizer", "adam")
    per = 2 if opt == "adam" else (1 if _g(cfg, "sgd_momentum", 0.9) else 0)
    st.tag = "optimizer states"
    for n in _step_order(cfg, chunks, pp_rank):
        for _ in range(per):
            if remaining >= 4 * n:
                st.alloc(4 * n)
                remaining -= 4 * n
    if remaining > 0:
        st.alloc(remaining)


def _step_transient(cfg, st: Stream, chunks, pp_rank: int, static) -> None:
    """The optimizer step's temporaries as static_memory.adam_step says the step runs: torch AdamW's per parameter
    (single-tensor) or per parameter group (foreach), else one block; first the fp32 copies of 16-bit gradients
    (one per parameter or shard, in step order), freed after it (by the next zero_grad)."""
    st.tag = "optimizer step"
    copy_bytes = static.optimizer_detail.get("fp32_grad_copy_bytes", 0)
    copies, budget = [], copy_bytes
    if budget:
        for n in _step_order(cfg, chunks, pp_rank):
            if 4 * n <= budget:
                copies.append(st.alloc(4 * n))
                budget -= 4 * n
        copies.append(st.alloc(budget))     # what the per-parameter split does not cover
    _update_temporaries(cfg, st, chunks, pp_rank, static, static.optimizer_step_transient_bytes - copy_bytes)
    for i in copies:
        st.free(i)


def _update_temporaries(cfg, st: Stream, chunks, pp_rank: int, static, fused_bytes: float) -> None:
    if static.optimizer_step not in ("single", "foreach"):
        st.spike(fused_bytes)
        return
    groups = optimizer_groups(chunks, *dp_layout(cfg), pp_rank)
    if static.optimizer_step == "foreach":   # torch._foreach_sqrt over a whole group, freed when the group is done
        best = max(groups, key=lambda g: max((sum(v) for v in g.values()), default=0), default={})
        for v in best.values():
            held = [st.alloc(4 * n) for n in v]
            for i in held:
                st.free(i)
        return
    best = max(groups, key=lambda g: max((max(v, default=0) for v in g.values()), default=0), default={})
    for v in best.values():   # torch AdamW: denom = sqrt(v) / c then + eps, per parameter, group by group
        prev = None
        for n in v:
            a = st.alloc(4 * n)
            b = st.alloc(4 * n)
            st.free(a)
            st.free(prev)
            prev = b
        st.free(prev)


# ---- a stage ---------------------------------------------------------------------------------------------------
def replayed_microbatches(M: int, group: int) -> int:
    """Microbatches replayed: all up to MAX_GROUPS + 1 groups, else MAX_GROUPS groups and the last partial one."""
    if M <= (MAX_GROUPS + 1) * group:
        return M
    return MAX_GROUPS * group + (M % group or group)


def stage_stream(cfg, cache, stage_chunks, pp_rank: int, static, base_extra: float = 0.0,
                 iterations: int = ITERATIONS, attn_buffer: float = 0.0, runtime: tuple = (),
                 labelled: bool = False, repeat: bool = True) -> Stream:
    """The allocation stream of one pipeline stage (module docstring). static: the stage's StaticMemory;
    base_extra: other persistent bytes from start-up (userbuffers); attn_buffer: allocated by the first forward;
    runtime: the GPU runtime buffers (runtime_tensors: bytes and the phase that allocates each); labelled: the stream
    keeps what each tensor is (Stream.tags); repeat: iterations after the second are copies of it (False: each
    generated anew, the same events)."""
    pp = cfg.pipeline_model_parallel_size
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    vp_arg = vpp if vpp > 1 else None
    group = getattr(cfg, "microbatch_group_size_per_vp_stage", None) or pp
    # 1F1B keeps up to pp microbatches in flight, the interleaved schedule works in groups: a group of pp.
    M = replayed_microbatches(cfg.num_microbatches, group if pp > 1 else 1)
    st = Stream(labelled)
    st.mark("start-up")
    made = _init_static(cfg, st, stage_chunks, pp_rank, static)
    st.tag = "other"
    st.alloc(base_extra)
    st.tag = "gpu runtime"
    pending = {}    # phase kind -> runtime tensors its first step allocates
    for nbytes, when in runtime:
        if when == "start-up":
            st.alloc(nbytes)
        else:
            pending.setdefault(when, []).append(nbytes)
    progs = []
    for c in stage_chunks:
        _, kinds, first, last = c.key
        progs.append(chunk_program(cache, tuple(map(bool, kinds)), first, last, recv_input=not first))
    steps = S.order(pp, pp_rank, M, vp_arg, group)
    recv, sends = S.p2p_flags(pp, pp_rank, vp_arg)
    p2p = cache.hidden if pp > 1 else 0.0
    counts, end = S.p2p_counts([(k, c) for k, _, c in steps], recv, sends, vp_arg is not None,
                               S.warmup_count(pp, pp_rank, M, vp_arg, group)) if p2p else \
        ([0] * len(steps), 0)
    held: list = []   # live p2p tensors

    def p2p_to(n: int) -> None:
        st.tag = "pipeline p2p"
        while len(held) < n:
            held.append(st.alloc(p2p))
        while len(held) > n:
            st.free(held.pop())

    start, held_before = 0, []     # the last iteration: where its events start, the p2p tensors live before it
    for it in range(iterations):
        if it >= 2 and repeat:
            # From the second on, an iteration repeats the one before it tensor for tensor (the first creates the
            # optimizer state): its events are copied with fresh ids, the p2p tensors carried into it standing for
            # those the one before received.
            copy_start, held_after = len(st.events), list(held)
            held[:] = st.repeat(start, dict(zip(held_before, held_after)), held)
            start, held_before = copy_start, held_after
            continue
        start, held_before = len(st.events), list(held)
        stacks: dict = {}
        for i, (kind, mb, c) in enumerate(steps):
            st.mark(kind)
            p2p_to(counts[i])
            if it == 0 and i == 0:
                st.tag = "attention buffer"
                st.alloc(attn_buffer)
            if pending.get(kind):
                # at the phase's first GEMM where the chunk's ops are programs (labelled), else at its start
                st.at_gemm = pending.pop(kind)
                if not any(item[0] == "prog" for item in progs[c]):
                    st.gemm_buffers()
            if kind == "F":
                stack = stacks[(mb, c)] = _Stack(st)
                _forward(progs[c], stack)
            else:
                stack = stacks.pop((mb, c))
                _backward(progs[c], stack)
                stack.clear()
        p2p_to(end)
        st.mark("optimizer")
        if it == 0:
            _first_step_state(cfg, st, stage_chunks, pp_rank, static.total_bytes - made)
        _step_transient(cfg, st, stage_chunks, pp_rank, static)
    return st


def _context(cfg, formula_set) -> tuple:
    from . import formulas as F
    from . import memory
    fset = formula_set if isinstance(formula_set, F.FormulaSet) else F.load(formula_set or F.DEFAULT_SET)
    return A.cache_for(fset, cfg), memory.all_param_chunks(cfg)


def _stage_events(cfg, ctx, rank, iterations: int, labelled: bool = False, repeat: bool = True):
    """The stage's stream events; labelled: the Stream itself (its tags kept)."""
    from . import tp_overlap
    from .static_memory import attention_buffer_bytes
    cache, chunks_by_stage = ctx
    chunks = chunks_by_stage[rank.pp_rank]
    has_layers = any(c.key[1] for c in chunks)
    from . import persistent_state
    st = stage_stream(cfg, cache, chunks, rank.pp_rank, rank.static,
                      tp_overlap.buffer_bytes(cfg) + persistent_state.stage_bytes(cfg, chunks), iterations,
                      attention_buffer_bytes(cfg, cache.fset.te_scores_in_buffer) if has_layers else 0.0,
                      runtime_tensors(rank), labelled, repeat)
    return st if labelled else st.events


def runtime_tensors(rank) -> list:
    """The stage's GPU runtime buffers (estimator.gpu_runtime) as tensors: (bytes, when), each item's `count`
    buffers of equal size, `when` the phase kind whose first step allocates it ("F", "B") or "start-up". torch's
    cuBLAS workspaces are made by each thread's first GEMM: the training loop's in the first forward, autograd's
    in the first backward (measured on H100: the allocator's request stream). The 512-byte block rounding is not
    a tensor: the replay rounds every block."""
    from .gpu_runtime import TORCH_THREADS, TORCH_WORKSPACES
    out = []
    for it in getattr(rank, "gpu_runtime", None) or []:
        if it.count <= 0:
            continue
        whens = ("F", "B") if it.name == TORCH_WORKSPACES and it.count == TORCH_THREADS else ("start-up",) * it.count
        out += [(it.bytes / it.count, w) for w in whens]
    return out


def stage_stream_events(cfg, formula_set, est, pp_rank: int, iterations: int = ITERATIONS) -> list:
    """The predicted stream of one stage of estimate `est` (same cfg and set), as caching_allocator.replay takes."""
    rank = next(r for r in est.ranks if r.pp_rank == pp_rank)
    return _stage_events(cfg, _context(cfg, formula_set), rank, iterations)


def modelled_reserved(cfg, formula_set, est, conf=None, iterations: int = ITERATIONS) -> list:
    """Per pipeline stage of estimate `est` (same cfg and set): the stage's predicted stream replayed through the
    caching-allocator model. One dict per stage: pp_rank, reserved_bytes (peak), allocated_peak_bytes (of the
    stream: the estimate's peak up to the decomposition and 512 B rounding), segments (peak), events."""
    from .caching_allocator import replay
    ctx = _context(cfg, formula_set)
    out = []
    for rank in est.ranks:
        events = _stage_events(cfg, ctx, rank, iterations)
        r = replay(events, conf)
        out.append({"pp_rank": rank.pp_rank, "reserved_bytes": r["peak_reserved_bytes"],
                    "allocated_peak_bytes": r["peak_allocated_bytes"], "segments": r["peak_segments"],
                    "events": len(events)})
    return out
