"""Scope and mark emission (docs/FORMATS.md 2.3) for megatron-core training, through the tracer's event core.

Everything here attaches to *unmodified* Megatron code from the outside, so it serves the built-in harness and a
user's own pretrain_gpt.py alike:
  * module forward scopes `mod:<path>` via torch's global module forward pre/post hooks;
  * `bwdlayer:<path>` per transformer layer via autograd hooks (a node pre-hook on the layer output's grad_fn
    opens it, a tensor hook on the layer input closes it) -- full backward hooks on every module break Megatron;
  * `recompute:<path>` for modules re-run inside megatron's CheckpointFunction.backward;
  * backward marks per op, `bwd>` + path when the backward reaches the op's output (a pre-hook on its grad_fn)
    and `bwd<` + path when the gradient of its input is complete (a hook on the input tensor): between them the
    records belong to that op's backward, so a layer's backward is attributed per op (FORMATS 2.3);
  * `fwd:<mb>` / `bwd:<mb>` (`:c<chunk>` with virtual stages) by wrapping schedules.forward_step/backward_step;
  * `pp_send` / `pp_recv` (P2PCommunicator), `grad_sync` (finalize_model_grads), `param_gather`
    (DDP.start_param_sync), `loss` (LanguageModule.compute_language_model_loss), `optim` (optimizer.step).
Layer indices in names are global (layer_number - 1), so pipeline stages and virtual chunks agree.
When no trace is open every call is a no-op.
"""
from __future__ import annotations

import contextlib
import functools
import re

from tracer import allocator

_enabled = False
_names: dict[int, str] = {}          # id(module) -> qualified path ('' for roots / wrappers)
_roots: list = []                    # keep named roots alive so their ids stay valid
_hook_handles: list = []
_patched = False
_recompute_depth = 0                 # >0 while CheckpointFunction.backward re-runs a forward
_module_depth_in_recompute = 0
_pending_recompute_pops: list[bool] = []   # per open module: did its pre-hook push a recompute scope?
_bwd_ids: dict[int, tuple[int, int | None]] = {}   # id(output tensor) -> (microbatch, chunk)
_fwd_count: dict = {}
_call_names: list[str] = []          # per open module call: the name its scope got (_call_name)
_mtp_layers: list[str] = []          # the multi-token prediction layers open now
_mtp_heads_left = 0                  # MTP loss heads still to run in this forward (set when the MTP block returns)


def enable(on: bool = True) -> None:
    """Turn emission on (a trace must be open) or off."""
    global _enabled
    _enabled = on


def push(name: str) -> None:
    if _enabled:
        allocator.push_scope(name)


def pop() -> None:
    if _enabled:
        allocator.pop_scope()


def mark(name: str) -> None:
    if _enabled:
        allocator.mark(name)


@contextlib.contextmanager
def scope(name: str):
    push(name)
    try:
        yield
    finally:
        pop()


