"""A traced allocation stream replayed through the caching-allocator model (estimator.caching_allocator): what
`max_memory_reserved` would have been had the run used PyTorch's CUDA caching allocator. The tracing allocator
itself does not cache (each tensor is its own cudaMalloc), so on a GPU trace this is the reserved figure the
traced run did not show; on a CPU trace it is the same question asked of a CPU run's tensors. Modelled, not yet
validated on a GPU."""
from __future__ import annotations

import numpy as np

from estimator.caching_allocator import AllocatorConfig, replay as replay_model

from .parse import ParsedRank
from .parse import replay as pair_events


def allocation_events(pr: ParsedRank) -> list:
    """The rank's tensors in trace order: ("a", id, bytes) / ("f", id). Zero-byte allocations are left out (the
    caching allocator hands out no block for them); allocations never freed stay live."""
    r = pr.trace.records
    kind = np.ascontiguousarray(r["kind"])
    size = np.ascontiguousarray(r["size"]).astype(np.int64)
    _, m_idx, f_idx = pair_events(kind, np.ascontiguousarray(r["ptr"]), size)
    keep = size[m_idx] > 0
    m_idx, f_idx = m_idx[keep], f_idx[keep]
    freed = f_idx < len(kind)
    at = np.concatenate([m_idx, f_idx[freed]])
    order = np.argsort(at, kind="stable")
    ids = np.concatenate([m_idx, m_idx[freed]])[order].tolist()
    is_alloc = (np.arange(len(at)) < len(m_idx))[order].tolist()
    sizes = size[ids].tolist()
    return [("a", i, s) if a else ("f", i) for i, a, s in zip(ids, is_alloc, sizes)]


def modelled_reserved(pr: ParsedRank, conf: AllocatorConfig | None = None) -> dict:
    """caching_allocator.replay stats of the rank's stream (peak_reserved_bytes, peak_allocated_bytes with 512 B
    rounding, segments, ...)."""
    return replay_model(allocation_events(pr), conf)
