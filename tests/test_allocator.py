"""The C++ event core (csrc/tracealloc.cpp) through its host backend: format, exact counters, scopes, names,
truncation, flush at exit and on signals, and the build/load paths. Real library, no mocks."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from tracer import allocator as A

ROOT = Path(__file__).resolve().parent.parent

# Tiny independent reader (FORMATS.md 2.1); the product reader is tracer/trace_reader.py.
REC = np.dtype([("t_ns", "<u8"), ("ptr", "<u8"), ("size", "<u8"), ("stream", "<u8"), ("scope", "<u4"),
                ("tag", "<u4"), ("tid", "<u4"), ("device", "<i2"), ("kind", "u1"), ("flags", "u1")])
MALLOC, FREE, MALLOC_FAIL, PUSH, POP, MARK, DEVICE_MEM = range(1, 8)


def _checksum(words):
    """FORMATS 2.1's block checksum, written out again: sum of mix(word + index * golden), mix(x) = y ^ (y >> 32),
    y = x * 0xBF58476D1CE4E5B9 (mod 2**64)."""
    x = (words.astype(np.uint64) + np.arange(len(words), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) \
        * np.uint64(0xBF58476D1CE4E5B9)
    return int((x ^ (x >> np.uint64(32))).sum(dtype=np.uint64))


def read_trace(path, whole=True):
    """(header, records). Every block must check out; `whole`: and the file must end where its header says."""
    raw = Path(path).read_bytes()
    assert raw[:8] == b"MTRACE01"
    hdr = np.frombuffer(raw[:64], dtype=[("magic", "S8"), ("version", "<u4"), ("record_size", "<u4"),
                                         ("t0", "<u8"), ("pid", "<u4"), ("backend", "<u4"), ("end_state", "<u4"),
                                         ("end_signal", "<u4"), ("end_slots", "<u8"), ("reserved", "<u8"),
                                         ("check", "<u8")])[0]
    assert hdr["version"] == 2 and hdr["record_size"] == 48 == REC.itemsize
    assert _checksum(np.frombuffer(raw[:56], "<u8")) == hdr["check"]
    n_slots = (len(raw) - 64) // 48
    if whole:
        assert hdr["end_state"] in (1, 2) and n_slots == hdr["end_slots"] and len(raw) == 64 + 48 * n_slots
    slots = np.frombuffer(raw[64:64 + 48 * n_slots], dtype=REC)
    words = np.frombuffer(raw[64:64 + 48 * n_slots], "<u8").reshape(-1, 6)
    out, pos = [], 0
    while pos < n_slots:
        h = slots[pos]
        n = int(h["size"])
        assert h["kind"] == 0xFF and h["t_ns"] == 0x314B434F4C42544D and h["stream"] == pos and n >= 1, pos
        if pos + 1 + n > n_slots:
            assert not whole, "block cut short"
            break
        blk = words[pos:pos + 1 + n].copy()
        blk[0, 1] = 0
        assert _checksum(blk.reshape(-1)) == h["ptr"], f"block at slot {pos} damaged"
        out.append(slots[pos + 1:pos + 1 + n])
        pos += 1 + n
    return hdr, (np.concatenate(out) if out else np.zeros(0, REC))


def read_names(path):
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        i, name = line.split("\t", 1)
        out[int(i)] = name
    return out


def replay(recs):
    """Live bytes in file order; a FREE of an unknown pointer is ignored, a MALLOC of a live one replaces it."""
    live_map, live, peak = {}, 0, 0
    for kind, ptr, size in zip(recs["kind"].tolist(), recs["ptr"].tolist(), recs["size"].tolist()):
        if kind == MALLOC:
            live += size - live_map.get(ptr, 0)
            live_map[ptr] = size
            peak = max(peak, live)
        elif kind == FREE and ptr in live_map:
            live -= live_map.pop(ptr)
    return live, peak


def run_child(code, tmp_path, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture
def trace(tmp_path):
    prefix = tmp_path / "rank0"
    A.open_trace(prefix, "host")
    yield prefix
    A.close()


def test_header_and_record_layout(trace):
    lib = A.lib()
    p = lib.mt_host_malloc(123)
    lib.mt_host_free(p, 123)
    A.close()
    hdr, recs = read_trace(f"{trace}.trace")
    assert hdr["pid"] == os.getpid() and hdr["backend"] == 0
    assert recs["kind"].tolist() == [MALLOC, FREE]
    assert recs["ptr"].tolist() == [p, p] and recs["size"].tolist() == [123, 123]
    assert (recs["device"] == -1).all() and (recs["stream"] == 0).all() and (recs["flags"] == 0).all()
    assert recs["t_ns"][0] <= recs["t_ns"][1]


def test_many_threads_exact_counts_and_peak(trace):
    lib = A.lib()
    n_threads, n_ops = 8, 20000
    counts = [[0, 0] for _ in range(n_threads)]

    def work(k):
        rng = random.Random(k)
        held = []
        for _ in range(n_ops):
            if held and rng.random() < 0.45:
                p, s = held.pop(rng.randrange(len(held)))
                lib.mt_host_free(p, s)
                counts[k][1] += 1
            else:
                s = rng.randrange(1, 1 << 20)
                held.append((lib.mt_host_malloc(s), s))
                counts[k][0] += 1
        # leave some live on purpose: the final live level must match too

    ts = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    live, peak = A.live_bytes(), A.peak_bytes()
    A.close()
    _, recs = read_trace(f"{trace}.trace")
    assert (recs["kind"] == MALLOC).sum() == sum(c[0] for c in counts)
    assert (recs["kind"] == FREE).sum() == sum(c[1] for c in counts)
    assert len(recs) == n_threads * n_ops
    assert replay(recs) == (live, peak)
    assert np.all(np.diff(recs["t_ns"].astype(np.int64)) >= 0), "timestamps taken under the lock are monotone"
    assert len(set(recs["tid"].tolist())) == n_threads


def test_native_threads_bench_trace_is_exact(trace):
    # C++ threads with no GIL in between: the heaviest contention the core sees; crosses block flushes.
    ns = A.lib().mt_host_bench(400_000, 8, 1)
    assert ns > 0
    live, peak = A.live_bytes(), A.peak_bytes()
    A.close()
    _, recs = read_trace(f"{trace}.trace")
    assert len(recs) == 400_000
    assert (recs["kind"] == MALLOC).sum() == (recs["kind"] == FREE).sum() == 200_000
    assert live == 0 and replay(recs) == (0, peak)


def test_bench_without_trace_refuses_logging():
    A.close()
    assert A.lib().mt_host_bench(1000, 1, 1) == -1.0
    assert A.lib().mt_host_bench(1000, 1, 0) > 0


def test_scopes_nest_and_tag_events(trace):
    lib = A.lib()
    ptrs = {}
    with A.scope("iter:0") as s_iter:
        with A.scope("fwd:0") as s_fwd:
            ptrs["fwd"] = lib.mt_host_malloc(100)
            with A.scope("mod:decoder.layers.0.mlp") as s_mod:
                assert A.current_scope() == s_mod
                ptrs["mod"] = lib.mt_host_malloc(200)
            A.mark("mid")
        lib.mt_host_free(ptrs["mod"], 200)
    lib.mt_host_free(ptrs["fwd"], 100)
    assert A.pop_scope() == 0  # empty stack: nothing to close, nothing logged
    A.close()
    _, recs = read_trace(f"{trace}.trace")
    names = read_names(f"{trace}.names")
    assert (s_iter, s_fwd, s_mod) == (1, 2, 3)
    kinds = recs["kind"].tolist()
    assert kinds == [PUSH, PUSH, MALLOC, PUSH, MALLOC, POP, MARK, POP, FREE, POP, FREE]
    pushes = recs[recs["kind"] == PUSH]
    assert pushes["size"].tolist() == [1, 2, 3]          # new instance ids
    assert pushes["scope"].tolist() == [0, 1, 2]         # parent = current before the push
    assert [names[t] for t in pushes["tag"].tolist()] == ["iter:0", "fwd:0", "mod:decoder.layers.0.mlp"]
    assert recs[recs["kind"] == POP]["scope"].tolist() == [3, 2, 1]  # innermost closes first
    assert recs[recs["kind"] == MALLOC]["scope"].tolist() == [2, 3]
    assert recs[recs["kind"] == FREE]["scope"].tolist() == [1, 0]
    mark = recs[recs["kind"] == MARK][0]
    assert names[int(mark["tag"])] == "mid" and mark["scope"] == 2
    assert (recs[(recs["kind"] != PUSH) & (recs["kind"] != MARK)]["tag"] == 0).all()  # only PUSH/MARK carry tags


def test_names_file(trace):
    ids = [A.intern(n) for n in ["alpha", "βeta", "alpha", "with\ttab"]]
    assert ids[0] == ids[2] and len(set(ids)) == 3 and A.intern("") == 0
    names = read_names(f"{trace}.names")  # written immediately, before any flush
    assert names[0] == "" and names[ids[0]] == "alpha" and names[ids[1]] == "βeta"
    assert names[ids[3]] == "with tab"
    # a new trace repeats the whole table, so cached ids stay valid across open/close
    A.close()
    A.open_trace(trace.with_name("rank1"), "host")
    assert read_names(trace.with_name("rank1.names"))[ids[1]] == "βeta"


def test_unknown_free_ignored_and_reset_peak(trace):
    lib = A.lib()
    lib.mt_log_free(0xDEAD0, 777, -1, None)  # allocated "before tracing"
    p = lib.mt_host_malloc(1000)
    lib.mt_host_free(p, 1000)
    q = lib.mt_host_malloc(10)
    assert (A.live_bytes(), A.peak_bytes()) == (10, 1000)
    A.reset_peak()
    assert A.peak_bytes() == 10
    A.close()
    _, recs = read_trace(f"{trace}.trace")
    assert recs["size"][0] == 777 and replay(recs) == (10, 1000)
    assert read_names(f"{trace}.names")[int(recs[-1]["tag"])] == "reset_peak"
    lib.mt_host_free(q, 10)


def test_null_pointer_frees_match_no_empty_slot(trace):
    """torch's raw deleter may be called with nullptr. The pointer table marks empty slots with 0, so a lookup of
    nullptr once matched an empty slot and subtracted that slot's stale size (seen as a 12-byte gap between the
    allocator's peak and the replay in a TP=2 run). Counters must equal the replay of the file."""
    lib = A.lib()
    sizes = (16, 32, 48)
    ptrs = [lib.mt_host_malloc(n) for n in sizes]
    for p, n in zip(ptrs, sizes):
        lib.mt_host_free(p, n)
    lib.mt_log_free(None, 0, -1, None)       # never allocated: ignored
    lib.mt_log_malloc(None, 100, -1, None)   # a null key is still an ordinary key
    lib.mt_log_free(None, 0, -1, None)
    lib.mt_log_free(None, 0, -1, None)       # freed twice: the second is unknown
    counters = (A.live_bytes(), A.peak_bytes())
    A.close()
    _, recs = read_trace(f"{trace}.trace")
    assert counters == replay(recs) == (0, 100)


