"""Trace torch's CPU tensor allocations with the same event core as the CUDA allocator.

`install(prefix)` opens a trace (backend "cpu-hook") and replaces torch's CPU allocator by a wrapper
(csrc/cpu_hook.cpp) that logs MALLOC/FREE for every CPU tensor storage, on every thread, then delegates to the
original allocator. The wrapper is compiled against the installed torch's c10 headers with g++ directly (no
ninja needed) and cached under the same cache dir as the core, keyed by source, torch version and flags.

What it sees: every storage made through c10's CPU allocator (torch.empty/zeros/randn, op outputs, autograd
saved tensors and gradients, DDP buckets, gloo collective outputs). What it does not: tensors allocated before
install (their frees are not logged either), memory torch does not own (from_numpy, frombuffer, mmap'd loads),
and CUDA pinned host memory (a separate host allocator; host RAM, irrelevant to GPU memory).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

from . import allocator

_SRC = Path(__file__).resolve().parent.parent / "csrc" / "cpu_hook.cpp"
_PRIORITY = 200  # above c10's default CPU allocator registration (0)
_hook: ctypes.CDLL | None = None


def _torch_build_info():
    import torch

    root = Path(torch.__file__).resolve().parent
    abi = int(bool(torch.compiled_with_cxx11_abi()))
    flags = ["-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-I{root / 'include'}", f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}"]
    return torch.__version__, flags


def build(force: bool = False) -> Path:
    """Compile csrc/cpu_hook.cpp for the installed torch into the cache dir (first time ~10 s)."""
    version, flags = _torch_build_info()
    h = hashlib.sha256(_SRC.read_bytes())
    h.update(f"{version}|{' '.join(flags)}".encode())
    out = allocator.cache_dir() / f"cpu_hook-{h.hexdigest()[:16]}.so"
    if force or not out.exists():
        allocator.compile_shared([_SRC], out, flags, "CPU allocator hook")
    return out


def install(prefix: str | os.PathLike | None = None) -> None:
    """Open `<prefix>.trace/.names` (backend cpu-hook) and route CPU tensor allocations through the tracer.

    With prefix=None the hook is installed without opening a trace (call allocator.open_trace later).
    Idempotent; there is no uninstall (tensors made under the hook must keep its deleter).
    """
    global _hook
    if prefix is not None:
        allocator.open_trace(prefix, "cpu-hook")
    if _hook is not None:
        return
    core = allocator.lib()
    hook = ctypes.CDLL(str(build()))
    hook.mt_cpu_hook_install.restype = ctypes.c_int
    hook.mt_cpu_hook_install.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
    hook.mt_cpu_hook_slow_allocs.restype = ctypes.c_long
    addr = lambda name: ctypes.cast(getattr(core, name), ctypes.c_void_p).value  # noqa: E731
    rc = hook.mt_cpu_hook_install(addr("mt_log_malloc"), addr("mt_log_free"), addr("mt_log_malloc_fail"),
                                  _PRIORITY)
    if rc not in (0, 1):
        raise RuntimeError(f"megatron-memtrace: installing the CPU allocator hook failed (code {rc}); another "
                           "allocator with a higher priority may be registered")
    _hook = hook


def installed() -> bool:
    return _hook is not None


def slow_allocs() -> int:
    """Allocations that took the hook's general path (extra context object); 0 with torch's default allocator."""
    return _hook.mt_cpu_hook_slow_allocs() if _hook is not None else 0
