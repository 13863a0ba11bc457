import types

import pytest

from estimator.static_memory import ParamInfo, buffer_layout, static_memory, table_bytes_per_param


def _cfg(**kw):
    base = dict(data_parallel_size=1, context_parallel_size=1, optimizer="adam")
    base.update(kw)
    return base


@pytest.mark.parametrize("prec", [{"bf16": True}, {"fp16": True}, {}])
@pytest.mark.parametrize("d", [1, 4, 8])
@pytest.mark.parametrize("dist", [False, True])
def test_bytes_per_param_table(prec, d, dist):
    # Megatron's table (DESIGN 6); 128-aligned params so no padding enters
    c = _cfg(data_parallel_size=d, use_distributed_optimizer=dist, **prec)
    n = 128 * 1024
    st = static_memory(c, [[ParamInfo(n), ParamInfo(n)]], dp_rank=0)
    expect = {"bf16": (18, 6, 12), "fp16": (20, 4, 16), "fp32": (16, 8, 8)}["bf16" if prec.get("bf16") else "fp16" if prec else "fp32"]
    per = expect[1] + expect[2] / d if dist else expect[0]
    # Megatron's table counts the fp32 copies of 16-bit gradients (fp16), which exist during the step only: the
    # persistent bytes leave them out, the step's transient holds them
    copy = st.optimizer_detail["fp32_grad_copy_bytes"]
    assert copy == (4 * 2 * n // (d if dist else 1) if prec.get("fp16") else 0)
    assert st.optimizer_step_transient_bytes >= copy
    assert (st.total_bytes + copy) / (2 * n) == pytest.approx(per)
    assert table_bytes_per_param(c) == pytest.approx(per)


torch = pytest.importorskip("torch")
pgb = pytest.importorskip("megatron.core.distributed.param_and_grad_buffer")
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402


@pytest.mark.parametrize("dp,dist,bucket", [(1, False, None), (4, True, None), (3, True, 5000), (8, True, None), (2, False, 3000)])
def test_buffer_layout_equals_megatron(monkeypatch, dp, dist, bucket):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None)  # needs an initialised group
    shapes = [(100, 37), (37,), (64, 64), (1000,), (33, 7), (5,), (300, 20)]
    shared = [False] * len(shapes)
    if dist:
        shared[0] = True  # a tied embedding weight gets its own bucket
    params = []
    for s, sh in zip(shapes, shared):
        p = torch.nn.Parameter(torch.zeros(s))
        if sh:
            p.shared_embedding = True
        params.append(p)
    group = types.SimpleNamespace(size=lambda: dp, rank=lambda: 0)
    pg = types.SimpleNamespace(tp=group, dp_cp=group)
    buf = pgb._ParamAndGradBuffer(DistributedDataParallelConfig(use_distributed_optimizer=dist), torch.float32,
                                  torch.float32, params, group, bucket, {p: str(i) for i, p in enumerate(params)},
                                  1.0, list(range(len(params))), False, pg)
    lay = buffer_layout([p.numel() for p in params], shared, dp, dist, bucket)
    assert lay.numel == buf.numel and lay.numel_unpadded == buf.numel_unpadded
    assert lay.buckets == list(buf.bucket_indices)
    assert lay.param_ranges == [buf.param_index_map[p][:2] for p in params]