def test_reopen_starts_with_an_empty_pointer_map(tmp_path):
    """A pointer still live when one trace closes must not leak into the next trace's counters."""
    lib = A.lib()
    A.open_trace(tmp_path / "first", "host")
    lib.mt_log_malloc(0x100, 4000, -1, None)
    A.close()
    A.open_trace(tmp_path / "second", "host")
    lib.mt_log_malloc(0x100, 4000, -1, None)
    lib.mt_log_malloc(0x200, 1000, -1, None)
    assert (A.live_bytes(), A.peak_bytes()) == (5000, 5000)
    lib.mt_log_free(0x100, 4000, -1, None)
    assert (A.live_bytes(), A.peak_bytes()) == (1000, 5000)
    A.close()
    _, recs = read_trace(tmp_path / "second.trace")
    assert replay(recs) == (1000, 5000)


def test_truncated_file_keeps_complete_records(trace, tmp_path):
    from tracer.trace_reader import read_trace as product_read
    lib = A.lib()
    for i in range(100):
        lib.mt_host_free(lib.mt_host_malloc(i + 1), i + 1)
    A.close()
    full = Path(f"{trace}.trace").read_bytes()
    cut = tmp_path / "cut.trace"
    cut.write_bytes(full[:64 + 48 * 58 + 20])  # the block header, 57 records, part of the 58th
    (tmp_path / "cut.names").write_bytes(Path(f"{trace}.names").read_bytes())
    _, a = read_trace(f"{trace}.trace")
    with pytest.warns(RuntimeWarning, match="cut short"):
        b = product_read(cut)
    assert len(a) == 200 and len(b.records) == 57 and (a[:57] == b.records).all()
    assert b.truncated_bytes == 20 and b.end_state == "clean" and b.problems()


