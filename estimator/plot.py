"""`--png FILE`: each pipeline stage's predicted memory at tensor resolution, stacked by category.

The picture is the predicted allocation stream (estimator.alloc_stream, the one the reserved-memory model and
--memory-snapshot replay): every tensor allocated and freed in order over start-up and three iterations, so each
forward and backward shows its sawtooth, not one block per microbatch. Drawn in the look of the tracer's timeline
(tracer/export.py: one panel per rank, MiB on y, forward / backward / optimizer marked in the same colours, the
peak marked and labelled) so a prediction and a measured run can be laid side by side; x is the allocation
event, not time. The modelled reserved memory (the caching-allocator model's replay of the same stream) is the
line above. matplotlib is optional: without it --png is refused with one line.
"""
from __future__ import annotations

import numpy as np

MiB = float(1 << 20)
MAX_PANELS = 8
MAX_POINTS = 20000     # events per panel drawn; longer streams keep each bin's highest moment
# The tracer's phase colours (tracer/export.py _PHASE_STYLE); the estimator does not import the tracer.
PHASES = {"F": ("forward", "#4C9F70"), "B": ("backward", "#E08E45"), "optimizer": ("optimizer", "#7E6BC4")}
LAYERS = (("parameters", "#1f3b73"), ("gradients", "#3f6fb5"), ("optimizer states", "#8fb3e0"),
          ("other persistent", "#b0b0b0"), ("activations", "#d9a441"), ("optimizer step", "#c05050"))
# A tensor's tag in the stream (alloc_stream.Stream.tags) -> its layer; any other tag is a segment's label.
_LAYER_OF = {"parameters": "parameters", "gradients": "gradients", "optimizer states": "optimizer states",
             "optimizer step": "optimizer step", "other": "other persistent", "gpu runtime": "other persistent",
             "attention buffer": "other persistent", "pipeline p2p": "other persistent"}


class PlotError(ValueError):
    pass


def _stages_to_draw(pp: int, worst: int) -> list:
    if pp <= MAX_PANELS:
        return list(range(pp))
    picks = {round(i * (pp - 1) / (MAX_PANELS - 2)) for i in range(MAX_PANELS - 1)} | {worst}
    return sorted(picks)


def stage_series(cfg, formula_set, est, pp_rank: int, conf=None) -> dict:
    """The stage's stream as per-event series: `series` (live bytes of each layer after each event), `phases`
    (the schedule phase each event belongs to), `reserved` (the caching-allocator model's reserved bytes after each
    event) and `peak_index` (the event after which the most bytes are live)."""
    from .alloc_stream import _context, _stage_events
    from .caching_allocator import replay
    rank = next(r for r in est.ranks if r.pp_rank == pp_rank)
    st = _stage_events(cfg, _context(cfg, formula_set), rank, 2, labelled=True)
    names = [name for name, _ in LAYERS]
    index = {name: i for i, name in enumerate(names)}
    n = len(st.events)
    delta = np.zeros((len(names), n))
    size: dict = {}
    for t, ev in enumerate(st.events):
        if ev[0] == "a":
            layer = index[_LAYER_OF.get(st.tags[ev[1]], "activations")]
            size[ev[1]] = (layer, ev[2])
            delta[layer, t] = ev[2]
        else:
            layer, nbytes = size.pop(ev[1])
            delta[layer, t] -= nbytes
    live = np.cumsum(delta, axis=1)
    phases = [""] * n
    bounds = st.marks + [(n, "")]
    for (start, phase), (end, _) in zip(bounds, bounds[1:]):
        phases[start:end] = [phase] * (end - start)
    reserved = np.array([r for _, r in replay(st.events, conf, timeline=True)["timeline"]], dtype=float)
    total = live.sum(axis=0)
    return {"series": {name: live[i] for i, name in enumerate(names)}, "phases": phases, "reserved": reserved,
            "total": total, "peak_index": int(np.argmax(total)) if n else 0}


def _bins(total: np.ndarray) -> np.ndarray:
    """Indices of the events drawn: all of them, or each bin's highest moment (so no peak is lost)."""
    n = len(total)
    if n <= MAX_POINTS:
        return np.arange(n)
    edges = np.linspace(0, n, MAX_POINTS + 1).astype(int)
    return np.array([lo + int(np.argmax(total[lo:hi])) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo])


def save(report, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--png needs matplotlib (pip install matplotlib)") from None
    est = report.estimate
    conf = report.reserved.conf if report.reserved is not None else None
    stages = _stages_to_draw(len(est.ranks), est.max_peak_pp_rank)
    fig, axes = plt.subplots(len(stages), 1, figsize=(11, 2.8 * len(stages) + 0.6), squeeze=False)
    for ax, p in zip(axes[:, 0], stages):
        rank = est.ranks[p]
        data = stage_series(report.cfg, report.formula_set, est, p, conf)
        keep = _bins(data["total"])
        xs = keep.astype(float)
        bottom = np.zeros(len(keep))
        for name, color in LAYERS:
            vals = data["series"][name][keep] / MiB
            if vals.any():
                ax.fill_between(xs, bottom, bottom + vals, step="post", color=color, lw=0, label=name)
            bottom = bottom + vals
        ax.plot(xs, data["reserved"][keep] / MiB, color="black", lw=0.7, drawstyle="steps-post",
                label="reserved (modelled)")
        trans = ax.get_xaxis_transform()
        for phase, (label, color) in PHASES.items():
            spans, start = [], None
            for i, ph in enumerate(data["phases"] + [""]):
                if ph == phase and start is None:
                    start = i
                elif ph != phase and start is not None:
                    spans.append((start, i - start))
                    start = None
            if spans:
                ax.broken_barh(spans, (0, 0.04), transform=trans, color=color, alpha=0.9, label=label)
        px = data["peak_index"]
        py = data["total"][px] / MiB if len(data["total"]) else 0.0
        top = max(py, float(data["reserved"].max()) / MiB if len(data["reserved"]) else 0.0)
        ax.plot([px], [py], "v", color="crimson", ms=8)
        n = max(len(data["total"]), 1)
        right = px > 0.6 * n
        ax.annotate(f"peak {py:,.0f} MiB: {rank.peak_phase}", (px, py), xytext=(-6 if right else 6, 9),
                    textcoords="offset points", fontsize=7.5, color="crimson", va="bottom",
                    ha="right" if right else "left", bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))
        ax.set_ylim(0, top * 1.3 if top > 0 else 1)
        ax.set_xlim(0, n)
        ax.set_ylabel("predicted memory (MiB)")
        ax.set_title(f"pipeline stage {p} (predicted, {est.schedule})", fontsize=9, loc="right")
        ax.grid(alpha=0.3, lw=0.5)
    handles, labels = axes[0, 0].get_legend_handles_labels()   # the same layers and phases on every panel
    fig.legend(handles, labels, loc="upper center", fontsize=7, ncol=len(labels), frameon=False)
    axes[-1, 0].set_xlabel("allocation event (start-up, then three iterations: every tensor allocated and freed)")
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / height))
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
