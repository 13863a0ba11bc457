"""Multi-token prediction (megatron-core's MultiTokenPredictionBlock, DeepSeek-V3's MTP): measured, not refused.

The MTP block's own code (the embedding of the shifted tokens, two norms, the projection of both joined, a final
norm) and its loss head are fitted from the campaign's MTP runs (fit/grids/make_cpu_gpu_kernels.py mtp_configs);
its transformer layer is walked with the decoder layer's programs, which the traces show it allocates exactly like.
Parameters and collectives are checked against megatron-core in test_params_vs_megatron.py and
test_comm_measured.py.
"""
import os
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "fit", "traces", "cpu_gpu_kernels")
HELD_OUT = os.path.join(ROOT, "fit", "traces", "cpu_mtp_heldout")
SHIPPED = os.path.join(ROOT, "fit", "sets", "cpu_compose.json")


@pytest.mark.parametrize("name", ["mtp_llama_tp2_sp_s64_b2_h128", "mtp_gpt_pp2_s96_b1_h96",
                                  "mtp_mla_moe_tp2_sp_ep4_a2a_s64_b2_h128_q48", "mtp_gpt_local_w1_s64_b2_h128"])
def test_the_mtp_transformer_layer_allocates_as_a_decoder_layer(name):
    """Each op of MTP's transformer layer allocates what the same op of the decoder's layers allocates in the same
    run (forward: event for event; backward: the same peak), what lets the estimator walk the decoder layer's
    programs there. The one difference errs high: the backward of the op that reads the layer's input frees that
    input, which under MTP is a view of the projection's output gathered whole over TP (s*b*h, where a decoder
    layer's input is s*b*h/st), so the decoder's program frees less than the MTP layer does, never more."""
    pytest.importorskip("numpy")
    from fit.programs.build import MTP_LAYER
    from fit.programs.extract import run_programs
    from fit.dataset import parsed_run

    path = os.path.join(TRACES, name)
    ranks, _, _ = parsed_run(path, False)
    programs = run_programs(path, ranks).programs
    mtp = {k: p for k, p in programs.items() if k[1].startswith(MTP_LAYER)}
    assert len(mtp) >= 10
    for (phase, label), p in mtp.items():
        twin = programs[(phase, "layers.*" + label[len(MTP_LAYER):])]
        if phase == "fwd":
            assert [(e.op, e.size) for e in p.compute] == [(e.op, e.size) for e in twin.compute], label
        else:
            (delta, peak), (twin_delta, twin_peak) = p.delta_peak(), twin.delta_peak()
            assert peak == twin_peak and delta <= twin_delta, (label, p.delta_peak(), twin.delta_peak())


@pytest.mark.parametrize("name", ["ho_mtp_llama_tp4_sp_s128_b1", "ho_mtp_llama_gqa_pp2_l6_s80_b3",
                                  "ho_mtp_gpt_tp2_pp2_dp2_do_s112_b2", "ho_mtp_mla_moe_tp2_sp_ep4_s128",
                                  "ho_mtp_llama_selective_s72_b2", "ho_mtp_gpt_cefusion_s128_b2",
                                  "ho_mtp_llama_gqa_pp4_vpp2_last_s96_b2", "ho_mtp_llama_full_s80_b2"])
def test_mtp_runs_the_fit_never_saw(name):
    """MTP configs outside the campaign (fit/grids/make_cpu_mtp_heldout.py), selective and full recompute (MTP's
    layer checkpointed after its embedding) composed from the plain layer: within 1% of the tracing allocator's
    peak on every traced rank."""
    from estimator import formulas as F
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from packed_runs import rank_peaks
    predicted, measured, _ = rank_peaks(os.path.join(HELD_OUT, name), F.load(SHIPPED))
    for p, m in zip(predicted, measured):
        assert -0.01 <= (p - m) / m <= 0.01, (name, p, m)


def test_mtp_changes_the_last_stage_only_and_is_measured():
    """A DeepSeek-style config: with --mtp-num-layers 1 the last stage holds more (the MTP layer, its embedding
    copy, one more loss head), the first stage the same; the estimate is measured, not extrapolated, and a set
    that never traced MTP, or more than one MTP layer, stops in one line."""
    from estimator.args import ConfigError
    from estimator.cli import build_report
    argv = shlex.split("--preset llama2_7b --micro-batch-size 1 --pipeline-model-parallel-size 2 "
                       "--nproc_per_node 2 --num-layers 8 --transformer-impl transformer_engine --bf16")
    plain = build_report(argv, reserved=False).estimate
    mtp = build_report(argv + ["--mtp-num-layers", "1"], reserved=False).estimate
    assert mtp.ranks[0].peak_bytes == plain.ranks[0].peak_bytes
    assert mtp.ranks[1].peak_bytes > plain.ranks[1].peak_bytes
    assert mtp.ranks[1].params > plain.ranks[1].params
    assert not [k for k in mtp.coverage["extrapolated"] if "mtp" in k or k.startswith("step")]
    assert not mtp.coverage["untraced"]
    for name in ("gpu_h100", "modelled"):
        with pytest.raises(ConfigError, match="--mtp-num-layers changes memory .* measured no run with it") as err:
            build_report(argv + ["--mtp-num-layers", "1", "--formulas", name], reserved=False)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="more than one multi-token prediction layer"):
        build_report(argv + ["--mtp-num-layers", "2"], reserved=False)