def test_cuda_backend_malloc_free_or_logged_failure(trace):
    """With a GPU: a real cudaMalloc/cudaFree pair. Without one (CPU CI, even with a CUDA toolkit but no driver,
    or no libcudart at all): nullptr and a MALLOC_FAIL record, never a crash."""
    lib = A.lib()
    assert lib.mt_cuda_malloc(0, 0, None) is None  # size 0: no allocation, no failure record
    p = lib.mt_cuda_malloc(4096, 0, None)
    if p:
        lib.mt_cuda_free(p, 4096, 0, None)
        assert A.device_mem(0)
    else:
        assert not A.device_mem(0)
    A.close()
    _, recs = read_trace(f"{trace}.trace")
    if p:
        assert recs["kind"].tolist() == [MALLOC, FREE, DEVICE_MEM] and (recs["device"] == 0).all()
        assert replay(recs) == (0, 4096) and recs[2]["size"] >= recs[2]["ptr"] > 0  # total >= free
    else:
        assert recs["kind"].tolist() == [MALLOC_FAIL] and recs["size"][0] == 4096 and recs["device"][0] == 0


def test_install_cuda_allocator_guarded_on_cpu_torch():
    torch = pytest.importorskip("torch")
    if hasattr(torch._C, "_cuda_customAllocator"):
        pytest.skip("CUDA torch build")
    with pytest.raises(RuntimeError, match="no CUDA support"):
        A.install_cuda_allocator()


