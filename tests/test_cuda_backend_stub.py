"""The CUDA backend of csrc/tracealloc.cpp against a stub cudart (tests/stub_cudart/stub_cudart.c, compiled here):
the dlsym binding (through RTLD_DEFAULT and through the search of loaded libraries by soname), the
CUDAPluggableAllocator entry points, cudaMemGetInfo readings at marks, a refused cudaMalloc. The real tracer and
the real reader and parser; only the CUDA runtime is stubbed. The trace must say exactly what the stub saw."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracer import allocator as A
from tracer.parse import parse_trace
from tracer.trace_reader import DEVICE_MEM, FREE, MALLOC, MALLOC_FAIL, read_trace

HERE = Path(__file__).resolve().parent / "stub_cudart"
ROOT = HERE.parent.parent
CONTEXT = {0: 512 << 20, 1: 300 << 20}   # the stub's fake per-device context (stub_cudart.c g_context)


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    cc = next((shutil.which(c) for c in (os.environ.get("CC"), "gcc", "cc", "clang") if c and shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler (gcc/cc/clang or $CC) to build the stub cudart")
    out = tmp_path_factory.mktemp("stub") / "libstub_cudart.so"
    subprocess.run([cc, "-O1", "-fPIC", "-shared", str(HERE / "stub_cudart.c"), "-o", str(out)], check=True)
    return out


def drive(stub, tmp_path, mode):
    prefix = tmp_path / "rank0"
    # A.build(): the library of the current source (a prebuilt one in tracer/ may predate it)
    env = dict(os.environ, MEMTRACE_LIB=str(A.build()), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(HERE / "drive.py"), str(stub), mode, str(prefix)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout), prefix


@pytest.mark.parametrize("mode", ["global", "soname"])
def test_trace_is_what_the_runtime_saw(stub, tmp_path, mode):
    seen, prefix = drive(stub, tmp_path, mode)
    if mode == "global":
        assert seen["source"] == "process (RTLD_DEFAULT)"
    else:
        assert seen["source"].endswith("/libcudart.so.12")

    tr = read_trace(str(prefix))
    assert tr.backend == "cuda" and tr.end_state == "clean" and not tr.problems()
    r = tr.records
    mem = np.isin(r["kind"], [MALLOC, FREE, MALLOC_FAIL, DEVICE_MEM])
    got = [[int(k), int(d), int(p), int(s)] for k, d, p, s in zip(r["kind"][mem], r["device"][mem], r["ptr"][mem],
                                                                  r["size"][mem])]
    # Record for record: MALLOC/FREE (pointer, size), MALLOC_FAIL (0, size), DEVICE_MEM (free, total), each with
    # the device; a refused malloc is logged by the stub with pointer 0 as well.
    assert got == seen["log"]
    assert len(got) > 300
    calls = r[np.isin(r["kind"], [MALLOC, FREE, MALLOC_FAIL])]
    assert (calls["stream"] == seen["stream"]).all()

    # Peak and live: the parser's replay, the tracer's own counters and the stub's books agree.
    level = peak = 0
    for kind, _, _, size in seen["log"]:
        level += size if kind == MALLOC else -size if kind == FREE else 0
        peak = max(peak, level)
    pr = parse_trace(tr)
    assert pr.peak_bytes == seen["tracer_peak"] == peak
    assert int(pr.live[-1]) == seen["tracer_live"] == sum(seen["used"]) == level > 0

    # Device readings: one per mark on the current device, plus the explicit reading of device 1. What the device
    # uses beyond the tracer's live bytes is the stub's fixed context (nothing else holds its memory).
    infos = [x for x in seen["log"] if x[0] == DEVICE_MEM]
    assert [(d["mark"], d["device"], d["free"], d["total"]) for d in pr.device_readings] == \
        [("start", 0, *infos[0][2:]), ("mid", 0, *infos[1][2:]), ("mid", 1, *infos[2][2:]),
         ("after_fail", 0, *infos[3][2:])]
    for d in pr.device_readings:
        used_here = d["live"] if d["device"] == 0 else 0   # the device-1 block was freed before its reading
        assert d["total"] - d["free"] - used_here == CONTEXT[d["device"]]
    assert seen["set_device_calls"] == 4   # the driver's two, and the tracer's switch to device 1 and back

    # The refused cudaMalloc: one MALLOC_FAIL of its size, and the runtime's error cleared (cudaGetLastError), as
    # torch's caching allocator does, so the next CUDA call does not report a stale error.
    assert pr.malloc_failures == [{"index": pr.malloc_failures[0]["index"], "size": seen["fail_size"], "device": 0}]
    assert seen["get_last_error_calls"] == 1 and seen["pending_error"] == 0
