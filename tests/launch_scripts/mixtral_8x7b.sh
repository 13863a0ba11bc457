#!/bin/bash
# Mixtral 8x7B on 8 nodes x 8 GPUs (PP 4 with 2 virtual stages, EP 8, DP 16): string flag lists and
# `python -m torch.distributed.run`. Written for tests/test_sed_workflow.py in the shape of Megatron-LM's
# example scripts. The Llama-2 tokenizer's vocabulary is not on the command line (see the test).

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

CHECKPOINT_PATH=${1:-/checkpoints/mixtral}
TOKENIZER_MODEL=${2:-/data/tokenizer.model}
DATA_PATH=${3:-/data/mixtral_text_document}

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

MODEL_ARGS="
    --disable-bias-linear \
    --seq-length 4096 \
    --max-position-embeddings 32768 \
    --num-layers 32 \
    --hidden-size 4096 \
    --ffn-hidden-size 14336 \
    --num-attention-heads 32 \
    --init-method-std 0.01 \
    --attention-dropout 0.0 \
    --hidden-dropout 0.0 \
    --normalization RMSNorm \
    --position-embedding-type rope \
    --swiglu \
    --untie-embeddings-and-output-weights \
    --group-query-attention \
    --num-query-groups 8 \
    --no-masked-softmax-fusion \
    --rotary-base 1000000"

MOE_ARGS="
    --num-experts 8 \
    --moe-router-topk 2 \
    --moe-router-load-balancing-type aux_loss \
    --moe-aux-loss-coeff 1e-2 \
    --moe-grouped-gemm \
    --moe-token-dispatcher-type alltoall"

DATA_ARGS="
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model ${TOKENIZER_MODEL} \
    --data-path $DATA_PATH \
    --split 99990,8,2"

TRAINING_ARGS="
    --micro-batch-size 1 \
    --global-batch-size 256 \
    --lr 1e-4 \
    --train-iters 500000 \
    --lr-decay-iters 320000 \
    --lr-decay-style cosine \
    --min-lr 1.0e-5 \
    --weight-decay 0.1 \
    --lr-warmup-iters 500 \
    --clip-grad 1.0 \
    --bf16"

MODEL_PARALLEL_ARGS="
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 4 \
    --num-layers-per-virtual-pipeline-stage 4 \
    --expert-model-parallel-size 8 \
    --use-distributed-optimizer \
    --sequence-parallel"

LOGGING_ARGS="
    --log-interval 1 \
    --save-interval 10000 \
    --eval-interval 1000 \
    --eval-iters 10 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH"

python -m torch.distributed.run $DISTRIBUTED_ARGS pretrain_gpt.py \
    $MODEL_ARGS \
    $MOE_ARGS \
    $DATA_ARGS \
    $TRAINING_ARGS \
    $MODEL_PARALLEL_ARGS \
    $LOGGING_ARGS