CHILD_PRELUDE = """
    import os, signal, sys, time
    from tracer import allocator as A
    A.open_trace("rank0", "host")
    lib = A.lib()
    with A.scope("x"):
        for i in range(100):
            lib.mt_host_malloc(i + 1)
    print("ready", flush=True)
"""


@pytest.mark.parametrize("how,rc", [("exit", 0), ("sigterm", -signal.SIGTERM), ("sigsegv", -signal.SIGSEGV),
                                    ("sigint", None)])
def test_flush_at_exit_and_on_signals(tmp_path, how, rc):
    tail = {
        "exit": "sys.exit(0)",  # no close(), no flush(): atexit must do it
        "sigterm": "time.sleep(60)",
        "sigsegv": "import ctypes; ctypes.string_at(0)",
        "sigint": "time.sleep(60)",
    }[how]
    proc = run_child(CHILD_PRELUDE + "    " + tail + "\n", tmp_path)
    assert proc.stdout.readline().strip() == "ready"
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif how == "sigint":
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if rc is None:  # SIGINT chains to Python's handler: KeyboardInterrupt, then a normal exit path
        assert "KeyboardInterrupt" in err
    else:
        assert proc.returncode == rc, err
    _, recs = read_trace(tmp_path / "rank0.trace")
    assert recs["kind"].tolist() == [PUSH] + [MALLOC] * 100 + [POP]
    assert replay(recs) == (5050, 5050)
    assert read_names(tmp_path / "rank0.names")[1] == "x"


def test_sigkill_leaves_whole_flushed_blocks(tmp_path):
    code = """
        import os, signal
        from tracer import allocator as A
        A.open_trace("rank0", "host")
        lib = A.lib()
        for i in range(40000):  # more than one 32768-record block
            lib.mt_host_malloc(8)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    proc = run_child(code, tmp_path)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    size = (tmp_path / "rank0.trace").stat().st_size
    assert (size - 64) % 48 == 0 and (size - 64) // 48 == 1 + 32768  # one whole block: its header + records
    hdr, recs = read_trace(tmp_path / "rank0.trace", whole=False)
    assert hdr["end_state"] == 0  # never closed: the file says so
    assert len(recs) == 32768 and (recs["kind"] == MALLOC).all() and (recs["size"] == 8).all()


def test_import_does_not_import_torch(tmp_path):
    proc = run_child("import sys, tracer.allocator as A; A.lib(); print('torch' in sys.modules)", tmp_path)
    out, err = proc.communicate(timeout=60)
    assert out.strip() == "False", err


def test_cached_build_is_keyed_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    out = A.build()
    assert out.parent == tmp_path / "cache" and out.name.startswith("tracealloc-")
    mtime = out.stat().st_mtime_ns
    assert A.build() == out and out.stat().st_mtime_ns == mtime  # same source: no rebuild
    assert A._abi_ok(str(out))


def test_no_compiler_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++/c++/clang++ here
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(A.TracerBuildError, match=r"^megatron-memtrace: no C\+\+ compiler") as ei:
        A.build()
    assert "\n" not in str(ei.value)


def test_setuptools_extension_is_found_first(tmp_path, monkeypatch):
    """setup.py's optional extension builds without torch/CUDA headers and is preferred when present."""
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    built = list((tmp_path / "lib" / "tracer").glob("_tracealloc*.so"))
    assert len(built) == 1 and A._abi_ok(str(built[0]))
    monkeypatch.setattr(A, "_PKG_DIR", built[0].parent)
    monkeypatch.setattr(A, "_lib_path", None)
    assert A.library_path() == str(built[0])


def test_fatal_signals_during_busy_threaded_writes_leave_whole_traces(tmp_path):
    """8 native threads write through the core while each fatal signal the handler covers kills the process, twice
    each: the handler freezes the buffer and writes the block a normal flush would, so every trace reads whole
    (blocks check out, header says which signal), and replays consistently. benchmarks/signal_stress.py runs more."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from signal_stress import SIGNALS, kill_round
    rng = random.Random(13)
    for sig in SIGNALS:
        for r in range(2):
            d = tmp_path / f"{sig.name}_{r}"
            d.mkdir()
            n, bad = kill_round(str(d), sig, rng.uniform(0.003, 0.03))
            assert not bad and n > 0, (sig.name, r, bad)
