#!/usr/bin/env python3
"""`get-training-info` from a checkout, without installing: `python get_training_info.py <torchrun line>`.

The installed command is estimator.cli:console_main; README section 1 has the launch-script workflow.
"""
import gc

if __name__ == "__main__":
    # A one-shot run: cyclic garbage collection passes and the interpreter's teardown of every module and object
    # are pure overhead here (about a fifth of the wall time on a 2-core machine, benchmarks/estimator_speed.py).
    gc.disable()
    from estimator.cli import console_main

    console_main()
