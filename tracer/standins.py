"""Stand-ins for the GPU kernel families Megatron-LM runs by default, so a CPU run keeps what the GPU run keeps.

Each stand-in is an autograd function (or a module built from megatron-core's own parts) that saves for backward
exactly the tensors the GPU kernel saves -- same shapes, same dtypes -- while computing the same values with
ordinary torch ops. What differs is only what a kernel allocates and frees inside itself (a GPU kernel keeps its
intermediates in registers; a stand-in may allocate small transients). docs/STANDINS.md is the table: per family,
the kernel it mirrors, the tensors it keeps and what remains different.

`install(tconfig, cfg)` patches megatron-core for one process, choosing per family by the same rules as
`estimator.formulas.kernels` (which the estimator applies to the command line), and returns the families it
installed. On a GPU only families whose real kernel is missing are replaced (Transformer Engine absent; the
masked-softmax and RoPE extensions absent); there the flash stand-in runs torch's real flash-attention kernel.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from estimator.formulas import fused_cross_entropy, kernels as kernel_switches, softmax_batch_per_block


# ----------------------------------------------------------------------------------------------- dropout
class _ByteMaskDropout(torch.autograd.Function):
    """CUDA's native_dropout: the mask it saves is bool (1 byte per element); CPU eager dropout keeps a mask in the
    input's dtype."""

    @staticmethod
    def forward(ctx, x, p):
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)
        scale = 1.0 / (1.0 - p)
        out = torch.mul(x, mask)
        out.mul_(scale)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        gi = torch.mul(g, mask)
        gi.mul_(ctx.scale)
        return gi, None


def _byte_mask_dropout(original):
    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0 or not torch.is_grad_enabled() or not input.requires_grad:
            return original(input, p, training, inplace)
        return _ByteMaskDropout.apply(input, p)
    return dropout


# ------------------------------------------------------------------------------------- masked softmax
def batch_per_block(sq: int, sk: int, b: int, np_: int) -> int:
    """megatron's get_batch_per_block, which only the CUDA extension answers: the estimator's rule."""
    return softmax_batch_per_block(sk)


_CAUSAL = {}


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """The upper triangle, made once per shape (the upper-triangular kernel needs no mask tensor at all)."""
    key = (sq, sk, str(device))
    if key not in _CAUSAL:
        _CAUSAL[key] = torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1)
    return _CAUSAL[key]


