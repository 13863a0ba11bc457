#!/usr/bin/env python3
"""Drop-in for `pretrain_gpt.py` in a Megatron-LM launch script: prints memory and communication estimates.

    sed 's%torchrun $DISTRIBUTED_ARGS pretrain_gpt.py%python get_training_info.py $DISTRIBUTED_ARGS%' run.sh > est.sh
"""
import gc
import os
import sys


def main() -> None:
    """The script, and the `get-training-info` console entry point."""
    # A one-shot run: cyclic garbage collection passes and the interpreter's teardown of every module and object
    # are pure overhead here (about a fifth of the wall time on a 2-core machine, benchmarks/estimator_speed.py).
    gc.disable()
    from estimator.cli import main as run

    rc = run(sys.argv[1:])
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader went away (e.g. `| head`): nothing left to report
        pass
    os._exit(rc)


if __name__ == "__main__":
    main()
