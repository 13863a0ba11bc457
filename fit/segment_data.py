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
    segs = [s for r in ranks for s in rank_segments(r)]
    later = any(s.iteration >= 1 for s in segs)
    segs = [s for s in segs if s.iteration >= 1 or not later]
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