def scoped(name: str, fn):
    """`fn` wrapped so each call runs inside scope `name`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with scope(name):
            return fn(*args, **kwargs)
    wrapper._memtrace_orig = fn
    return wrapper


# ---- module names ------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)$")
# megatron-core's placeholders for absent submodules (cross attention in a GPT layer, qk-layernorm when off):
# they pass their input through, so a scope for them would only cut their parent's code in two.
_IDENTITY_MODULES = ("IdentityOp", "IdentityFuncOp")


def _strip_wrappers(path: str) -> str:
    # DDP / Float16Module wrap the model as `.module`; the op names start at the GPTModel.
    while path == "module" or path.startswith("module."):
        path = path[len("module."):] if path.startswith("module.") else ""
    return path


def register_root(root) -> None:
    """Name every submodule of `root` by its qualified path (wrappers stripped, global layer indices)."""
    _roots.append(root)
    renamed: dict[str, str] = {}
    for path, mod in root.named_modules():
        name = _strip_wrappers(path)
        # Rewrite a local `layers.<i>` prefix to the global index megatron keeps in `layer_number` (1-based).
        for old, new in renamed.items():
            if name == old or name.startswith(old + "."):
                name = new + name[len(old):]
                break
        if type(mod).__name__ in _IDENTITY_MODULES:
            _names.setdefault(id(mod), "")   # no scope: nothing of their own, forward or backward
            continue
        m = _LAYER_RE.search(name)
        if m and hasattr(mod, "layer_number"):
            new = name[: m.start(2)] + str(int(mod.layer_number) - 1)
            renamed[name] = new
            name = new
        _names.setdefault(id(mod), name)


def module_name(mod) -> str:
    name = _names.get(id(mod))
    if name is None:
        register_root(mod)      # first module seen outside any known tree is a root (e.g. the DDP wrapper)
        name = _names[id(mod)]
    return name


def _is_layer(mod) -> bool:
    return hasattr(mod, "layer_number") and type(mod).__name__.endswith("TransformerLayer")


# ---- global module hooks -----------------------------------------------------------------------------------

def _first_tensor(args, kwargs, key="hidden_states"):
    import torch
    cand = kwargs.get(key) if kwargs else None
    if cand is None and args:
        cand = args[0]
    return cand if isinstance(cand, torch.Tensor) else None


def _call_name(mod, name: str) -> str:
    """The name of this call of `mod`. Multi-token prediction runs the model's own embedding inside each MTP layer,
    and its output layer and loss once per MTP layer before the main ones: those calls are ops of their own
    (`mtp.layers.<i>.embedding...`, `mtp_head.output_layer`, `mtp_head.loss`), not more calls of the main ones."""
    if name and _mtp_layers and not name.startswith(_mtp_layers[-1]):
        return _mtp_layers[-1] + "." + name
    if name == "output_layer" and _mtp_heads_left:
        return "mtp_head.output_layer"
    return name


def _pre_hook(mod, args):
    global _module_depth_in_recompute
    if not _enabled:
        return None
    name = _call_name(mod, module_name(mod))
    _call_names.append(name)
    if type(mod).__name__ == "MultiTokenPredictionLayer":
        _mtp_layers.append(name)
    pushed_recompute = False
    if _recompute_depth > 0:
        if _module_depth_in_recompute == 0 and name:
            allocator.push_scope("recompute:" + name)
            pushed_recompute = True
        _module_depth_in_recompute += 1
    _pending_recompute_pops.append(pushed_recompute)
    if name:
        allocator.push_scope("mod:" + name)
    return None


def _post_hook(mod, args, kwargs, output):
    global _module_depth_in_recompute, _mtp_heads_left
    import torch
    if not _enabled or not _pending_recompute_pops:
        return None
    name = _call_names.pop() if _call_names else _names.get(id(mod), "")
    kind = type(mod).__name__
    if kind == "MultiTokenPredictionLayer" and _mtp_layers:
        _mtp_layers.pop()
    elif kind == "MultiTokenPredictionBlock" and torch.is_grad_enabled():
        _mtp_heads_left = len(mod.layers)
    if name and torch.is_grad_enabled():
        mark_backward(name, _first_tensor(args, kwargs), output)
    if name:
        if _is_layer(mod) and torch.is_grad_enabled():
            # Not under no_grad (the first pass of full recompute): that pass has no backward of its own.
            # Registered after the forward (global pre-hooks get no kwargs and megatron passes hidden_states
            # by keyword); the order of the input's hook relative to other hooks does not depend on it.
            _hook_layer_input(_first_tensor(args, kwargs), name)
            out = output[0] if isinstance(output, (tuple, list)) else output
            _hook_layer_output(out, name)
        allocator.pop_scope()
    if _recompute_depth > 0 and _module_depth_in_recompute > 0:
        _module_depth_in_recompute -= 1
    if _pending_recompute_pops.pop():
        allocator.pop_scope()
    return None


def _hook_layer_input(x, name):
    # The input's gradient is complete once every node of this layer's backward has run: close bwdlayer there.
    # Tensor hooks run before node pre-hooks on the same node, so this pop precedes the previous layer's push.
    if x is not None and x.requires_grad:
        x.register_hook(lambda g: (pop(), None)[1])


def _hook_layer_output(out, name):
    import torch
    if isinstance(out, torch.Tensor) and out.requires_grad and out.grad_fn is not None:
        label = "bwdlayer:" + name
        out.grad_fn.register_prehook(lambda grads: (push(label), None)[1])


def _first_of(x):
    import torch
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        return next((y for y in x if isinstance(y, torch.Tensor)), None)
    return None


def mark_backward(name: str, inp, output) -> None:
    """Bracket the backward of op `name` by marks: `bwd>name` when autograd reaches the grad_fn of its output,
    `bwd<name` when its input's gradient is complete. A module whose output is its input (IdentityOp) has no
    backward of its own; one whose output is a child's output shares the child's grad_fn (the parser orders
    marks that fall on the same moment by the forward nesting)."""
    out = _first_of(output)
    if out is None or out is inp or not out.requires_grad or out.grad_fn is None:
        return
    enter, leave = "bwd>" + name, "bwd<" + name
    out.grad_fn.register_prehook(lambda grads: (mark(enter), None)[1])
    if inp is not None and inp.requires_grad:
        inp.register_hook(lambda g: (mark(leave), None)[1])


def attach_module_hooks() -> None:
    """Register the process-wide module forward hooks (once)."""
    import torch.nn.modules.module as M
    if _hook_handles:
        return
    _hook_handles.append(M.register_module_forward_pre_hook(_pre_hook))
    _hook_handles.append(M.register_module_forward_hook(_post_hook, with_kwargs=True))


# ---- megatron patches --------------------------------------------------------------------------------------

def _chunk_label(mb, chunk):
    return f"{mb}" if chunk is None else f"{mb}:c{chunk}"


def _wrap_forward_step(orig):
    @functools.wraps(orig)
    def forward_step(*args, **kwargs):
        global _mtp_heads_left
        _mtp_heads_left = 0
        chunk = kwargs.get("vp_stage")
        mb = kwargs.get("current_microbatch")
        if mb is None:
            mb = _fwd_count.get(chunk, 0)
        _fwd_count[chunk] = mb + 1
        with scope("fwd:" + _chunk_label(mb, chunk)):
            result = orig(*args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        out = out[0] if isinstance(out, list) and out else out
        _bwd_ids[id(out)] = (mb, chunk)
        return result
    forward_step._memtrace_orig = orig
    return forward_step


def _wrap_backward_step(orig):
    @functools.wraps(orig)
    def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        out = output_tensor[0] if isinstance(output_tensor, list) and output_tensor else output_tensor
        mb, chunk = _bwd_ids.pop(id(out), (None, None))
        label = "bwd:" + ("?" if mb is None else _chunk_label(mb, chunk))
        with scope(label):
            return orig(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    backward_step._memtrace_orig = orig
    return backward_step


def _loss_scoped(orig):
    """compute_language_model_loss in a `loss` scope, its backward bracketed like a module's (mark_backward)."""
    @functools.wraps(orig)
    def compute_language_model_loss(self, labels, logits, *args, **kwargs):
        global _mtp_heads_left
        import torch
        name = "mtp_head.loss" if _mtp_heads_left else "loss"     # (_call_name)
        with scope(name):
            out = orig(self, labels, logits, *args, **kwargs)
        if torch.is_grad_enabled():
            mark_backward(name, logits, out)
        _mtp_heads_left = max(_mtp_heads_left - 1, 0)
        return out
    compute_language_model_loss._memtrace_orig = orig
    return compute_language_model_loss


