#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine (the device machine some sessions are lent):
# the Triton kernels' tests natively, their speed against the PyTorch reference, the engine's
# greedy parity with transformers and its seeded sampling, offline throughput against
# transformers, and the KV transfer of GPU memory over tcp and torch (NCCL).
#
#   bash benchmarks/gpu_first_figures.sh OUT_DIR [MODEL_DIR]
#
# MODEL_DIR: a Hugging Face directory whose config and tokenizer are used with random weights
# (the default model's 98 MB GGUF may not travel to that machine); default: the default model's
# converted directory. Each step has its own time limit and log (OUT_DIR/STEP.log); a failing
# step does not stop the next; STEPS="parity kernels_bench" runs only those (parity_long needs
# parity's random model). Needs torch with CUDA, triton and transformers (no install here).
set -u
out=${1:?usage: gpu_first_figures.sh OUT_DIR [MODEL_DIR]}
model=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
py=${PYTHON:-python3}
random_model=${TMPDIR:-/tmp}/pdserve-random-model

step() {  # step NAME SECONDS COMMAND...: run with a limit, keep the log, show its end
    local name=$1 limit=$2
    shift 2
    case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "rc=$rc after $((SECONDS - start))s" >>"$out/$name.log"
    grep -v -E '^\s*$|it/s\]|s/it\]' "$out/$name.log" | tail -n 30
}

step env 30 sh -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $py -c 'import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__,
  torch.version.cuda, triton.__version__, transformers.__version__)'; nproc; grep -m1 'model name' /proc/cpuinfo"
step triton_tests 150 "$py" -m pytest -q -p no:cacheprovider --durations=5 tests/kernels/test_triton_ops.py
step parity 150 "$py" benchmarks/device_parity.py --device cuda --random-weights "$random_model" \
    ${model:+--model "$model"}
step parity_long 150 "$py" benchmarks/device_parity.py --device cuda --model "$random_model" \
    --repeat-prompts 24
step throughput 150 "$py" benchmarks/throughput.py --device cuda --dtype bfloat16 \
    --model "$random_model" --batch-sizes 1,64 --min-out 128 --max-out 128 --repeats 3 \
    --out-dir "$out"
step kernels_bench 45 "$py" benchmarks/kernels_bench.py --dtype bfloat16
step kv_transfer 60 "$py" benchmarks/kv_transfer.py --device cuda --transports tcp torch \
    --tokens 256 4096 --repeats 5 --warmup 1 --ttft-max-tokens 0
