"""The `qcopy` switch (estimator.formulas.switches) says whether megatron-core's SelfAttention copies the query when
it reshapes [s, b, g, a/g * d] into [s, b, a, d], and `qcore` whether the query it hands on is a view that the
unfused core attention's reshape to [s, b*a, d] must copy: checked against the real module, one process on a fake
world of TP ranks per case (the QKV projection needs no communication forward; a gather where groups < TP, CPU
shims on)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from estimator import formulas as F  # noqa: E402
from estimator.args import parse_args  # noqa: E402

# (heads, query groups, TP, micro-batch): MHA, GQA, MQA, one group per rank, two groups per rank, groups < TP;
# one sequence and more
CASES = [(8, 8, 1, 2), (8, 2, 1, 2), (8, 1, 1, 2), (6, 3, 1, 2), (8, 2, 2, 2), (8, 4, 2, 2), (8, 8, 2, 2),
         (8, 1, 2, 3), (16, 8, 4, 2), (16, 2, 4, 2), (8, 1, 1, 1), (8, 2, 2, 1), (4, 2, 1, 1)]

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
for a, g, t, b in json.loads(sys.argv[1]):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=t, create_gloo_process_groups=False)
        tc = TransformerConfig(num_layers=1, hidden_size=8 * a, num_attention_heads=a, num_query_groups=g,
                               tensor_model_parallel_size=t, use_cpu_initialization=True, add_bias_linear=False)
        attn = build_module(get_gpt_layer_local_spec().submodules.self_attention, config=tc, layer_number=1)
        q, k, v = attn.get_query_key_value_tensors(torch.randn(4, b, 8 * a))
        copied = q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        try:    # what DotProductAttention's reshape [sq, b, np, hn] -> [sq, b * np, hn] does to it
            q.view(q.shape[0], q.shape[1] * q.shape[2], -1)
            core = False
        except RuntimeError:
            core = True
        out.append((copied, core))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
print(json.dumps(out))
"""


def test_qcopy_and_qcore_are_where_megatron_core_copies_the_query():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES)], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    copies = json.loads(res.stdout.strip().splitlines()[-1])
    for (a, g, t, b), (copied, core) in zip(CASES, copies):
        argv = ["--nproc_per_node", str(t), "--num-layers", "1", "--hidden-size", str(8 * a),
                "--num-attention-heads", str(a), "--seq-length", "4", "--max-position-embeddings", "4",
                "--micro-batch-size", str(b), "--vocab-size", "64", "--tensor-model-parallel-size", str(t)] \
            + (["--group-query-attention", "--num-query-groups", str(g)] if g != a else [])
        sw = F.switches(parse_args(argv))
        assert sw["qcopy"] is copied and sw["qcore"] is core, (a, g, t, b)
        # a rotated query is a new contiguous tensor
        assert not F.switches(parse_args(argv + ["--position-embedding-type", "rope"]))["qcore"]
    for i in (0, 1):
        assert any(c[i] for c in copies) and not all(c[i] for c in copies)
