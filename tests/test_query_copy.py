"""The `qcopy` switch (estimator.formulas.switches) says whether megatron-core's SelfAttention copies the query when
it reshapes [s, b, g, a/g * d] into [s, b, a, d]: checked against the real module, one process on a fake world of
TP ranks per case (the QKV projection needs no communication forward; a gather where groups < TP, CPU shims on)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from estimator import formulas as F  # noqa: E402
from estimator.args import parse_args  # noqa: E402

# (heads, query groups, TP): MHA, GQA, MQA, one group per rank, two groups per rank, groups < TP
CASES = [(8, 8, 1), (8, 2, 1), (8, 1, 1), (6, 3, 1), (8, 2, 2), (8, 4, 2), (8, 8, 2), (8, 1, 2), (16, 8, 4),
         (16, 2, 4)]

PROBE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from tracer import megatron_compat
megatron_compat.install()
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import build_module
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
out = []
for a, g, t in json.loads(sys.argv[1]):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=t, create_gloo_process_groups=False)
        tc = TransformerConfig(num_layers=1, hidden_size=8 * a, num_attention_heads=a, num_query_groups=g,
                               tensor_model_parallel_size=t, use_cpu_initialization=True, add_bias_linear=False)
        attn = build_module(get_gpt_layer_local_spec().submodules.self_attention, config=tc, layer_number=1)
        q, k, v = attn.get_query_key_value_tensors(torch.randn(4, 1, 8 * a))
        out.append(q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr())
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
print(json.dumps(out))
"""


def test_qcopy_is_where_megatron_core_copies_the_query():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES)], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    copies = json.loads(res.stdout.strip().splitlines()[-1])
    for (a, g, t), copied in zip(CASES, copies):
        cfg = parse_args(["--nproc_per_node", str(t), "--num-layers", "1", "--hidden-size", str(8 * a),
                          "--num-attention-heads", str(a), "--seq-length", "4", "--max-position-embeddings", "4",
                          "--micro-batch-size", "1", "--vocab-size", "64", "--tensor-model-parallel-size", str(t)]
                         + (["--group-query-attention", "--num-query-groups", str(g)] if g != a else []))
        assert F.switches(cfg)["qcopy"] is copied, (a, g, t)
    assert any(copies) and not all(copies)
