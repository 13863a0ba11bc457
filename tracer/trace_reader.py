"""Read one rank's trace files (docs/FORMATS.md section 2) into numpy, without a Python loop per record.

`read_trace(path)` accepts `.../rank0.trace`, `.../rank0.json`, `.../rank0.names` or the prefix `.../rank0`.
A compressed record file, `rank0.trace.xz` or `rank0.trace.gz` (e.g. the packed campaign traces under fit/traces/),
is read transparently when no plain `rank0.trace` exists: it is decompressed into memory, and a compressed stream
that ends early (a copy cut short) is read up to its last complete record, like a truncated plain trace.

Format 2 (FORMATS 2.1) says how the writer stopped (closed cleanly, flushed by a fatal signal, or never closed) and
checksums every block of records: a damaged block ends the read there, and `Trace.problems()` says so. Format 1
traces (the packed campaign traces) have neither and read as before.
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
VERSION = 2                 # what write_trace and csrc/ write
VERSIONS = (1, 2)           # what this reader reads
HEADER_SIZE = 64
RECORD_SIZE = 48
BLOCK = 0xFF                # kind of a block header slot (format 2)
BLOCK_MAGIC = 0x314B434F4C42544D   # "MTBLOCK1", its t_ns
END_OPEN, END_CLEAN, END_SIGNAL = 0, 1, 2

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
    ("end_state", "<u4"), ("end_signal", "<u4"), ("end_slots", "<u8"), ("reserved", "<u8"), ("check", "<u8"),
])
assert _FILE_HEADER_DTYPE.itemsize == HEADER_SIZE

MALLOC, FREE, MALLOC_FAIL, SCOPE_PUSH, SCOPE_POP, MARK, DEVICE_MEM = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {MALLOC: "MALLOC", FREE: "FREE", MALLOC_FAIL: "MALLOC_FAIL", SCOPE_PUSH: "SCOPE_PUSH",
              SCOPE_POP: "SCOPE_POP", MARK: "MARK", DEVICE_MEM: "DEVICE_MEM"}
BACKENDS = {0: "host", 1: "cuda", 2: "cpu-hook"}


class TraceFormatError(ValueError):
    """The file is not a megatron-memtrace trace this reader understands."""


# ---- checksums (FORMATS 2.1): sum mod 2**64 of mix(w_i + i * golden) over a block's 64-bit words ------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_MASK = (1 << 64) - 1
_OFFSETS = np.zeros(0, dtype=np.uint64)   # i * golden for i = 0, 1, ...: the same for every block, kept
_SCRATCH = [np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)]   # reused: fresh MB-sized arrays page-fault


def _mixed(words: np.ndarray, first: int = 0) -> np.ndarray:
    """mix(w_i + i * golden) per word, mix(x) = y ^ (y >> 32) with y = x * M1, into reused buffers (the result is
    valid until the next call)."""
    global _OFFSETS
    n = len(words)
    if first + n > len(_OFFSETS):
        _OFFSETS = np.arange(max(first + n, 6 * 32769), dtype=np.uint64) * _GOLDEN
    if n > len(_SCRATCH[0]):
        _SCRATCH[:] = [np.empty(max(n, 6 * 32769), dtype=np.uint64) for _ in range(2)]
    x, t = _SCRATCH[0][:n], _SCRATCH[1][:n]
    np.add(_OFFSETS[first: first + n], words, out=x)
    x *= _M1
    np.right_shift(x, np.uint64(32), out=t)
    x ^= t
    return x


def checksum(words: np.ndarray, first: int = 0) -> int:
    """The checksum of little-endian 64-bit words whose first has index `first` in its block."""
    return int(_mixed(np.asarray(words, dtype="<u8"), first).sum(dtype=np.uint64))


def _mix1(w: int, i: int) -> int:
    return int(_mixed(np.array([w], dtype=np.uint64), i)[0])


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
    truncated_bytes: int = 0       # bytes of an incomplete last record (or block) that were dropped
    end_state: str | None = None   # format 2: "clean" | "signal" | "open" (never closed); None for format 1
    end_signal: int = 0            # the fatal signal that flushed it ("signal")
    damage: str | None = None      # the first damaged block or header, where reading stopped
    cut_short: str | None = None   # the file ends before where its writer stopped (a copy cut short)

    def problems(self) -> list[str]:
        """Why this trace may not hold the whole run, one phrase each ("damaged: ...", "truncated: ...", then how
        the run ended); [] for a complete trace."""
        out = []
        if self.damage:
            out.append(f"damaged: {self.damage}")
        if self.cut_short:
            out.append(f"truncated: {self.cut_short}")
        elif self.truncated_bytes:
            out.append(f"truncated: {self.truncated_bytes} trailing bytes of an incomplete record dropped")
        if "config" in self.header:  # a profiler's header: written at the start, completed when the run ends
            if "allocator_peak_bytes" not in self.header:
                out.append("the rank's header has no final allocator counters: the run was cut short")
            if self.header.get("error"):
                out.append(f"the run failed: {self.header['error']}")
        if self.end_state == "signal":
            out.append(f"the run was killed by signal {signal_name(self.end_signal)}; the trace ends at its "
                       f"last event before that")
        elif self.end_state == "open":
            out.append("the trace was never closed (the run was killed, e.g. by SIGKILL or the OOM killer, or is "
                       "still running); it ends at the last flushed block")
        return out

    @property
    def rank(self) -> int:
        return int(self.header.get("rank", _rank_from_path(self.path)))

    def name(self, tag: int) -> str:
        return self.names[tag] if 0 <= tag < len(self.names) else f"<name {tag}>"


def signal_name(sig: int) -> str:
    import signal
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


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
    (decompressed) leading bytes when already in memory. Format 2 adds `end_state`, `end_signal`, `end_slots` and
    `damage` (a header whose checksum does not match: its end fields are then not trusted)."""
    if raw is None:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    raw = raw[:HEADER_SIZE]
    if len(raw) < HEADER_SIZE:
        raise TraceFormatError(f"{path}: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte trace header")
    h = np.frombuffer(raw[: _FILE_HEADER_DTYPE.itemsize], dtype=_FILE_HEADER_DTYPE)[0]
    if bytes(h["magic"]) != MAGIC:
        raise TraceFormatError(f"{path}: not a megatron-memtrace trace (magic {bytes(raw[:8])!r}, want {MAGIC!r})")
    if int(h["version"]) not in VERSIONS:
        raise TraceFormatError(f"{path}: trace format version {int(h['version'])}, this reader reads "
                               f"{' and '.join(map(str, VERSIONS))}")
    if int(h["record_size"]) != RECORD_SIZE:
        raise TraceFormatError(f"{path}: record size {int(h['record_size'])}, want {RECORD_SIZE}")
    out = {"version": int(h["version"]), "t0_ns": int(h["t0_ns"]), "pid": int(h["pid"]),
           "backend": BACKENDS.get(int(h["backend"]), str(int(h["backend"])))}
    if out["version"] >= 2:
        words = np.frombuffer(raw[:56], dtype="<u8")
        state = int(h["end_state"])
        if checksum(words) != int(h["check"]) or state not in (END_OPEN, END_CLEAN, END_SIGNAL):
            out.update(end_state=None, end_signal=0, end_slots=None,
                       damage="the file header is damaged (its checksum does not match)")
        else:
            out.update(end_state={END_OPEN: "open", END_CLEAN: "clean", END_SIGNAL: "signal"}[state],
                       end_signal=int(h["end_signal"]), end_slots=int(h["end_slots"]), damage=None)
    return out


