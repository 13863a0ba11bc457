"""Parsed traces -> per-segment samples: what each op's own code adds and peaks at, forward and backward.

tracer.segments cuts every microbatch into segments labelled by op (`layers.*.mlp@linear_fc1`, ...). Per run and
label this reduces them over layers, microbatches, ranks and iterations >= 1 (iteration 0 is warm-up) to one value
per quantity: `fwd_delta`, `fwd_peak`, `bwd_delta`, `bwd_peak` (the most common value; segments of one label on
identical layers allocate identically), with the range of the values reduced. These are the
numbers a composed estimate replays, so a label's values must depend only on the switches of the ops around it:
`compare_runs` shows, for two configs, which labels agree and which do not.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

QUANTITIES = ("fwd_delta", "fwd_peak", "bwd_delta", "bwd_peak")


@dataclass
class SegmentSample:
    run: str
    label: str
    in_layer: bool
    values: dict                                   # quantity -> int (absent: the phase has no such segment)
    spread: dict = field(default_factory=dict)     # quantity -> (min, max) over the reduced segments


def run_samples(path: str, ranks: list | None = None) -> dict[str, SegmentSample]:
    """label -> SegmentSample for one run directory (all ranks pooled)."""
    from tracer.parse import parse_run
    from tracer.segments import rank_segments
    ranks = parse_run(path) if ranks is None else ranks
    segs = [(i, s) for i, r in enumerate(ranks) for s in rank_segments(r)]
    later = any(s.iteration >= 1 for _, s in segs)
    segs = fold_siblings([(i, s) for i, s in segs if s.iteration >= 1 or not later])
    by: dict[str, dict[str, list[int]]] = {}
    for s in segs:
        d = by.setdefault(s.label, {})
        d.setdefault(f"{s.phase}_delta", []).append(s.delta)
        d.setdefault(f"{s.phase}_peak", []).append(s.peak)
    out = {}
    for label, d in by.items():
        vals = {q: Counter(xs).most_common(1)[0][0] for q, xs in d.items()}
        spread = {q: (min(xs), max(xs)) for q, xs in d.items()}
        out[label] = SegmentSample(path, label, label.startswith("layers.*"), vals, spread)
    return out


def fold_siblings(segs: list) -> list:
    """Segments ([(rank index, Segment)]) with the instances of a label repeated within one call of its enclosing
    op (a SequentialMLP's local experts) made alike, so one value per label composes: the tensors they share are
    freed in backward by whichever instance runs last, and a transient (the experts' outputs joined) comes after the
    last one in forward. Per call, each instance gets the largest instance peak, and each backward delta the label's
    most common one, the difference going to the enclosing op's own code that runs after them (its code before its
    first child). Returns the Segments."""
    import dataclasses
    groups: dict = {}
    for i, s in segs:
        groups.setdefault((i, s.iteration, s.microbatch, s.chunk, s.layer, s.phase), []).append(s)
    common = {}
    for _, s in segs:
        common.setdefault((s.label, s.phase), []).append(s.delta)
    common = {k: Counter(v).most_common(1)[0][0] for k, v in common.items()}
    out = []
    for group in groups.values():
        count = Counter(s.label for s in group)
        if max(count.values()) == 1:
            out += group
            continue
        peak = {}
        for s in group:
            peak[s.label] = max(peak.get(s.label, s.peak), s.peak)
        moved: dict = {}
        fixed = []
        for s in group:
            if count[s.label] == 1:
                fixed.append(s)
                continue
            delta = s.delta
            if s.phase == "bwd":
                owner = _single_ancestor(s.label, count)
                if owner is not None:
                    delta = common[(s.label, s.phase)]
                    moved[owner] = moved.get(owner, 0) + s.delta - delta
            fixed.append(dataclasses.replace(s, delta=delta, peak=peak[s.label]))
        out += [dataclasses.replace(s, delta=s.delta + moved[s.label]) if s.label in moved else s for s in fixed]
    return out


def _single_ancestor(label: str, count: Counter) -> str | None:
    """The nearest op enclosing `label` that runs once in its group of segments (count: label -> instances)."""
    parts = label.split("@", 1)[0].split(".")
    while parts:
        name = ".".join(parts)
        if count.get(name) == 1:
            return name
        parts.pop()
    return None


def compare_runs(a: dict[str, SegmentSample], b: dict[str, SegmentSample], slack: int = 0) -> list[tuple]:
    """[(label, quantity, value in a, value in b)] for every label both have, where the values differ by more than
    `slack` bytes; labels only one run has come back with None on the other side."""
    out = []
    for label in sorted(set(a) | set(b)):
        sa, sb = a.get(label), b.get(label)
        if sa is None or sb is None:
            out.append((label, "*", None if sa is None else "present", None if sb is None else "present"))
            continue
        for q in QUANTITIES:
            va, vb = sa.values.get(q), sb.values.get(q)
            if va != vb and (va is None or vb is None or abs(va - vb) > slack):
                out.append((label, q, va, vb))
    return out