class _FusedSoftmax(torch.autograd.Function):
    """ScaledUpperTriangMaskedSoftmax / ScaledMaskedSoftmax / ScaledSoftmax: the kernel writes the probabilities in
    the input's dtype (fp32 only in registers) and saves them and a one-element scale; the scores are not kept."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        sq, sk = scores.shape[-2], scores.shape[-1]
        if causal:
            mask = _causal_mask(sq, sk, scores.device)
        probs = torch.empty_like(scores)
        # one [sq, sk] slice at a time: the kernel's intermediates stay in registers, so only a slice-sized
        # transient here (never a whole scaled or masked copy of the scores)
        flat_in, flat_out = scores.detach().view(-1, sq, sk), probs.view(-1, sq, sk)
        flat_mask = None if mask is None else mask.expand(*scores.shape[:-2], sq, sk).reshape(-1, sq, sk)
        for i in range(flat_in.shape[0]):
            x = flat_in[i] * scale
            m = mask if causal else None if flat_mask is None else flat_mask[i]
            if m is not None:
                x.masked_fill_(m, -10000.0)
            flat_out[i].copy_(torch.softmax(x, dim=-1))
        scale_t = torch.tensor([scale])
        ctx.save_for_backward(probs, scale_t)
        return probs

    @staticmethod
    def backward(ctx, g):
        probs, scale_t = ctx.saved_tensors
        gi = torch._softmax_backward_data(g, probs, -1, probs.dtype)
        gi.mul_(float(scale_t[0]))
        return gi, None, None, None


def _install_softmax():
    from megatron.core.fusions import fused_softmax as fs
    from megatron.core.transformer.enums import AttnMaskType

    def get_batch_per_block(self, sq, sk, b, np_):
        return batch_per_block(sq, sk, b, np_)

    def forward_fused_softmax(self, input, mask):
        b, np_, sq, sk = input.size()
        scale = self.scale if self.scale is not None else 1.0
        causal = self.attn_mask_type == AttnMaskType.causal
        return _FusedSoftmax.apply(input, None if causal else mask, float(scale), causal)

    fs.FusedScaleMaskSoftmax.get_batch_per_block = get_batch_per_block
    fs.FusedScaleMaskSoftmax.forward_fused_softmax = forward_fused_softmax


# ---------------------------------------------------------------------------------------- bias + activation
def _install_bias_activation():
    """megatron's GeLUFunction / SwiGLUFunction / BiasSwiGLUFunction stay the autograd functions (they choose what
    is saved: the pre-activation input, and the bias); their torch.compile'd arithmetic is replaced by code that
    allocates what the compiled kernel does on a GPU (H100 traces): one output tensor, forward and backward (the
    eager arithmetic makes a full-size tensor per operation: seven for GeLU's backward). A bias's gradient is
    reduced as autograd's CUDA reduction does it (_cuda_bias_grad). Weighted SwiGLU (MoE probabilities applied in
    the activation) keeps its eager arithmetic."""
    from megatron.core.fusions import fused_bias_gelu as g, fused_bias_swiglu as s

    g.bias_gelu, g.bias_gelu_back = _bias_gelu, _bias_gelu_back
    s.swiglu, s.bias_swiglu, s.swiglu_back, s.bias_swiglu_back = _swiglu, _bias_swiglu, _swiglu_back, _bias_swiglu_back
    for name in ("weighted_swiglu", "weighted_swiglu_back"):
        orig = getattr(getattr(s, name, None), "_torchdynamo_orig_callable", None)
        if orig is not None:
            setattr(s, name, orig)
    g.GeLUFunction.backward = staticmethod(_gelu_function_backward)
    s.BiasSwiGLUFunction.backward = staticmethod(_bias_swiglu_function_backward)


def _bias_gelu(bias, y):
    out = torch.add(y, bias, out=torch.empty_like(y))
    return torch.ops.aten.gelu_(out, approximate="tanh")     # megatron's tanh approximation, in place


def _bias_gelu_back(g, bias, y):
    x = torch.add(y, bias, out=torch.empty_like(y))
    return torch.ops.aten.gelu_backward.grad_input(g, x, approximate="tanh", grad_input=x)


def _swiglu(y):
    y1, y2 = torch.chunk(y, 2, -1)
    out = torch.ops.aten.silu.out(y1, out=y.new_empty(y1.shape))
    return out.mul_(y2)


def _bias_swiglu(y, bias):
    # silu(y1 + b1) * (y2 + b2) in one output needs a second buffer here: the linear half plus its bias is a
    # transient a GPU kernel does not make (megatron's SwiGLU with a bias; Llama-style MLPs have none)
    b1, b2 = torch.chunk(bias, 2, -1)
    y1, y2 = torch.chunk(y, 2, -1)
    out = torch.add(y1, b1, out=y.new_empty(y1.shape))
    torch.ops.aten.silu_(out)
    up = torch.add(y2, b2, out=y.new_empty(y2.shape))
    out.mul_(up)
    del up
    return out


def _swiglu_back(g, y):
    y1, y2 = torch.chunk(y, 2, -1)
    out = y.new_empty(y.shape)
    o1, o2 = torch.chunk(out, 2, -1)
    torch.ops.aten.silu_backward.grad_input(y2, y1, grad_input=o1).mul_(g)   # g * silu'(y1) * y2
    torch.ops.aten.silu.out(y1, out=o2).mul_(g)                               # g * silu(y1)
    return out


def _bias_swiglu_back(g, y, bias):
    x = torch.add(y, bias, out=y.new_empty(y.shape))     # a transient the GPU kernel does not make (above)
    out = _swiglu_back(g, x)
    del x
    return out


_SEMAPHORE_BLOCK = 512   # the caching allocator's smallest block (kMinBlockSize)


def _cuda_bias_grad(grad: torch.Tensor, width: int) -> torch.Tensor:
    """A bias's gradient as autograd reduces it on a GPU (the sum over tokens of the activation's input gradient,
    torch's CUDA reduction kernel): the [width] output, then the kernel's fp32 staging buffer and its semaphores,
    freed at once. Sizes as the H100 traces show them for every bias of width F over R tokens: 8 * R * F bytes of
    staging (measured up to R = 2,048; torch bounds the blocks of a larger reduction by the GPU's size, so beyond
    it this errs high) and 4 bytes per 128 outputs of semaphores, rounded up: not a sum of monomials in F, so
    requested here as the 512-byte block the caching allocator hands any request up to 512 B (F up to 16,384)."""
    out = grad.new_empty(width)
    rows = grad.numel() // width
    staging = torch.empty(8 * rows * width, dtype=torch.uint8, device=grad.device)
    semaphores = torch.empty(_SEMAPHORE_BLOCK, dtype=torch.uint8, device=grad.device)
    torch.sum(grad.reshape(rows, width), dim=0, out=out)
    del semaphores, staging
    return out


def _gelu_function_backward(ctx, grad_output):
    from megatron.core.fusions import fused_bias_gelu as g
    input, bias = ctx.saved_tensors
    tmp = g.bias_gelu_back(grad_output, bias, input)
    return tmp, _cuda_bias_grad(tmp, bias.numel())


def _bias_swiglu_function_backward(ctx, grad_output):
    from megatron.core.fusions import fused_bias_swiglu as s
    input, bias = ctx.saved_tensors
    input = input.to(ctx.ori_input_dtype) if ctx.fp8_input_store else input
    tmp = s.bias_swiglu_back(grad_output, input, bias)
    return tmp, _cuda_bias_grad(tmp, bias.numel()), None, None


# ---------------------------------------------------------------------------------------- bias-dropout-add
# inductor reduces a bias's gradient over the tokens in two passes: fp32 partial sums per block of this many rows
# (H100 traces: s*b*h/(32*st) bytes, i.e. 4 bytes x h per 128 tokens), then the sum of the partials.
_BIAS_GRAD_ROWS = 128


_SCALARS: dict = {}


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor of `like`'s dtype, made once: multiplying by a Python float allocates a CPU scalar tensor
    each time (a GPU kernel takes the scalar as an argument)."""
    key = (value, like.dtype, like.device)
    if key not in _SCALARS:
        _SCALARS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return _SCALARS[key]


