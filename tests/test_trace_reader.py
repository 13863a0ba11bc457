"""Trace reader on traces written by the real C++ core (host backend): header, records, names, truncation,
damaged blocks, end states, bad files, format 1 files."""
import os
import warnings

import numpy as np
import pytest

import tracer.allocator as A
from tracer.trace_reader import (MALLOC, FREE, RECORD_DTYPE, SCOPE_POP, SCOPE_PUSH, MARK, TraceFormatError,
                                 END_OPEN, END_SIGNAL, find_traces, read_trace, write_trace)


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
    assert t.backend == "host" and t.pid == os.getpid() and t.version == 2 and t.truncated_bytes == 0
    assert t.end_state == "clean" and t.damage is None and t.cut_short is None and t.problems() == []
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
    # the block is cut: its complete records are kept, unchecked, and the trace says it is cut short
    assert len(t.records) == 7 and t.truncated_bytes == 31 and t.damage is None
    assert "cut short" in t.cut_short and any(p.startswith("truncated") for p in t.problems())
    with open(path, "r+b") as f:          # header only: zero records, no crash, still cut short
        f.truncate(64)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        t = read_trace(path)
    assert len(t.records) == 0 and "0 of the 10" in t.cut_short


def _many_blocks(prefix, n=1000, block=100, **kw):
    rec = np.zeros(n, RECORD_DTYPE)
    rec["kind"], rec["size"], rec["ptr"], rec["t_ns"] = MALLOC, np.arange(n) + 1, np.arange(n) * 64 + 4096, np.arange(n)
    write_trace(prefix, rec, [""], block_records=block, **kw)
    return prefix + ".trace", rec


@pytest.mark.parametrize("offset", [64 + 48 * 101 * 3 + 48 * 7 + 17,   # a record's size field, block 3
                                    64 + 48 * 101 * 3 + 8,             # block 3's header: its checksum
                                    64 + 48 * 101 * 3 + 16])           # block 3's header: its record count
def test_damaged_block_stops_the_read_there(tmp_path, offset):
    path, rec = _many_blocks(str(tmp_path / "rank0"))
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x10
    open(path, "wb").write(bytes(data))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = read_trace(path)
    assert len(w) == 1 and "damaged" in str(w[0].message)
    assert len(t.records) == 300 and (t.records == rec[:300]).all()
    assert "slot 303" in t.damage and "300 records" in t.damage and t.problems()[0].startswith("damaged")


def test_every_single_byte_flip_in_the_records_is_detected(tmp_path):
    path, rec = _many_blocks(str(tmp_path / "rank0"), n=20, block=10)
    clean = open(path, "rb").read()
    for off in range(0, len(clean), 7):   # 7 is prime to 48: every byte position of a slot is hit in some slot
        data = bytearray(clean)
        data[off] ^= 0x01 if off % 2 else 0x80
        open(path, "wb").write(bytes(data))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                t = read_trace(path)
            except TraceFormatError:
                assert off < 16, off        # magic, version, record size: refused outright
                continue
        assert t.problems(), off
        assert (t.records == rec[:len(t.records)]).all(), off   # what is read is never wrong


def test_damaged_file_header_is_reported(tmp_path):
    path, _ = _many_blocks(str(tmp_path / "rank0"))
    data = bytearray(open(path, "rb").read())
    data[40] ^= 1                                  # end_slots
    open(path, "wb").write(bytes(data))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        t = read_trace(path)
    assert "header is damaged" in t.damage and t.end_state is None and len(t.records) == 1000


def test_end_states(tmp_path):
    path, _ = _many_blocks(str(tmp_path / "a"), end_state=END_OPEN)
    t = read_trace(path)
    assert t.end_state == "open" and "never closed" in t.problems()[0] and len(t.records) == 1000
    path, _ = _many_blocks(str(tmp_path / "b"), end_state=END_SIGNAL, end_signal=15)
    t = read_trace(path)
    assert t.end_state == "signal" and "SIGTERM" in t.problems()[0]
    data = open(path, "rb").read()
    open(path, "wb").write(data + data[64:64 + 48 * 3])   # more slots than the writer wrote
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert "after the end its writer recorded" in read_trace(path).damage


def test_format_1_still_reads(tmp_path):
    prefix = str(tmp_path / "rank0")
    rec = np.zeros(5, RECORD_DTYPE)
    rec["kind"] = MALLOC
    write_trace(prefix, rec, [""], version=1)
    t = read_trace(prefix)
    assert t.version == 1 and t.end_state is None and len(t.records) == 5 and t.problems() == []


def test_torn_names_line_is_skipped(tmp_path):
    path = small_trace(str(tmp_path / "rank0"))
    with open(str(tmp_path / "rank0.names"), "rb") as f:
        n = f.read().count(b"\n")
    with open(str(tmp_path / "rank0.names"), "a") as f:
        f.write(f"{n}\tpartial-na")           # no newline: a crash mid-write, skipped
    t = read_trace(path)
    assert t.name(int(t.records["tag"][0])) == "mod:decoder.layers.0.mlp" and len(t.names) == n


@pytest.mark.parametrize("how,msg", [
    ("missing", "rank0.names: missing"),
    ("garbage", "damaged string table"),
    ("short", "string table ends at id"),
])
def test_bad_names_file_is_one_clear_error(tmp_path, how, msg):
    path = small_trace(str(tmp_path / "rank0"))
    names = tmp_path / "rank0.names"
    lines = names.read_text().splitlines(keepends=True)
    if how == "missing":
        names.unlink()
    elif how == "garbage":
        names.write_text("".join(lines[:1] + ["x\tname\n"] + lines[2:]))
    else:
        names.write_text("".join(lines[:1]))
    with pytest.raises(TraceFormatError, match=msg):
        read_trace(path)


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