def read_names(path: str) -> list[str]:
    """`id<TAB>name` lines, ids 0, 1, 2, ... in order (FORMATS 2.2) -> list indexed by id. A torn last line (a crash
    mid-write, no newline) is skipped; a missing file or a line out of that order is a TraceFormatError."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: missing (the string table written next to the trace)") from None
    lines = data.decode("utf-8", errors="replace").split("\n")
    lines.pop()  # the text after the last newline: empty, or a torn line
    out = []
    for n, line in enumerate(lines):
        i, tab, name = line.partition("\t")
        if not tab or i != str(n):
            raise TraceFormatError(f"{path}: damaged string table (line {n + 1} is not `{n}<TAB>name`)")
        out.append(name)
    return out or [""]


def read_records(path: str, mmap: bool = False) -> tuple[np.ndarray, int]:
    """All complete 48-byte slots after the header (format 1: the records), and the number of trailing bytes of a
    torn one."""
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


def read_blocks(slots: np.ndarray, end_slots: int | None = None) -> tuple[np.ndarray, str | None, str | None]:
    """Format 2: the records of the good blocks of `slots` (block headers dropped), then (damage, cut_short): why
    reading stopped before the end of the file, and whether the file ends before the `end_slots` its writer
    recorded. A block that runs past the end of the file is a cut, not damage: its records in the file are kept
    (unchecked), as format 1 keeps every complete record of a truncated file."""
    parts, pos, n_slots = [], 0, len(slots)
    damage = cut = None
    if n_slots:
        words = slots.view("<u8").reshape(n_slots, 6)
    limit = n_slots if end_slots is None else min(n_slots, end_slots)  # slots after the recorded end: not blocks
    while pos < limit:
        h = slots[pos]
        n = int(h["size"])
        if int(h["kind"]) != BLOCK or int(h["t_ns"]) != BLOCK_MAGIC or int(h["stream"]) != pos or n < 1:
            damage = f"bad block header at slot {pos}"
        elif pos + 1 + n > limit:
            rest = slots[pos + 1: limit]
            # A cut only where the file may end early and nothing after this header is another block header;
            # otherwise the record count itself is damaged.
            if ((end_slots is None or n_slots < end_slots)
                    and not ((rest["kind"] == BLOCK) & (rest["t_ns"] == BLOCK_MAGIC)).any()):
                cut = f"the last block is cut short ({len(rest)} of its {n} records in the file, unchecked)"
                parts.append(rest)
                break
            damage = f"bad block header at slot {pos}"
        else:
            blk = words[pos: pos + 1 + n].reshape(-1)
            # the stored checksum was computed with its own word (index 1) zero
            got = (checksum(blk) - _mix1(int(h["ptr"]), 1) + _mix1(0, 1)) & _MASK
            if got != int(h["ptr"]):
                damage = f"checksum mismatch in the block at slot {pos}"
        if damage:
            n_good = sum(len(p) for p in parts)
            damage += f"; read the {n_good} records of the blocks before it"
            break
        parts.append(slots[pos + 1: pos + 1 + n])
        pos += 1 + n
    if not damage and not cut and end_slots is not None and n_slots < end_slots:
        cut = f"the file holds {n_slots} of the {end_slots} record slots its writer wrote"
    if not damage and end_slots is not None and n_slots > end_slots:
        damage = f"{n_slots - end_slots} slots after the end its writer recorded"
    return _compact(slots, parts), damage, cut


def _compact(slots: np.ndarray, parts: list) -> np.ndarray:
    """The records of `parts` (views of `slots`, in order) as one array: moved down in place over the block headers
    when `slots` is writable (a file just read; no second copy of a large trace), else copied."""
    if not parts:
        return np.zeros(0, RECORD_DTYPE)
    if not slots.flags.writeable or not slots.flags.c_contiguous:
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
    import ctypes
    base, got = slots.ctypes.data, 0
    for p in parts:
        src = p.ctypes.data
        dst = base + got * RECORD_SIZE
        if src != dst:
            ctypes.memmove(dst, src, len(p) * RECORD_SIZE)   # overlapping, downwards: memmove is safe
        got += len(p)
    return slots[:got]


def records_from_bytes(raw: bytes) -> tuple[np.ndarray, int]:
    """`read_records` for a trace already in memory (header included)."""
    n = max(len(raw) - HEADER_SIZE, 0) // RECORD_SIZE
    torn = len(raw) - HEADER_SIZE - n * RECORD_SIZE
    if n <= 0:
        return np.zeros(0, RECORD_DTYPE), max(torn, 0)
    return np.frombuffer(raw, dtype=RECORD_DTYPE, count=n, offset=HEADER_SIZE), torn


def read_trace(path: str, mmap: bool = False) -> Trace:
    """Read header, records, names and the JSON header of one rank. Warns once if the file is truncated or damaged
    (Trace.problems() says how). A compressed record file (`.trace.xz` / `.trace.gz`) is decompressed into memory;
    `mmap` maps a format 1 file (a format 2 file's records are copied out of their blocks)."""
    prefix = trace_prefix(str(path))
    tpath = trace_file(prefix)
    if tpath is None:
        raise TraceFormatError(f"{prefix}.trace: no such trace file (nor {prefix}.trace.xz / .trace.gz)")
    if tpath.endswith(".trace"):
        fh = read_header(tpath)
        records, torn = read_records(tpath, mmap=mmap and fh["version"] == 1)
        complete = True
    else:
        raw, complete = decompress(tpath)
        fh = read_header(tpath, raw)
        records, torn = records_from_bytes(raw)
    damage = cut = None
    if fh["version"] >= 2:
        ended = fh["end_state"] in ("clean", "signal")  # the writer recorded where the file ends
        records, damage, cut = read_blocks(records, fh["end_slots"] if ended else None)
        damage = fh["damage"] or damage
    if not complete:
        cut = "the compressed stream ends early" + (f"; {cut}" if cut else "")
    names = read_names(prefix + ".names")
    _check_tags(records, names, prefix + ".names")
    header = {}
    if os.path.exists(prefix + ".json"):
        try:
            with open(prefix + ".json") as f:
                header = json.load(f)
        except (OSError, ValueError) as e:
            raise TraceFormatError(f"{prefix}.json: unreadable header ({e})") from None
        if not isinstance(header, dict):
            raise TraceFormatError(f"{prefix}.json: header is not a JSON object")
    t = Trace(path=tpath, records=records, names=names, header=header,
              t0_ns=fh["t0_ns"], pid=fh["pid"], backend=fh["backend"], version=fh["version"],
              truncated_bytes=torn, end_state=fh.get("end_state"), end_signal=fh.get("end_signal", 0),
              damage=damage, cut_short=cut)
    if damage or cut or torn:
        broken = [p for p in t.problems() if p.startswith(("damaged", "truncated"))]
        warnings.warn(f"{tpath}: {'; '.join(broken)} ({len(records)} records read)", RuntimeWarning, stacklevel=2)
    return t


def _check_tags(records: np.ndarray, names: list[str], names_path: str) -> None:
    """Every name id a record uses must be in the string table (the writer appends a name before any record uses
    it, so a shorter table was cut or belongs to another run)."""
    if len(records):
        top = int(records["tag"].max())
        if top >= len(names):
            raise TraceFormatError(f"{names_path}: the string table ends at id {len(names) - 1} but the trace uses "
                                   f"id {top} (the file is truncated or belongs to another run)")


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
                header: dict | None = None, t0_ns: int = 0, pid: int = 0, backend: int = 0,
                version: int = VERSION, block_records: int = 1 << 15, end_state: int = END_CLEAN,
                end_signal: int = 0) -> None:
    """Write a trace in the exact file format (format 2: blocks of `block_records`, the given end state; format 1:
    bare records); used by the parser benchmark and tests (the real writer is csrc/)."""
    recs = np.ascontiguousarray(records, dtype=RECORD_DTYPE)
    if version == 1:
        body = recs.tobytes()
        end_slots = 0
    else:
        out, pos = [], 0
        for lo in range(0, len(recs), block_records):
            blk = recs[lo: lo + block_records]
            h = np.zeros(1, RECORD_DTYPE)
            h["t_ns"], h["size"], h["stream"], h["kind"] = BLOCK_MAGIC, len(blk), pos, BLOCK
            words = np.concatenate([h, blk]).view("<u8")
            h["ptr"] = checksum(words)
            out += [h.tobytes(), blk.tobytes()]
            pos += 1 + len(blk)
        body = b"".join(out)
        end_slots = pos
    hdr = np.zeros(1, _FILE_HEADER_DTYPE)
    hdr["magic"], hdr["version"], hdr["record_size"] = MAGIC, version, RECORD_SIZE
    hdr["t0_ns"], hdr["pid"], hdr["backend"] = t0_ns, pid, backend
    if version >= 2:
        hdr["end_state"], hdr["end_signal"], hdr["end_slots"] = end_state, end_signal, end_slots
        hdr["check"] = checksum(hdr.view("<u8")[:7])
    with open(prefix + ".trace", "wb") as f:
        f.write(hdr.tobytes())
        f.write(body)
    items = dict(names.items() if isinstance(names, dict) else enumerate(names))
    with open(prefix + ".names", "w") as f:
        f.writelines(f"{i}\t{items.get(i, '')}\n" for i in range(max(items, default=0) + 1))
    if header is not None:
        with open(prefix + ".json", "w") as f:
            json.dump(header, f)