class _FusedBiasDropoutAdd(torch.autograd.Function):
    """megatron's bias_dropout_add_fused_train as torch.compile (inductor) runs it on a GPU, event for event as the
    H100 traces show it: forward writes its output alone (with dropout: an 8-byte seed, freed at once, and the
    1-byte mask it keeps; x + bias is never materialized); backward passes the output's gradient on as the
    residual's (and as x's without dropout) and frees the mask as soon as x's gradient is made, before a bias's
    gradient, which is reduced through fp32 partial sums. The mask marks dropped elements (masked_fill needs no
    cast of a bool mask, which a CPU multiply would make)."""

    @staticmethod
    def forward(ctx, x, bias, residual, p):
        dropped = None
        if p > 0.0:
            seed = torch.empty(1, dtype=torch.int64, device=x.device)
            dropped = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(p)
        out = torch.empty_like(x)
        if bias is not None:
            torch.add(x, bias, out=out)
        else:
            out.copy_(x)
        if dropped is not None:
            del seed
            out.masked_fill_(dropped, 0).mul_(_scalar(1.0 / (1.0 - p), out))
        out.add_(residual)
        # a ctx attribute, not save_for_backward: the compiled backward frees the mask mid-way (above)
        ctx.dropped, ctx.p, ctx.has_bias = dropped, p, bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        dropped, ctx.dropped = ctx.dropped, None
        gx = g
        if dropped is not None:
            gx = g.masked_fill(dropped, 0)
            gx.mul_(_scalar(1.0 / (1.0 - ctx.p), gx))
            del dropped
        gb = None
        if ctx.has_bias:
            h = gx.shape[-1]
            rows = gx.numel() // h
            flat = gx.reshape(rows, h)
            # inductor's fp32 partial sums: their buffer only (this sum needs none)
            partial = torch.empty(rows * h // _BIAS_GRAD_ROWS, dtype=torch.float32, device=g.device)
            gb = torch.empty(h, dtype=g.dtype, device=g.device)
            torch.sum(flat, dim=0, out=gb)     # (on CPU in fp32 internally, no buffer of its own)
            del partial
        return gx, gb, g, None


def _install_bias_dropout_add():
    from megatron.core.fusions import fused_bias_dropout as fbd

    def bias_dropout_add_fused_train(x_with_bias, residual, prob):
        x, bias = x_with_bias
        residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
        return _FusedBiasDropoutAdd.apply(x, bias, residual, float(prob))

    fbd.bias_dropout_add_fused_train = bias_dropout_add_fused_train


# ----------------------------------------------------------------------------------------------------- RoPE
class _FusedRoPE(torch.autograd.Function):
    """Transformer Engine's FusedRoPEFunc: keeps only the frequencies (shared by every layer), not the rotated input
    or its halves; backward rotates the gradient back."""

    @staticmethod
    def forward(ctx, t, freqs, interleaved):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
        ctx.save_for_backward(freqs)
        ctx.interleaved = interleaved
        return _apply_rotary_pos_emb_bshd(t.detach(), freqs, rotary_interleaved=interleaved)

    @staticmethod
    def backward(ctx, g):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
        (freqs,) = ctx.saved_tensors
        # a rotation's transpose is the rotation by the opposite angle
        return _apply_rotary_pos_emb_bshd(g, -freqs, rotary_interleaved=ctx.interleaved), None, None


def _install_rope():
    from megatron.core.models.common.embeddings import rope_utils

    def fused_apply_rotary_pos_emb(t, freqs, interleaved=False, **_):
        return _FusedRoPE.apply(t, freqs, interleaved)

    rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb


# MLA's fused YaRN RoPE (megatron.core.fusions.fused_mla_yarn_rope_apply): megatron's own autograd functions
# allocate what the GPU run allocates (the query rotated in place; the key and value as new tensors, their
# gradients likewise) and call Triton kernels, which a CPU lacks. These stand in for the four kernels, in numpy on
# the tensors' own memory (no allocation), with the kernels' arithmetic: the rotary part's even / odd elements
# (x1, x2) become the left / right halves x1*cos - x2*sin, x2*cos + x1*sin, per token position (sbhd: row // b).
def _rope_halves(x, cos, sin, pos):
    """x [..., emb] (float32 numpy), cos / sin [max_seq, emb], pos the rows' positions -> the rotated halves."""
    import numpy as np
    h = x.shape[-1] // 2
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (h,)
    cl, cr = cos[pos, :h].reshape(shape), cos[pos, h:].reshape(shape)
    sl, sr = sin[pos, :h].reshape(shape), sin[pos, h:].reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * cl - x2 * sl, x2 * cr + x1 * sr], axis=-1)


def _rope_halves_back(g, cos, sin, pos):
    """The transpose of _rope_halves: the gradient of x (even / odd elements) from the halves' gradient."""
    import numpy as np
    h = g.shape[-1] // 2
    shape = (len(pos),) + (1,) * (g.ndim - 2) + (h,)
    cl, cr = cos[pos, :h].reshape(shape), cos[pos, h:].reshape(shape)
    sl, sr = sin[pos, :h].reshape(shape), sin[pos, h:].reshape(shape)
    gl, gr = g[..., :h], g[..., h:]
    out = np.empty(g.shape, np.float32)
    out[..., 0::2] = gl * cl + gr * sr
    out[..., 1::2] = gr * cr - gl * sl
    return out


def _put(dst: torch.Tensor, values) -> None:
    """Write a float32 numpy array into a tensor (view) of any float dtype, in place."""
    dst.copy_(torch.from_numpy(values))


