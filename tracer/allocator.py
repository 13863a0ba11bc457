"""Python side of the C++ tracing allocator (csrc/tracealloc.cpp): build, load, scopes, counters, install.

The library is a plain shared object driven through ctypes, so importing this module never imports torch.
Where it comes from, in order:
  1. ``$MEMTRACE_LIB`` (an explicit path),
  2. the setuptools-built ``tracer/_tracealloc*.so`` (``pip install .``), if its ABI version matches,
  3. an on-demand ``g++`` build cached in ``~/.cache/megatron-memtrace/`` keyed by the source hash.
One process loads exactly one copy: torch's CUDAPluggableAllocator is pointed at the same path, so the
allocator, the scopes and the counters share one event core.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

ABI_VERSION = 3  # must equal kAbiVersion in csrc/tracealloc.cpp
BACKENDS = {"host": 0, "cuda": 1, "cpu-hook": 2}

_PKG_DIR = Path(__file__).resolve().parent
_CSRC = _PKG_DIR.parent / "csrc" / "tracealloc.cpp"
_CXXFLAGS = ["-O2", "-std=c++17", "-fvisibility=hidden", "-fPIC", "-shared"]
_LIBS = ["-ldl", "-lpthread"]

_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None
_names: dict[str, int] = {"": 0}
_backend: int | None = None


class TracerBuildError(RuntimeError):
    """The tracing allocator library could not be found or built."""


def cache_dir() -> Path:
    """Where on-demand builds go: $MEMTRACE_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache, /megatron-memtrace."""
    env = os.environ.get("MEMTRACE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-memtrace"


def find_compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def compile_shared(sources: list[Path], out: Path, flags: list[str], tag: str) -> Path:
    """Compile `sources` into `out` atomically (temp file + rename: safe when several ranks build at once)."""
    cxx = find_compiler()
    if cxx is None:
        raise TracerBuildError(
            f"megatron-memtrace: no C++ compiler (g++/c++/clang++ or $CXX) found to build the {tag}; "
            "install one, or `pip install .` where one exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *(str(s) for s in sources), "-o", tmp, *flags]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise TracerBuildError(f"megatron-memtrace: building the {tag} failed:\n{' '.join(cmd)}\n"
                                   f"{res.stderr.strip()[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _extra_flags() -> list[str]:
    # e.g. MEMTRACE_LDFLAGS="-L/usr/local/cuda/lib64 -lcudart" to link cudart instead of resolving it at run time
    return os.environ.get("MEMTRACE_CXXFLAGS", "").split() + os.environ.get("MEMTRACE_LDFLAGS", "").split()


def cached_build_path() -> Path:
    h = hashlib.sha256(_CSRC.read_bytes())
    h.update(" ".join(_CXXFLAGS + _LIBS + _extra_flags()).encode())
    return cache_dir() / f"tracealloc-{h.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
    """Compile csrc/tracealloc.cpp into the cache dir (no-op if that exact source was built already)."""
    if not _CSRC.exists():
        raise TracerBuildError(f"megatron-memtrace: {_CSRC} is missing and no prebuilt library was found")
    out = cached_build_path()
    if force or not out.exists():
        compile_shared([_CSRC], out, _CXXFLAGS + _LIBS + _extra_flags(), "tracing allocator")
    return out


def _abi_ok(path: str) -> bool:
    try:
        lib = ctypes.CDLL(path)
        fn = lib.mt_abi_version
    except (OSError, AttributeError):
        return False
    fn.restype = ctypes.c_int
    return fn() == ABI_VERSION


def library_path() -> str:
    """Path of the shared library this process uses (finding or building it on first call)."""
    global _lib_path
    with _lock:
        if _lib_path:
            return _lib_path
        env = os.environ.get("MEMTRACE_LIB")
        if env:
            if not _abi_ok(env):
                raise TracerBuildError(f"megatron-memtrace: MEMTRACE_LIB={env} is not a tracealloc library "
                                       f"with ABI version {ABI_VERSION}")
            _lib_path = env
            return env
        # A prebuilt (setuptools) library is used only if it matches the source's ABI; else build fresh.
        for cand in sorted(glob.glob(str(_PKG_DIR / "_tracealloc*.so"))):
            if _abi_ok(cand):
                _lib_path = cand
                return cand
        _lib_path = str(build())
        return _lib_path


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    sig = {
        "mt_abi_version": (c.c_int, []),
        "mt_open": (c.c_int, [c.c_char_p, c.c_int]),
        "mt_close": (None, []),
        "mt_is_open": (c.c_int, []),
        "mt_flush": (None, []),
        "mt_intern": (c.c_uint32, [c.c_char_p]),
        "mt_scope_push": (c.c_uint32, [c.c_uint32]),
        "mt_scope_pop": (c.c_uint32, []),
        "mt_current_scope": (c.c_uint32, []),
        "mt_mark": (None, [c.c_uint32]),
        "mt_live_bytes": (c.c_uint64, []),
        "mt_peak_bytes": (c.c_uint64, []),
        "mt_reset_peak": (None, []),
        "mt_last_error": (c.c_char_p, []),
        "mt_log_malloc": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "mt_log_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "mt_cuda_available": (c.c_int, []),
        "mt_cuda_source": (c.c_char_p, []),
        "mt_cuda_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "mt_cuda_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "mt_device_mem": (c.c_int, [c.c_int]),
        "mt_host_malloc": (c.c_void_p, [c.c_size_t]),
        "mt_host_free": (None, [c.c_void_p, c.c_size_t]),
        "mt_host_bench": (c.c_double, [c.c_long, c.c_int, c.c_int]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def lib() -> ctypes.CDLL:
    """The loaded library (ctypes), with argument types declared."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            loaded = ctypes.CDLL(path)
            _declare(loaded)
            _lib = loaded
        return _lib


