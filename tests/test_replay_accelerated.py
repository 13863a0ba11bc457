"""The caching-allocator replay in C (csrc/replay.c, estimator._replay) equals the Python model it accelerates
(estimator.caching_allocator.CachingAllocator, itself checked against torch's rules and 12 H100 request streams),
on random streams built to cross every rule's boundary and on the estimator's own predicted streams."""
import random
import shlex

import pytest

from estimator import alloc_stream as AS
from estimator import caching_allocator as CA
from estimator.cli import build_report

MiB = 1 << 20


def test_the_extension_is_built():
    # setup.py builds it (optional=True only so that an install without a compiler still works)
    assert CA._accelerated is not None


def _random_stream(rng, n):
    sizes = [1, 511, 512, 513, 4096, 65536, MiB - 1, MiB, MiB + 1, 2 * MiB, 3 * MiB + 7, 10 * MiB - 1, 10 * MiB,
             10 * MiB + 1, 20 * MiB, 33 * MiB + 512, 100 * MiB]
    events, live, next_id = [], [], 1
    for _ in range(n):
        r = rng.random()
        if r < 0.55 or not live:
            size = rng.choice(sizes) if rng.random() < 0.5 else rng.randint(1, 64 * MiB)
            events.append(("a", next_id, size))
            live.append(next_id)
            next_id += 1
        elif r < 0.97:
            events.append(("f", live.pop(rng.randrange(len(live)))))
        else:   # a free of a tensor the stream never allocated (a trace that starts mid-run): ignored
            events.append(("f", 10 ** 9 + rng.randrange(100)))
    return events


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_replay_equal(seed):
    rng = random.Random(seed)
    events = _random_stream(rng, rng.choice([50, 500, 5000]))
    assert CA.replay(events) == CA.replay(events, accelerated=False)


def test_large_ids_and_a_reused_id_replay_equal():
    events = [("a", 2 ** 62, 5 * MiB), ("a", 7, 100), ("a", 7, 3 * MiB), ("f", 7), ("f", 2 ** 62), ("a", -5, 512)]
    assert CA.replay(events) == CA.replay(events, accelerated=False)


def test_other_settings_and_odd_events_take_the_python_model():
    events = [("a", 1, 3 * MiB), ("a", 2, 2.5), ("f", 1)]          # a float size: the class takes it
    assert CA.replay(events) == CA.replay(events, accelerated=False)
    conf = CA.parse_alloc_conf("expandable_segments:True")
    assert CA.replay(_random_stream(random.Random(1), 300), conf) == \
        CA.replay(_random_stream(random.Random(1), 300), conf, accelerated=False)


@pytest.mark.parametrize("argv", [
    "--preset llama2_7b --nproc_per_node 8 --nnodes 2 --tensor-model-parallel-size 2 "
    "--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64 --bf16 --use-distributed-optimizer",
    "--preset mixtral_8x7b --nproc_per_node 8 --nnodes 4 --tensor-model-parallel-size 2 "
    "--pipeline-model-parallel-size 2 --expert-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 64 "
    "--bf16 --sequence-parallel --recompute-granularity selective",
])
def test_predicted_streams_replay_equal(argv):
    rep = build_report(shlex.split(argv), reserved=False)
    for rank in rep.estimate.ranks:
        events = AS.stage_stream_events(rep.cfg, rep.formula_set, rep.estimate, rank.pp_rank)
        assert len(events) > 10_000
        assert CA.replay(events) == CA.replay(events, accelerated=False)
