"""Parser on traces written by the real C++ core: replay = the core's counters, pointer reuse, scope tree,
categories, per-op statistics, peak breakdown, speed."""
import threading

import numpy as np
import pytest

import tracer.allocator as A
from tracer.parse import (CATEGORIES, bench_parse, normalise_op, parse_file, parse_run, range_max)


def log_m(ptr, size):
    A.lib().mt_log_malloc(ptr, size, -1, None)


def log_f(ptr, size=0):
    A.lib().mt_log_free(ptr, size, -1, None)


@pytest.mark.parametrize("path,op,layer", [
    ("decoder.layers.7.mlp.linear_fc1", "layers.*.mlp.linear_fc1", 7),
    ("module.module.decoder.layers.12.self_attention", "layers.*.self_attention", 12),
    ("module.0.decoder.layers.3", "layers.*", 3),
    ("decoder.final_layernorm", "final_layernorm", None),
    ("module.embedding.word_embeddings", "embedding.word_embeddings", None),
    ("output_layer", "output_layer", None),
    ("", "model", None),
    ("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1", "layers.*.mlp.experts.local_experts.*.linear_fc1", 2),
    ("decoder.layers.2.mlp.experts.local_experts.11", "layers.*.mlp.experts.local_experts.*", 2),
])
def test_normalise_op(path, op, layer):
    assert normalise_op(path) == (op, layer)


def test_replay_pairs_reused_pointers_and_ignores_unknown_frees(tmp_path):
    A.open_trace(str(tmp_path / "rank0"), "host")
    log_f(0x9000, 777)             # allocated before tracing: ignored by counter and replay
    log_m(0x1000, 100)
    log_m(0x2000, 300)
    log_f(0x1000)
    log_m(0x1000, 50)              # address reused with another size
    log_f(0x2000)
    log_f(0x2000)                  # double free: ignored
    log_m(0x3000, 1000)
    log_f(0x1000)
    log_m(0x3000, 200)             # MALLOC of a live pointer replaces the old allocation (core's rule)
    peak, live = A.peak_bytes(), A.live_bytes()
    A.close()
    pr = parse_file(str(tmp_path / "rank0.trace"))
    assert (peak, live) == (pr.peak_bytes, int(pr.live[-1])) == (1050, 200)
    assert pr.live.tolist() == [0, 100, 400, 300, 350, 50, 50, 1050, 1000, 200]
    a = pr.allocs
    assert a["size"].tolist() == [100, 300, 50, 1000, 200]
    assert a["free"].tolist() == [3, 5, 8, 9, 10]     # record index that ends it; 10 = never freed


def test_replay_equals_counters_with_many_threads(tmp_path):
    """8 threads doing host malloc/free concurrently: the replayed peak and final live equal the core's."""
    A.open_trace(str(tmp_path / "rank0"), "host")
    L = A.lib()

    def work(seed):
        rng = np.random.default_rng(seed)
        held = []
        for n in rng.integers(1, 5000, size=3000).tolist():
            held.append((L.mt_host_malloc(n), n))
            if len(held) > 20 or rng.random() < 0.4:
                p, m = held.pop(int(rng.integers(len(held))))
                L.mt_host_free(p, m)
        for p, m in held[:5]:
            L.mt_host_free(p, m)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    peak, live = A.peak_bytes(), A.live_bytes()
    A.close()
    pr = parse_run(str(tmp_path))[0]
    assert pr.peak_bytes == peak and int(pr.live[-1]) == live and pr.n_events > 8 * 3000
    assert len(set(pr.trace.records["tid"].tolist())) >= 2


_BASE = 0


def training_like_trace(prefix):
    """Setup (params, ddp grad buffer), then 2 iterations x 2 microbatches with op scopes, backward layers,
    grad sync and an optimizer step, with known sizes."""
    global _BASE
    _BASE += 1 << 32      # fresh addresses per trace: the core keeps its pointer map across open_trace calls
    log_m = lambda p, n: A.lib().mt_log_malloc(_BASE + p, n, -1, None)   # noqa: E731
    log_f = lambda p: A.lib().mt_log_free(_BASE + p, 0, -1, None)       # noqa: E731
    A.open_trace(prefix, "host")
    with A.scope("setup:model"):
        log_m(0x100, 4000)                        # parameter
    with A.scope("setup:ddp"):
        log_m(0x200, 4000)                        # gradient buffer
    log_m(0x300, 10)                              # setup scratch, freed before training: other
    log_f(0x300)
    A.mark("setup_done")
    addr = 0x10000
    for it in range(2):
        with A.scope(f"iter:{it}"):
            saved = []
            for mb in range(2):
                with A.scope(f"fwd:{mb}"):
                    for layer in range(2):
                        with A.scope(f"mod:decoder.layers.{layer}"):
                            with A.scope(f"mod:decoder.layers.{layer}.mlp"):
                                addr += 0x100; log_m(addr, 300); saved.append(addr)   # saved by mlp
                                addr += 0x100; log_m(addr, 50); log_f(addr)          # temporary
                            addr += 0x100; log_m(addr, 20); saved.append(addr)       # saved by the layer itself
                            addr += 0x100; log_m(addr, 7); tmp = addr
                            with A.scope(f"mod:decoder.layers.{layer}.mlp"):
                                pass
                            log_f(tmp)                                              # temporary, layer level
                    with A.scope("pp_send"):
                        addr += 0x100; log_m(addr, 33); log_f(addr)                 # communication
            for mb in range(2):
                with A.scope(f"bwd:{mb}"):
                    for layer in (1, 0):
                        with A.scope(f"bwdlayer:decoder.layers.{layer}"):
                            addr += 0x100; log_m(addr, 500); log_f(addr)            # bwd transient
                            log_f(saved.pop()); log_f(saved.pop())
            with A.scope("grad_sync"):
                addr += 0x100; log_m(addr, 64); log_f(addr)
            with A.scope("optim"):
                if it == 0:
                    log_m(0x400, 8000)                                              # optimizer state
                addr += 0x100; log_m(addr, 4000); log_f(addr)                       # temporary in the step
        A.mark(f"iter_end:{it}")
    peak = A.peak_bytes()
    A.close()
    return peak


