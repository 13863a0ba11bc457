"""Pipeline schedules as megatron-core runs them, and the memory timeline they produce on one rank.

Orders follow megatron/core/pipeline_parallel/schedules.py: forward_backward_no_pipelining (F,B per microbatch),
forward_backward_pipelining_without_interleaving (warmup = min(pp - rank - 1, M) forwards, steady 1F1B, cooldown
backwards) and forward_backward_pipelining_with_interleaving (get_pp_rank_microbatches warmup count and the
get_schedule_table order; backward visits model chunks in reverse). Pipeline p2p tensors that outlive their step
(received inputs kept by the model chunk, sent input gradients, interleaved sends deferred past the pair's
backward) are counted per step by p2p_counts.
"""
from __future__ import annotations

from estimator._record import dataclass, field
from itertools import accumulate
from operator import add

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
               interleaved: bool) -> Tuple[List[int], int]:
    """Pipeline p2p tensors (each one hidden state) live at each step of seq ((kind, chunk) per step) on top of
    the saved bytes, and at the optimizer step, as megatron-core's schedules (0.16) keep them:
    - the model chunk keeps its last input (TransformerBlock.set_input_tensor) and, once that input's backward
      ran, its .grad (the input gradient): 2 per input-receiving chunk with nothing in flight, until the chunk's
      next forward replaces it (across iterations too: the optimizer step and the next iteration's first steps);
    - the input gradient a backward sent to the previous stage is referenced until the next backward has run
      (send_prev_wait_handle waited after the next backward's send; `input_tensor_grad` in 1F1B): 1 during the
      steps up to and including the next backward, unless the chunk still holds it (above);
    - interleaved schedule only, steady 1F1B pairs (the p2p exchange comes after the pair's backward): the pair's
      forward output is sent, and pseudo-freed, only after the backward (1 during the backward when the forward's
      chunk sends its output), and the output gradient for the pair's backward is received before its forward
      (1 during the forward when the backward's chunk receives one; the backward itself counts it already).
    The chunk's received input until its backward is a saved unit (activations.chunk_activations), not counted here."""
    fl = [0] * len(recv)  # microbatches in flight per chunk
    held = sum(map(bool, recv))  # input-receiving chunks with nothing in flight
    prev = -1      # chunk of the last backward
    out: List[int] = []
    last = len(seq) - 1
    for i, (kind, c) in enumerate(seq):
        if kind == "F":
            if recv[c] and not fl[c]:
                held -= 1  # set_input_tensor replaces the kept input
            n = 2 * held
            if prev >= 0 and recv[prev] and (fl[prev] or prev == c):
                n += 1
            if interleaved and i < last and seq[i + 1][0] == "B" and sends[seq[i + 1][1]]:
                n += 1
            fl[c] += 1
        else:
            n = 2 * held
            if prev >= 0 and recv[prev] and fl[prev]:
                n += 1
            if interleaved and i > 0 and seq[i - 1][0] == "F" and sends[seq[i - 1][1]]:
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
    counts, end = p2p_counts([(k, c) for k, _, c in steps], recv, sends, interleaved) if p2p else ((), 0)
    level = float(static_bytes)
    peak, where, at = level, "start", -1
    live = best = 0
    events: List[Event] = []
    n_f = 0
    for i, (kind, mb, c) in enumerate(steps):
        ch = chunks[c]
        before = level
        if kind == "F":
            top = level + (ch.fwd_extra + counts[i] * p2p if p2p else ch.fwd_extra)
            level += ch.saved
            live += 1
            n_f += 1
            stage = "warmup" if n_f <= warmup else "steady"
        else:
            top = level + (ch.bwd_extra + counts[i] * p2p if p2p else ch.bwd_extra)
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
# starts at pair P + 1. This holds exactly only while every sum is exact in floating point, so
# the short walk is taken only when all byte counts are integers and every partial sum stays below 2**53;
# otherwise the full schedule is simulated. tests/test_estimator_speed_equivalence.py checks both against each other.

_EXACT = float(1 << 53)
_INF = float("inf")


