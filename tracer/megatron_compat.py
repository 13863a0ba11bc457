"""CPU compatibility layer that lets UNMODIFIED megatron-core 0.16.1 train on CPU with gloo.

megatron-core assumes CUDA everywhere (device='cuda' factories, streams, `Tensor.type()` checks, the CUDA RNG
tracker). These shims map each assumption onto the CPU, and nothing else (DESIGN.md section 4 lists them as
measured facts). `install()` is idempotent and must only be used on a machine without CUDA; the GPU path never
calls it.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.Lock()
_installed = False
_mode: "_CudaToCpuMode | None" = None


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # Megatron passes torch.cuda.current_device() (an int on GPU) as a device.
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites device='cuda' factory kwargs to CPU, and makes `.cuda()` / `.to('cuda')` no-ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)   # pinning needs a CUDA driver
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class _DummyStream:
    """Stand-in for torch.cuda.Stream / current_stream(): CPU work is synchronous, so every op is a no-op."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU
        self.cuda_stream = 0

    def wait_stream(self, other): pass
    def wait_event(self, event): pass
    def record_event(self, event=None): return event or _DummyEvent()
    def synchronize(self): pass
    def query(self): return True
    def __eq__(self, other): return isinstance(other, _DummyStream)
    def __hash__(self): return 0


class _DummyEvent:
    def __init__(self, *args, **kwargs): pass
    def record(self, stream=None): pass
    def wait(self, stream=None): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, other): return 0.0


_STREAM = _DummyStream()


def _patch_torch_cuda() -> None:
    c = torch.cuda
    c.current_device = lambda: _CPU
    c.synchronize = lambda device=None: None
    c.empty_cache = lambda: None
    c.current_stream = lambda device=None: _STREAM
    c.default_stream = lambda device=None: _STREAM
    c.set_stream = lambda stream: None
    c.Stream = _DummyStream
    c.Event = _DummyEvent
    c.stream = lambda stream=None: contextlib.nullcontext()
    c.set_device = lambda device: None
    # One RNG for everything: the CUDA tracker's get/set/seed calls act on the CPU generator.
    c.get_rng_state = lambda device="cuda": _untraced_rng_state()
    c.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (a lazy no-op on CPU): leave that one alone and
    # seed the CPU generator directly here to avoid recursion.
    c.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.Tensor.record_stream = lambda self, stream: None


def _patch_tensor_type() -> None:
    """Distributed optimizer and grad clipping assert `param.type()` is a torch.cuda.*Tensor."""
    orig = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = orig(self)
            return "torch.cuda." + name[len("torch."):] if name.startswith("torch.") and ".cuda." not in name else name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda."):]
        return orig(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    # Megatron compares against these names; on a CPU wheel they exist but cannot construct tensors.
    for name in ("FloatTensor", "HalfTensor", "BFloat16Tensor"):
        setattr(torch.cuda, name, getattr(torch, name))


def _untraced_rng_state():
    """A copy of the CPU generator state in memory torch does not own, so the allocator hook never sees it.

    On a GPU the CUDA RNG states that Megatron's tracker forks and recompute keeps are host tensors, invisible to
    the device allocator; as traced CPU tensors they would add 5056 B per fork to the layers' saved bytes."""
    state = torch.default_generator.get_state()  # what torch.get_rng_state() returns, without the patch below
    return torch.frombuffer(bytearray(state.numpy().tobytes()), dtype=torch.uint8)


def _patch_rng_tracker() -> None:
    """Megatron's CUDA RNG tracker (dropout forks, recompute replay) reads/writes the CPU generator instead."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return _untraced_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    # Checkpointing also keeps the CPU generator's state (torch.get_rng_state): host memory on a GPU run too.
    torch.get_rng_state = _untraced_rng_state


def _patch_torch_norm() -> None:
    """The local spec's WrappedTorchNorm refuses sequence parallel; the norm is elementwise over tokens, so it is
    correct under SP as long as its params are tagged `sequence_parallel` (their grads get all-reduced over TP)."""
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_memtrace_sp", False):
        return
    orig_new = cls.__new__

    def new(klass, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp = config.sequence_parallel
        if not sp:
            return orig_new(klass, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = orig_new(klass, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm

    cls.__new__ = staticmethod(new)
    cls._memtrace_sp = True


def _patch_moe() -> None:
    """MoE shims: alltoall split sizes as plain lists (gloo), and `te_general_gemm` defined when TE is absent."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None   # moe_utils only defines it in its TE import branch

    orig = mappings.all_to_all
    if getattr(orig, "_memtrace", False):
        return

    def _as_list(sizes):
        return sizes.tolist() if hasattr(sizes, "tolist") else sizes

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
        return orig(group, input_, _as_list(output_split_sizes_), _as_list(input_split_sizes))

    all_to_all._memtrace = True
    for mod in (mappings, tensor_parallel, token_dispatcher):
        if getattr(mod, "all_to_all", None) is orig:
            mod.all_to_all = all_to_all


# Collectives megatron-core runs on its TP/EP/DP groups (bound by name at its import, so patched before it). The
# list forms carry uneven splits: the all-to-all MoE dispatcher's gather and reduce-scatter over expert TP, whose
# flat buffer gloo's Work holds until its worker drops it.
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base",
                "_reduce_scatter_base", "all_to_all_single", "broadcast", "all_gather", "reduce_scatter")