class _Kernel:
    """A Triton kernel's launch syntax, kernel[grid](*args), for a Python function."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _mla_positions(total: int, batch, cp_size) -> "object":
    import numpy as np
    assert batch is not None and cp_size == 1, "stand-in: MLA fused RoPE in sbhd layout without CP only"
    return np.arange(total) // batch


def _mla_q_fwd(q, cos, sin, qk_head_dim, emb_dim, nheads, batch, seq_num, cu, s0, s1, cp_rank, cp_size, **_):
    pe = q[..., qk_head_dim:]
    _put(pe, _rope_halves(_np32(pe), _np32(cos).reshape(-1, emb_dim), _np32(sin).reshape(-1, emb_dim),
                          _mla_positions(q.shape[0], batch, cp_size)))


def _mla_q_bwd(g, cos, sin, qk_head_dim, emb_dim, nheads, batch, seq_num, cu, s0, s1, cp_rank, cp_size, **_):
    pe = g[..., qk_head_dim:]
    _put(pe, _rope_halves_back(_np32(pe), _np32(cos).reshape(-1, emb_dim), _np32(sin).reshape(-1, emb_dim),
                               _mla_positions(g.shape[0], batch, cp_size)))


def _mla_kv_fwd(kv, k_pos_emb, o_key, o_value, cos, sin, emb_dim, k_dim, v_dim, nheads, batch, seq_num, cu,
                *rest, **_):
    cp_size = rest[-1]
    o_key[..., :k_dim].copy_(kv[..., :k_dim])
    o_value.copy_(kv[..., k_dim:])
    rot = _rope_halves(_np32(k_pos_emb), _np32(cos).reshape(-1, emb_dim), _np32(sin).reshape(-1, emb_dim),
                       _mla_positions(kv.shape[0], batch, cp_size))
    _put(o_key[..., k_dim:], rot[:, None, :].repeat(nheads, axis=1))


def _mla_kv_bwd(dk, dv, d_kv, d_emb, cos, sin, emb_dim, k_dim, v_dim, nheads, batch, seq_num, cu, *rest, **_):
    cp_size = rest[-1]
    d_kv[..., :k_dim].copy_(dk[..., :k_dim])
    d_kv[..., k_dim:].copy_(dv)
    g = _np32(dk[..., k_dim:]).sum(axis=1)        # the shared rotary key's gradient, summed over heads
    back = _rope_halves_back(g, _np32(cos).reshape(-1, emb_dim), _np32(sin).reshape(-1, emb_dim),
                             _mla_positions(dk.shape[0], batch, cp_size))
    _put(d_emb.view(-1, emb_dim), back)


def _install_mla_rope():
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mla_rope
    mla_rope.rotary_fwd_q_kernel = _Kernel(_mla_q_fwd)
    mla_rope.rotary_bwd_q_kernel = _Kernel(_mla_q_bwd)
    mla_rope.rotary_fwd_kv_kernel = _Kernel(_mla_kv_fwd)
    mla_rope.rotary_bwd_kv_kernel = _Kernel(_mla_kv_bwd)
    mla_rope.triton.cdiv = lambda a, b: -(-a // b)


# ---------------------------------------------------------------------------------------------- torch's norms
# torch's own functions, kept before _install_torch_norms replaces them (the TE norm stand-in's backward uses them)
_TORCH_LAYER_NORM = torch.nn.functional.layer_norm
_TORCH_RMS_NORM = torch.nn.functional.rms_norm


class _CudaNorm(torch.autograd.Function):
    """torch's layer_norm / rms_norm as their CUDA kernels allocate (the local spec's norms, WrappedTorchNorm, on a
    GPU): forward the output in the input's dtype, then fp32 statistics, one per row (mean and rstd; rstd alone for
    RMSNorm: CUDA's _fused_rms_norm), saving the input, the weight and the statistics; backward the input's
    gradient, then the weight's and the bias's. On CPU torch decomposes rms_norm into elementwise ops that keep
    more, and its layer_norm keeps 16-bit statistics. Each product is written into the output (or the input's
    gradient) before it is reduced, so the only other tensors are vectors of one value per row (a statistic in the
    input's dtype, the backward's row sums), which a GPU kernel keeps in registers."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        h = x.shape[-1]
        rows = x.reshape(-1, h)
        n = rows.shape[0]
        result = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out = result.view(n, h)      # (the tensor returned is no view: autograd adds into a gradient that is none)
        mean = None if rms else torch.empty(n, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        low = _RowVector(x, n)
        if not rms:
            torch.sum(rows, -1, out=low.buffer(mean))
            mean.copy_(low.buffer(mean)).mul_(_scalar(1.0 / h, mean))
        _centre(rows, mean, low, out)
        out.mul_(out)
        torch.sum(out, -1, out=low.buffer(rstd))
        rstd.copy_(low.buffer(rstd)).mul_(_scalar(1.0 / h, rstd)).add_(_scalar(eps, rstd)).rsqrt_()
        _centre(rows, mean, low, out)
        out.mul_(low.of(rstd)[:, None]).mul_(weight)
        if bias is not None:
            out.add_(bias)
        del low
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, mean, rstd)
        return result

    @staticmethod
    def backward(ctx, g):
        x, weight, mean, rstd = ctx.saved_tensors
        h = x.shape[-1]
        rows, g = x.reshape(-1, h), g.reshape(-1, h)
        n = rows.shape[0]
        grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx = grad.view(n, h)
        dw = torch.empty_like(weight)
        db = torch.empty_like(weight) if ctx.has_bias else None
        low = _RowVector(x, n)
        _centre(rows, mean, low, dx)
        dx.mul_(low.of(rstd)[:, None]).mul_(g)                 # g * xhat
        torch.sum(dx, 0, out=dw)
        if db is not None:
            torch.sum(g, 0, out=db)
        dx.mul_(weight)
        c_xhat = torch.empty(n, dtype=x.dtype, device=x.device)
        torch.sum(dx, -1, out=c_xhat).mul_(_scalar(1.0 / h, c_xhat))         # mean(g * w * xhat) per row
        c_mean = None if mean is None else torch.mv(g, weight).mul_(_scalar(1.0 / h, c_xhat))   # mean(g * w)
        _centre(rows, mean, low, dx)
        r = low.of(rstd)[:, None]
        dx.mul_(r).mul_(c_xhat[:, None]).neg_().addcmul_(g, weight)
        if c_mean is not None:
            dx.sub_(c_mean[:, None])
        dx.mul_(r)
        return grad, dw, db, None, None


class _RowVector:
    """One value per row in the input's dtype, for arithmetic with the rows (an fp32 statistic times 16-bit rows
    would make a converted copy of the rows); in fp32 the statistic itself."""

    def __init__(self, x, n):
        self._vec = None if x.dtype == torch.float32 else torch.empty(n, dtype=x.dtype, device=x.device)

    def buffer(self, stat):
        return stat if self._vec is None else self._vec

    def of(self, stat):
        return stat if self._vec is None else self._vec.copy_(stat)


def _centre(rows, mean, low, out):
    """out = rows - mean (RMSNorm: rows)."""
    if mean is None:
        out.copy_(rows)
    else:
        torch.sub(rows, low.of(mean)[:, None], out=out)


