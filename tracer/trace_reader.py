"""Read one rank's trace files (docs/FORMATS.md section 2) into numpy, without a Python loop per record.

`read_trace(path)` accepts `.../rank0.trace`, `.../rank0.json`, `.../rank0.names` or the prefix `.../rank0`.
A compressed record file, `rank0.trace.xz` or `rank0.trace.gz` (e.g. the packed campaign traces under fit/traces/),
is read transparently when no plain `rank0.trace` exists: it is decompressed into memory, and a compressed stream
that ends early (a copy cut short) is read up to its last complete record, like a truncated plain trace.
"""
from __future__ import annotations

import json
import lzma
import os
import zlib
import warnings
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"MTRACE01"
VERSION = 1
HEADER_SIZE = 64
RECORD_SIZE = 48

# Field order and widths are the contract of FORMATS 2.1; the dtype is packed (no padding) and little-endian.
RECORD_DTYPE = np.dtype([
    ("t_ns", "<u8"), ("ptr", "<u8"), ("size", "<u8"), ("stream", "<u8"),
    ("scope", "<u4"), ("tag", "<u4"), ("tid", "<u4"),
    ("device", "<i2"), ("kind", "u1"), ("flags", "u1"),
])
assert RECORD_DTYPE.itemsize == RECORD_SIZE

_FILE_HEADER_DTYPE = np.dtype([
    ("magic", "S8"), ("version", "<u4"), ("record_size", "<u4"), ("t0_ns", "<u8"),
    ("pid", "<u4"), ("backend", "<u4"),
])

MALLOC, FREE, MALLOC_FAIL, SCOPE_PUSH, SCOPE_POP, MARK, DEVICE_MEM = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {MALLOC: "MALLOC", FREE: "FREE", MALLOC_FAIL: "MALLOC_FAIL", SCOPE_PUSH: "SCOPE_PUSH",
              SCOPE_POP: "SCOPE_POP", MARK: "MARK", DEVICE_MEM: "DEVICE_MEM"}
BACKENDS = {0: "host", 1: "cuda", 2: "cpu-hook"}


class TraceFormatError(ValueError):
    """The file is not a megatron-memtrace trace this reader understands."""


@dataclass
class Trace:
    path: str                      # the .trace file
    records: np.ndarray            # structured array of RECORD_DTYPE, file order
    names: list[str]               # names[tag] (index 0 is the empty name)
    header: dict = field(default_factory=dict)   # rank<R>.json, {} when absent
    t0_ns: int = 0
    pid: int = 0
    backend: str = "host"
    version: int = VERSION
    truncated_bytes: int = 0       # bytes of an incomplete last record that were dropped

    @property
    def rank(self) -> int:
        return int(self.header.get("rank", _rank_from_path(self.path)))

    def name(self, tag: int) -> str:
        return self.names[tag] if 0 <= tag < len(self.names) else f"<name {tag}>"


def _rank_from_path(path: str) -> int:
    base = os.path.basename(path).split(".")[0]
    return int(base[4:]) if base.startswith("rank") and base[4:].isdigit() else 0


COMPRESSED = (".xz", ".gz")          # record-file suffixes read transparently (after ".trace")
TRACE_SUFFIXES = (".trace",) + tuple(".trace" + c for c in COMPRESSED)


