"""A traced run -> its allocation programs: per segment label and phase, the ordered allocations and frees.

tracer.segments cuts every microbatch's forward and backward into segments, each one op's own code (FORMATS 3.1).
Here each segment instance becomes the list of its memory events in record order: an allocation (`+`, its size)
or a free (`-`, the size it releases and which allocation that was). Pointers pair every free with its allocation
(tracer.parse.replay), wherever it was made:

  `#j`                    the j-th allocation of this same segment
  `fwd:<label>#j`         the j-th allocation of segment <label> of the forward of the same microbatch
  `fwd:<label>[-1]#j`     ... of the layer before (a layer offset where both segments belong to layers)
  `outside`               an allocation made outside every segment (setup, the optimizer step, a pipeline receive)

A free repeated once per sibling instance (a SequentialMLP's experts: its backward frees each expert's slice of
the tokens, one per local expert, E/EP of them) is one event with a count: consecutive frees of one size that name
the same allocation elsewhere (the label's `*` stands for every expert) collapse into `count` frees, so runs of
different expert counts share one structure and the count is fitted like a size (fit.py).

Another thread's allocation and free (gloo's worker in a CPU run) land at a moment that varies against the
compute thread's events, run to run and layer to layer. Such a *worker pair* is kept apart from the compute
events as (size, after, until): allocated after the first `after` compute events and freed after `until` of them.
A segment's worker pairs keep the order the worker allocated them, so the k-th pair of one run is the k-th of
another. Programs of one structure take the widest window any of their instances had (the earliest `after`, the
latest `until`), so the worker's buffer is counted over every moment it was seen live: a bound that errs high, named in
the set (`+~` / `-~` events).

A label repeats over layers, microbatches, iterations and ranks; identical layers allocate identically, so one
*representative* instance speaks for the run: the most common event list (kinds and sizes) among the instances of
iterations >= 1 (iteration 0 is warm-up) and of layers >= 1 (layer 0 also frees what only the first layer holds:
the embedding's output, the attention mask), ties to the later instance. How many instances agreed is kept.
Replaying a program's sizes from its entry level gives the segment's delta and peak, which is all a composed
estimate needs of it; the references say what is freed, for reading and for the reserved-memory stream.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

ALLOC, FREE = "+", "-"
OUTSIDE = "outside"


@dataclass(frozen=True)
class Event:
    op: str        # ALLOC | FREE | WORKER_ALLOC | WORKER_FREE
    size: int      # bytes allocated, or released by the free
    ref: str = ""  # a free: the allocation it releases (module docstring); an allocation: ""
    count: int = 1  # a free of another segment's allocation repeated once per sibling instance (docstring)


WORKER_ALLOC, WORKER_FREE = "+~", "-~"


@dataclass
class Program:
    """One label's representative program in one phase of one run: the compute thread's events and the worker
    pairs (size, after, until) placed among them."""
    phase: str
    label: str
    compute: tuple                # of Event
    workers: tuple                # of (size, after, until)
    instances: int                # instances of the label in the run (iterations >= 1)
    agreeing: int                 # of which had these compute events and worker sizes

    @property
    def shape(self) -> tuple:
        """The event structure: kinds and references of the compute events, and how many worker pairs (what must
        agree for sizes to be aligned: the same tensors; the workers' windows are widened to agree)."""
        return tuple(e.op + e.ref for e in self.compute) + (len(self.workers),)

    def events(self, windows: list | None = None) -> list:
        """The compute events with each worker pair's allocation and free placed by its window (its own, or the
        given ones: the widest of its structure group)."""
        return placed(self.compute, self.workers, windows)

    def delta_peak(self) -> tuple[int, int]:
        return replay_sizes(signed(self.events()))


def placed(compute: tuple, workers: tuple, windows: list | None = None) -> list:
    windows = windows or [(a, u) for _, a, u in workers]
    before: dict = {}
    for k, ((size, _, _), (after, until)) in enumerate(zip(workers, windows)):
        before.setdefault(after, []).append((0, k, Event(WORKER_ALLOC, size, f"~{k}")))
        before.setdefault(until, []).append((1, k, Event(WORKER_FREE, size, f"~{k}")))
    out = []
    for i in range(len(compute) + 1):
        out += [e for _, _, e in sorted(before.get(i, []), key=lambda x: (x[0], x[1]))]
        if i < len(compute):
            out.append(compute[i])
    return out


def signed(events) -> list:
    return [e.size if e.op in (ALLOC, WORKER_ALLOC) else -e.size * e.count for e in events]


def repeated(ref: str) -> bool:
    """A free's reference that may repeat once per sibling instance: another segment's allocation."""
    return ":" in ref


def collapsed(compute: list, workers: list) -> tuple:
    """(compute events with each run of identical frees of another segment's allocation as one counted event,
    worker windows moved to the new positions: a window that starts or ends inside a run widens to the run)."""
    out: list = []
    pos: list = []      # original index -> index in out
    for e in compute:
        last = out[-1] if out else None
        if e.op == FREE and repeated(e.ref) and last is not None and last.op == FREE and last.ref == e.ref \
                and last.size == e.size:
            out[-1] = Event(FREE, e.size, e.ref, last.count + 1)
        else:
            out.append(e)
        pos.append(len(out) - 1)
    n = len(compute)
    moved = [[size, pos[after] if after < n else len(out), pos[until - 1] + 1 if until > 0 else 0]
             for size, after, until in workers]
    return tuple(out), moved


def replay_sizes(signed: list) -> tuple:
    """(delta, peak) of signed sizes replayed from level 0: the level at the end and the highest level reached
    (0 if it never rises above the entry)."""
    level = peak = 0
    for x in signed:
        level += x
        if level > peak:
            peak = level
    return level, peak


@dataclass
class RunPrograms:
    path: str
    programs: dict = field(default_factory=dict)     # (phase, label) -> Program
    firsts: dict = field(default_factory=dict)       # (phase, label) -> Program at the model's first layer
    # (phase, label, "first" | "last") -> Program of the first / last of a label's instances repeated within one call
    # of their op (a SequentialMLP's local experts: the last frees in forward, the first in backward, what they share)
    positions: dict = field(default_factory=dict)


def rank_instances(pr, segs) -> list:
    """[(Segment, [Event])] for every segment of one parsed rank."""
    from tracer.trace_reader import FREE as K_FREE, MALLOC as K_MALLOC
    kind = np.asarray(pr.trace.records["kind"])
    tid = np.asarray(pr.trace.records["tid"])
    a = pr.allocs
    m_idx, f_idx, size = a["idx"], a["free"], a["size"]
    n = pr.n_events
    alloc_of = np.full(n + 1, -1, np.int64)          # record index -> allocation number
    alloc_of[m_idx] = np.arange(len(m_idx))
    freed = np.full(n + 1, -1, np.int64)             # record index of a matched FREE -> allocation number
    ok = f_idx < n
    freed[f_idx[ok]] = np.flatnonzero(ok)
    seg_of = np.full(n, -1, np.int64)                # record -> segment (segments partition (start, end])
    for si, s in enumerate(segs):
        seg_of[s.start + 1:s.end + 1] = si
    local_index = np.full(len(m_idx), -1, np.int64)  # allocation -> its index within its segment
    is_mem = (kind == K_MALLOC) | ((kind == K_FREE) & (freed[:n] >= 0))
    compute_tid = {}
    for phase in ("fwd", "bwd"):   # the thread that runs a phase (autograd's device thread on a GPU backward)
        rows = [np.arange(s.start + 1, s.end + 1) for s in segs if s.phase == phase]
        rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        rows = rows[is_mem[rows]]
        compute_tid[phase] = int(np.bincount(tid[rows]).argmax()) if len(rows) else 0
    out = []
    for si, s in enumerate(segs):
        idx = np.arange(s.start + 1, s.end + 1)
        idx = idx[is_mem[idx]]
        main = compute_tid[s.phase]
        # worker pairs: allocated and freed inside this segment, both by another thread than the phase's
        pair_free = {}
        for i in idx.tolist():
            if kind[i] == K_MALLOC and tid[i] != main:
                f = int(f_idx[alloc_of[i]])
                if s.start < f <= s.end and tid[f] != main:
                    pair_free[f] = i
        paired = set(pair_free) | set(pair_free.values())
        compute, workers, opened, j = [], [], {}, 0
        for i in idx.tolist():
            if i in paired:
                if kind[i] == K_MALLOC:
                    opened[i] = len(workers)
                    workers.append([int(size[alloc_of[i]]), len(compute), None])
                else:
                    workers[opened[pair_free[i]]][2] = len(compute)
                continue
            if kind[i] == K_MALLOC:
                al = alloc_of[i]
                local_index[al] = j
                j += 1
                compute.append(Event(ALLOC, int(size[al])))
            else:
                al = freed[i]
                compute.append(Event(FREE, int(size[al]), _ref(segs, si, int(seg_of[m_idx[al]]), int(local_index[al]))))
        compute, workers = collapsed(compute, workers)
        # in the order the worker allocated them: what pairs a run's k-th worker buffer with another run's (sorted
        # by size, two buffers whose sizes cross between runs would swap windows)
        out.append((s, compute, tuple(tuple(w) for w in workers)))
    return out


def _ref(segs, here: int, there: int, j: int) -> str:
    if there == here:
        return f"#{j}"
    if there < 0 or j < 0:
        return OUTSIDE
    s, o = segs[here], segs[there]
    where = f"{o.phase}:{o.label}"
    if s.layer is not None and o.layer is not None and o.layer != s.layer:
        where += f"[{o.layer - s.layer:+d}]"
    if o.microbatch != s.microbatch or o.iteration != s.iteration:
        where += f"@mb{o.microbatch - s.microbatch:+d}" if o.iteration == s.iteration else "@iter"
    return f"{where}#{j}"


def run_programs(path: str, ranks: list) -> RunPrograms:
    """The representative program of every (phase, label) of one run (all ranks pooled), and of every label's
    instances at the model's first layer (`firsts`: that layer's segments, and the decoder's own code next to it),
    which also free what only the first layer holds."""
    from tracer.segments import rank_segments
    inst: dict = {}
    first: dict = {}
    positioned: dict = {}
    for pr in ranks:
        segs = rank_segments(pr)
        later = any(s.iteration >= 1 for s in segs)
        instances = rank_instances(pr, segs)
        # the chunks that hold the embedding: their layer 0 is the model's first layer
        embedded = {(s.iteration, s.microbatch, s.chunk) for s in segs if s.label == "embedding"}
        position = _sibling_positions(instances)
        for i, (s, compute, workers) in enumerate(instances):
            if later and s.iteration < 1:
                continue
            inst.setdefault((s.phase, s.label), []).append((s, compute, workers))
            if (s.iteration, s.microbatch, s.chunk) in embedded and _at_first_layer(instances, i):
                first.setdefault((s.phase, s.label), []).append((s, compute, workers))
            if position[i] and (s.layer is None or s.layer >= 1):
                positioned.setdefault((s.phase, s.label, position[i]), []).append((s, compute, workers))
    out = RunPrograms(path)
    for key, lst in inst.items():
        generic = [x for x in lst if x[0].layer is None or x[0].layer >= 1] or lst
        out.programs[key] = _representative(key, generic, len(lst))
    for key, lst in first.items():
        out.firsts[key] = _representative(key, lst, len(lst))
    for key, lst in positioned.items():
        out.positions[key] = _representative(key, lst, len(lst))
    return out


def _sibling_positions(instances: list) -> list:
    """Per instance, "first" or "last" where its label repeats within one call of its op (same iteration,
    microbatch, chunk, layer and phase: a SequentialMLP's local experts), counted in forward order (a backward runs
    them in reverse); None elsewhere."""
    groups: dict = {}
    for i, (s, _, _) in enumerate(instances):
        groups.setdefault((s.iteration, s.microbatch, s.chunk, s.layer, s.phase, s.label), []).append(i)
    out: list = [None] * len(instances)
    for (*_, phase, label), idx in groups.items():
        if len(idx) < 2 or not label.startswith("layers.") or "local_experts" not in label:
            continue
        order = idx if phase == "fwd" else idx[::-1]
        out[order[0]], out[order[-1]] = "first", "last"
    return out


def _at_first_layer(instances: list, i: int) -> bool:
    """A segment of the model's first layer, or the decoder's own code right after it (forward) or right before
    it (backward, which runs in reverse)."""
    s = instances[i][0]
    if s.layer is not None:
        return s.layer == 0 and s.label.startswith("layers.")
    if not s.label.startswith("decoder@layers"):
        return False
    j = i - 1 if s.phase == "fwd" else i + 1
    if not 0 <= j < len(instances):
        return False
    o = instances[j][0]
    return o.layer == 0 and o.phase == s.phase and o.microbatch == s.microbatch and o.iteration == s.iteration


def _representative(key: tuple, lst: list, n: int) -> "Program":
    """The most common event list among instances (ties: the later instance: the last layer of the forward; in
    backward, the layer nearest the loss), with its worker pairs' widest windows."""
    count = Counter(_sized(c, w) for _, c, w in lst)
    best = max(count.values())
    want = next(_sized(c, w) for _, c, w in reversed(lst) if count[_sized(c, w)] == best)
    chosen = [(c, w) for _, c, w in lst if _sized(c, w) == want]
    return Program(key[0], key[1], chosen[-1][0], widest([w for _, w in chosen]), n, best)


def widest(worker_lists: list) -> tuple:
    """Worker pairs of several instances (same sizes in order) with the widest window of each."""
    first = worker_lists[0]
    return tuple((size, min(w[k][1] for w in worker_lists), max(w[k][2] for w in worker_lists))
                 for k, (size, _, _) in enumerate(first))


def _sized(compute: tuple, workers: tuple) -> tuple:
    return tuple((e.op, e.size, e.count) for e in compute), tuple(size for size, _, _ in workers)
