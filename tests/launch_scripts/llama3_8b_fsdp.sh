#!/bin/bash
# Llama-3 8B with Megatron FSDP (parameters, gradients and optimizer states sharded) on 2 nodes x 8 GPUs:
# `python3 -u -m torch.distributed.run`, a quoted script path, extra flags forwarded with "$@".
# Written for tests/test_sed_workflow.py in the shape of Megatron-LM's example scripts.

MEGATRON_LM=${MEGATRON_LM:-$HOME/Megatron-LM}
: "${NNODES:=2}"

DISTRIBUTED_ARGS="--nproc_per_node=8 --nnodes=$NNODES --node_rank=${NODE_RANK:-0} --master_addr=${MASTER_ADDR:-localhost} --master_port=${MASTER_PORT:-6000}"

MODEL_ARGS="--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 \
    --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 \
    --tokenizer-type NullTokenizer --vocab-size 128256 --mock-data"

python3 -u -m torch.distributed.run $DISTRIBUTED_ARGS \
    "$MEGATRON_LM/pretrain_gpt.py" \
    $MODEL_ARGS \
    --micro-batch-size 1 \
    --global-batch-size 64 \
    --train-iters 100 \
    --lr 1e-4 \
    --bf16 \
    --use-megatron-fsdp \
    --data-parallel-sharding-strategy optim_grads_params \
    --no-gradient-accumulation-fusion \
    --use-distributed-optimizer \
    --ckpt-format fsdp_dtensor \
    "$@"
