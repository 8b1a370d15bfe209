#!/usr/bin/env bash
# crosskd's GPU measurements as one run for a lent device machine (about 8 minutes on an H100 or
# H200; each part has its own time limit, and a part that fails or runs out is reported and the
# next one runs). It prints the card's name and the torch and CUDA versions, then:
#   1. the fused loss (benchmarks/loss.py --fused, one process): eager and compiled per-block
#      kernels, bf16 and fp32, 2 x 8192 and 4 x 512 rows, students of V = 49k / 128k / 152k,
#      against torch's linear + cross entropy (time and peak memory), each row printed as it is
#      measured and each goal as soon as every student has it; the unfused loss and tau 2 in
#      bf16 only; a compiled row that fails is reported and the compiled kernels skipped;
#   2. the training step (benchmarks/train_step.py --gpu, one rank): a Llama-3.2-1B-shaped
#      random-init student under bf16 autocast (one rank is not sharded: crosskd applies FSDP2
#      from dp_shard 2), SDPA attention, one packed row of 8192 tokens, top-32 cache teacher:
#      tokens/s, MFU, peak memory, the head + loss share, and the same step with CE only;
#   3. teacher scoring (benchmarks/teacher.py) against a plain forward of the same teacher, a
#      random-init Llama of Qwen3-0.6B's width and depth (about 0.5B parameters, Qwen3's
#      vocabulary) in bf16, with the CPU's encoding timed alone;
#   4. `crosskd serve` on the GPU under benchmarks/serve_load.py (loopback; the same teacher):
#      tokens/s, p50/p99 latency, the queue bound under overload.
# Parts 2-4 run in processes of their own: the training step initialises torch.distributed and
# the server is a process by design.
#
# Nothing is downloaded. Before a device run, build the zoo tokenizers here into .zoo (git
# ignores it; about 40 MB) and carry it:
#   CROSSKD_CACHE_DIR=$PWD/.zoo .venv/bin/python -c "from crosskd.tokenization import \
#     load_tokenizer as t; [t(f'zoo:{n}') for n in ('llama3', 'qwen3', 'smollm2')]"
#   rm -rf .zoo/tokenizers   # derived entries; the device's transformers derives its own
# then, with carry [".zoo"]:
#   CROSSKD_CACHE_DIR=$PWD/.zoo PYTHONPATH=$PWD/lib bash benchmarks/gpu.sh
# `bash benchmarks/gpu.sh --smoke` runs every part on the CPU at toy sizes (a few minutes on
# 2 cores): a check of the script and its options, not a measurement.
set -uo pipefail
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python=${PYTHON:-python}
work=$(mktemp -d -t crosskd-gpu-XXXXXX)
trap 'rm -rf "$work"' EXIT

if [ "${1:-}" = --smoke ]; then
  device=cpu dtype=float32
  loss=(--device cpu --repeat 1 --shapes 1x64 2x32 --dtypes bf16 fp32 --kernels eager
        --students smollm2 --fp32-steps fused)
  step=(--hidden-size 64 --layers 2 --heads 4 --kv-heads 2 --intermediate-size 128
        --length 128 --rows 1 --warmup 1 --repeats 2)
  shape='{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128}'
  scoring=(--repeat 1 --bytes 6000 --length 128 --budget 512)
  serving=(--requests 8 --clients 2 --overload-clients 8 --overload-requests 16 --length 64
           --max-batch-tokens 512 --max-queue-tokens 256)
else
  device=cuda dtype=bfloat16
  loss=(--device cuda --repeat 5 --shapes 2x8192 4x512 --dtypes bf16 fp32
        --kernels eager compiled --fp32-steps fused)
  step=(--length 8192 --rows 1 --warmup 2 --repeats 5 --attention sdpa)
  shape='{"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
          "num_key_value_heads": 8, "intermediate_size": 3072}'
  scoring=(--repeat 3 --bytes 400000 --length 2048 --budget 16384)
  serving=(--requests 32 --clients 8 --sequences 4 --length 256 --max-batch-tokens 16384
           --max-queue-tokens 16384 --overload-clients 64 --overload-requests 256)
fi

# part NAME SECONDS COMMAND...: run it under its limit; report a failure and go on.
part() {
  local name=$1 seconds=$2 started=$SECONDS code=0
  shift 2
  echo "== $name (limit ${seconds} s)"
  timeout --kill-after=10 "$seconds" "$@" || code=$?
  echo "== $name: exit $code after $(( SECONDS - started )) s"
  [ "$code" -eq 0 ] || failed+=("$name (exit $code)")
}
failed=()

"$python" -c "
import torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU (the CPU)'
print(f'device: {name}; torch {torch.__version__}, CUDA {torch.version.cuda}')
"
part "fused loss" 240 "$python" loss.py --fused "${loss[@]}"
part "training step" 120 "$python" train_step.py --gpu "${step[@]}" --workdir "$work/step"
part "teacher scoring" 60 "$python" teacher.py --device "$device" --dtype "$dtype" \
  --init zoo:qwen3 --init-shape "$shape" --init-dir "$work/teacher" "${scoring[@]}"
part "serving" 60 "$python" serve_load.py --device "$device" --dtype "$dtype" \
  --init zoo:qwen3 --init-shape "$shape" --init-dir "$work/teacher" "${serving[@]}"

if [ "${#failed[@]}" -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "all parts done"
