"""Trace reader on traces written by the real C++ core (host backend): header, records, names, truncation,
bad files."""
import os
import shutil
import warnings

import numpy as np
import pytest

import tracer.allocator as A
from tracer.trace_reader import (MALLOC, FREE, RECORD_DTYPE, SCOPE_POP, SCOPE_PUSH, MARK, TraceFormatError,
                                 find_traces, read_trace)


def small_trace(prefix):
    """push a scope, 3 host mallocs (one freed inside it), pop, free the rest, mark."""
    A.open_trace(prefix, "host")
    L = A.lib()
    with A.scope("mod:decoder.layers.0.mlp"):
        p = [L.mt_host_malloc(n) for n in (1000, 2048, 64)]
        L.mt_host_free(p[2], 64)
    L.mt_host_free(p[0], 1000)
    L.mt_host_free(p[1], 2048)
    A.mark("iter_end:0")
    A.close()
    return prefix + ".trace"


def test_header_records_names(tmp_path):
    path = small_trace(str(tmp_path / "rank0"))
    t = read_trace(path)
    assert t.backend == "host" and t.pid == os.getpid() and t.version == 1 and t.truncated_bytes == 0
    assert t.records.dtype == RECORD_DTYPE and RECORD_DTYPE.itemsize == 48
    assert t.records["kind"].tolist() == [SCOPE_PUSH, MALLOC, MALLOC, MALLOC, FREE, SCOPE_POP, FREE, FREE, MARK]
    assert t.records["size"][1:4].tolist() == [1000, 2048, 64]
    assert np.all(np.diff(t.records["t_ns"].astype(np.int64)) >= 0)
    assert t.name(int(t.records["tag"][0])) == "mod:decoder.layers.0.mlp"
    assert t.name(int(t.records["tag"][-1])) == "iter_end:0"
    # the same trace through every spelling of its path
    for alias in (str(tmp_path / "rank0"), str(tmp_path / "rank0.names")):
        assert len(read_trace(alias).records) == 9
    assert find_traces(str(tmp_path)) == [path]


def test_truncated_trace_reads_complete_records_and_warns_once(tmp_path):
    path = small_trace(str(tmp_path / "rank0"))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 48 - 17)            # lose the MARK and 31 bytes of the last FREE
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = read_trace(path)
    assert len(w) == 1 and "truncated" in str(w[0].message)
    assert len(t.records) == 7 and t.truncated_bytes == 31
    with open(path, "r+b") as f:          # header only: zero records, no crash
        f.truncate(64)
    assert len(read_trace(path).records) == 0


def test_torn_names_line_is_skipped(tmp_path):
    path = small_trace(str(tmp_path / "rank0"))
    with open(str(tmp_path / "rank0.names"), "a") as f:
        f.write("77\tpartial-na")           # no newline: still parsed as a name, no crash
        f.write("\ngarbage-without-tab")
    t = read_trace(path)
    assert t.name(int(t.records["tag"][0])) == "mod:decoder.layers.0.mlp"


@pytest.mark.parametrize("damage,msg", [
    (lambda b: b"NOTATRAC" + b[8:], "magic"),
    (lambda b: b[:8] + (7).to_bytes(4, "little") + b[12:], "version 7"),
    (lambda b: b[:12] + (40).to_bytes(4, "little") + b[16:], "record size"),
    (lambda b: b[:20], "shorter"),
])
def test_bad_files_raise_clear_errors(tmp_path, damage, msg):
    path = small_trace(str(tmp_path / "rank0"))
    data = open(path, "rb").read()
    open(path, "wb").write(damage(data))
    with pytest.raises(TraceFormatError, match=msg):
        read_trace(path)


def test_missing_and_empty_dir(tmp_path):
    with pytest.raises(TraceFormatError, match="no such trace"):
        read_trace(str(tmp_path / "rank3.trace"))
    with pytest.raises(TraceFormatError, match="no rank"):
        find_traces(str(tmp_path))
