"""estimator.torchrun splits a command line as torchrun itself does (its flag table against torch's own parser)."""
import pytest

from estimator import torchrun as TR


def _torch_parser():
    run = pytest.importorskip("torch.distributed.run")
    return run.get_args_parser()


def test_flag_table_is_torchruns():
    parser = _torch_parser()
    with_value, switches = set(), set()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        (switches if action.nargs == 0 else with_value).update(action.option_strings)
    assert with_value == TR.VALUE_FLAGS
    assert switches == TR.SWITCH_FLAGS


@pytest.mark.parametrize("line", [
    "--nproc_per_node 8 --nnodes 2 pretrain_gpt.py --num-layers 4 --bf16",
    "--nproc-per-node=8 --standalone --rdzv-backend c10d --rdzv_endpoint host:29500 /a/b/pretrain_gpt.py --x 1",
    "--nnodes 1:4 --max-restarts 3 -r 3 -t 3 --tee 1 --node_rank 0 train.py",
    "--master_addr localhost --master_port 6000 --nproc_per_node 2 --no-python ./run --flag",
])
def test_split_agrees_with_torchrun(line):
    argv = line.split()
    ours = TR.split(argv)
    theirs = _torch_parser().parse_args(argv)
    assert ours.script == theirs.training_script
    assert ours.script_args == theirs.training_script_args


def test_a_line_without_script_is_the_older_form():
    line = TR.split("--nproc_per_node 8 --nnodes 2 --rdzv-id x --num-layers 4 pretrain_gpt.py".split())
    assert line.script is None
    assert line.script_args == "--num-layers 4 pretrain_gpt.py".split()
    assert line.world_flags() == "--nproc_per_node 8 --nnodes 2".split()


def test_world_flags_keep_only_the_placement():
    line = TR.split("--rdzv-endpoint=h:1 --nproc_per_node=4 --standalone --node-rank 1 -m pkg.mod --a".split())
    assert line.script == "pkg.mod" and line.script_args == ["--a"]
    assert line.world_flags() == ["--nproc_per_node=4", "--node-rank", "1"]
    assert line.has_switch("-m")
