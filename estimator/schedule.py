"""Pipeline schedules as megatron-core runs them, and the memory timeline they produce on one rank.

Orders follow megatron/core/pipeline_parallel/schedules.py: forward_backward_no_pipelining (F,B per microbatch),
forward_backward_pipelining_without_interleaving (warmup = min(pp - rank - 1, M) forwards, steady 1F1B, cooldown
backwards) and forward_backward_pipelining_with_interleaving (get_pp_rank_microbatches warmup count and the
get_schedule_table order; backward visits model chunks in reverse). Pipeline p2p tensors that outlive their step
(received inputs kept by the model chunk, sent input gradients, interleaved sends deferred past the pair's
backward) are counted per step by p2p_counts.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from fractions import Fraction
from math import isfinite

from estimator._record import dataclass, field

Step = tuple  # Tuple[str, int, int]: ("F" | "B", microbatch, model chunk)


def schedule_table(M: int, vp: int, group: int) -> List[Tuple[int, int]]:
    """(microbatch, chunk) per virtual microbatch id (== megatron's get_schedule_table)."""
    out = []
    for lo in range(0, M, group):
        hi = M if lo + group >= M else lo + group
        out.extend((mb, c) for c in range(vp) for mb in range(lo, hi))
    return out


def warmup_count(pp: int, rank: int, M: int, vp: Optional[int] = None, group: Optional[int] = None) -> int:
    total = M * (vp or 1)
    if pp <= 1:
        return 0
    if not vp:
        w = pp - rank - 1
    else:
        w = (pp - rank - 1) * 2 + (vp - 1) * (group or pp)
    return min(w, total)


def order(pp: int, rank: int, M: int, vp: Optional[int] = None, group: Optional[int] = None) -> List[Step]:
    """Forward/backward steps of one PP rank in execution order."""
    vp = vp if vp and vp > 1 else None
    if pp <= 1 and not vp:
        return [s for mb in range(M) for s in (("F", mb, 0), ("B", mb, 0))]
    total = M * (vp or 1)
    w = warmup_count(pp, rank, M, vp, group)
    if vp:
        table = schedule_table(M, vp, group or pp)
        fwd = [("F", mb, c) for mb, c in table]
        bwd = [("B", mb, vp - 1 - c) for mb, c in table]
    else:
        fwd = [("F", mb, 0) for mb in range(M)]
        bwd = [("B", mb, 0) for mb in range(M)]
    steps = fwd[:w]
    for i in range(total - w):
        steps += [fwd[w + i], bwd[i]]
    steps += bwd[total - w:]
    return steps


def max_in_flight(steps: Sequence[Step]) -> int:
    live = best = 0
    for kind, _, _ in steps:
        live += 1 if kind == "F" else -1
        best = max(best, live)
    return best


@dataclass
class Event:
    index: int
    phase: str          # "F" | "B" | "optimizer"
    microbatch: int
    chunk: int
    level_before: float
    peak: float
    level_after: float


@dataclass
class RankTimeline:
    peak: float
    peak_phase: str          # e.g. "F mb=3 chunk=0 (warmup)" or "optimizer step"
    peak_index: int
    in_flight_max: int
    events: List[Event] = field(default_factory=list)


def p2p_flags(pp: int, rank: int, vp: Optional[int] = None) -> Tuple[List[bool], List[bool]]:
    """(recv, sends) per model chunk of a PP rank: whether the chunk's input arrives by p2p (all but the first
    stage's first chunk) and whether its output is sent on (all but the last stage's last chunk)."""
    n = vp if vp and vp > 1 else 1
    if pp <= 1:
        return [False] * n, [False] * n
    return ([not (rank == 0 and c == 0) for c in range(n)],
            [not (rank == pp - 1 and c == n - 1) for c in range(n)])


def p2p_counts(seq: Sequence[Tuple[str, int]], recv: Sequence[bool], sends: Sequence[bool],
               interleaved: bool, warmup: int = 0) -> Tuple[List[int], int]:
    """Pipeline p2p tensors (each one hidden state) live at each step of seq ((kind, chunk) per step) on top of
    the saved bytes, and at the optimizer step, as megatron-core's schedules (0.16) keep them:
    - the model chunk keeps its last input (TransformerBlock.set_input_tensor) and, once that input's backward
      ran, its .grad (the input gradient): 2 per input-receiving chunk with nothing in flight, until the chunk's
      next forward replaces it (across iterations too: the optimizer step and the next iteration's first steps);
    - the input gradient a backward sent to the previous stage is referenced until the next backward has run
      (send_prev_wait_handle waited after the next backward's send; `input_tensor_grad` in 1F1B): 1 during the
      steps up to and including the next backward, unless the chunk still holds it (above);
    - 1F1B without interleaving: the output gradient a backward received (send_forward_recv_backward's result,
      `output_tensor_grad`) stays referenced through the next forward, until the next exchange replaces it: 1
      during a forward that directly follows a backward of a chunk that receives output gradients;
    - interleaved schedule only, steady 1F1B pairs (the p2p exchange comes after the pair's backward): the pair's
      forward output is sent, and pseudo-freed, only after the backward (1 during the backward when the forward's
      chunk sends its output), and the output gradient for the pair's backward is received before its forward
      (1 during the forward when the backward's chunk receives one; the backward itself counts it already).
      The first `warmup` forwards are no pair's: the last of them sends its output at once, also where every
      forward is a warmup one and a backward follows it directly.
    The chunk's received input until its backward is a saved unit (activations.chunk_activations), not counted here."""
    fl = [0] * len(recv)  # microbatches in flight per chunk
    held = sum(map(bool, recv))  # input-receiving chunks with nothing in flight
    prev = -1      # chunk of the last backward
    out: List[int] = []
    last = len(seq) - 1
    for i, (kind, c) in enumerate(seq):
        if kind == "F":
            # 1F1B, a forward right after the chunk's own backward: that backward's input and its gradient stay
            # referenced until this forward is done (elsewhere set_input_tensor releases the kept input at once)
            kept = recv[c] and not fl[c]
            late = kept and not interleaved and i > 0 and seq[i - 1] == ("B", c)
            if kept and not late:
                held -= 1  # set_input_tensor replaces the kept input
            n = 2 * held
            if prev >= 0 and recv[prev] and (fl[prev] or prev == c) and not late:
                n += 1
            if late:
                held -= 1
            if interleaved and warmup <= i < last and seq[i + 1][0] == "B" and sends[seq[i + 1][1]]:
                n += 1
            if not interleaved and i and seq[i - 1][0] == "B" and sends[seq[i - 1][1]]:
                n += 1
            fl[c] += 1
        else:
            n = 2 * held
            if prev >= 0 and recv[prev] and fl[prev]:
                n += 1
            if interleaved and i > warmup and seq[i - 1][0] == "F" and sends[seq[i - 1][1]]:
                n += 1
            fl[c] -= 1
            if recv[c] and not fl[c]:
                held += 1
            prev = c
        out.append(n)
    return out, 2 * held


def simulate(steps: Sequence[Step], chunks, static_bytes: float, optimizer_transient: float = 0.0,
             keep_events: bool = False, warmup: int = 0, p2p: float = 0.0, recv: Sequence[bool] = (),
             sends: Sequence[bool] = (), interleaved: bool = False) -> RankTimeline:
    """chunks[c]: object with saved / fwd_extra / bwd_extra bytes per microbatch (activations.ChunkActivations).
    The level starts at the static bytes; a forward adds its chunk's saved bytes (its transient on top), a
    backward frees them (its transient on top of the level with them live); the optimizer step comes last.
    p2p: bytes of one pipeline p2p tensor; with recv / sends (p2p_flags) and interleaved, the p2p tensors that
    p2p_counts finds live are added on top of each step's transient and of the optimizer step's."""
    counts, end = p2p_counts([(k, c) for k, _, c in steps], recv, sends, interleaved, warmup) if p2p else ((), 0)
    level = static_bytes  # integers and Fractions stay exact (the tests' exact reference)
    peak, where, at = level, "start", -1
    live = best = 0
    events: List[Event] = []
    n_f = 0
    last_kind: dict = {}   # chunk -> its last step's kind ("B" then: a backward's leftovers, ChunkActivations)
    for i, (kind, mb, c) in enumerate(steps):
        ch = chunks[c]
        before = level
        again = last_kind.get(c) == "B"
        last_kind[c] = kind
        if kind == "F":
            top = level + (ch.fwd_extra + counts[i] * p2p if p2p else ch.fwd_extra)
            level += ch.saved
            live += 1
            n_f += 1
            stage = "warmup" if n_f <= warmup else "steady"
        else:
            alt = _bwd_again(ch) if again else None
            extra = ch.bwd_extra if alt is None else alt
            top = level + (extra + counts[i] * p2p if p2p else extra)
            level -= ch.saved
            live -= 1
            stage = "cooldown" if n_f == len(steps) // 2 and warmup else "steady"
        best = max(best, live)
        if top > peak:
            peak, at = top, i
            where = f"{'forward' if kind == 'F' else 'backward'} mb={mb} chunk={c} ({stage}, {live if kind == 'B' else live - 1} others in flight)"
        if keep_events:
            events.append(Event(i, kind, mb, c, before, top, level))
    top = level + (optimizer_transient + end * p2p if p2p else optimizer_transient)
    if top > peak:
        peak, at, where = top, len(steps), "optimizer step"
    if keep_events:
        events.append(Event(len(steps), "optimizer", -1, -1, level, top, level))
    return RankTimeline(peak, where, at, best, events)


def _bwd_again(ch):
    """A chunk's backward transient right after its previous backward, where that differs (ChunkActivations)."""
    v = getattr(ch, "bwd_again", None)
    return None if v is None or v == ch.bwd_extra else v


# --- the same timeline without walking every microbatch ---------------------------------------------------------
#
# All microbatches are identical, so the steady state repeats. Write P for the period of the forward chunk sequence
# (group x vp virtual microbatches; 1 without interleaving) and J for the end of its periodic part (the last,
# partial microbatch group breaks the pattern). Steady pair k runs fwd[w + k] then bwd[k]; the saved bytes live
# before it are those of fwd[0 : w + k] minus those of bwd[0 : k]. For P <= k and w + k < J, the windows
# fwd[w + k - P : w + k] and bwd[k - P : k] each hold every chunk `group` times, so pair k starts from the same live
# set as pair k - P and runs the same chunks: the same levels, the same tops, the same in-flight count. None of them
# can beat an earlier top (a new peak must be strictly higher), so whole periods past the first are skipped and the
# level after them is the level before them. With pipeline p2p tensors (p2p_counts) a step's count depends on the
# in-flight microbatches per chunk (the same for pair k and pair k - P), on the chunks of its own pair and on the
# chunk of backward k - 1 (none before pair 0): the same for pair k and pair k - P once k >= P + 1, so the skip then
# starts at pair P + 1. The pairs after the skipped periods up to J - w repeat pairs of the first period too: they
# move the state but are never looked at.
#
# The rest is walked in runs: a run repeats one unit (a forward of chunk a, a backward of chunk b, or a steady pair
# F a + B b) m times. Inside a run the level moves by the same d per unit, and every unit after the first has the
# same p2p counts (a run's forwards keep their chunk in flight, its backwards never empty theirs before its last
# unit, and the neighbour of each step is fixed), except that the last forward of a forward run may precede a
# backward. So among units 1 .. m-2 the tops are linear in the unit: the first wins a tie (d <= 0) or the last is
# strictly highest (d > 0); only units 0, 1 (or m-2) and m-1 are looked at, and a run whose highest possible top
# (highest level + largest transient + every p2p tensor) cannot beat the peak so far is not looked at. All this
# holds exactly only while every sum is exact in floating point, so the short walk is taken only when all byte
# counts are integers and every partial sum stays below 2**53; otherwise the walk runs on exact numbers (Python
# integers, or Fractions for fractional byte counts) and rounds its results once, so its cost never depends on the
# number of microbatches. tests/test_estimator_speed_equivalence.py checks it against the step-by-step simulation.

_EXACT = float(1 << 53)


def _exact(values, total: int) -> bool:
    try:
        floats = list(map(float, values))
        if not all(map(float.is_integer, floats)):
            return False
    except (TypeError, ValueError, OverflowError):
        return False
    return sum(map(abs, floats)) * (total + 2) < _EXACT


def _rational(x):
    """x as an exact number: an int when integral, else the Fraction equal to it; None when not finite."""
    if isinstance(x, (int, Fraction)):
        return x
    x = float(x)
    if not isfinite(x):
        return None
    return int(x) if x.is_integer() else Fraction(x)


class _ExactChunk:
    __slots__ = ("saved", "fwd_extra", "bwd_extra")

    def __init__(self, saved, fwd_extra, bwd_extra):
        self.saved, self.fwd_extra, self.bwd_extra = saved, fwd_extra, bwd_extra


def _chunk_runs(lo: int, hi: int, vp: Optional[int], g: int, M: int, reverse: bool) -> List[Tuple[int, int]]:
    """(chunk, length) runs of the forward chunk sequence (the backward one when reverse) over virtual microbatch
    ids [lo, hi): blocks of `g` microbatches per chunk, the last partial group in blocks of what is left."""
    if not vp:
        return [(0, hi - lo)] if hi > lo else []
    P = g * vp
    J = (M // g) * P
    r = M - (M // g) * g
    out = []
    j = lo
    while j < hi:
        if j < J:
            base = j - j % P
            c = (j - base) // g
            end = base + (c + 1) * g
        else:
            c = (j - J) // r
            end = J + (c + 1) * r
        if end > hi:
            end = hi
        out.append((vp - 1 - c if reverse else c, end - j))
        j = end
    return out


def _pair_runs(fwd: List[Tuple[int, int]], bwd: List[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
    """(forward chunk, backward chunk, pairs) runs of steady pairs from the two runs lists (equal lengths)."""
    out = []
    i = k = 0
    (a, la), (b, lb) = (fwd[0], bwd[0]) if fwd else ((0, 0), (0, 0))
    while la:
        m = la if la < lb else lb
        out.append((a, b, m))
        la -= m
        lb -= m
        if not la and i + 1 < len(fwd):
            i += 1
            a, la = fwd[i]
        if not lb and k + 1 < len(bwd):
            k += 1
            b, lb = bwd[k]
    return out


class _Walk:
    """simulate() and p2p_counts() over one rank, a unit at a time: the level, the microbatches in flight per chunk,
    the input-receiving chunks holding nothing (held), the last backward's chunk if it receives (prev), the chunk
    of the step just run if it was a forward (last_f), forwards / backwards run so far, and the first highest top
    with (kind, forward or backward index, level before)."""
    __slots__ = ("saved", "fx", "bx", "recv", "sends", "inter", "p2p", "floor", "level", "fl", "held", "prev",
                 "last_f", "last_b", "grad_held", "nf", "nb", "best", "at")

    def __init__(self, chunks, level0: float, recv, sends, interleaved: bool, p2p: float):
        self.saved = [ch.saved for ch in chunks]
        self.fx = [ch.fwd_extra for ch in chunks]
        self.bx = [ch.bwd_extra for ch in chunks]
        self.recv, self.sends, self.inter, self.p2p = recv, sends, interleaved, p2p
        self.level, self.fl, self.held, self.prev, self.last_f = level0, [0] * len(chunks), sum(recv), None, None
        self.last_b = None       # the chunk of the step just run if it was a backward
        self.grad_held = False   # 1F1B: the last backward's received output gradient, referenced until a forward ran
        self.nf = self.nb = 0
        self.best, self.at = level0, None
        self.floor = -float("inf")  # some step's top is at least this: a run that stays below it holds no peak

    def fwd(self, x: int, nxt_b: Optional[int]) -> None:
        """Forward of chunk x; nxt_b: the chunk of the next step if that is a backward."""
        fl = self.fl
        # as p2p_counts: a 1F1B forward right after its chunk's backward keeps that backward's input until it is done
        kept = self.recv[x] and not fl[x]
        late = kept and not self.inter and self.last_b == x
        if kept and not late:
            self.held -= 1  # set_input_tensor replaces the kept input
        lv = self.level
        if self.p2p:
            n = 2 * self.held
            p = self.prev
            if p is not None and (fl[p] or p == x) and not late:
                n += 1
            if nxt_b is not None and self.inter and self.sends[nxt_b]:
                n += 1
            if self.grad_held:
                n += 1
            top = lv + (self.fx[x] + n * self.p2p)
        else:
            top = lv + self.fx[x]
        if top > self.best:
            self.best, self.at = top, ("F", self.nf, lv)
        if late:
            self.held -= 1
        self.last_b = None
        fl[x] += 1
        self.level = lv + self.saved[x]
        self.nf += 1
        self.last_f = x
        self.grad_held = False

    def bwd(self, c: int) -> None:
        fl = self.fl
        lv = self.level
        if self.p2p:
            n = 2 * self.held
            p = self.prev
            if p is not None and fl[p]:
                n += 1
            f = self.last_f
            if f is not None and self.inter and self.sends[f]:
                n += 1
            top = lv + (self.bx[c] + n * self.p2p)
        else:
            top = lv + self.bx[c]
        if top > self.best:
            self.best, self.at = top, ("B", self.nb, lv)
        fl[c] -= 1
        self.level = lv - self.saved[c]
        self.nb += 1
        self._after_bwd(c)

    def _after_bwd(self, c: int, emptied: bool = True) -> None:
        """State after a backward of chunk c (emptied: c held something before the last unit)."""
        if self.recv[c]:
            if emptied and not self.fl[c]:
                self.held += 1
            self.prev = c
        else:
            self.prev = None
        self.last_f = None
        self.last_b = c
        self.grad_held = not self.inter and self.sends[c]

    def skip_f(self, a: int, m: int) -> None:
        """m forwards of chunk a, not looked at."""
        if self.recv[a] and not self.fl[a]:
            self.held -= 1
        self.fl[a] += m
        self.level += m * self.saved[a]
        self.nf += m
        self.last_f = a
        self.last_b = None
        self.grad_held = False

    def skip_b(self, b: int, m: int) -> None:
        self.fl[b] -= m
        self.level -= m * self.saved[b]
        self.nb += m
        self._after_bwd(b)

    def skip_pair(self, a: int, b: int, m: int) -> None:
        if a != b:
            if self.recv[a] and not self.fl[a]:
                self.held -= 1
            self.fl[a] += m
            self.fl[b] -= m
            self.level += m * (self.saved[a] - self.saved[b])
        self.nf += m
        self.nb += m
        self._after_bwd(b, a != b)  # F b + B b leaves the chunk as it was

    def _beaten(self, bound) -> bool:
        """Whether a run whose tops are all at most `bound` cannot hold the first highest top."""
        return bound <= self.best or bound < self.floor

    def _cap(self):
        """The most p2p tensor bytes a step of the next run can hold: a run empties a chunk only after its last step,
        so at most 2 per held chunk now, + 1 for the last backward's input grad + 1 for a deferred send
        (interleaved) or a received output gradient still referenced (1F1B)."""
        return (2 * self.held + 2) * self.p2p if self.p2p > 0 else 0

    def run_f(self, a: int, m: int, nxt_b: Optional[int]) -> None:
        """m forwards of chunk a; nxt_b: the chunk of the step after the last if that is a backward."""
        d = self.saved[a]
        if self._beaten(max(self.level, self.level + (m - 1) * d) + self.fx[a] + self._cap()):
            return self.skip_f(a, m)
        self.fwd(a, None if m > 1 else nxt_b)
        if m > 1:
            self._middle(m, d, lambda: self.fwd(a, None), lambda k: self.skip_f(a, k))
            self.fwd(a, nxt_b)

    def run_b(self, b: int, m: int) -> None:
        d = -self.saved[b]
        if self._beaten(max(self.level, self.level + (m - 1) * d) + self.bx[b] + self._cap()):
            return self.skip_b(b, m)
        self.bwd(b)
        if m > 1:
            self._middle(m, d, lambda: self.bwd(b), lambda k: self.skip_b(b, k))
            self.bwd(b)

    def run_pair(self, a: int, b: int, m: int) -> None:
        sa = self.saved[a]
        d = sa - self.saved[b]
        fx, bx = self.fx[a], sa + self.bx[b]
        if self._beaten(max(self.level, self.level + (m - 1) * d) + (fx if fx > bx else bx) + self._cap()):
            return self.skip_pair(a, b, m)
        self.fwd(a, b)
        self.bwd(b)
        if m > 1:
            self._middle(m, d, lambda: (self.fwd(a, b), self.bwd(b)), lambda k: self.skip_pair(a, b, k))
            self.fwd(a, b)
            self.bwd(b)

    @staticmethod
    def _middle(m: int, d, unit, skip) -> None:
        """Units 1 .. m-2 of a run whose unit 0 ran: unit 1, then unit m-2 if the level rises (d > 0), the others
        skipped."""
        if m < 3:
            return
        unit()
        if m > 3:
            if d > 0:
                if m > 4:
                    skip(m - 4)
                unit()
            else:
                skip(m - 3)


def _warmup_floor(walk: _Walk, warm: List[Tuple[int, int]], after: List[Tuple[int, int]]) -> float:
    """A top some step reaches (p2p tensors count >= 0): the last warmup forward's or the first steady forward's
    level plus its transient. The warmup usually ends at about the highest level, so most runs before stay under."""
    level = walk.level
    for a, m in warm:
        level += m * walk.saved[a]
    floor = -float("inf")
    if warm:
        a = warm[-1][0]
        floor = level - walk.saved[a] + walk.fx[a]
    if after:
        a = after[0][0]
        floor = max(floor, level + walk.fx[a])
    return floor


def rank_timeline(pp: int, rank: int, M: int, chunks, static_bytes: float, optimizer_transient: float = 0.0,
                  vp: Optional[int] = None, group: Optional[int] = None,
                  p2p: float = 0.0) -> Tuple[RankTimeline, float]:
    """(simulate(order(pp, rank, M, vp, group), chunks, ..., warmup=warmup_count(...), p2p=p2p,
    recv/sends=p2p_flags(pp, rank, vp), interleaved=vp > 1), saved activation bytes live at the peak step (0.0 at
    the optimizer step or at the start)), without building the step list: its cost depends on pp, vp and the
    group size, not on M. Same phase text and indices as the full simulation, and the same numbers as it gives in
    exact arithmetic (equal to its floating-point ones while every partial sum is an exact float)."""
    vp = vp if vp and vp > 1 else None
    total = M * (vp or 1)
    used = chunks[: vp or 1]
    recv, sends = p2p_flags(pp, rank, vp)
    if any(_bwd_again(ch) is not None for ch in used):
        # back-to-back backwards of one chunk differ from the rest: walked step by step (MoE full recompute only)
        return _simulated(pp, rank, M, chunks, static_bytes, optimizer_transient, vp, group, p2p, recv, sends)
    vals = [static_bytes, optimizer_transient] + [x for ch in used for x in (ch.saved, ch.fwd_extra, ch.bwd_extra)]
    if p2p:
        vals.append(p2p * (2 * len(used) + 2))
    if not _exact(vals, total):
        exact = [_rational(x) for x in (static_bytes, optimizer_transient, p2p)]
        exact_chunks = [[_rational(x) for x in (ch.saved, ch.fwd_extra, ch.bwd_extra)] for ch in used]
        if None in exact or any(None in c for c in exact_chunks):
            return _simulated(pp, rank, M, chunks, static_bytes, optimizer_transient, vp, group, p2p, recv, sends)
        static_bytes, optimizer_transient, p2p = exact
        used = [_ExactChunk(*c) for c in exact_chunks]
        level0 = static_bytes
    else:
        level0 = float(static_bytes)
    w = warmup_count(pp, rank, M, vp, group)  # order()'s warmup forwards (== the `warmup` simulate() is given)
    g = (group or pp) if vp else M
    if vp:
        P = g * vp
        n_full = M // g
        J = n_full * P
        r_last = M - n_full * g
    else:
        P, J = 1, M
    S_ = total - w  # steady 1F1B pairs
    skip_from = skip_to = S_
    lim = min(S_, J - w)
    # With p2p tensors, pair k also depends on the chunk of backward k - 1 (none before pair 0): skip from P + 1.
    first = P + 1 if p2p else P
    if lim - first >= P:
        skip_from = first
        skip_to = first + ((lim - first) // P) * P
    walk = _Walk(used, level0, recv, sends, bool(vp), p2p)
    cooldown = _chunk_runs(S_, total, vp, g, M, True)
    # Warmup forwards; the last precedes the first backward when there are no steady pairs.
    warm = _chunk_runs(0, w, vp, g, M, False)
    if p2p >= 0:
        walk.floor = _warmup_floor(walk, warm, _chunk_runs(w, min(w + 1, total), vp, g, M, False))
    for a, m in warm:
        walk.run_f(a, m, None)
    walk.last_f = None   # warmup forwards send their outputs at once (p2p_counts)
    # Steady pairs: [0, skip_from) walked, whole periods skipped (state unchanged), the pairs repeating the first
    # period moved over, the rest walked.
    for a, b, m in _pair_runs(_chunk_runs(w, w + skip_from, vp, g, M, False),
                              _chunk_runs(0, skip_from, vp, g, M, True)):
        walk.run_pair(a, b, m)
    walk.nf += skip_to - skip_from
    walk.nb += skip_to - skip_from
    rest = skip_to
    if skip_to > skip_from and lim > skip_to:
        for a, b, m in _pair_runs(_chunk_runs(w + skip_to, w + lim, vp, g, M, False),
                                  _chunk_runs(skip_to, lim, vp, g, M, True)):
            walk.skip_pair(a, b, m)
        rest = lim
    for a, b, m in _pair_runs(_chunk_runs(w + rest, w + S_, vp, g, M, False),
                              _chunk_runs(rest, S_, vp, g, M, True)):
        walk.run_pair(a, b, m)
    for b, m in cooldown:
        walk.run_b(b, m)

    peak, where, at, act = level0, "start", -1, 0.0
    if walk.at is not None:
        kind, j, before = walk.at
        peak = walk.best
        if kind == "F":
            if j < w:
                at, others, stage = j, j, "warmup"
            else:
                at, others, stage = w + 2 * (j - w), w, "steady"
        elif j < S_:
            at, others = w + 2 * j + 1, w
            stage = "cooldown" if (j == S_ - 1 and w) else "steady"
        else:
            q = j - S_
            at, others, stage = w + 2 * S_ + q, w - q - 1, "cooldown" if w else "steady"
        if vp:
            blk = j // P
            if blk < n_full:
                mb = blk * g + (j - blk * P) % g
                c = (j - blk * P) // g
            else:
                mb = n_full * g + (j - J) % r_last
                c = (j - J) // r_last
            if kind == "B":
                c = vp - 1 - c
        else:
            mb, c = j, 0
        if kind == "F":
            act = (before - level0) + walk.saved[c]
            where = f"forward mb={mb} chunk={c} ({stage}, {others} others in flight)"
        else:
            act = before - level0
            where = f"backward mb={mb} chunk={c} ({stage}, {others} others in flight)"
    p2p_end = 2 * sum(recv) if p2p else 0  # every receiving chunk keeps its last input and its grad past the end
    top = walk.level + (optimizer_transient + p2p_end * p2p if p2p else optimizer_transient)
    if top > peak:
        peak, at, where, act = top, 2 * total, "optimizer step", 0.0
    # exact numbers (the integer / Fraction walk) are rounded once, here
    return RankTimeline(float(peak), where, at, w + (1 if S_ > 0 else 0)), float(act)


def _simulated(pp, rank, M, chunks, static_bytes, optimizer_transient, vp, group, p2p, recv, sends):
    """rank_timeline by the full simulation: only for byte counts that are not finite (no exact arithmetic)."""
    steps = order(pp, rank, M, vp, group)
    tl = simulate(steps, chunks, static_bytes, optimizer_transient, warmup=warmup_count(pp, rank, M, vp, group),
                  p2p=p2p, recv=recv, sends=sends, interleaved=bool(vp))
    if tl.peak_phase == "optimizer step":
        return tl, 0.0
    level = 0.0
    for i, (kind, _, c) in enumerate(steps[: tl.peak_index + 1]):
        if kind == "F":
            level += chunks[c].saved
        elif i < tl.peak_index:
            level -= chunks[c].saved
    return tl, level
