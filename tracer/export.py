"""Exports of parsed traces: a PyTorch memory snapshot pickle (opens in torch.cuda._memory_viz and the
https://pytorch.org/memory_viz page) and a PNG live-memory timeline with phases shaded and the peak marked."""
from __future__ import annotations

import pickle

import numpy as np

from .parse import CATEGORIES, K_BWD, K_FWD, K_ITER, K_OPTIM, K_RECOMPUTE, ParsedRank

MiB = 1024 * 1024


# ---------------------------------------------------------------------------------------------------- snapshot
def _frames_by_scope(pr: ParsedRank) -> list:
    """One frame list per scope row, innermost first like torch's own stacks; shared lists keep the pickle small.
    A frame reads `<scope name>:0:<op>` in memory_viz."""
    sc = pr.scopes
    frames: list = [None] * len(sc.open)
    for row in range(len(sc.open)):          # parents come before children in push order
        name = pr.scope_name(row)
        frame = {"filename": name, "line": 0, "name": name.split(":", 1)[-1]}
        p = int(sc.parent[row])
        frames[row] = [frame] + (frames[p] if p >= 0 else [])
    return frames


def to_snapshot(ranks: list[ParsedRank]) -> dict:
    """The dict torch.cuda.memory._snapshot() returns: `segments` (state at the end of the trace) and one
    `device_traces` list per rank (rank R shown as device R). The tracing allocator does not cache, so every
    allocation is its own segment: segment_alloc + alloc, then free_requested + free_completed + segment_free."""
    segments, device_traces = [], []
    for dev, pr in enumerate(ranks):
        a = pr.allocs
        frames = _frames_by_scope(pr)
        no_frames: list = []
        rec = pr.trace.records
        ptr = np.asarray(rec["ptr"])[a["idx"]].tolist()
        stream = np.asarray(rec["stream"])[a["idx"]].tolist()
        t_us = (pr.t_ns // 1000).tolist()
        cat = [CATEGORIES[c] for c in a["category"].tolist()]
        n = pr.n_events
        # events sorted by record index: mallocs at idx, frees at free idx (never-freed ones stay in `segments`)
        ev_idx = np.concatenate([a["idx"], a["free"][a["free"] < n]])
        ev_alloc = np.concatenate([np.arange(len(a["idx"])), np.flatnonzero(a["free"] < n)])
        ev_is_free = np.concatenate([np.zeros(len(a["idx"]), bool), np.ones(int((a["free"] < n).sum()), bool)])
        order = np.argsort(ev_idx, kind="stable")
        trace = []
        sizes, scopes = a["size"].tolist(), a["scope"].tolist()
        for i, j, is_free in zip(ev_idx[order].tolist(), ev_alloc[order].tolist(), ev_is_free[order].tolist()):
            fr = frames[scopes[j]] if scopes[j] >= 0 else no_frames
            base = {"addr": ptr[j], "size": sizes[j], "stream": stream[j], "time_us": t_us[i], "frames": fr}
            acts = (("free_requested", "free_completed", "segment_free") if is_free
                    else ("segment_alloc", "alloc"))
            trace.extend(dict(base, action=act, category=cat[j]) for act in acts)
        device_traces.append(trace)
        for j in np.flatnonzero(a["free"] >= n).tolist():
            fr = frames[scopes[j]] if scopes[j] >= 0 else no_frames
            block = {"address": ptr[j], "size": sizes[j], "requested_size": sizes[j],
                     "state": "active_allocated", "frames": fr}
            segments.append({"device": dev, "address": ptr[j], "total_size": sizes[j], "allocated_size": sizes[j],
                             "active_size": sizes[j], "requested_size": sizes[j], "stream": stream[j],
                             "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                             "frames": fr, "blocks": [block]})
    return {"segments": segments, "device_traces": device_traces,
            "allocator_settings": {"backend": "megatron-memtrace (no caching)"}}


def save_snapshot(ranks: list[ParsedRank], path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(to_snapshot(ranks), f, protocol=4)


# ---------------------------------------------------------------------------------------------------- PNG
_PHASE_STYLE = {K_FWD: ("forward", "#4C9F70"), K_BWD: ("backward", "#E08E45"),
                K_RECOMPUTE: ("recompute", "#C05050"), K_OPTIM: ("optimizer", "#7E6BC4")}


def _decimate(x: np.ndarray, y: np.ndarray, n_max: int = 20000):
    """Keep at most ~n_max points but every bucket's max, so the peak never disappears from the plot."""
    if len(y) <= n_max:
        return x, y
    step = int(np.ceil(len(y) / n_max))
    starts = np.arange(0, len(y), step)
    ymax = np.maximum.reduceat(y, starts)
    return x[starts], ymax


def plot_timeline(ranks: list[ParsedRank], path: str, x: str = "time") -> None:
    """One panel per rank: live MiB over time (or record index, x='events') with fwd/bwd/recompute/optimizer
    shaded, iterations separated, and the peak marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 2.8 * len(ranks) + 0.6), squeeze=False, sharex=False)
    for ax, pr in zip(axes[:, 0], ranks):
        if pr.n_events == 0:
            ax.set_title(f"rank {pr.rank}: empty trace")
            continue
        xs = pr.t_ns / 1e9 if x == "time" else np.arange(pr.n_events, dtype=float)
        sc = pr.scopes
        # zoom on the training iterations: the setup before them is usually long and flat
        iters = np.flatnonzero(sc.kind == K_ITER)
        lo = 0
        if len(iters):   # show the iterations and a little of the setup before them (30% of their span)
            x0 = xs[int(sc.open[iters].min())]
            lo = int(np.searchsorted(xs, x0 - 0.3 * (xs[-1] - x0)))
        xd, yd = _decimate(xs[lo:], pr.live[lo:] / MiB)
        ax.step(xd, yd, where="post", color="#1f3b73", lw=1.0, label="live memory")
        trans = ax.get_xaxis_transform()
        for k, (label, color) in _PHASE_STYLE.items():
            rows = np.flatnonzero((sc.kind == k) & (sc.close > lo))
            if k in (K_FWD, K_BWD):     # shade only the outermost fwd/bwd (chunks/nesting add nothing visually)
                rows = rows[~np.isin(sc.kind[np.maximum(sc.parent[rows], 0)], (K_FWD, K_BWD)) | (sc.parent[rows] < 0)]
            if len(rows) == 0:
                continue
            x0 = xs[sc.open[rows]]
            x1 = xs[np.minimum(sc.close[rows], pr.n_events - 1)]
            ax.broken_barh(list(zip(x0, x1 - x0)), (0, 1), transform=trans, color=color, alpha=0.22, label=label)
        for r in iters:
            ax.axvline(xs[sc.open[r]], color="grey", ls=":", lw=0.8)
            ax.text(xs[sc.open[r]], 0.98, f" {pr.scope_name(r)}", transform=trans, va="top", fontsize=7,
                    color="dimgrey")
        px, py = xs[pr.peak_index], pr.peak_bytes / MiB
        ax.plot([px], [py], "v", color="crimson", ms=8, label=f"peak {py:.3g} MiB")
        right = px > 0.6 * xd[-1] + 0.4 * xd[0]          # keep the label inside the axes
        ax.annotate(f"peak {py:.3g} MiB: {pr.peak_phase}", (px, py), xytext=(6 if not right else -6, 9),
                    textcoords="offset points", fontsize=7.5, color="crimson", va="bottom",
                    ha="right" if right else "left", bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))
        ax.set_ylim(0, py * 1.3 if py > 0 else 1)
        ax.set_ylabel("live memory (MiB)")
        ax.set_title(f"rank {pr.rank}" + _coords(pr), fontsize=9, loc="right")
        ax.grid(alpha=0.3, lw=0.5)
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=7, ncol=6, frameon=False)
    axes[-1, 0].set_xlabel("time since trace start (s)" if x == "time" else "trace record index")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _coords(pr: ParsedRank) -> str:
    c = pr.header.get("coords") or {}
    return ("  (" + " ".join(f"{k}{v}" for k, v in c.items()) + ")") if c else ""
