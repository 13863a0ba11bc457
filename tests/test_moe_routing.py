"""Balanced MoE routing for profiling (tracer/moe_routing.py, `tracer.profile --balanced-routing`): the pattern
itself, and a real megatron-core MoE run on CPU in which every local expert then receives the same tokens, so
the run's MoE buffers are determined by its shapes (the fit refuses MoE runs traced without it)."""
from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tracer.moe_routing import balance_

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tokens, experts, topk", [(80, 4, 2), (64, 8, 3), (12, 4, 1), (10, 4, 2), (7, 8, 2)])
def test_pattern_is_round_robin_top_k_written_in_place(tokens, experts, topk):
    logits = torch.randn(tokens, 1, experts)
    ptr = logits.data_ptr()
    balance_(logits, experts, topk)
    assert logits.data_ptr() == ptr                       # in place: nothing a real run would not allocate
    top = logits.view(-1, experts).topk(topk, dim=1).indices
    for n in range(tokens):                               # token n: experts n, n+1, ... (mod E), in that order
        assert top[n].tolist() == [(n % experts + j) % experts for j in range(topk)]
    counts = torch.bincount(top.flatten(), minlength=experts)
    if tokens % experts == 0:
        assert counts.tolist() == [tokens * topk // experts] * experts
    else:                                                 # a last partial block: off by at most k
        assert int(counts.max() - counts.min()) <= topk


def test_pattern_leaves_the_autograd_graph_alone():
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(6, 8)
    logits = x @ w
    balance_(logits, 4, 2)
    (logits.softmax(-1) * torch.arange(4.0)).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


MOE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
       "--max-position-embeddings", "16", "--micro-batch-size", "2", "--vocab-size", "64",
       "--make-vocab-size-divisible-by", "16", "--transformer-impl", "local", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def balanced_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe_balanced"))
    cmd = [sys.executable, "-m", "tracer.profile", "--cpu", "--nproc", "1", "--out", out, "--iterations", "2",
           "--balanced-routing", "--", *MOE]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return out


def test_every_local_expert_gets_the_same_tokens_in_a_real_run(balanced_run):
    from tracer.parse import parse_run, saved_mask
    pr = parse_run(balanced_run)[0]
    assert pr.header["routing"] == "balanced"
    a, keep = pr.allocs, saved_mask(pr)
    per_expert = collections.Counter()
    for i in np.flatnonzero(keep):
        path = pr.scope_path(int(a["scope"][i]))
        name = path[-1]
        if ".local_experts." in name and "iter:1" in path and "fwd:0" in path:
            expert = int(name.split(".local_experts.", 1)[1].split(".", 1)[0])
            per_expert[expert] += int(a["size"][i])
    # 32 tokens x top-2 over 4 experts: 16 tokens each, so each expert's saved activations are equal and nonzero.
    assert sorted(per_expert) == [0, 1, 2, 3]
    assert len(set(per_expert.values())) == 1 and per_expert[0] > 0


def test_fit_refuses_moe_runs_traced_with_data_dependent_routing(balanced_run, tmp_path):
    from fit.dataset import DatasetError, load_run
    load_run(balanced_run)                                 # balanced: accepted
    run = tmp_path / "unbalanced"
    shutil.copytree(balanced_run, run)
    hdr = json.loads((run / "rank0.json").read_text())
    hdr["routing"] = "model"
    (run / "rank0.json").write_text(json.dumps(hdr))
    with pytest.raises(DatasetError, match="without --balanced-routing"):
        load_run(str(run))