def _cuda_norm_fits(x, shape, weight, bias) -> bool:
    """How megatron's norms call torch: one normalized (last) dimension and an affine weight (and bias) of the
    input's dtype. Anything else runs torch's own function."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return (x.is_floating_point() and len(shape) == 1 and shape[0] == x.shape[-1] and weight is not None
            and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype))


def _install_torch_norms():
    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        if _cuda_norm_fits(input, normalized_shape, weight, bias):
            return _CudaNorm.apply(input, weight, bias, eps, False)
        return _TORCH_LAYER_NORM(input, normalized_shape, weight, bias, eps)

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        if _cuda_norm_fits(input, normalized_shape, weight, None):
            return _CudaNorm.apply(input, weight, None, torch.finfo(input.dtype).eps if eps is None else eps, True)
        return _TORCH_RMS_NORM(input, normalized_shape, weight, eps)

    torch.nn.functional.layer_norm = layer_norm
    torch.nn.functional.rms_norm = rms_norm


# ----------------------------------------------------------------------------------------- fused cross entropy
class _FusedCrossEntropy(torch.autograd.Function):
    """megatron's fused_vocab_parallel_cross_entropy (--cross-entropy-loss-fusion, impl native) as its
    torch.compile'd (inductor) kernels run on a GPU, event for event as the H100 traces show them: forward an fp32
    copy of the logits (kept: it becomes the softmax), their row maximum, the target mask (1 byte) and the masked
    target (int64) (both kept), the predicted logits and the exp sums joined into one buffer (the TP all-reduce's),
    a transient fp32 [s, b, v/t] buffer, then the loss; backward an fp32 gradient of the logits and its 16-bit copy
    (bf16, as megatron's kernel casts). Values: the same cross entropy and gradient. The CPU eager code keeps
    other tensors (an arange, index copies)."""

    @staticmethod
    def forward(ctx, logits, target, tp_group):
        v = logits.shape[-1]
        start = v * tp_group.rank()
        probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        probs.copy_(logits)
        rows = probs.view(-1, v)
        n = rows.shape[0]
        logits_max = torch.amax(probs, -1, out=torch.empty(target.shape, dtype=torch.float32, device=logits.device))
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        probs.sub_(logits_max.unsqueeze(-1))
        mask = torch.empty(target.shape, dtype=torch.bool, device=logits.device)
        local = torch.empty(n, dtype=torch.int64, device=logits.device)
        # outside this rank's vocabulary: |2 (t - start) - (v - 1)| > v - 1, in place in `local`
        torch.sub(target.reshape(-1), _scalar(start, local), out=local)
        local.mul_(_scalar(2, local)).sub_(_scalar(v - 1, local)).abs_()
        torch.gt(local.view(target.shape), _scalar(v - 1, local), out=mask)
        torch.sub(target.reshape(-1), _scalar(start, local), out=local).masked_fill_(mask.view(-1), 0)
        predicted = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
        both = torch.empty(2 * n, dtype=torch.float32, device=logits.device)
        torch.gather(rows, 1, local.view(-1, 1), out=predicted.view(-1, 1))
        predicted.masked_fill_(mask, 0.0)
        probs.exp_()
        torch.sum(probs, -1, out=sum_exp)
        torch.cat((predicted.view(-1), sum_exp.view(-1)), out=both)
        if target.shape[-1] == 1:       # inductor's kernel for one sequence per micro-batch frees them the other way
            del predicted, sum_exp
        else:
            del sum_exp, predicted
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        predicted, sum_exp = both[:n].view(target.shape), both[n:].view(target.shape)
        softmax = torch.empty_like(probs)           # inductor's transient, here the division's output
        torch.div(probs, sum_exp.unsqueeze(-1), out=softmax)
        probs.copy_(softmax)
        del softmax
        loss = torch.log(sum_exp, out=torch.empty(target.shape, dtype=torch.float32, device=logits.device))
        loss.sub_(predicted)
        ctx.save_for_backward(probs, mask, local)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, mask, local = ctx.saved_tensors
        v = softmax.shape[-1]
        n = local.shape[0]
        grad = torch.empty(softmax.shape, dtype=torch.float32, device=softmax.device)
        grad_input = torch.empty(softmax.shape, dtype=torch.bfloat16, device=softmax.device)
        # the target's -1 per row (0 where masked), scaled by the row's gradient: staged in grad_input's memory
        minus = grad_input.view(-1)[:2 * n].view(torch.float32)
        minus.view(mask.shape).copy_(grad_output)      # (a strided gradient is read as it is, as a kernel does)
        minus.masked_fill_(mask.view(-1), 0.0).neg_()
        grad.copy_(softmax).mul_(grad_output.unsqueeze(-1))
        grad.view(-1, v).scatter_add_(1, local.view(-1, 1), minus.view(-1, 1))
        grad_input.copy_(grad)
        del grad
        return grad_input, None, None


def _install_fused_cross_entropy():
    from megatron.core.models.common.language_module import language_module

    def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
        return _FusedCrossEntropy.apply(vocab_parallel_logits, target, tp_group)

    language_module.fused_vocab_parallel_cross_entropy = fused_vocab_parallel_cross_entropy


# ------------------------------------------------------------------------------- Transformer Engine modules
class _TENorm(torch.autograd.Function):
    """Transformer Engine's layernorm / rmsnorm forward: output in the input's dtype, statistics in fp32, one value
    per token (mu and rsigma, rsigma only for RMSNorm); saves the input, the weight and the statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        h = x.shape[-1]
        rows = x.reshape(-1, h)
        sq = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32).square_().div_(h)
        if rms:
            mu = None
            rsigma = sq.add_(eps).rsqrt_()
        else:
            mu = torch.mean(rows, dim=-1, dtype=torch.float32)
            rsigma = sq.sub_(mu * mu).add_(eps).rsqrt_()
        out = torch.empty_like(rows)
        if mu is not None:
            torch.sub(rows, mu[:, None], out=out)
        else:
            out.copy_(rows)
        out.mul_(rsigma[:, None]).mul_(weight)
        if bias is not None:
            out.add_(bias)
        ctx.rms, ctx.eps = rms, eps
        ctx.save_for_backward(x, weight, mu if mu is not None else rsigma, rsigma)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        # the statistics are kept as TE keeps them; the gradient is recomputed from the input here (a GPU
        # kernel reads them instead)
        x, weight, _mu, _rsigma = ctx.saved_tensors
        h = x.shape[-1]
        with torch.enable_grad():
            xr = x.detach().reshape(-1, h).float().requires_grad_(True)
            w = weight.detach().float().requires_grad_(True)
            if ctx.rms:
                y = _TORCH_RMS_NORM(xr, (h,), w, ctx.eps)
            else:
                y = _TORCH_LAYER_NORM(xr, (h,), w, None, ctx.eps)
            gx, gw = torch.autograd.grad(y, (xr, w), g.reshape(-1, h).float())
        gb = g.reshape(-1, h).float().sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return gx.to(x.dtype).view(x.shape), gw.to(weight.dtype), gb, None, None


def _te_norm(x, weight, bias, eps, rms):
    return _TENorm.apply(x, weight, bias, eps, rms)


def _norm_parameters(config, size: int) -> tuple:
    """A TE norm's weight (ones) and bias (zeros; none for RMSNorm) in the model's dtype, tagged for the
    sequence-parallel gradient all-reduce as megatron tags its norms."""
    dt = config.params_dtype
    weight = torch.nn.Parameter(torch.ones(size, dtype=dt))
    bias = None if config.normalization == "RMSNorm" else torch.nn.Parameter(torch.zeros(size, dtype=dt))
    for p in (weight, bias):
        if p is not None:
            setattr(p, "sequence_parallel", config.sequence_parallel)
    return weight, bias


def _modules():
    """The stand-in module classes, built on megatron-core's own (imported late: megatron is optional here)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.utils import make_viewless_tensor

    class StandinNorm(MegatronModule):
        """TENorm: Transformer Engine's LayerNorm / RMSNorm module (final layernorm, qk-norm, MoE pre-MLP norm)."""

        def __init__(self, config, hidden_size, eps=1e-5, **_):
            super().__init__(config=config)
            self.rms, self.eps = config.normalization == "RMSNorm", eps
            self.weight, self.bias = _norm_parameters(config, hidden_size)

        def forward(self, x):
            return _te_norm(x, self.weight, self.bias, self.eps, self.rms)

    class StandinLayerNormColumnParallelLinear(ColumnParallelLinear):
        """TELayerNormColumnParallelLinear: the norm fused into the column-parallel GEMM. Saved like TE's
        _LayerNormLinear: the norm's input, the normalized output (before the sequence-parallel all-gather, gathered
        again in backward) and fp32 statistics per token; megatron's linear saves exactly its (local) input."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, **kw):
            super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                             gather_output=gather_output, skip_bias_add=skip_bias_add, is_expert=is_expert,
                             skip_weight_param_allocation=skip_weight_param_allocation, **kw)
            self.rms, self.eps = config.normalization == "RMSNorm", config.layernorm_epsilon
            self.layer_norm_weight, self.layer_norm_bias = _norm_parameters(config, input_size)

        def forward(self, x, *args, **kwargs):
            ln_out = _te_norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.rms)
            return super().forward(ln_out, *args, **kwargs)

    class StandinAttention(DotProductAttention):
        """TEDotProductAttention's constructor: MLA passes the query/key and value head widths (k_channels,
        v_channels), which megatron's local DotProductAttention does not take; the forward works on the tensors'
        own widths."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    class StandinFlashAttention(StandinAttention):
        """TEDotProductAttention with the flash / cuDNN fused backend (Megatron-LM's default): keeps q, k, v (as
        given, sbhd, no copies; GQA without repeating k and v), the output and fp32 softmax statistics per query
        row and head; no [s, s] tensor. Computed by torch's flash-attention kernel (the real one on a GPU)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is None and attention_bias is None, "stand-in: no packed sequences / bias"
            p = self.attention_dropout.p if self.training else 0.0
            out = _FlashAttention.apply(query, key, value, p, self.softmax_scale)
            out = out.view(out.shape[0], out.shape[1], -1)
            return make_viewless_tensor(out, requires_grad=out.requires_grad, keep_graph=True)

    class StandinUnfusedAttention(StandinAttention):
        """TEDotProductAttention with TE's unfused backend (UnfusedDotProductAttention; fp32, or
        --attention-backend unfused): megatron's local attention, whose scores live in megatron's global memory
        buffer, but with the scores as TE makes them: an empty [b*a/t, s, s] tensor handed to baddbmm (beta 0),
        released once baddbmm returns its new output, which stays referenced to the end of the forward (a forward
        transient, not a persistent buffer). GQA's k and v repeated per head, the softmax (megatron's fused module
        and its stand-in kernel), the dropout and the second batched GEMM as megatron's local attention has them."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            from megatron.core import tensor_parallel
            assert packed_seq_params is None and attention_bias is None, "stand-in: no packed sequences / bias"
            heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
            if heads // groups > 1:
                key = key.repeat_interleave(heads // groups, dim=2)
                value = value.repeat_interleave(heads // groups, dim=2)
            sq, b, sk = query.size(0), query.size(1), key.size(0)
            q = query.reshape(sq, b * heads, -1)
            k = key.reshape(sk, b * heads, -1)
            scores = torch.empty(b * heads, sq, sk, dtype=q.dtype, device=q.device)
            scores = torch.baddbmm(scores, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                                   alpha=self.softmax_scale).view(b, heads, sq, sk)
            probs = self.scale_mask_softmax(scores, attention_mask, self.softmax_offset)
            with tensor_parallel.get_cuda_rng_tracker().fork():    # TE's attention_dropout_ctx
                probs = self.attention_dropout(probs)
            v = value.reshape(sk, b * heads, -1)
            context = torch.bmm(probs.view(b * heads, sq, sk), v.transpose(0, 1))
            context = context.view(b, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
            return context.view(sq, b, -1)

    class StandinLinear(MegatronModule):
        """TELinear with parallel_mode "duplicated" (MLA's down projections in the TE spec): the whole weight on
        every TP rank, applied to the rank's own tokens; saves its input, as TE's _Linear does. Under sequence
        parallelism the weight's gradient is reduced over TP like the norms' (the `sequence_parallel` mark)."""

        def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias, skip_bias_add,
                     skip_weight_param_allocation=False, tp_comm_buffer_name=None, is_expert=False, tp_group=None,
                     **_):
            super().__init__(config=config)
            assert parallel_mode == "duplicated" and not skip_weight_param_allocation, "stand-in: duplicated only"
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(self.weight)
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
            self.skip_bias_add = skip_bias_add
            for prm in self.parameters():
                prm.sequence_parallel = config.sequence_parallel

        def forward(self, x):
            add = self.bias if not self.skip_bias_add else None
            out = torch.nn.functional.linear(x, self.weight, add)
            return out, (self.bias if self.skip_bias_add else None)

    class StandinGroupedLinear(MegatronModule):
        """TEGroupedLinear (TE's GroupedLinear behind TEGroupedMLP, --moe-grouped-gemm): one weight per local
        expert (weight0, weight1, ...; bias0, ... with biases), the expert tensor-parallel split done here as
        megatron's wrapper does it (TE itself communicates nothing: the token dispatcher does)."""

        parallel = None   # "column" (linear_fc1) or "row" (linear_fc2): the subclasses below

        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                     is_expert=True, tp_comm_buffer_name=None, pg_collection=None):
            super().__init__(config=config)
            tp = _expert_tp_size(pg_collection)
            if self.parallel == "column":
                output_size //= tp
            else:
                input_size //= tp
            self.num_gemms, self.return_bias = num_gemms, skip_bias_add and bias
            expert_parallel = config.expert_model_parallel_size > 1
            dtype = config.params_dtype
            for i in range(num_gemms):
                w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
                init_method(w)
                setattr(self, f"weight{i}", w)
                if bias:
                    setattr(self, f"bias{i}", torch.nn.Parameter(torch.zeros(output_size, dtype=dtype)))
            for prm in self.parameters():
                prm.allreduce = not (is_expert and expert_parallel)   # expert parameters: the expert DP buffers
            self.use_bias = bias

        def forward(self, x, m_splits):
            n = self.num_gemms
            weights = [getattr(self, f"weight{i}") for i in range(n)]
            biases = [getattr(self, f"bias{i}") for i in range(n)] if self.use_bias else []
            out = _GroupedGemm.apply(x, tuple(m_splits), self.use_bias and not self.return_bias, *weights, *biases)
            if self.return_bias:
                return out, biases
            return out, None

    class StandinColumnParallelGroupedLinear(StandinGroupedLinear):
        parallel = "column"

    class StandinRowParallelGroupedLinear(StandinGroupedLinear):
        parallel = "row"

    return (StandinNorm, StandinLayerNormColumnParallelLinear, StandinFlashAttention, StandinUnfusedAttention,
            (StandinColumnParallelGroupedLinear, StandinRowParallelGroupedLinear), StandinLinear)


def _expert_tp_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "expt_tp", None) is not None:
        return torch.distributed.get_world_size(pg_collection.expt_tp)
    from megatron.core import parallel_state as ps
    return ps.get_expert_tensor_parallel_world_size()


