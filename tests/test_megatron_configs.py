"""benchmarks/megatron_configs.py reads a Megatron-LM functional test's model_config.yaml into the estimator's
command line: a config written here in that file's shape, estimated end to end from a checkout-shaped folder."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = """ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
MODEL_ARGS:
  # Add network size args
  --num-layers: 4
  --hidden-size: 256
  --num-attention-heads: 8
  --seq-length: 512
  --max-position-embeddings: 512
  --micro-batch-size: 2
  --global-batch-size: 32
  --tensor-model-parallel-size: 2
  --pipeline-model-parallel-size: 2
  --expert-model-parallel-size: 2
  --expert-tensor-parallel-size: 1
  --num-experts: 8
  --moe-router-topk: 2
  --sequence-parallel: true
  --bf16: true
  --use-distributed-optimizer: true
  --num-distributed-optimizer-instances: 2
  --no-gradient-accumulation-fusion: false
  --data-path: ${DATA_PATH}/text/my-gpt3_00_text_document
  --save: ${CHECKPOINT_SAVE_PATH}
  --lr: 0.00015 # a comment
TEST_TYPE: regular
"""


def _run(root, *extra):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "megatron_configs.py"), str(root),
                           *extra], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_config_is_read_and_estimated(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import megatron_configs as MC
    args = MC.model_args(CONFIG)
    assert args["--num-layers"] == "4" and args["--lr"] == "0.00015" and "ENV_VARS" not in str(args)
    argv = MC.argv_of(args)
    assert "--data-path" not in argv and "--save" not in argv                  # paths from the environment
    assert "--no-gradient-accumulation-fusion" not in argv and "--bf16" in argv  # false dropped, true a flag
    assert argv[-2:] == ["--vocab-size", "50257"]
    assert MC.world_of(args) == 8                 # lcm(8, TP 2 x PP 2, expert TP 1 x EP 2 x PP 2)
    case = tmp_path / MC.CASES / "moe" / "tiny_case"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(CONFIG)
    (tmp_path / MC.CASES / "moe" / "inference_case").mkdir()
    (tmp_path / MC.CASES / "moe" / "inference_case" / "model_config.yaml").write_text(
        "MODEL_ARGS:\n  --temperature: 1.0\n")
    res = _run(tmp_path, "--kinds", "moe", "--list")
    assert res.returncode == 0, res.stderr
    assert "1 of 1 training configs estimated (100%; 1 inference configs left out)" in res.stdout
    assert "moe/tiny_case" in res.stdout and "estimated" in res.stdout


def test_a_folder_without_configs_is_one_line_and_exit_2(tmp_path):
    res = _run(tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "model_config.yaml" in res.stderr
