"""The CPU allocator hook (csrc/cpu_hook.cpp): real torch CPU allocations reach the event core.

Each check runs in a subprocess: the hook replaces torch's process-wide CPU allocator and cannot be undone.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
REC = np.dtype([("t_ns", "<u8"), ("ptr", "<u8"), ("size", "<u8"), ("stream", "<u8"), ("scope", "<u4"),
                ("tag", "<u4"), ("tid", "<u4"), ("device", "<i2"), ("kind", "u1"), ("flags", "u1")])
MALLOC, FREE, MALLOC_FAIL, PUSH, POP, MARK = range(1, 7)


def read_trace(path):
    raw = Path(path).read_bytes()
    assert raw[:8] == b"MTRACE01"
    backend = int(np.frombuffer(raw[28:32], "<u4")[0])
    n = (len(raw) - 64) // 48
    return backend, np.frombuffer(raw[64:64 + 48 * n], dtype=REC)


def replay(recs):
    live_map, live, peak = {}, 0, 0
    for kind, ptr, size in zip(recs["kind"].tolist(), recs["ptr"].tolist(), recs["size"].tolist()):
        if kind == MALLOC:
            live += size - live_map.get(ptr, 0)
            live_map[ptr] = size
            peak = max(peak, live)
        elif kind == FREE and ptr in live_map:
            live -= live_map.pop(ptr)
    return live, peak


def run(code, tmp_path, timeout=240, env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    script = tmp_path / "child.py"  # a file, not -c: torch.multiprocessing's spawn re-imports __main__
    script.write_text(textwrap.dedent(code))
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def events_of(recs, ptr):
    sel = recs[recs["ptr"] == ptr]
    return list(zip(sel["kind"].tolist(), sel["size"].tolist()))


def test_tensors_matmul_autograd_threads(tmp_path):
    out = run("""
        import json, threading, torch
        from tracer import allocator as A, cpu_hook
        torch.set_num_threads(1)
        cpu_hook.install("rank0")
        r = {}
        x = torch.empty(1000, dtype=torch.float32); r["empty"] = x.data_ptr(); del x
        a = torch.randn(64, 32, requires_grad=True); b = torch.randn(32, 16)
        with A.scope("fwd:0"):
            c = a @ b; r["matmul"] = c.data_ptr()
            h = torch.sigmoid(c); r["saved"] = h.data_ptr()   # sigmoid saves its output for backward
            loss = h.sum()
            del c, h                                          # only the autograd graph keeps `saved` alive
        A.mark("fwd_done")
        with A.scope("bwd:0"):
            loss.backward()
        del loss
        r["grad"] = a.grad.data_ptr()
        def worker():
            t = torch.ones(256, dtype=torch.float64); r["thread"] = t.data_ptr(); del t
        th = threading.Thread(target=worker); th.start(); th.join()
        try:
            torch.empty(1 << 60, dtype=torch.uint8)  # impossible: logged as MALLOC_FAIL, torch still raises
        except RuntimeError:
            r["oom_raised"] = True
        r["live"], r["peak"] = A.live_bytes(), A.peak_bytes()
        r["slow"] = cpu_hook.slow_allocs()
        A.close()
        print(json.dumps(r))
    """, tmp_path)
    backend, recs = read_trace(tmp_path / "rank0.trace")
    assert backend == 2
    assert events_of(recs, out["empty"])[:2] == [(MALLOC, 4000), (FREE, 4000)]
    assert events_of(recs, out["matmul"])[0] == (MALLOC, 64 * 16 * 4)
    # the saved sigmoid output is freed in backward, not when the Python name went away
    kinds = recs["kind"].tolist()
    mark_at = kinds.index(MARK)
    saved = np.flatnonzero(recs["ptr"] == out["saved"])
    assert recs["kind"][saved[0]] == MALLOC and saved[0] < mark_at
    assert recs["kind"][saved[1]] == FREE and saved[1] > mark_at
    assert recs["scope"][saved[1]] == 2  # inside bwd:0 (instance 2)
    assert events_of(recs, out["grad"])[0] == (MALLOC, 64 * 32 * 4)
    th = np.flatnonzero(recs["ptr"] == out["thread"])
    assert recs["tid"][th[0]] != recs["tid"][0] and recs["size"][th[0]] == 2048
    fail = recs[recs["kind"] == MALLOC_FAIL]
    assert out["oom_raised"] and fail["size"].tolist() == [1 << 60]
    assert replay(recs) == (out["live"], out["peak"])
    assert out["slow"] == 0  # torch's default CPU allocator takes the no-extra-context path


def test_gloo_worker_threads_are_traced(tmp_path):
    """Two gloo ranks with async collectives: gloo allocates and frees on its own worker threads, and the
    allocator-level hook sees those events (a per-thread profiler would not)."""
    out = run("""
        import json, os, time, torch, torch.distributed as dist, torch.multiprocessing as mp
        def main(rank):
            from tracer import allocator as A, cpu_hook
            cpu_hook.install(f"rank{rank}")
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
            dist.init_process_group("gloo", rank=rank, world_size=2)
            works, outs = [], []
            with A.scope("grad_sync"):
                for _ in range(4):
                    works.append(dist.all_reduce(torch.full((1 << 16,), float(rank + 1)), async_op=True))
                    outs.append([torch.empty(1 << 14) for _ in range(2)])
                    works.append(dist.all_gather(outs[-1], torch.full((1 << 14,), float(rank)), async_op=True))
                for w in works:
                    w.wait()
            ok = all(o[1][0].item() == 1.0 for o in outs)
            del works, outs
            time.sleep(0.2)  # gloo may drop its last references a little late
            dist.barrier(); dist.destroy_process_group()
            json.dump({"ok": ok, "live": A.live_bytes(), "peak": A.peak_bytes()}, open(f"rank{rank}.out", "w"))
            A.close()
        if __name__ == "__main__":
            mp.spawn(main, nprocs=2)
            print(json.dumps([json.load(open(f"rank{r}.out")) for r in range(2)]))
    """, tmp_path, env={"PORT": str(29700 + os.getpid() % 200)})
    for rank in range(2):
        _, recs = read_trace(tmp_path / f"rank{rank}.trace")
        assert out[rank]["ok"]
        assert replay(recs) == (out[rank]["live"], out[rank]["peak"])
        ev = recs[(recs["kind"] == MALLOC) | (recs["kind"] == FREE)]
        main_tid = recs["tid"][0]
        other = ev[ev["tid"] != main_tid]
        assert (other["kind"] == MALLOC).any() and (other["kind"] == FREE).any(), "no events from gloo threads"