class _GroupedGemm(torch.autograd.Function):
    """TE's _GroupedLinear without fp8: forward writes every expert's GEMM into one new [tokens, out] tensor (the
    bias, where it is applied, in place: TE's GEMM epilogue) and saves the input (its per-expert row blocks are
    views of it) and the weights; backward takes a contiguous gradient, makes the input's gradient [tokens, in],
    then one weight gradient per expert (and one bias gradient per expert), then drops its reference to the input."""

    @staticmethod
    def forward(ctx, x, m_splits, add_bias, *params):
        n = len(m_splits)
        weights, biases = params[:n], params[n:]
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], weights[0].shape[0], dtype=x.dtype, device=x.device)
        blocks = [slice(a - m, a) for a, m in zip(itertools.accumulate(m_splits), m_splits)]   # each expert's rows
        for w, bias, r in itertools.zip_longest(weights, biases, blocks):
            if r.stop > r.start:
                torch.mm(rows[r], w.t(), out=out[r])
                if add_bias:
                    out[r].add_(bias)
        ctx.blocks, ctx.n_bias, ctx.in_shape = blocks, len(biases), x.shape
        ctx.save_for_backward(x, *weights)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, g):
        x, *weights = ctx.saved_tensors
        g2 = g.contiguous().view(-1, g.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        dgrad = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        for w, r in zip(weights, ctx.blocks):      # an expert without tokens has no rows to fill
            if r.stop > r.start:
                torch.mm(g2[r], w, out=dgrad[r])
        wgrads = [torch.empty(w.shape, dtype=x.dtype, device=x.device) for w in weights]
        for wg, r in zip(wgrads, ctx.blocks):
            if r.stop > r.start:
                torch.mm(g2[r].t(), rows[r], out=wg)
            else:
                wg.zero_()
        bgrads = [g2[r].sum(dim=0) for r in ctx.blocks] if ctx.n_bias else []
        del x, rows
        return (dgrad.view(ctx.in_shape), None, None, *wgrads, *bgrads)


class _FlashAttention(torch.autograd.Function):
    """flash-attn's FlashAttnFunc / TE's FusedAttnFunc, sbhd layout: saves q, k, v, the output and the logsumexp
    (fp32, [b, heads, sq]); the output is written in sbhd ([sq, b, heads, d]) as TE returns it."""

    @staticmethod
    def forward(ctx, q, k, v, p, scale):
        qb, kb, vb = (t.detach().permute(1, 2, 0, 3) for t in (q, k, v))     # [b, heads, s, d] views
        gqa = qb.shape[1] != kb.shape[1]
        ctx.mla = v.shape[-1] != q.shape[-1]
        if ctx.mla:
            # MLA: cuDNN's fused attention takes a value head of another width; torch's flash kernels do not
            assert not q.is_cuda and not gqa, "stand-in: unequal head widths on CPU, without GQA, only"
            p = 0.0
            o, lse = _attention_widths(qb, kb, vb, scale)
        elif q.is_cuda:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qb, _rep(kb, qb) if gqa else kb,
                                                                     _rep(vb, qb) if gqa else vb, p, True,
                                                                     scale=scale)
            o, lse, ctx.rng = res[0], res[1], (res[6], res[7])
        else:
            # torch's CPU flash kernel has no dropout; in-kernel dropout keeps nothing but an RNG state on a GPU,
            # so the memory is the same without it (only the values differ)
            p = 0.0
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qb, _rep(kb, qb) if gqa else kb, _rep(vb, qb) if gqa else vb, p, True, scale=scale)
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])     # [sq, b, heads, d of the value]
        out.copy_(o.permute(2, 0, 1, 3))
        del o
        ctx.p, ctx.scale = p, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        qb, kb, vb, ob, gb = (t.permute(1, 2, 0, 3) for t in (q, k, v, out, g))
        gqa = qb.shape[1] != kb.shape[1]
        kr, vr = (_rep(kb, qb), _rep(vb, qb)) if gqa else (kb, vb)
        if ctx.mla:
            gq, gk, gv = _attention_widths_backward(gb, qb, kb, vb, ob, lse, ctx.scale)
        elif q.is_cuda:
            seed, offset = ctx.rng
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                gb, qb, kr, vr, ob, lse, None, None, qb.shape[2], kb.shape[2], ctx.p, True, seed, offset,
                scale=ctx.scale)
        else:
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gb, qb, kr, vr, ob, lse, ctx.p, True, scale=ctx.scale)
        if gqa:   # the repeated heads' gradients sum back into their group
            r = qb.shape[1] // kb.shape[1]
            gk = gk.unflatten(1, (kb.shape[1], r)).sum(2)
            gv = gv.unflatten(1, (kb.shape[1], r)).sum(2)
        return (gq.permute(2, 0, 1, 3), gk.permute(2, 0, 1, 3), gv.permute(2, 0, 1, 3), None, None)