def trace_prefix(path: str) -> str:
    """`dir/rank3.trace` / `.trace.xz` / `.trace.gz` / `.json` / `.names` / `dir/rank3` -> `dir/rank3`."""
    for ext in TRACE_SUFFIXES[1:] + (".trace", ".names", ".json"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def trace_file(prefix: str) -> str | None:
    """The record file of a rank: `prefix.trace`, else `prefix.trace.xz`, else `prefix.trace.gz`; None if none."""
    for ext in TRACE_SUFFIXES:
        if os.path.exists(prefix + ext):
            return prefix + ext
    return None


def decompress(path: str) -> tuple[bytes, bool]:
    """The whole decompressed content of an .xz/.gz file and whether its stream was complete. A stream cut short
    (or corrupt from some point on) yields what decompressed before that point."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".xz"):
        d = lzma.LZMADecompressor()
        errors = (lzma.LZMAError, EOFError)
    elif path.endswith(".gz"):
        d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        errors = (zlib.error, EOFError)
    else:
        raise TraceFormatError(f"{path}: unknown compression (readable: {', '.join(COMPRESSED)})")
    out, step = [], 1 << 20
    try:
        for i in range(0, len(data), step):  # chunked, so corruption late in the file keeps what came before
            out.append(d.decompress(data[i:i + step]))
            if d.eof:
                break
    except errors as exc:
        if not out or not any(out):
            raise TraceFormatError(f"{path}: cannot decompress ({exc})") from None
        return b"".join(out), False
    return b"".join(out), bool(d.eof)


def read_header(path: str, raw: bytes | None = None) -> dict:
    """The binary file header as a dict; raises TraceFormatError on a bad magic or version. `raw`: the file's
    (decompressed) leading bytes when already in memory."""
    if raw is None:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    raw = raw[:HEADER_SIZE]
    if len(raw) < HEADER_SIZE:
        raise TraceFormatError(f"{path}: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte trace header")
    h = np.frombuffer(raw[: _FILE_HEADER_DTYPE.itemsize], dtype=_FILE_HEADER_DTYPE)[0]
    if bytes(h["magic"]) != MAGIC:
        raise TraceFormatError(f"{path}: not a megatron-memtrace trace (magic {bytes(raw[:8])!r}, want {MAGIC!r})")
    if int(h["version"]) != VERSION:
        raise TraceFormatError(f"{path}: trace format version {int(h['version'])}, this reader reads {VERSION}")
    if int(h["record_size"]) != RECORD_SIZE:
        raise TraceFormatError(f"{path}: record size {int(h['record_size'])}, want {RECORD_SIZE}")
    return {"version": int(h["version"]), "t0_ns": int(h["t0_ns"]), "pid": int(h["pid"]),
            "backend": BACKENDS.get(int(h["backend"]), str(int(h["backend"])))}


def read_names(path: str) -> list[str]:
    """`id<TAB>name` lines -> dense list indexed by id; a torn last line (crash mid-write) is skipped."""
    names: dict[int, str] = {0: ""}
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        for line in data.decode("utf-8", errors="replace").split("\n"):
            i, tab, name = line.partition("\t")
            if tab and i.isdigit():
                names[int(i)] = name
    out = [""] * (max(names) + 1)
    for i, n in names.items():
        out[i] = n
    return out


def read_records(path: str, mmap: bool = False) -> tuple[np.ndarray, int]:
    """All complete records after the header, and the number of trailing bytes of a torn record."""
    size = os.path.getsize(path)
    n = (size - HEADER_SIZE) // RECORD_SIZE
    torn = size - HEADER_SIZE - n * RECORD_SIZE
    if n <= 0:
        return np.zeros(0, RECORD_DTYPE), max(torn, 0)
    if mmap:
        return np.memmap(path, dtype=RECORD_DTYPE, mode="r", offset=HEADER_SIZE, shape=(n,)), torn
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        return np.fromfile(f, dtype=RECORD_DTYPE, count=n), torn


def records_from_bytes(raw: bytes) -> tuple[np.ndarray, int]:
    """`read_records` for a trace already in memory (header included)."""
    n = max(len(raw) - HEADER_SIZE, 0) // RECORD_SIZE
    torn = len(raw) - HEADER_SIZE - n * RECORD_SIZE
    if n <= 0:
        return np.zeros(0, RECORD_DTYPE), max(torn, 0)
    return np.frombuffer(raw, dtype=RECORD_DTYPE, count=n, offset=HEADER_SIZE), torn


def read_trace(path: str, mmap: bool = False) -> Trace:
    """Read header, records, names and the JSON header of one rank. Warns once if the file was truncated.
    A compressed record file (`.trace.xz` / `.trace.gz`) is decompressed into memory (`mmap` is ignored)."""
    prefix = trace_prefix(str(path))
    tpath = trace_file(prefix)
    if tpath is None:
        raise TraceFormatError(f"{prefix}.trace: no such trace file (nor {prefix}.trace.xz / .trace.gz)")
    if tpath.endswith(".trace"):
        fh = read_header(tpath)
        records, torn = read_records(tpath, mmap=mmap)
        complete = True
    else:
        raw, complete = decompress(tpath)
        fh = read_header(tpath, raw)
        records, torn = records_from_bytes(raw)
    if torn or not complete:
        why = "" if complete else "compressed stream ends early; "
        warnings.warn(f"{tpath}: truncated trace ({why}read {len(records)} complete records "
                      f"and dropped {torn} trailing bytes)", RuntimeWarning, stacklevel=2)
    header = {}
    if os.path.exists(prefix + ".json"):
        try:
            with open(prefix + ".json") as f:
                header = json.load(f)
        except (OSError, ValueError) as e:
            raise TraceFormatError(f"{prefix}.json: unreadable header ({e})") from None
        if not isinstance(header, dict):
            raise TraceFormatError(f"{prefix}.json: header is not a JSON object")
    return Trace(path=tpath, records=records, names=read_names(prefix + ".names"), header=header,
                 t0_ns=fh["t0_ns"], pid=fh["pid"], backend=fh["backend"], version=fh["version"],
                 truncated_bytes=torn)


def find_traces(path: str) -> list[str]:
    """A directory -> its rank<R>.trace files (or .trace.xz / .trace.gz where no plain one exists) sorted by
    rank; a file or prefix -> [that trace]."""
    if os.path.isdir(path):
        prefixes = {os.path.join(path, trace_prefix(f)) for f in os.listdir(path)
                    if f.startswith("rank") and f.endswith(TRACE_SUFFIXES)}
        if not prefixes:
            raise TraceFormatError(f"{path}: no rank<R>.trace files in this directory")
        return [trace_file(p) for p in sorted(prefixes, key=_rank_from_path)]
    prefix = trace_prefix(str(path))
    return [trace_file(prefix) or prefix + ".trace"]


def write_trace(prefix: str, records: np.ndarray, names: dict[int, str] | list[str] = (),
                header: dict | None = None, t0_ns: int = 0, pid: int = 0, backend: int = 0) -> None:
    """Write a trace in the exact file format; used by the parser benchmark (the real writer is csrc/)."""
    hdr = np.zeros(1, _FILE_HEADER_DTYPE)
    hdr["magic"], hdr["version"], hdr["record_size"] = MAGIC, VERSION, RECORD_SIZE
    hdr["t0_ns"], hdr["pid"], hdr["backend"] = t0_ns, pid, backend
    with open(prefix + ".trace", "wb") as f:
        f.write(hdr.tobytes().ljust(HEADER_SIZE, b"\0"))
        f.write(np.ascontiguousarray(records, dtype=RECORD_DTYPE).tobytes())
    items = names.items() if isinstance(names, dict) else enumerate(names)
    with open(prefix + ".names", "w") as f:
        f.writelines(f"{i}\t{n}\n" for i, n in items if i)
    if header is not None:
        with open(prefix + ".json", "w") as f:
            json.dump(header, f)