# Normally gloo's worker lets go within microseconds; two ranks on two loaded cores can take milliseconds.
_SETTLE_S = 0.2
_WORKER_S = 0.001


def _storages(args, kwargs) -> list:
    """(storage, its use count now) of the op's tensors; the count includes the storage object held here."""
    out = []
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                out.append((s, torch._C._storage_Use_Count(s._cdata)))
    return out


def _settle(held: list) -> None:
    """Wait (up to _SETTLE_S) until gloo's worker thread has dropped its references to the op's tensors.

    gloo's worker marks the work complete, then drops the work (and with it the tensors) a moment later; when the
    caller has already let go, the tensor is freed on that thread at an arbitrary later point of the trace, so
    the same op's buffer lives longer on one rank than on its peer. On a GPU the caller's order decides."""
    import time
    deadline = time.perf_counter() + _SETTLE_S
    while any(torch._C._storage_Use_Count(s._cdata) > n for s, n in held):
        if time.perf_counter() > deadline:
            return
        time.sleep(0.0001)
    # Buffers of gloo's own (the flat copy a reduce-scatter works on) are not the op's tensors: the worker frees
    # them when it drops the finished Work, just after the caller's wait returns. A moment's sleep lets it run
    # first on a loaded core, so they are freed inside the op that made them, as a GPU frees its workspaces.
    time.sleep(_WORKER_S)


class _SettledWork:
    """An async collective's Work whose wait() also settles its tensors (see _settle); megatron-core only waits on
    its handles, once."""

    def __init__(self, work, held):
        self._work, self._held = work, held

    def wait(self, *args, **kwargs):
        if self._work is None:
            return True
        out = self._work.wait(*args, **kwargs)
        # Let go of the Work (it holds views of the tensors) so that only gloo's worker may still hold them, then
        # wait for that; no reference of ours outlives the op either.
        self._work = None
        _settle(self._held)
        self._held = []
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _patch_collectives() -> None:
    import torch.distributed as dist
    for name in _COLLECTIVES:
        orig = getattr(dist, name, None)
        if orig is None or getattr(orig, "_memtrace", False):
            continue

        def settled(*args, _orig=orig, **kwargs):
            held = _storages(args, kwargs)
            work = _orig(*args, **kwargs)
            if work is None:
                _settle(held)
                held.clear()
                return None
            return _SettledWork(work, held)
        settled._memtrace = True
        settled.__name__ = name
        setattr(dist, name, settled)


def _pin_gemm_path() -> None:
    """Keep 16-bit matrix products off oneDNN. On CPUs with AVX-512 BF16 or AMX, torch runs bf16/fp16 GEMMs
    through oneDNN, elsewhere through cpublas, which allocates only the output. bf16 traces from another machine
    held odd-sized transients inside their GEMMs that an AVX2 machine's traces of the same configs lack (README,
    the CPU layer): the same config must trace alike on every CPU, and a GPU has no per-call buffer of that kind."""
    torch.backends.mkldnn.enabled = False


def install() -> None:
    """Apply every shim once per process (idempotent). Refuses to run where CUDA is actually available."""
    global _installed, _mode
    with _lock:
        if _installed:
            return
        if torch.cuda.is_available():
            raise RuntimeError("megatron_compat.install() is the CPU path; CUDA is available here")
        _patch_collectives()   # first: megatron modules bind some collectives by name when imported
        _patch_torch_cuda()
        _patch_tensor_type()
        _patch_rng_tracker()
        _patch_torch_norm()
        _patch_moe()
        _pin_gemm_path()
        # Entered and never exited: the mode stays on for the rest of the process (main thread; CPU autograd
        # runs backward on the calling thread).
        _mode = _CudaToCpuMode()
        _mode.__enter__()
        _installed = True


def installed() -> bool:
    return _installed
