#!/usr/bin/env python3
"""Drop-in for `pretrain_gpt.py` in a Megatron-LM launch script: prints memory and communication estimates.

    sed 's%torchrun $DISTRIBUTED_ARGS pretrain_gpt.py%python get_training_info.py $DISTRIBUTED_ARGS%' run.sh > est.sh
"""
import sys

from estimator.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
