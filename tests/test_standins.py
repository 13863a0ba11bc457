"""GPU kernel stand-ins (tracer/standins.py): each computes what the kernel computes (values and gradients against
torch / megatron-core references) and saves for backward exactly the tensors the GPU kernel saves (captured with
autograd's saved-tensor hooks); the estimator's kernel rules agree with megatron-core's own checks."""
import os
import subprocess
import sys

import pytest
import torch

from tracer import standins

pytestmark = pytest.mark.filterwarnings("ignore")


def saved(fn, *args):
    """fn(*args) and the (shape, dtype) of every tensor autograd saved for its backward."""
    out = []

    def pack(t):
        out.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = fn(*args)
    return res, out


def grads(fn, inputs, g):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    y = fn(*inputs)
    y.backward(g)
    return y.detach(), [x.grad for x in inputs]


def reference_attention(q, k, v, scale):
    """Causal softmax attention in sbhd, GQA groups repeated, with plain torch ops."""
    r = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    s = qb @ kb.transpose(-1, -2) * scale
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ vb).permute(2, 0, 1, 3)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_flash_attention_values_gradients_and_saved_tensors(heads, groups):
    torch.manual_seed(0)
    s, b, d = 24, 2, 8
    q, k, v = torch.randn(s, b, heads, d), torch.randn(s, b, groups, d), torch.randn(s, b, groups, d)
    g = torch.randn(s, b, heads, d)
    scale = d ** -0.5
    ys, gs = grads(lambda q, k, v: standins._FlashAttention.apply(q, k, v, 0.0, scale), (q, k, v), g)
    yr, gr = grads(lambda q, k, v: reference_attention(q, k, v, scale), (q, k, v), g)
    torch.testing.assert_close(ys, yr, rtol=1e-4, atol=1e-5)
    for a, r in zip(gs, gr):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    _, kept = saved(lambda: standins._FlashAttention.apply(qq, kk, vv, 0.0, scale))
    # q, k, v unrepeated, the sbhd output, fp32 logsumexp [b, heads, s]: nothing of size s x s
    assert kept == [((s, b, heads, d), torch.float32), ((s, b, groups, d), torch.float32),
                    ((s, b, groups, d), torch.float32), ((s, b, heads, d), torch.float32),
                    ((b, heads, s), torch.float32)]