def _wrap_checkpoint_backward(orig):
    def backward(ctx, *args):
        global _recompute_depth
        _recompute_depth += 1
        try:
            return orig(ctx, *args)
        finally:
            _recompute_depth -= 1
    return staticmethod(backward)


def new_iteration() -> None:
    """Reset the per-iteration microbatch counters (call at the start of every iteration)."""
    _fwd_count.clear()
    _bwd_ids.clear()


def patch_megatron() -> None:
    """Attach iteration-independent scopes to megatron-core internals (idempotent)."""
    global _patched
    if _patched:
        return
    from megatron.core import distributed as mdist
    from megatron.core.distributed import distributed_data_parallel as ddp_mod
    import importlib
    from megatron.core.models.common.language_module import language_module as lm
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    schedules.forward_step = _wrap_forward_step(schedules.forward_step)
    schedules.backward_step = _wrap_backward_step(schedules.backward_step)

    # Pure sends are pp_send; anything that receives (incl. the combined send+recv calls) is pp_recv.
    C = p2p.P2PCommunicator
    for meth in ("send_forward", "send_backward"):
        setattr(C, meth, scoped("pp_send", getattr(C, meth)))
    for meth in ("recv_forward", "recv_backward", "send_forward_recv_backward", "send_backward_recv_forward",
                 "send_forward_recv_forward", "send_backward_recv_backward",
                 "send_forward_backward_recv_forward_backward"):
        if hasattr(C, meth):
            setattr(C, meth, scoped("pp_recv", getattr(C, meth)))

    # The package re-exports the function under the submodule's name, so fetch the module itself.
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    fin = scoped("grad_sync", fmg.finalize_model_grads)
    fmg.finalize_model_grads = fin
    mdist.finalize_model_grads = fin
    DDP = ddp_mod.DistributedDataParallel
    DDP.start_param_sync = scoped("param_gather", DDP.start_param_sync)
    LM = lm.LanguageModule
    LM.compute_language_model_loss = _loss_scoped(LM.compute_language_model_loss)
    CF = mrandom.CheckpointFunction
    CF.backward = _wrap_checkpoint_backward(CF.backward)
    _patched = True


def wrap_optimizer(optimizer):
    """Scope `optimizer.step` as `optim` (instance attribute; the class stays untouched)."""
    if not getattr(optimizer.step, "_memtrace_orig", None):
        optimizer.step = scoped("optim", optimizer.step)
    return optimizer