def _p2p_counts_coded(sc: Sequence[int], vn: int, recv: Sequence[bool], sends: Sequence[bool], interleaved: bool,
                      start: int, stop: int) -> List[int]:
    """p2p_counts(seq, recv, sends, interleaved)[0][start:stop] for seq coded as sc (forward of chunk c: c, backward
    of chunk c: vn + c): the same walk over plain ints, from the in-flight state the steps before `start` leave."""
    prefix = sc[:start]
    fl = [prefix.count(c) - prefix.count(vn + c) for c in range(vn)]
    held = sum([1 for c in range(vn) if recv[c] and not fl[c]])
    prev_recv_fl = None  # the last backward's chunk, if it receives its input (else None)
    for j in range(start - 1, -1, -1):
        if sc[j] >= vn:
            if recv[sc[j] - vn]:
                prev_recv_fl = sc[j] - vn
            break
    out = [0] * (stop - start)
    last = len(sc) - 1
    for i in range(start, stop):
        x = sc[i]
        if x < vn:
            if recv[x] and not fl[x]:
                held -= 1
            n = 2 * held
            if prev_recv_fl is not None and (fl[prev_recv_fl] or prev_recv_fl == x):
                n += 1
            if interleaved and i < last:
                y = sc[i + 1]
                if y >= vn and sends[y - vn]:
                    n += 1
            fl[x] += 1
        else:
            c = x - vn
            n = 2 * held
            if prev_recv_fl is not None and fl[prev_recv_fl]:
                n += 1
            if interleaved and i > 0:
                y = sc[i - 1]
                if y < vn and sends[y]:
                    n += 1
            fl[c] -= 1
            if recv[c]:
                if not fl[c]:
                    held += 1
                prev_recv_fl = c
            else:
                prev_recv_fl = None
        out[i - start] = n
    return out


def _exact(values, total: int) -> bool:
    try:
        floats = list(map(float, values))
        if not all(map(float.is_integer, floats)):
            return False
    except (TypeError, ValueError, OverflowError):
        return False
    return sum(map(abs, floats)) * (total + 2) < _EXACT