@pytest.mark.parametrize("rms", [False, True])
def test_te_norm_values_gradients_and_saved_tensors(rms):
    torch.manual_seed(1)
    x, w, bias = torch.randn(6, 3, 16), torch.rand(16) + 0.5, None if rms else torch.randn(16)
    g = torch.randn(6, 3, 16)
    ins = (x, w) if rms else (x, w, bias)
    fn = (lambda x, w: standins._TENorm.apply(x, w, None, 1e-5, True)) if rms else \
        (lambda x, w, b: standins._TENorm.apply(x, w, b, 1e-5, False))
    ref = (lambda x, w: torch.nn.functional.rms_norm(x, (16,), w, 1e-5)) if rms else \
        (lambda x, w, b: torch.nn.functional.layer_norm(x, (16,), w, b, 1e-5))
    ys, gs = grads(fn, ins, g)
    yr, gr = grads(ref, ins, g)
    torch.testing.assert_close(ys, yr, rtol=1e-5, atol=1e-5)
    for a, r in zip(gs, gr):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    wb = w.to(torch.bfloat16).requires_grad_(True)
    _, kept = saved(lambda: standins._TENorm.apply(xb, wb, None, 1e-5, rms))
    # the input and weight in their dtype, one fp32 statistic per token (mu and rsigma; rsigma twice for RMSNorm,
    # one tensor saved in both slots)
    assert kept == [((6, 3, 16), torch.bfloat16), ((16,), torch.bfloat16), ((18,), torch.float32),
                    ((18,), torch.float32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attention_with_mla_head_widths_allocates_only_its_outputs(dtype):
    """MLA's query / key heads are wider than its value heads (rope part included), which cuDNN's fused attention
    takes and torch's CPU flash kernel does not: the stand-in computes it outside torch's allocator, so its
    allocations are the kernel's outputs alone (the output, fp32 logsumexp; the three input gradients)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(2)
    s, b, heads, dqk, dv = 20, 2, 3, 12, 8
    q, k, v = torch.randn(s, b, heads, dqk), torch.randn(s, b, heads, dqk), torch.randn(s, b, heads, dv)
    g = torch.randn(s, b, heads, dv)
    scale = dqk ** -0.5
    ins = tuple(t.to(dtype) for t in (q, k, v))
    ys, gs = grads(lambda q, k, v: standins._FlashAttention.apply(q, k, v, 0.0, scale), ins, g.to(dtype))
    yr, gr = grads(lambda q, k, v: reference_attention(q, k, v, scale), (q, k, v), g)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(ys.float(), yr, **tol)
    for a, r in zip(gs, gr):
        torch.testing.assert_close(a.float(), r, **tol)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in ins)
    _, kept = saved(lambda: standins._FlashAttention.apply(qq, kk, vv, 0.0, scale))
    assert kept == [((s, b, heads, dqk), dtype), ((s, b, heads, dqk), dtype), ((s, b, heads, dv), dtype),
                    ((s, b, heads, dv), dtype), ((b, heads, s), torch.float32)]
    e = ins[0].element_size()
    allowed = {s * b * heads * dv * e, b * heads * s * 4, s * b * heads * dqk * e}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        standins._FlashAttention.apply(qq, kk, vv, 0.0, scale).backward(g.to(dtype))
    sizes = {ev.cpu_memory_usage for ev in prof.events()
             if ev.cpu_memory_usage > 0 and ev.name.startswith("aten::empty")}
    assert s * b * heads * dv * e in sizes and sizes <= allowed, sizes - allowed


@pytest.mark.parametrize("rms", [False, True])
def test_cuda_norm_values_gradients_saved_tensors_and_allocations(rms):
    """torch's norms as CUDA runs them (the local spec on a GPU): torch's values and gradients (fp64); the input,
    the weight and fp32 statistics saved; in bf16, beyond its output (forward) and its gradients (backward), only
    vectors of one value per row."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(1)
    x, w, bias = torch.randn(6, 3, 16, dtype=torch.float64), torch.rand(16, dtype=torch.float64) + 0.5, \
        None if rms else torch.randn(16, dtype=torch.float64)
    g = torch.randn(6, 3, 16, dtype=torch.float64)
    ins = (x, w) if rms else (x, w, bias)
    fn = (lambda x, w: standins._CudaNorm.apply(x, w, None, 1e-5, True)) if rms else \
        (lambda x, w, b: standins._CudaNorm.apply(x, w, b, 1e-5, False))
    ref = (lambda x, w: standins._TORCH_RMS_NORM(x, (16,), w, 1e-5)) if rms else \
        (lambda x, w, b: standins._TORCH_LAYER_NORM(x, (16,), w, b, 1e-5))
    ys, gs = grads(fn, ins, g)
    yr, gr = grads(ref, ins, g)
    torch.testing.assert_close(ys, yr, rtol=1e-6, atol=1e-6)    # (the statistics are fp32, as CUDA keeps them)
    for a, r in zip(gs, gr):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    rows, h = 512, 256
    xb = torch.randn(rows // 4, 4, h, dtype=torch.bfloat16, requires_grad=True)
    wb = (torch.rand(h) + 0.5).to(torch.bfloat16).requires_grad_(True)
    bb = None if rms else torch.zeros(h, dtype=torch.bfloat16, requires_grad=True)
    y, kept = saved(lambda: standins._CudaNorm.apply(xb, wb, bb, 1e-5, rms))
    stats = [((rows,), torch.float32)] * (1 if rms else 2)
    assert kept == [((rows // 4, 4, h), torch.bfloat16), ((h,), torch.bfloat16)] + stats
    allowed = {rows * h * 2, h * 2, rows * 2, rows * 4}    # rows x h, weight-sized, per-row vectors, statistics
    y.backward(torch.ones_like(y))                          # (its scalars are made once, on the first call)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        standins._CudaNorm.apply(xb, wb, bb, 1e-5, rms).backward(torch.ones_like(y))
    sizes = {e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0 and e.name.startswith("aten::empty")}
    assert rows * h * 2 in sizes
    assert sizes and sizes <= allowed, sizes - allowed


def test_fused_rope_matches_megatron_unfused_and_keeps_only_the_frequencies():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    torch.manual_seed(2)
    t, half = torch.randn(10, 2, 4, 8), torch.randn(10, 1, 1, 4)
    freqs = torch.cat((half, half), dim=-1)      # as megatron builds them: one angle per rotated pair
    g = torch.randn(10, 2, 4, 8)
    ys, (gs,) = grads(lambda t: standins._FusedRoPE.apply(t, freqs, False), (t,), g)
    yr, (gr,) = grads(lambda t: _apply_rotary_pos_emb_bshd(t, freqs), (t,), g)
    torch.testing.assert_close(ys, yr)
    torch.testing.assert_close(gs, gr, rtol=1e-5, atol=1e-6)
    tt = t.clone().requires_grad_(True)
    _, kept = saved(lambda: standins._FusedRoPE.apply(tt, freqs, False))
    assert kept == [((10, 1, 1, 8), torch.float32)]


def test_fused_softmax_keeps_probabilities_in_the_input_dtype():
    torch.manual_seed(3)
    x = torch.randn(2, 4, 16, 16)
    g = torch.randn(2, 4, 16, 16)
    scale = 0.5
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1)
    ys, (gs,) = grads(lambda x: standins._FusedSoftmax.apply(x.clone(), None, scale, True), (x,), g)
    yr, (gr,) = grads(lambda x: (x * scale).masked_fill(causal, -10000.0).softmax(-1), (x,), g)
    torch.testing.assert_close(ys, yr)
    torch.testing.assert_close(gs, gr, rtol=1e-5, atol=1e-6)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    _, kept = saved(lambda: standins._FusedSoftmax.apply(xb * 1, None, scale, True))
    assert kept == [((2, 4, 16, 16), torch.bfloat16), ((1,), torch.float32)]


def test_byte_mask_dropout_saves_a_bool_mask():
    torch.manual_seed(4)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    drop = standins._byte_mask_dropout(torch.nn.functional.dropout)
    y, kept = saved(lambda: drop(x, 0.25, True))
    assert kept == [((64, 64), torch.bool)]
    y.backward(torch.ones_like(y))
    kept_mask = y != 0
    torch.testing.assert_close(x.grad, kept_mask.to(x.dtype) / 0.75)


def test_softmax_kernel_rule_matches_megatron():
    """estimator.formulas.kernels decides where megatron-core runs the fused softmax kernel; megatron's own
    is_kernel_available (with the kernel's block size from tracer.standins) must agree on every shape."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from estimator.formulas import _softmax_kernel_fits

    sm = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
                               scaled_masked_softmax_fusion=True, mask_func=None, softmax_in_fp32=True, scale=None)
    sm.get_batch_per_block = lambda sq, sk, b, np_: standins.batch_per_block(sq, sk, b, np_)
    checked = 0
    for s in (8, 16, 20, 32, 48, 64, 96, 128, 256, 1024, 4096, 8192):
        for b in (1, 2, 3, 4):
            for heads in (1, 2, 4, 6, 8, 32):
                assert sm.is_kernel_available(None, b, heads, s, s) == _softmax_kernel_fits(None, s, b, heads), \
                    (s, b, heads)
                checked += 1
    assert checked == 12 * 4 * 6


def test_kernels_follow_megatron_lm_flags():
    from estimator.args import parse_args
    from estimator.formulas import kernels

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--vocab-size", "256"]
    k = kernels(parse_args(base + ["--bf16"]))
    assert k == {"spec": "te", "attention": "flash", "fuse_act": True, "fuse_softmax": False, "fuse_rope": False,
                 "dropout_mask": "byte", "fuse_bda": True, "collectives": "direct", "grouped_gemm": False,
                 "scores": "buffer", "torch_norm": "cpu"}
    # --moe-grouped-gemm: TE's grouped GEMM for MoE experts under the TE spec; megatron's local spec would build
    # its legacy GroupedMLP instead (not told apart), and a dense model has no experts
    moe = base + ["--bf16", "--num-experts", "4", "--moe-grouped-gemm"]
    assert kernels(parse_args(moe))["grouped_gemm"] is True
    assert kernels(parse_args(moe + ["--transformer-impl", "local"]))["grouped_gemm"] is False
    assert kernels(parse_args(base + ["--bf16", "--moe-grouped-gemm"]))["grouped_gemm"] is False
    assert kernels(parse_args(base + ["--bf16", "--no-bias-dropout-fusion"]))["fuse_bda"] is False
    # fp32: TE has no flash / fused attention for it; 'auto' runs TE's unfused attention (an fp32 softmax)
    k = kernels(parse_args(base))
    assert (k["spec"], k["attention"], k["fuse_softmax"], k["scores"]) == ("te", "unfused", False, "call")
    k = kernels(parse_args(base + ["--transformer-impl", "local", "--bf16", "--position-embedding-type", "rope",
                                   "--disable-bias-linear"]))
    # no bias: no fused bias-gelu (Megatron-LM turns it off); unfused 16-bit attention: the fused softmax
    assert (k["spec"], k["attention"], k["fuse_act"], k["fuse_softmax"], k["fuse_rope"]) == \
        ("local", "unfused", False, True, True)
    assert k["torch_norm"] == "cuda"     # the local spec's norms are torch's, run by CUDA's kernels
    k = kernels(parse_args(base + ["--transformer-impl", "local", "--no-masked-softmax-fusion", "--bf16"]))
    assert k["fuse_softmax"] is False


@pytest.mark.megatron
def test_traced_te_flash_layer_keeps_no_s_squared_term(tmp_path):
    """A real megatron-core run with Megatron-LM's default kernels (TE spec, flash attention, fused bias-gelu) on the
    stand-ins, traced by the CPU allocator hook: per layer and microbatch the saved bytes are e*16sbh (norm
    outputs, QKV, attention output, fc1 and activation outputs, residuals) plus the fp32 statistics of two fused
    norms (16sb) and the flash logsumexp (4abs), at two sequence lengths: no a*s*s*b term."""
    from tracer.parse import parse_run

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    b, h, a, e = 2, 64, 4, 4
    for s in (32, 64):
        out = tmp_path / f"s{s}"
        cmd = [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--gpu-kernels", "--nproc", "1",
               "--out", str(out), "--iterations", "2", "--", "--num-layers", "2", "--hidden-size", str(h),
               "--num-attention-heads", str(a), "--seq-length", str(s), "--max-position-embeddings", str(s),
               "--micro-batch-size", str(b), "--global-batch-size", str(b), "--vocab-size", "128",
               "--hidden-dropout", "0", "--attention-dropout", "0", "--attention-backend", "flash"]
        r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        (pr,) = parse_run(str(out))
        assert pr.header["kernels"]["spec"] == "te" and pr.header["kernels"]["attention"] == "flash"
        last = max(row["iteration"] for row in pr.op_stats)
        per_layer = {}
        for row in pr.op_stats:
            if row["iteration"] == last and row["layer"] is not None:
                per_layer[row["layer"]] = per_layer.get(row["layer"], 0) + row["saved_bytes"]
        assert sorted(per_layer) == [0, 1]
        for layer, got in per_layer.items():
            assert got == e * 16 * s * b * h + 16 * s * b + 4 * a * s * b, (s, layer, got)


@pytest.mark.parametrize("p,bias", [(0.0, True), (0.0, False), (0.25, True), (0.25, False)])
def test_fused_bias_dropout_add_values_gradients_and_mask(p, bias):
    """megatron's bias-dropout-add: out = residual + dropout(x + bias). Without dropout the stand-in equals
    megatron's own function (values and gradients); with it, the gradient reaching x is the kept pattern times
    1 / (1 - p), and the output is the residual plus x + bias under that same pattern. Nothing is saved through
    autograd (the 1-byte mask is held by the function itself, as inductor's backward frees it mid-way)."""
    from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func

    torch.manual_seed(3)
    x, r = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    bb = torch.randn(16) if bias else None
    g = torch.ones(8, 2, 16)
    ins = (x, r, bb) if bias else (x, r)

    def stand_in(x, r, b=None):
        return standins._FusedBiasDropoutAdd.apply(x, b, r, p)

    ys, gs = grads(stand_in, ins, g)
    if p == 0.0:
        yr, gr = grads(lambda x, r, b=None: _bias_dropout_add_func((x, b), r, p, True), ins, g)
        torch.testing.assert_close(ys, yr)
        for a, ref in zip(gs, gr):
            torch.testing.assert_close(a, ref)
    else:
        keep = gs[0] * (1.0 - p)          # 1 where kept, 0 where dropped
        assert set(keep.unique().tolist()) == {0.0, 1.0}
        torch.testing.assert_close(ys, r + (x + (bb if bias else 0.0)) * keep / (1.0 - p))
        torch.testing.assert_close(gs[1], g)
        if bias:
            torch.testing.assert_close(gs[2], gs[0].sum((0, 1)))
    xx = x.clone().requires_grad_(True)
    _, kept = saved(lambda: standins._FusedBiasDropoutAdd.apply(xx, None, r, p))
    assert kept == []


@pytest.mark.megatron
@pytest.mark.parametrize("dropout,bias", [(0.1, True), (0.0, True), (0.1, False)])
def test_fused_bias_dropout_add_program_is_the_h100_one(tmp_path, dropout, bias):
    """A bf16 TE-spec run on the stand-ins: the bias-dropout-add segments (`layers.*@self_attention`,
    `layers.*@mlp`) allocate and free event for event what the H100 traces' programs (fit/sets/gpu_h100.json,
    evaluated at this run's shapes) do, forward and backward, up to the CPU's gradient-accumulation casts."""
    from benchmarks.standin_programs import without_grad_casts
    from estimator import formulas as F
    from fit.programs.build import load_runs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = 128
    cmd = [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--gpu-kernels", "--out",
           str(tmp_path), "--iterations", "2", "--", "--num-layers", "2", "--hidden-size", str(h),
           "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--vocab-size", "512", "--bf16",
           "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout)] + \
        ([] if bias else ["--disable-bias-linear"])
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run,) = load_runs([str(tmp_path)])
    assert run.switches["fuse_bda"] is True and run.switches["spec"] == "te"
    gpu = F.load("gpu_h100").programs
    compared = 0
    for label in ("layers.*@self_attention", "layers.*@mlp"):
        for phase in ("fwd", "bwd"):
            cells, _ = gpu.select(phase, label, run.switches)
            assert len(cells) == 1, (phase, label)
            want = [(op, int(round(x)), ref) for op, x, ref in cells[0].evaluated(run.point)]
            got = without_grad_casts([(e.op, e.size, e.ref) for e in run.programs[(phase, label)].events()])
            assert got == want, (phase, label)
            compared += bool(want)
    assert compared >= 2


@pytest.mark.megatron
@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_torch_norm_programs_are_the_h100_ones(tmp_path, model):
    """A bf16 local-spec run on the stand-ins: its norms (torch's RMSNorm and LayerNorm as CUDA runs them) allocate
    and free event for event what the H100 traces' programs (fit/sets/gpu_h100.json, evaluated at this run's
    shapes) do, forward and backward, but for the stand-in's vectors of one value per row (freed in the op)."""
    from benchmarks.standin_programs import without_grad_casts
    from estimator import formulas as F
    from fit.programs.build import load_runs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    s, b = 128, 2
    llama = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"]
    cmd = [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--gpu-kernels", "--out",
           str(tmp_path), "--iterations", "2", "--", "--num-layers", "2", "--hidden-size", "128",
           "--num-attention-heads", "4", "--seq-length", str(s), "--max-position-embeddings", str(s),
           "--micro-batch-size", str(b), "--global-batch-size", str(b), "--vocab-size", "512", "--bf16",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local"] + \
        (llama if model == "llama" else [])
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run,) = load_runs([str(tmp_path)])
    assert run.switches["torch_norm"] == "cuda" and run.switches["spec"] == "local"
    gpu = F.load("gpu_h100").programs
    row_vector = 2 * s * b

    def kept(events):
        dropped = {f"#{i}" for i, (op, size, ref) in enumerate(e for e in events if e[0] == "+")
                   if size == row_vector}
        return [e for e in events if not (e[0] == "+" and e[1] == row_vector) and e[2] not in dropped]

    for label in ("layers.*.input_layernorm", "layers.*.pre_mlp_layernorm", "final_layernorm"):
        for phase in ("fwd", "bwd"):
            cells, _ = gpu.select(phase, label, run.switches)
            assert len(cells) == 1, (phase, label)
            want = [(op, int(round(x)), ref) for op, x, ref in cells[0].evaluated(run.point)]
            events = without_grad_casts([(e.op, e.size, e.ref) for e in run.programs[(phase, label)].events()])
            assert any(size == row_vector for _, size, _ in events)
            assert kept(events) == want, (phase, label)


def test_fused_cross_entropy_values_gradients_and_saved_tensors(monkeypatch):
    """megatron's native fused cross entropy as its compiled kernels run: torch's cross entropy and its gradient
    (the gradient in bf16, as megatron's kernel casts it), also for targets outside this rank's vocabulary share;
    it keeps the fp32 softmax, the 1-byte target mask and the int64 local targets."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: None)   # one TP rank

    class Rank1Of2:                   # the second half of the vocabulary: targets below it are masked
        def rank(self):
            return 1

        def size(self):
            return 2

    torch.manual_seed(2)
    s, b, v = 6, 3, 13
    logits = torch.randn(s, b, v).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, 2 * v, (s, b))
    g = torch.randn(b, s).t()          # strided, as the caller's transposed loss hands it back
    (loss, kept) = saved(lambda: standins._FusedCrossEntropy.apply(logits, target, Rank1Of2()))
    loss.backward(g)
    ref_logits = logits.detach().float().requires_grad_(True)
    local = target - v
    inside = (local >= 0) & (local < v)
    # one rank's share, as megatron's before the TP all-reduce: over logits shifted by their maximum, a target
    # outside the share picks 0
    shifted = ref_logits - ref_logits.max(-1, keepdim=True)[0].detach()
    picked = shifted.gather(-1, local.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1) * inside
    ref = torch.logsumexp(shifted, -1) - picked
    ref.backward(g)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=2e-2, atol=2e-2)
    assert kept == [((s, b, v), torch.float32), ((s, b), torch.bool), ((s * b,), torch.int64)]


@pytest.mark.megatron
@pytest.mark.parametrize("mb", [1, 2])
def test_fused_cross_entropy_program_is_the_h100_one(tmp_path, mb):
    """A bf16 run with --cross-entropy-loss-fusion on the stand-ins (one rank on the fake process group): the loss
    segment and the output layer around it allocate and free event for event what the H100 traces' programs
    (fit/sets/gpu_h100.json, evaluated at this run's shapes) do, forward and backward."""
    from benchmarks.standin_programs import compare_run
    from estimator import formulas as F
    from fit.programs.build import load_runs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--gpu-kernels", "--fake-world", "1",
           "--out", str(tmp_path), "--iterations", "2", "--", "--num-layers", "2", "--hidden-size", "128",
           "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
           "--micro-batch-size", str(mb), "--global-batch-size", str(mb), "--vocab-size", "512", "--bf16",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--cross-entropy-loss-fusion"]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run,) = load_runs([str(tmp_path)])
    assert run.switches["fuse_ce"] == "native"
    verdicts = compare_run(run, F.load("gpu_h100").programs)
    for label in ("loss", "output_layer"):
        for phase in ("fwd", "bwd"):
            assert verdicts[(phase, label)][0] == "equal", (phase, label, verdicts[(phase, label)])


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_values_gradients_and_saved_tensors(bias):
    """TE's GroupedLinear stand-in: each expert's rows times its own weight (an expert with no tokens included),
    the gradients of a per-expert reference, and nothing saved but the input and the weights."""
    torch.manual_seed(0)
    splits = (3, 0, 5, 2)
    x = torch.randn(sum(splits), 6, dtype=torch.float64)
    ws = [torch.randn(4, 6, dtype=torch.float64) for _ in splits]
    bs = [torch.randn(4, dtype=torch.float64) for _ in splits] if bias else []
    g = torch.randn(sum(splits), 4, dtype=torch.float64)

    def grouped(x, *params):
        return standins._GroupedGemm.apply(x, splits, bias, *params)

    def reference(x, *params):
        w, b = params[:len(splits)], params[len(splits):]
        parts = torch.split(x, list(splits))
        return torch.cat([p @ w[i].t() + (b[i] if bias else 0) for i, p in enumerate(parts)])

    _, kept = saved(grouped, *[t.clone().requires_grad_(True) for t in (x, *ws, *bs)])
    assert sorted(kept) == sorted([(tuple(x.shape), x.dtype)] + [((4, 6), torch.float64)] * len(splits))
    got, got_grads = grads(grouped, [x, *ws, *bs], g)
    want, want_grads = grads(reference, [x, *ws, *bs], g)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


# megatron-core in a process of its own (the scripts below initialize its parallel state): one gloo rank on CPU
_ONE_RANK = r'''
import tempfile, warnings
warnings.filterwarnings("ignore")
import torch
from tracer import megatron_compat, standins
megatron_compat.install()
torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
ps.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1)
'''


def run_one_rank(script: str) -> list:
    """stdout's words of `script` run after _ONE_RANK in a fresh interpreter (the test fails on its error)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _ONE_RANK + script], cwd=root, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout.split()


_GROUPED_VS_SEQUENTIAL = r'''
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
n, h, fe = 4, 16, 8
cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, num_moe_experts=n, moe_router_topk=2,
                        moe_ffn_hidden_size=fe, add_bias_linear=False, use_cpu_initialization=True,
                        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
                        moe_grouped_gemm=True, gradient_accumulation_fusion=False, params_dtype=torch.float64)
provider, _ = standins._install_te_spec()
module, subs = provider().grouped_mlp_modules(True, False)
pgs = ProcessGroupCollection.use_mpu_process_groups()
grouped = module(n, cfg, subs, pg_collection=pgs)
seq = SequentialMLP(n, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                    pg_collection=pgs)
with torch.no_grad():
    for i, e in enumerate(seq.local_experts):
        getattr(grouped.linear_fc1, f"weight{i}").copy_(e.linear_fc1.weight)
        getattr(grouped.linear_fc2, f"weight{i}").copy_(e.linear_fc2.weight)
tokens = torch.tensor([3, 0, 5, 2])            # an expert without tokens included
x = torch.randn(int(tokens.sum()), h, dtype=torch.float64)
probs = torch.rand(int(tokens.sum()), dtype=torch.float64)
outs = []
for m in (grouped, seq):
    xi, pi = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    y, _ = m(xi, tokens, pi)
    y.backward(torch.ones_like(y))
    outs.append((y.detach(), xi.grad, pi.grad))
for a, b in zip(*outs):
    torch.testing.assert_close(a, b)
got = dict(grouped.named_parameters())
for i, e in enumerate(seq.local_experts):
    torch.testing.assert_close(got[f"linear_fc1.weight{i}"].grad, e.linear_fc1.weight.grad)
    torch.testing.assert_close(got[f"linear_fc2.weight{i}"].grad, e.linear_fc2.weight.grad)
print(type(grouped).__name__, type(grouped.linear_fc1).__name__, type(grouped.linear_fc2).__name__)
'''


@pytest.mark.megatron
def test_grouped_gemm_in_megatrons_te_grouped_mlp_equals_its_sequential_mlp():
    """The stand-in spec's grouped experts are megatron-core's own TEGroupedMLP with the grouped linears standing in
    for TE's; given the same expert weights, tokens per expert and routing probabilities, it computes what megatron's
    SequentialMLP computes: outputs, the gradients of the tokens and the probabilities, and every expert's weight
    gradients (fp64, in a process of its own: it initializes megatron's parallel state)."""
    assert run_one_rank(_GROUPED_VS_SEQUENTIAL) == ["TEGroupedMLP", "StandinColumnParallelGroupedLinear",
                                                    "StandinRowParallelGroupedLinear"]


_TE_UNFUSED_VS_LOCAL = r'''
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
s, b, a, g, d = 12, 2, 4, 2, 8
cfg = TransformerConfig(num_layers=1, hidden_size=a * d, num_attention_heads=a, num_query_groups=g,
                        attention_dropout=0.0, masked_softmax_fusion=False, params_dtype=torch.float64)
provider, unfused = standins._install_te_spec()
mods = [cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        for cls in (unfused, DotProductAttention)]
q, k, v = (torch.randn(s, b, n, d, dtype=torch.float64) for n in (a, g, g))
mask = torch.triu(torch.ones(b, 1, s, s, dtype=torch.bool), diagonal=1)
outs = []
for m in mods:
    ps._GLOBAL_MEMORY_BUFFER = None
    ps._set_global_memory_buffer()
    qi, ki, vi = (t.clone().requires_grad_(True) for t in (q, k, v))
    y = m(qi, ki, vi, mask)
    y.backward(torch.ones_like(y))
    outs.append((y.detach(), qi.grad, ki.grad, vi.grad))
    print(type(m).__name__, len(ps.get_global_memory_buffer().buffer))
for x, y in zip(*outs):
    torch.testing.assert_close(x, y)
'''


@pytest.mark.megatron
def test_te_unfused_attention_makes_its_scores_per_call_and_computes_the_local_attention():
    """TE's unfused backend stand-in computes what megatron's local DotProductAttention computes (GQA, causal mask;
    outputs and the q, k, v gradients, fp64) but leaves megatron's global memory buffer untouched: its scores are a
    tensor of each call (TE's UnfusedDotProductAttention), where the local attention keeps them in that buffer."""
    assert run_one_rank(_TE_UNFUSED_VS_LOCAL) == ["StandinUnfusedAttention", "0", "DotProductAttention", "1"]


def _megatron_eager(name: str):
    """megatron's own arithmetic for a fused activation (the function torch.compile wraps, where it does)."""
    from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu
    fn = getattr(fused_bias_gelu, name, None) or getattr(fused_bias_swiglu, name)
    return getattr(fn, "_torchdynamo_orig_callable", fn)


@pytest.mark.parametrize("name,args", [
    ("bias_gelu", ("b", "y")), ("bias_gelu_back", ("g", "b", "y")), ("swiglu", ("y2",)),
    ("bias_swiglu", ("y2", "b2")), ("swiglu_back", ("g", "y2")), ("bias_swiglu_back", ("g", "y2", "b2"))])
def test_fused_activation_arithmetic_equals_megatrons(name, args):
    """The bias-activation stand-ins compute what megatron's compiled functions compute (fp64: megatron's tanh
    constants against torch's own tanh-approximate GeLU agree to the printed digits)."""
    torch.manual_seed(5)
    f = 12
    t = {"y": torch.randn(6, 2, f, dtype=torch.float64), "b": torch.randn(f, dtype=torch.float64),
         "y2": torch.randn(12, 2 * f, dtype=torch.float64), "b2": torch.randn(2 * f, dtype=torch.float64)}
    t["g"] = torch.randn(6, 2, f, dtype=torch.float64) if "gelu" in name else torch.randn(12, f, dtype=torch.float64)
    if name.endswith("_back") and "swiglu" in name:
        t["g"] = torch.randn(12, f, dtype=torch.float64)
    ins = [t[a] for a in args]
    torch.testing.assert_close(getattr(standins, "_" + name)(*ins), _megatron_eager(name)(*ins), rtol=1e-7, atol=1e-8)


def test_cuda_bias_grad_sums_over_tokens():
    """A bias's gradient is the sum over tokens, in the gradient's dtype (its buffers' order: the program test
    below)."""
    g = torch.randn(5, 3, 200, dtype=torch.bfloat16)
    out = standins._cuda_bias_grad(g, 200)
    torch.testing.assert_close(out, g.float().sum((0, 1)).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    assert out.shape == (200,) and out.dtype == torch.bfloat16


@pytest.mark.megatron
@pytest.mark.parametrize("model", ["gpt", "gpt_local", "llama"])
def test_fused_activation_programs_are_the_h100_ones(tmp_path, model):
    """A bf16 run on the stand-ins: the fused activation's segment (`layers.*.mlp@linear_fc1`: megatron's bias-GeLU
    with its bias, SwiGLU without) allocates and frees event for event what the H100 traces' programs
    (fit/sets/gpu_h100.json, evaluated at this run's shapes) do, forward and backward: one output each way, and
    the bias's gradient through the CUDA reduction's buffers. A free of another segment's tensor is compared by
    the segment (the TE spec's layernorm-linear stand-in makes more tensors on a CPU, which renumbers them)."""
    from benchmarks.standin_programs import in_allocator_blocks, without_grad_casts
    from estimator import formulas as F
    from fit.programs.build import load_runs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    s, b = 128, 2
    extra = {"gpt": [], "gpt_local": ["--transformer-impl", "local"],
             "llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                       "--disable-bias-linear", "--untie-embeddings-and-output-weights"]}[model]
    cmd = [sys.executable, "-W", "ignore", "-m", "tracer.profile", "--cpu", "--gpu-kernels", "--out",
           str(tmp_path), "--iterations", "2", "--", "--num-layers", "2", "--hidden-size", "128",
           "--num-attention-heads", "4", "--seq-length", str(s), "--max-position-embeddings", str(s),
           "--micro-batch-size", str(b), "--global-batch-size", str(b), "--vocab-size", "512", "--bf16",
           "--hidden-dropout", "0", "--attention-dropout", "0"] + extra
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run,) = load_runs([str(tmp_path)])
    assert run.switches["fuse_act"] is True

    def segment(events):
        # the reduction's semaphores (4 bytes per 128 outputs, rounded up) are requested as the one 512-byte block
        # the caching allocator makes of them: compared as that block
        return [(op, size, ref if ref.startswith("#") or not ref else ref.split("#")[0])
                for op, size, ref in in_allocator_blocks(events)]

    label = "layers.*.mlp@linear_fc1"
    gpu = F.load("gpu_h100").programs
    for phase in ("fwd", "bwd"):
        cells, _ = gpu.select(phase, label, run.switches)
        assert len(cells) == 1, phase
        want = [(op, int(round(x)), ref) for op, x, ref in cells[0].evaluated(run.point)]
        got = without_grad_casts([(e.op, e.size, e.ref) for e in run.programs[(phase, label)].events()])
        assert segment(got) == segment(want), phase
        assert sum(op == "+" for op, _, _ in got) == (1 if phase == "fwd" or model == "llama" else 4)


def test_mla_fused_rope_kernels_rotate_as_the_triton_kernels_and_allocate_as_megatron():
    """MLA's fused YaRN RoPE: megatron's own autograd functions with the stand-in kernels. The query is rotated in
    place (its rotary part: even / odd elements into left / right halves by each token's cos and sin) and the key is
    the plain part and the rotated shared part per head; backward is the rotation's transpose (checked as
    <J x, y> = <x, J^T y>); the only allocations are megatron's own (the key, the value; their gradients)."""
    pytest.importorskip("megatron.core")
    from torch.profiler import ProfilerActivity, profile
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mla_rope

    standins._install_mla_rope()
    torch.manual_seed(3)
    s, b, heads, dq, dr, dv = 6, 2, 3, 4, 8, 5
    angles = torch.rand(s, dr // 2) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).view(s, 1, 1, dr).contiguous()
    sin = torch.cat([angles.sin(), angles.sin()], -1).view(s, 1, 1, dr).contiguous()

    def rotate(x):   # the kernels' arithmetic on [s, b, ..., dr]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, sn = angles.cos().view(s, 1, 1, -1), angles.sin().view(s, 1, 1, -1)
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], -1)

    q = torch.randn(s, b, heads, dq + dr)
    out = mla_rope.fused_apply_mla_rope_for_q(q.clone(), cos, sin, dq, dr)
    torch.testing.assert_close(out, torch.cat([q[..., :dq], rotate(q[..., dq:])], -1))
    kv, pe = torch.randn(s, b, heads, dq + dv), torch.randn(s, b, 1, dr)
    key, value = mla_rope.fused_apply_mla_rope_for_kv(kv, pe, cos, sin, dr, dq, dv)
    torch.testing.assert_close(key, torch.cat([kv[..., :dq], rotate(pe).expand(s, b, heads, dr)], -1))
    torch.testing.assert_close(value, kv[..., dq:])
    # backward: the adjoint of the forward map
    x = (torch.randn(s, b, heads, dq + dr, dtype=torch.float64).float().requires_grad_(True),)
    y = torch.randn(s, b, heads, dq + dr)
    fx = mla_rope.fused_apply_mla_rope_for_q(x[0].clone(), cos, sin, dq, dr)
    (gx,) = torch.autograd.grad(fx, x, y.clone())     # (the kernel rotates the gradient in place)
    torch.testing.assert_close((fx * y).sum(), (x[0] * gx).sum(), rtol=1e-5, atol=1e-5)
    kvx, pex = kv.clone().requires_grad_(True), pe.clone().requires_grad_(True)
    k2, v2 = mla_rope.fused_apply_mla_rope_for_kv(kvx, pex, cos, sin, dr, dq, dv)
    yk, yv = torch.randn_like(k2), torch.randn_like(v2)
    gkv, gpe = torch.autograd.grad((k2, v2), (kvx, pex), (yk, yv))
    torch.testing.assert_close((k2 * yk).sum() + (v2 * yv).sum(), (kvx * gkv).sum() + (pex * gpe).sum(),
                               rtol=1e-5, atol=1e-5)
    # allocations: megatron's new_empty outputs only (bf16)
    kvb, peb = kv.to(torch.bfloat16).requires_grad_(True), pe.to(torch.bfloat16).requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kb, vb = mla_rope.fused_apply_mla_rope_for_kv(kvb, peb, cos, sin, dr, dq, dv)
        torch.autograd.grad((kb, vb), (kvb, peb), (torch.ones_like(kb), torch.ones_like(vb)))
    sizes = sorted(ev.cpu_memory_usage for ev in prof.events()     # the allocating calls themselves
                   if ev.cpu_memory_usage > 0 and ev.name in ("aten::empty", "aten::empty_strided"))
    t = s * b
    expected = sorted([t * heads * (dq + dr) * 2, t * heads * dv * 2,            # key, value
                       t * heads * (dq + dr) * 2, t * heads * dv * 2,            # their ones_like gradients
                       t * heads * (dq + dv) * 2, t * dr * 2])                   # d_kv, d_emb
    assert sizes == expected, sizes
