#!/bin/bash
# A gpt-oss-like MoE (24 layers, hidden 2880, 64 heads in 8 KV groups, 32 experts top-4, QKV bias, 201k vocab) on
# 2 nodes x 8 GPUs (PP 2, EP 8): `env` assignments before torchrun, quoted arrays, a quoted script path with a
# directory variable. Written for tests/test_sed_workflow.py.

MEGATRON_PATH=${MEGATRON_PATH:-/opt/Megatron-LM}
OUT_DIR=${OUT_DIR:-"/results/gpt oss like"}

DISTRIBUTED_ARGS=(
    --nproc-per-node 8
    --nnodes 2
    --node-rank "${NODE_RANK:-0}"
    --rdzv-backend c10d
    --rdzv-endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}"
    --rdzv-id gptoss
)

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2880
    --ffn-hidden-size 2880
    --num-attention-heads 64
    --kv-channels 64
    --group-query-attention
    --num-query-groups 8
    --seq-length 4096
    --max-position-embeddings 131072
    --position-embedding-type rope
    --rotary-base 150000
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --add-qkv-bias
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 32
    --moe-router-topk 4
    --moe-ffn-hidden-size 2880
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)

TRAIN_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
    --train-iters 1000
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --bf16
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --expert-model-parallel-size 8
    --use-distributed-optimizer
    --recompute-granularity selective
    --tokenizer-type NullTokenizer
    --vocab-size 201088
    --mock-data
    --save "$OUT_DIR/checkpoints"
    --tensorboard-dir "$OUT_DIR/tensorboard"
)

env CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 torchrun "${DISTRIBUTED_ARGS[@]}" \
    "${MEGATRON_PATH}/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${TRAIN_ARGS[@]}"