def test_training_like_trace_stats_and_categories(tmp_path):
    peak = training_like_trace(str(tmp_path / "rank0"))
    pr = parse_run(str(tmp_path))[0]
    assert pr.peak_bytes == peak == pr.counter_peak_bytes
    # op statistics: saved per op per layer per microbatch, innermost attribution
    rows = {(r["op"], r["layer"], r["microbatch"], r["iteration"]): r for r in pr.op_stats}
    assert len(rows) == 2 * 2 * 2 * 2
    for it in range(2):
        for mb in range(2):
            for layer in range(2):
                mlp = rows[("layers.*.mlp", layer, mb, it)]
                lay = rows[("layers.*", layer, mb, it)]
                assert mlp["saved_bytes"] == 300 and lay["saved_bytes"] == 20
                assert mlp["fwd_peak_bytes"] == 350 and lay["fwd_peak_bytes"] == 350
                assert mlp["bwd_peak_bytes"] is None and lay["bwd_peak_bytes"] == 500
    # categories of every allocation
    a = pr.allocs
    cat = {int(i): CATEGORIES[c] for i, c in zip(a["idx"], a["category"])}
    by_size = {}
    for i, s in zip(a["idx"].tolist(), a["size"].tolist()):
        by_size.setdefault(s, set()).add(cat[i])
    assert by_size[4000] == {"parameter", "gradient", "temporary"}
    assert by_size[8000] == {"optimizer"}
    assert by_size[10] == {"other"}
    assert by_size[300] == by_size[20] == {"saved"}
    assert by_size[50] == by_size[7] == by_size[500] == {"temporary"}
    assert by_size[33] == by_size[64] == {"communication"}
    # the peak: first reached in iteration 0 optimizer step (8000 state + 4000 temp on 8000 static)
    assert peak == 4000 + 4000 + 8000 + 4000
    assert pr.peak_phase.startswith("optimizer step, iteration 0")
    assert pr.peak_scope_path == ["iter:0", "optim"]
    assert sum(pr.peak_by_category.values()) == peak
    assert pr.peak_by_category == {"parameter": 4000, "gradient": 4000, "optimizer": 8000, "saved": 0,
                                   "temporary": 4000, "communication": 0, "other": 0}
    assert sum(r["bytes"] for r in pr.peak_by_op) == peak
    assert {(r["op"], r["category"]) for r in pr.peak_by_op} == {
        ("optim", "optimizer"), ("optim", "temporary"), ("setup:model", "parameter"), ("setup:ddp", "gradient")}


def test_scope_tree(tmp_path):
    training_like_trace(str(tmp_path / "rank0"))
    pr = parse_run(str(tmp_path))[0]
    sc = pr.scopes
    assert (sc.close > sc.open).all() and (sc.close < pr.n_events).all()
    has_parent = sc.parent >= 0
    assert (sc.depth[has_parent] == sc.depth[sc.parent[has_parent]] + 1).all()
    assert (sc.open[sc.parent[has_parent]] < sc.open[has_parent]).all()
    assert (sc.close[sc.parent[has_parent]] > sc.close[has_parent]).all()
    # every MALLOC's innermost scope (rebuilt) is the one the core recorded
    rec_scope = pr.trace.records["scope"][pr.allocs["idx"]].astype(np.int64)
    rebuilt = np.where(pr.allocs["scope"] >= 0, sc.id[np.maximum(pr.allocs["scope"], 0)], 0)
    assert (rec_scope == rebuilt).all()
    i = int(np.flatnonzero(sc.kind == 2)[1])  # second fwd scope
    assert pr.scope_path(i)[:2] == ["iter:0", "fwd:1"]


def test_range_max_nested():
    a = np.array([0, 5, 1, 9, 2, 3])
    assert range_max(a, np.array([0, 1, 4, 2]), np.array([5, 2, 5, 2])).tolist() == [9, 5, 3, 1]


def test_parser_speed():
    """Regression guard (best of 3, the machine may be shared); benchmarks/parse_speed.py reports the number."""
    eps = max(bench_parse(500_000) for _ in range(3))
    assert eps > 1e6, f"{eps:.3g} events/s"
