"""Compressed traces (rank<R>.trace.xz / .trace.gz, as packed under fit/traces/) read exactly like plain ones:
same records, names and header through every path spelling, truncation tolerated, corrupt streams a clear error."""
import gzip
import lzma
import shutil
import warnings

import numpy as np
import pytest

from tests.test_trace_reader import small_trace
from tracer.parse import parse_run
from tracer.trace_reader import TraceFormatError, find_traces, read_trace

COMPRESS = {".xz": lzma.compress, ".gz": gzip.compress}


def compressed_copy(tmp_path, ext):
    (tmp_path / "plain").mkdir()
    plain = small_trace(str(tmp_path / "plain" / "rank0"))
    packed = tmp_path / "packed"
    packed.mkdir()
    with open(plain, "rb") as fh:
        (packed / f"rank0.trace{ext}").write_bytes(COMPRESS[ext](fh.read()))
    for aux in ("rank0.names",):
        shutil.copy(tmp_path / "plain" / aux, packed / aux)
    return plain, packed


@pytest.mark.parametrize("ext", [".xz", ".gz"])
def test_compressed_reads_like_plain(tmp_path, ext):
    plain, packed = compressed_copy(tmp_path, ext)
    a = read_trace(plain)
    for alias in (packed / f"rank0.trace{ext}", packed / "rank0", packed / "rank0.names", packed / "rank0.trace"):
        b = read_trace(str(alias))
        assert b.path == str(packed / f"rank0.trace{ext}")
        assert np.array_equal(a.records, b.records) and a.names == b.names and b.truncated_bytes == 0
        assert (a.t0_ns, a.pid, a.backend) == (b.t0_ns, b.pid, b.backend)
    assert find_traces(str(packed)) == [str(packed / f"rank0.trace{ext}")]
    assert parse_run(str(packed))[0].peak_bytes == parse_run(str(tmp_path / "plain"))[0].peak_bytes


def test_plain_file_wins_over_compressed(tmp_path):
    plain, packed = compressed_copy(tmp_path, ".xz")
    shutil.copy(plain, packed / "rank0.trace")
    assert find_traces(str(packed)) == [str(packed / "rank0.trace")]
    assert read_trace(str(packed / "rank0")).path == str(packed / "rank0.trace")


@pytest.mark.parametrize("ext", [".xz", ".gz"])
def test_cut_short_stream_reads_complete_records_and_warns(tmp_path, ext):
    plain, packed = compressed_copy(tmp_path, ext)
    raw = open(plain, "rb").read()
    n_full = len(read_trace(plain).records)
    cut = raw[: 64 + 6 * 48 + 17]                      # the block header, five records and part of a sixth
    (packed / f"rank0.trace{ext}").write_bytes(COMPRESS[ext](cut))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = read_trace(str(packed / "rank0"))
    assert len(w) == 1 and "truncated" in str(w[0].message)
    assert len(t.records) == 5 < n_full and t.truncated_bytes == 17 and "cut short" in t.cut_short
    # the compressed stream itself cut short: what decompressed is kept, with a warning
    whole = COMPRESS[ext](raw)
    (packed / f"rank0.trace{ext}").write_bytes(whole[: len(whole) - 12])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = read_trace(str(packed / "rank0"))
    assert len(w) == 1 and "truncated" in str(w[0].message)
    assert np.array_equal(t.records, read_trace(plain).records[: len(t.records)])
    assert t.cut_short.startswith("the compressed stream ends early")


def test_garbage_compressed_file_is_a_clear_error(tmp_path):
    (tmp_path / "rank0.trace.xz").write_bytes(b"this is not xz data at all" * 4)
    with pytest.raises(TraceFormatError, match="decompress"):
        read_trace(str(tmp_path / "rank0"))
    (tmp_path / "rank0.trace.xz").unlink()
    (tmp_path / "rank0.trace.gz").write_bytes(gzip.compress(b"NOTATRAC" + bytes(100)))
    with pytest.raises(TraceFormatError, match="magic"):
        read_trace(str(tmp_path / "rank0"))
