"""Cost flat in scale: 100,000 GPUs and 10**7 microbatches are estimated and written without a pass per rank per
rank or a step list (issue 13). Regression guards with wide margins: benchmarks/estimator_speed.py reports the
times (about 0.7 s of CPU for 125 MB of JSON at 100,000 GPUs on the 2-core dev VM; it took minutes before)."""
import shlex
import time

from estimator import cli
from estimator import report as R
from estimator.report_json import json_chunks

BIG = ("--preset llama2_7b --nproc_per_node 8 --nnodes 12500 --tensor-model-parallel-size 8 "
       "--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 50000 --bf16 "
       "--vocab-size 1200000 --untie-embeddings-and-output-weights")   # the last stage is the worst


def test_100k_gpus_json_and_text():
    t0 = time.process_time()
    rep = cli.build_report(shlex.split(BIG))
    chunks = json_chunks(rep)
    text = R.to_text(rep)
    cpu = time.process_time() - t0
    assert cpu < 6.0, cpu
    assert rep.cfg.world_size == 100_000 and rep.estimate.max_peak_pp_rank == 1
    doc = "".join(chunks)
    assert doc.count('\n   "rank": ') == 100_000
    assert f'"max_peak_rank": {R.worst_rank(rep)},' in doc and R.worst_rank(rep) == 50_000
    assert "(50000 GPUs)" in text


def test_ten_million_microbatches():
    t0 = time.process_time()
    rep = cli.build_report(shlex.split(
        "--preset llama2_7b --nproc_per_node 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
        "--num-layers-per-virtual-pipeline-stage 2 --micro-batch-size 1 --global-batch-size 10000000 --bf16"))
    assert time.process_time() - t0 < 2.0
    assert rep.cfg.num_microbatches == 10 ** 7 and rep.estimate.max_peak_bytes > 0
