"""`--png FILE`: each pipeline stage's predicted memory over one iteration's schedule, stacked by category.

Drawn in the look of the tracer's timeline (tracer/export.py: one panel per rank, MiB on y, forward / backward /
optimizer shaded in the same colours, the peak marked and labelled) so a prediction and a measured run can be laid
side by side; x is the schedule's step (one forward or backward of one microbatch on one chunk), not time.
matplotlib is optional: without it --png is refused with one line.
"""
from __future__ import annotations

MiB = float(1 << 20)
MAX_PANELS = 8
# The tracer's phase colours (tracer/export.py _PHASE_STYLE); the estimator does not import the tracer.
PHASES = {"F": ("forward", "#4C9F70"), "B": ("backward", "#E08E45"), "optimizer": ("optimizer", "#7E6BC4")}
LAYERS = (("parameters", "#1f3b73"), ("gradients", "#3f6fb5"), ("optimizer states", "#8fb3e0"),
          ("other persistent", "#b0b0b0"), ("activations", "#d9a441"), ("transient", "#c05050"))


class PlotError(ValueError):
    pass


def _stages_to_draw(pp: int, worst: int) -> list:
    if pp <= MAX_PANELS:
        return list(range(pp))
    picks = {round(i * (pp - 1) / (MAX_PANELS - 2)) for i in range(MAX_PANELS - 1)} | {worst}
    return sorted(picks)


def stage_series(rank) -> dict:
    """Per schedule step (and the optimizer step): bytes of each stacked layer, the phases and the peak index."""
    st, events = rank.static, rank.timeline.events
    base = events[0].level_before   # the simulation starts at the static bytes (+ persistent buffers)
    fixed = {"parameters": st.weights_bytes, "gradients": st.grad_buffer_bytes,
             "optimizer states": st.optimizer_bytes, "other persistent": base - st.total_bytes}
    series = {name: [] for name, _ in LAYERS}
    phases, tops = [], []
    for e in events:
        for k, v in fixed.items():
            series[k].append(v)
        series["activations"].append(e.level_before - base)
        series["transient"].append(e.peak - e.level_before)
        phases.append(e.phase)
        tops.append(e.peak)
    peak_at = max(range(len(tops)), key=tops.__getitem__)
    return {"series": series, "phases": phases, "tops": tops, "peak_index": peak_at}


def save(report, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--png needs matplotlib (pip install matplotlib)") from None
    from estimator import memory as MEM
    est = MEM.estimate(report.cfg, report.formula_set, timeline=True)
    stages = _stages_to_draw(len(est.ranks), est.max_peak_pp_rank)
    fig, axes = plt.subplots(len(stages), 1, figsize=(11, 2.8 * len(stages) + 0.6), squeeze=False)
    for ax, p in zip(axes[:, 0], stages):
        rank = est.ranks[p]
        data = stage_series(rank)
        n = len(data["phases"])
        xs = list(range(n + 1))
        bottom = [0.0] * (n + 1)
        for name, color in LAYERS:
            vals = [v / MiB for v in data["series"][name]]
            vals.append(vals[-1])
            top = [b + v for b, v in zip(bottom, vals)]
            if any(vals):
                ax.fill_between(xs, bottom, top, step="post", color=color, lw=0, label=name)
            bottom = top
        trans = ax.get_xaxis_transform()
        for phase, (label, color) in PHASES.items():
            spans = [(i, 1) for i, ph in enumerate(data["phases"]) if ph == phase]
            if spans:
                ax.broken_barh(spans, (0, 0.04), transform=trans, color=color, alpha=0.9, label=label)
        px = data["peak_index"] + 0.5
        py = data["tops"][data["peak_index"]] / MiB
        ax.plot([px], [py], "v", color="crimson", ms=8)
        right = px > 0.6 * n
        ax.annotate(f"peak {py:,.0f} MiB: {rank.peak_phase}", (px, py), xytext=(-6 if right else 6, 9),
                    textcoords="offset points", fontsize=7.5, color="crimson", va="bottom",
                    ha="right" if right else "left", bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))
        ax.set_ylim(0, py * 1.3 if py > 0 else 1)
        ax.set_xlim(0, n)
        ax.set_ylabel("predicted memory (MiB)")
        ax.set_title(f"pipeline stage {p} (predicted, {est.schedule})", fontsize=9, loc="right")
        ax.grid(alpha=0.3, lw=0.5)
    handles, labels = axes[0, 0].get_legend_handles_labels()   # the same layers and phases on every panel
    fig.legend(handles, labels, loc="upper center", fontsize=7, ncol=len(labels), frameon=False)
    axes[-1, 0].set_xlabel("schedule step (forward / backward of one microbatch on one chunk; last: optimizer)")
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / height))
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