def rank_timeline(pp: int, rank: int, M: int, chunks, static_bytes: float, optimizer_transient: float = 0.0,
                  vp: Optional[int] = None, group: Optional[int] = None,
                  p2p: float = 0.0) -> Tuple[RankTimeline, float]:
    """(simulate(order(pp, rank, M, vp, group), chunks, ..., warmup=warmup_count(...), p2p=p2p,
    recv/sends=p2p_flags(pp, rank, vp), interleaved=vp > 1), saved activation bytes live at the peak step (0.0 at
    the optimizer step or at the start)), without building the step list when the arithmetic is exact. Same
    numbers, phase text and indices as the full simulation."""
    vp = vp if vp and vp > 1 else None
    total = M * (vp or 1)
    used = chunks[: vp or 1]
    recv, sends = p2p_flags(pp, rank, vp)
    vals = [static_bytes, optimizer_transient] + [x for ch in used for x in (ch.saved, ch.fwd_extra, ch.bwd_extra)]
    if p2p:
        vals.append(p2p * (2 * len(used) + 2))
    if not _exact(vals, total):
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

    w = warmup_count(pp, rank, M, vp, group)  # order()'s warmup forwards (== the `warmup` simulate() is given)
    saved = [ch.saved for ch in used]
    vn = len(used)
    # Steps as codes: forward of chunk c -> c, backward of chunk c -> vn + c; a step's level change and transient
    # are then one lookup each.
    dsel = saved + [-x for x in saved]
    xsel = [ch.fwd_extra for ch in used] + [ch.bwd_extra for ch in used]
    vlast = (vp or 1) - 1
    # Code of forward j (cf[j]) and of backward j (cbc[j] = vn + cb[j], cb[j] = vlast - cf[j]), from the schedule
    # table.
    if vp:
        g = group or pp
        P = g * vp
        n_full = M // g
        J = n_full * P
        r_last = M - n_full * g
        pat = [c for c in range(vp) for _ in range(g)]
        cf = pat * n_full + [c for c in range(vp) for _ in range(r_last)]
        cbc = [vn + vlast - c for c in pat] * n_full + [vn + vlast - c for c in range(vp) for _ in range(r_last)]
    else:
        P, J = 1, M
        cf = [0] * M
        cbc = [1] * M
    S_ = total - w  # steady 1F1B pairs
    skip_from = skip_to = S_
    lim = min(S_, J - w)
    # With p2p tensors, pair k also depends on the chunk of backward k - 1 (none before pair 0): skip from P + 1.
    first = P + 1 if p2p else P
    if lim - first >= P:
        skip_from = first
        skip_to = first + ((lim - first) // P) * P
    # The kept steps in order: warmup forwards, steady pairs [0, skip_from) and [skip_to, S_), cooldown backwards.
    pf = cf[w: w + skip_from] + cf[w + skip_to: w + S_]
    n2 = 2 * len(pf)
    sc = cf[:w]
    sc += pf
    sc += pf  # placeholders, overwritten below
    sc[w: w + n2: 2] = pf
    sc[w + 1: w + n2: 2] = cbc[:skip_from] + cbc[skip_to:S_]
    sc += cbc[S_:]
    deltas = [dsel[x] for x in sc]
    extras = [xsel[x] for x in sc]
    level0 = float(static_bytes)
    levels = list(accumulate(deltas, initial=level0))
    tops = list(map(add, levels, extras))  # levels[i]: the level before kept step i
    p2p_end = 0
    if p2p and tops:
        # The pipeline p2p tensors live at each kept step (p2p_counts over the kept steps: the skipped whole periods
        # leave the per-chunk in-flight state unchanged).
        n_max = 2 * sum(recv) + 2
        # A step's p2p count is at most n_max, so a step whose top without p2p tensors is more than n_max * p2p
        # below the highest such top cannot hold the peak (left at -inf); counts are needed from the first step
        # that can to the last.
        thr = max(tops) - n_max * p2p
        start, stop = 0, len(tops)
        while tops[stop - 1] < thr:
            stop -= 1
        while tops[start] < thr:
            start += 1
        # Kept pairs [skip_to, lim) repeat pairs [skip_to - q*P, lim - q*P), which lie in [1, P + 1) and were
        # kept: same levels, tops and counts, so never a new peak (a tie goes to the earlier step). Left at -inf.
        rem_lo = w + 2 * skip_from
        rem_hi = rem_lo + 2 * (lim - skip_to if skip_to > skip_from else 0)
        # The first highest top over the walked steps (every other step counts as -inf).
        top, i = -_INF, -1
        for lo, hi in ((start, min(stop, rem_lo)), (max(start, rem_hi), stop)):
            if lo < hi:
                counts = _p2p_counts_coded(sc, vn, recv, sends, bool(vp), lo, hi)
                seg = [lv + (x + n * p2p) for lv, x, n in zip(levels[lo:hi], extras[lo:hi], counts)]
                best = max(seg)
                if best > top:
                    top, i = best, lo + seg.index(best)
    elif tops:
        top = max(tops)
        i = tops.index(top)
    if p2p:
        p2p_end = 2 * sum(recv)  # every receiving chunk keeps its last input and its grad past the last step
    peak, where, at, act = level0, "start", -1, 0.0
    if tops:
        if top > peak:
            peak, before = top, levels[i]
            n_pairs_1 = 2 * skip_from  # kept steps of the first steady part
            if i < w:  # warmup forward j = i
                kind, j, at, others, stage = "F", i, i, i, "warmup"
            elif i < w + n2:
                k2 = i - w
                k = k2 // 2 if k2 < n_pairs_1 else skip_to + (k2 - n_pairs_1) // 2
                at = w + 2 * k + (k2 & 1)
                if not k2 & 1:
                    kind, j, others, stage = "F", w + k, w, "steady"
                else:
                    kind, j, others = "B", k, w
                    stage = "cooldown" if (k == S_ - 1 and w) else "steady"
            else:
                q = i - w - n2
                kind, j, at, others, stage = "B", S_ + q, w + 2 * S_ + q, w - q - 1, "cooldown" if w else "steady"
            if vp:
                blk = j // P
                if blk < n_full:
                    mb = blk * g + (j - blk * P) % g
                else:
                    mb = n_full * g + (j - J) % r_last
            else:
                mb = j
            if kind == "F":
                c = cf[j]
                act = (before - level0) + saved[c]
                where = f"forward mb={mb} chunk={c} ({stage}, {others} others in flight)"
            else:
                c = cbc[j] - vn
                act = before - level0
                where = f"backward mb={mb} chunk={c} ({stage}, {others} others in flight)"
    top = levels[-1] + (optimizer_transient + p2p_end * p2p if p2p else optimizer_transient)
    if top > peak:
        peak, at, where, act = top, 2 * total, "optimizer step", 0.0
    return RankTimeline(peak, where, at, w + (1 if S_ > 0 else 0)), act
