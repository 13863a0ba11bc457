"""fp8 (estimator.fp8, modelled): the fp8 GEMM weights it caches are megatron-core's linear weights, counted on a
real GPTModel; Megatron's fp8 checks; saved activations shrink where TE quantizes the saved inputs."""
import shlex

import pytest

from estimator import fp8
from estimator import memory as MEM
from estimator.args import ConfigError, parse_args

BASE = ("--nproc_per_node 1 --num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --vocab-size 500 --micro-batch-size 2 --bf16 --disable-bias-linear "
        "--swiglu --num-query-groups 2 --group-query-attention ")


def parse(extra):
    return parse_args(shlex.split(BASE + extra))


def peak_parts(extra):
    r = MEM.estimate(parse(extra), "modelled").ranks[0]
    return r.bytes["parameters"], r.per_op


@pytest.mark.megatron
def test_cached_weights_are_megatron_cores_linear_weights():
    from tests.conftest import run_on_gloo_world
    cfg = parse("")
    [(_, _, _, counts, err)] = run_on_gloo_world(1, [(0, cfg)])
    assert err is None, err
    # No biases: each linear op's numel is its weight's.
    linear = sum(n for (op, layer), n in counts.items() if layer is not None and op.rsplit(".", 1)[-1]
                 in fp8.FP8_LINEARS)
    assert linear > 0
    plain, _ = peak_parts("")
    for flags, per_element, history in (("--fp8-format hybrid", 2, 1), ("--fp8-format e4m3 --fp8-amax-history-len 16", 2, 16),
                                        ("--fp8-format hybrid --fp8-recipe tensorwise", 2, 0),
                                        ("--fp8-format hybrid --fp8-param-gather --use-distributed-optimizer", 0, 1)):
        with_fp8, _ = peak_parts(flags)
        dist = peak_parts("--use-distributed-optimizer")[0] if "distributed" in flags else plain
        modules = 4 * cfg.num_layers
        assert with_fp8 - dist == per_element * linear + modules * 5 * 4 * history, flags


def test_bf16_layers_are_left_out_and_checks():
    cfg = parse("--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16")
    assert fp8.bf16_layers(cfg) == {0, 2}
    assert fp8.stage_weight_bytes(cfg, 0, 2)[1] == 4      # the middle layer's four GEMMs only
    for extra, message in (("--fp8-param-gather", "fp8_param must be used together with fp8 mode"),
                           ("--fp8-format hybrid --first-last-layers-bf16", "Delayed scaling does not support"),
                           ("--fp8-format hybrid --fp8-param-gather", "only supported with distributed optimizer"),
                           ("--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 "
                            "--num-layers-at-end-in-bf16 4", "must be between 0 and"),
                           ("--fp8-format hybrid --transformer-impl local", "needs --transformer-impl"),
                           ("--fp8-format e5m2", "invalid choice")):
        with pytest.raises(ConfigError, match=message):
            parse(extra)


def test_saved_activations_in_fp8():
    _, plain = peak_parts("")
    _, quant = peak_parts("--fp8-format hybrid")
    row = quant["layers.*.fp8_saved_inputs"]
    assert row["count"] == 3 and row["saved"] < 0            # a net saving on every dense layer
    assert {op: d["saved"] for op, d in plain.items()} == \
        {op: d["saved"] for op, d in quant.items() if op != "layers.*.fp8_saved_inputs"}
    # The 2-byte layer-norm outputs (linear_qkv, linear_fc1) and the activation output (linear_fc2's input) take
    # one byte; linear_proj adds a 1-byte copy of the attention output.
    s, b, h, f, a_d = 32, 2, 64, 64 * 8 // 3 // 64 * 64, 64
    assert row["saved"] == 3 * (s * b * a_d - (2 * s * b * h + s * b * f))


def test_fp8_param_gather_halves_the_gemm_weights_on_the_wire():
    from estimator.cli import build_report
    argv = shlex.split(BASE.replace("--nproc_per_node 1", "--nproc_per_node 4") + "--use-distributed-optimizer "
                       "--global-batch-size 8 --fp8-format hybrid")

    def gathered(extra):
        rep = build_report(argv + extra)
        rows = [c for c in rep.comm.collectives if c.op == "all-gather" and c.dim == "dp"]
        return rep, sum(c.bytes for c in rows), rows
    rep, fp8_bytes, rows = gathered(["--fp8-param-gather"])
    _, plain_bytes, _ = gathered([])
    share = fp8.param_gather_share(rep.cfg, 0, MEM.all_param_chunks(rep.cfg)[0])
    linear = sum(fp8._weight_elements(op) for op in fp8._fp8_gemm_ops(rep.cfg, 0))
    assert 0.5 < share < 1 and share == linear / rep.estimate.ranks[0].params
    assert fp8_bytes == pytest.approx(plain_bytes * (1 - share / 2), abs=len(rows))
    assert all(c.modelled and c.dtype == "bf16/fp8" for c in rows)