def _np32(t: torch.Tensor):
    """A 16- or 32-bit CPU tensor's values as a float32 numpy array, made outside torch's allocator (a bf16
    tensor's bits shifted into float32's upper half), so the stand-in's arithmetic leaves no trace."""
    import numpy as np
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)   # a view: no copy
    return t.numpy().astype(np.float32)


def _from_np(a, like_shape, dtype) -> torch.Tensor:
    """A new tensor of `dtype` holding numpy array `a` (the tensor is the kernel's output; the cast is in place)."""
    out = torch.empty(like_shape, dtype=dtype)
    out.copy_(torch.from_numpy(a))
    return out


def _attention_widths(qb, kb, vb, scale) -> tuple:
    """Causal attention over [b, heads, s, d] views whose value width differs from the query's: (output
    [b, heads, sq, dv] in the inputs' dtype, fp32 logsumexp [b, heads, sq]), computed in numpy so that, as a
    fused kernel, it allocates only its outputs."""
    import numpy as np
    q, k, v = _np32(qb), _np32(kb), _np32(vb)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    sq, sk = s.shape[-2:]
    s[..., np.triu(np.ones((sq, sk), bool), k=sk - sq + 1)] = -np.inf
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bhkd->bhqd", e / total, v)
    lse = (m + np.log(total))[..., 0]
    return _from_np(o, o.shape, qb.dtype), _from_np(lse, lse.shape, torch.float32)


