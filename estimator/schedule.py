"""Pipeline schedules as megatron-core runs them, and the memory timeline they produce on one rank.

Orders follow megatron/core/pipeline_parallel/schedules.py: forward_backward_no_pipelining (F,B per microbatch),
forward_backward_pipelining_without_interleaving (warmup = min(pp - rank - 1, M) forwards, steady 1F1B, cooldown
backwards) and forward_backward_pipelining_with_interleaving (get_pp_rank_microbatches warmup count and the
get_schedule_table order; backward visits model chunks in reverse).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

Step = Tuple[str, int, int]  # ("F" | "B", microbatch, model chunk)


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


def simulate(steps: Sequence[Step], chunks, static_bytes: float, optimizer_transient: float = 0.0,
             keep_events: bool = False, warmup: int = 0) -> RankTimeline:
    """chunks[c]: object with saved / fwd_extra / bwd_extra bytes per microbatch (activations.ChunkActivations).
    The level starts at the static bytes; a forward adds its chunk's saved bytes (its transient on top), a
    backward frees them (its transient on top of the level with them live); the optimizer step comes last."""
    level = float(static_bytes)
    peak, where, at = level, "start", -1
    live = best = 0
    events: List[Event] = []
    n_f = 0
    for i, (kind, mb, c) in enumerate(steps):
        ch = chunks[c]
        before = level
        if kind == "F":
            top = level + ch.fwd_extra
            level += ch.saved
            live += 1
            n_f += 1
            stage = "warmup" if n_f <= warmup else "steady"
        else:
            top = level + ch.bwd_extra
            level -= ch.saved
            live -= 1
            stage = "cooldown" if n_f == len(steps) // 2 and warmup else "steady"
        best = max(best, live)
        if top > peak:
            peak, at = top, i
            where = f"{'forward' if kind == 'F' else 'backward'} mb={mb} chunk={c} ({stage}, {live if kind == 'B' else live - 1} others in flight)"
        if keep_events:
            events.append(Event(i, kind, mb, c, before, top, level))
    top = level + optimizer_transient
    if top > peak:
        peak, at, where = top, len(steps), "optimizer step"
    if keep_events:
        events.append(Event(len(steps), "optimizer", -1, -1, level, top, level))
    return RankTimeline(peak, where, at, best, events)
