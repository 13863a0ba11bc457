"""Flags of Megatron-LM releases newer than the one the estimator models (estimator/megatron_flags_newer.py, read
from each release's own parser by tools/gen_newer_megatron_flags.py): each is known with its release, listed as
ignored where it cannot change a training step's memory, refused naming its release otherwise; a flag no release
has stays Megatron's "no such flag"."""
import subprocess
import sys
from pathlib import Path

import pytest

from estimator import flag_policy as P
from estimator.args import ConfigError, parse_args
from estimator.megatron_flags import MEGATRON_LM
from estimator.megatron_flags_newer import NEWER, RELEASES

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--nproc_per_node", "8", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--vocab-size", "1000", "--bf16"]


def test_the_table_holds_only_flags_the_modelled_release_lacks():
    assert NEWER and not set(NEWER) & set(MEGATRON_LM)
    assert RELEASES == sorted(RELEASES[:-1]) + RELEASES[-1:]     # tags oldest first, then main's commit
    for flag, (dest, values, release) in NEWER.items():
        assert flag.startswith("--") and dest and release in RELEASES
        assert values in (0, 1, "?", "*", "+") or isinstance(values, int)
    # the flag a Muon test config of Megatron-LM's main trips on is known, from the release that added it
    assert P.newer_release("--no-use-layer-wise-param-layout") == NEWER["--no-use-layer-wise-param-layout"][2]
    assert P.newer_release("--bf16") is None


def test_a_harmless_newer_flag_is_ignored_with_its_values():
    cfg = parse_args(BASE + ["--fault-injector-seed", "3", "--use-mup", "--async-strategy", "nvrx"])
    assert cfg.ignored_args == ["--fault-injector-seed", "3", "--use-mup", "--async-strategy", "nvrx"]
    assert all(P.newer_ignored(f) for f in ("--fault-injector-seed", "--use-mup", "--async-strategy"))


@pytest.mark.parametrize("flag", ["--no-use-layer-wise-param-layout", "--enable-mhc-connections",
                                  "--moe-paged-stash", "--activation-offload-fraction"])
def test_any_other_newer_flag_is_refused_naming_its_release(flag):
    argv = BASE + [flag] + (["0.5"] if NEWER[flag][1] == 1 else [])
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    msg = str(err.value)
    assert msg.startswith(f"{flag} cannot be estimated") and NEWER[flag][2] in msg and P.BASE_RELEASE in msg


def test_the_cli_says_it_in_one_line_and_lists_ignored_releases():
    cmd = [sys.executable, str(ROOT / "get_training_info.py"), *BASE]
    res = subprocess.run(cmd + ["--moe-paged-stash"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert NEWER["--moe-paged-stash"][2] in res.stderr
    res = subprocess.run(cmd + ["--use-mup", "--detail", "2"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert f"--use-mup [{NEWER['--use-mup'][2]}]" in res.stdout
    res = subprocess.run(cmd + ["--use-mupp"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "Megatron-LM has no such flag (did you mean --use-mup" in res.stderr