def _attention_widths_backward(gb, qb, kb, vb, ob, lse, scale) -> tuple:
    """The gradients of _attention_widths' inputs ([b, heads, s, d] each, the inputs' dtype) from the output's
    gradient, recomputing the probabilities from the logsumexp as a flash backward does."""
    import numpy as np
    q, k, v, o, g, l = (_np32(t) for t in (qb, kb, vb, ob, gb, lse))
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    sq, sk = s.shape[-2:]
    s[..., np.triu(np.ones((sq, sk), bool), k=sk - sq + 1)] = -np.inf
    prob = np.exp(s - l[..., None])
    gv = np.einsum("bhqk,bhqd->bhkd", prob, g)
    gp = np.einsum("bhqd,bhkd->bhqk", g, v)
    gs = prob * (gp - (g * o).sum(-1, keepdims=True)) * scale
    gq = np.einsum("bhqk,bhkd->bhqd", gs, k)
    gk = np.einsum("bhqk,bhqd->bhkd", gs, q)
    return tuple(_from_np(a, a.shape, qb.dtype) for a in (gq, gk, gv))


def _rep(kv, q):
    """Keys / values repeated to the query heads for the kernel call only (transient): the GPU kernels read groups
    natively and keep k and v unrepeated."""
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


def _install_te_spec():
    """Transformer Engine's spec provider answers with the stand-ins (megatron-core builds the TE layer spec
    through it: norms fused into linear_qkv and linear_fc1, TE core attention, TENorm for the final norm)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron.core.transformer import multi_latent_attention as mla

    norm, ln_linear, flash, unfused, grouped, linear = _modules()
    mla.TELinear = linear    # MLA picks the down projections' parallel mode by comparing with TE's class

    class StandinTESpecProvider(LocalSpecProvider):
        attention = flash

        def linear(self):
            return linear

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return ln_linear

        def layer_norm(self, rms_norm=False, for_qk=False):
            return norm

        def core_attention(self):
            return self.attention

        def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
            if moe_use_grouped_gemm and not moe_use_legacy_grouped_gemm:
                return TEGroupedMLP, MLPSubmodules(linear_fc1=grouped[0], linear_fc2=grouped[1])
            return super().grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)

    specs.TESpecProvider = StandinTESpecProvider
    specs.TENorm = norm
    return StandinTESpecProvider, unfused


def _importable(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def softmax_kernel_present() -> bool:
    """megatron's fused masked-softmax extensions: the causal kernel and the one is_kernel_available asks."""
    return _importable("scaled_upper_triang_masked_softmax_cuda") and _importable("scaled_masked_softmax_cuda")


def rope_kernel_present() -> bool:
    """Transformer Engine's fused RoPE, as megatron-core found it at import."""
    from megatron.core.models.common.embeddings import rope_utils
    return rope_utils.fused_apply_rotary_pos_emb is not None


def _install_fp8_state() -> None:
    """megatron-core 0.16.1's CheckpointWithoutOutput (the layernorm and moe_act recompute modules) asks TE's fp8
    state even without fp8 (its `fp8 is not None` holds for False), and a process without Transformer Engine has
    none: fp8 off, and TE's recompute-phase and fp8 contexts, which only tell TE's fp8 modules the phase, null
    ones."""
    from megatron.core.tensor_parallel import random as mrandom

    class FP8GlobalStateManager:
        @staticmethod
        def is_fp8_enabled():
            return False

        @staticmethod
        def get_fp8_recipe():
            return None

    mrandom.FP8GlobalStateManager = FP8GlobalStateManager
    mrandom.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
    mrandom.fp8_autocast = lambda **kwargs: contextlib.nullcontext()


def install(tconfig, cfg, on_gpu: bool = False) -> dict:
    """Patch megatron-core so this process runs what a GPU runs for `cfg`'s flags (estimator.formulas.kernels);
    returns the kernel switches in effect (recorded in the trace header). `tconfig` gets the fusion flags the
    kernels serve. On a GPU, a family is replaced only where its real kernel is missing."""
    k = kernel_switches(cfg)
    if not _importable("transformer_engine"):
        _install_fp8_state()
    if k["dropout_mask"] == "byte" and not on_gpu:
        torch.nn.functional.dropout = _byte_mask_dropout(torch.nn.functional.dropout)
    if k["fuse_softmax"] and not (on_gpu and softmax_kernel_present()):
        _install_softmax()
    tconfig.masked_softmax_fusion = k["fuse_softmax"]
    if k["fuse_act"] and not on_gpu:          # on a GPU megatron's torch.compile'd arithmetic runs as it is
        _install_bias_activation()
    tconfig.bias_activation_fusion = k["fuse_act"]
    if k["fuse_bda"] and not on_gpu:          # on a GPU megatron's torch.compile'd function runs as it is
        _install_bias_dropout_add()
    tconfig.bias_dropout_fusion = k["fuse_bda"]
    if k["torch_norm"] == "cuda" and not on_gpu:
        _install_torch_norms()
    if fused_cross_entropy(cfg) == "native" and not on_gpu:
        _install_fused_cross_entropy()
    if k["fuse_rope"] and not (on_gpu and rope_kernel_present()):
        _install_rope()
    if k["fuse_rope"] and getattr(cfg, "multi_latent_attention", False) and not (on_gpu and _importable("triton")):
        _install_mla_rope()
    tconfig.apply_rope_fusion = k["fuse_rope"]
    if k["spec"] == "te" and not (on_gpu and _importable("transformer_engine")):
        provider, unfused = _install_te_spec()
        if k["attention"] != "flash":
            provider.attention = unfused     # TE's unfused backend
    return k
