"""The predicted allocation stream as a PyTorch memory snapshot: the pickle torch.cuda.memory._snapshot() writes,
which PyTorch's memory_viz (https://pytorch.org/memory_viz, torch.cuda._memory_viz) opens, so a prediction sits
beside a snapshot of the real run (or tracer.export's snapshot of a traced one) in the same viewer.

Each pipeline stage is one device (stage r as device r). Its stream (estimator.alloc_stream, three iterations) is
replayed through the caching-allocator model (estimator.caching_allocator), which gives every tensor its address
and every new segment its cudaMalloc: `device_traces` holds segment_alloc / alloc / free_requested /
free_completed entries in stream order (time_us is the event's index), `segments` the allocator's state after
the last event. A tensor's one frame names what it is: a category (parameters, gradients, optimizer states,
optimizer step, pipeline p2p, ...) or, for activations from a program set, the segment label whose program made
it (`layers.*.mlp@linear_fc1`, `... (backward)`).
"""
from __future__ import annotations

import pickle

from .alloc_stream import ITERATIONS, _context, _stage_events
from .caching_allocator import CachingAllocator


def _frames(tag: str, cache: dict) -> list:
    hit = cache.get(tag)
    if hit is None:
        hit = cache[tag] = [{"filename": tag, "line": 0, "name": tag}]
    return hit


def stage_snapshot(events: list, tags: dict, device: int, conf=None) -> tuple:
    """(trace entries, segments) of one stage's stream replayed through the caching-allocator model."""
    m = CachingAllocator(conf)
    live: dict = {}
    trace: list = []
    frames: dict = {}
    for t, ev in enumerate(events):
        if ev[0] == "a":
            before = m.reserved
            block = m.alloc(ev[2])
            fr = _frames(tags.get(ev[1], "other"), frames)
            if m.reserved > before:
                trace.append({"action": "segment_alloc", "addr": m._seg_base(block), "size": m.reserved - before,
                              "stream": 0, "time_us": t, "frames": fr, "device": device})
            live[ev[1]] = (block, ev[2], fr)
            trace.append({"action": "alloc", "addr": block.ptr, "size": ev[2], "stream": 0, "time_us": t,
                          "frames": fr, "device": device})
        else:
            hit = live.pop(ev[1], None)
            if hit is None:
                continue
            block, size, fr = hit
            entry = {"addr": block.ptr, "size": size, "stream": 0, "time_us": t, "frames": fr, "device": device}
            trace.append(dict(entry, action="free_requested"))
            m.free(block)
            trace.append(dict(entry, action="free_completed"))
    requested = {id(b): (size, fr) for b, size, fr in live.values()}
    blocks = [b for b, _, _ in live.values()] + [b for pool in m.pools for b in pool.by_key.values() if b.mapped]
    by_segment: dict = {}
    for b in blocks:
        by_segment.setdefault(m._seg_base(b), []).append(b)
    segments = []
    for base in sorted(by_segment):
        seg_blocks = sorted(by_segment[base], key=lambda b: b.ptr)
        out_blocks, allocated, req_total = [], 0, 0
        for b in seg_blocks:
            size, fr = requested.get(id(b), (0, []))
            if b.allocated:
                allocated += b.size
                req_total += size
            out_blocks.append({"address": b.ptr, "size": b.size, "requested_size": size if b.allocated else b.size,
                               "state": "active_allocated" if b.allocated else "inactive", "frames": fr})
        total = sum(b.size for b in seg_blocks)
        segments.append({"device": device, "address": base, "total_size": total, "allocated_size": allocated,
                         "active_size": allocated, "requested_size": req_total, "stream": 0,
                         "segment_type": "small" if seg_blocks[0].small else "large",
                         "segment_pool_id": (0, 0), "is_expandable": bool(m.conf.expandable), "frames": [],
                         "blocks": out_blocks})
    return trace, segments


def predicted_snapshot(cfg, formula_set, est, conf=None, iterations: int = ITERATIONS) -> dict:
    """The snapshot dict of estimate `est` (same cfg and set): one device per pipeline stage."""
    ctx = _context(cfg, formula_set)
    traces, segments = [], []
    for rank in est.ranks:
        st = _stage_events(cfg, ctx, rank, iterations, labelled=True)
        trace, segs = stage_snapshot(st.events, st.tags, rank.pp_rank, conf)
        traces.append(trace)
        segments += segs
    return {"segments": segments, "device_traces": traces}


def save(cfg, formula_set, est, path: str, conf=None) -> None:
    with open(path, "wb") as f:
        pickle.dump(predicted_snapshot(cfg, formula_set, est, conf), f)