# ---- trace lifecycle -----------------------------------------------------------------------------

def open_trace(prefix: str | os.PathLike, backend: str | int = "host") -> None:
    """Start writing `<prefix>.trace` and `<prefix>.names`; resets counters and the scope stack."""
    global _backend
    b = BACKENDS[backend] if isinstance(backend, str) else int(backend)
    if b not in BACKENDS.values():
        raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(BACKENDS)}")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    rc = lib().mt_open(os.fsencode(prefix), b)
    if rc != 0:
        raise OSError(-rc, f"megatron-memtrace: cannot open trace {prefix}: {os.strerror(-rc)}")
    _backend = b


def close() -> None:
    """Flush and close the trace (also done automatically at exit and on fatal signals)."""
    lib().mt_close()


def is_open() -> bool:
    return bool(lib().mt_is_open())


def flush() -> None:
    lib().mt_flush()


# ---- names, scopes, marks ------------------------------------------------------------------------

def intern(name: str) -> int:
    """Id of `name` in the string table (written to `.names` on first use); cached."""
    nid = _names.get(name)
    if nid is None:
        nid = lib().mt_intern(name.encode("utf-8"))
        _names[name] = nid
    return nid


def push_scope(name: str) -> int:
    """Open a scope instance (child of the current one); returns its instance id."""
    return lib().mt_scope_push(intern(name))


def pop_scope() -> int:
    """Close the current scope instance; returns its id (0 if no scope was open)."""
    return lib().mt_scope_pop()


def current_scope() -> int:
    return lib().mt_current_scope()


@contextlib.contextmanager
def scope(name: str):
    """`with scope("fwd:0"): ...` -- push on entry, pop on exit (also on exceptions)."""
    sid = push_scope(name)
    try:
        yield sid
    finally:
        pop_scope()


def mark(name: str) -> None:
    """Log a MARK; on the CUDA backend also a DEVICE_MEM reading (memory no PyTorch allocator sees)."""
    lib().mt_mark(intern(name))
    if _backend == BACKENDS["cuda"]:
        device_mem()


def device_mem(device: int = -1) -> bool:
    """Log a DEVICE_MEM record (cudaMemGetInfo free/total); False when no CUDA runtime is usable."""
    return lib().mt_device_mem(device) == 0


# ---- counters ------------------------------------------------------------------------------------

def live_bytes() -> int:
    return lib().mt_live_bytes()


def peak_bytes() -> int:
    """Peak live bytes since open (or since reset_peak); equals the maximum of a replay of the trace."""
    return lib().mt_peak_bytes()


def reset_peak() -> None:
    """Restart the peak at the live level; logged as MARK `reset_peak` so a replay can follow."""
    lib().mt_reset_peak()


# ---- CUDA ----------------------------------------------------------------------------------------

def install_cuda_allocator():
    """Route every CUDA tensor allocation of this process through the tracing allocator.

    Must run before the first CUDA allocation. Returns torch's CUDAPluggableAllocator object. Raises
    RuntimeError with a clear message on a CPU-only torch build or when no CUDA runtime can be found.
    """
    import torch  # deferred: this module must import without torch

    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError("megatron-memtrace: this torch build has no CUDA support "
                           f"(torch {torch.__version__}); the CUDA tracing allocator cannot be installed. "
                           "On CPU use tracer.cpu_hook.install() instead.")
    path = library_path()
    if not lib().mt_cuda_available():
        raise RuntimeError("megatron-memtrace: no CUDA runtime (libcudart) could be found in this process")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "mt_cuda_malloc", "mt_cuda_free")
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise RuntimeError("megatron-memtrace: could not install the tracing allocator; it must be installed "
                           f"before the first CUDA allocation of the process ({e})") from e
    return alloc
