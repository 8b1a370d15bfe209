#!/usr/bin/env bash
# The fused output layer's GPU measurements, as one script for a lent device machine: the loss
# fused with the head against torch's linear + cross entropy, eager and with the compiled
# per-block kernels (loss.kernels), in bfloat16 and float32, at 2 x 8192 and 4 x 512 rows.
# Needs the zoo tokenizers under $CROSSKD_CACHE_DIR (nothing is downloaded) and crosskd on
# PYTHONPATH, e.g.
#   CROSSKD_CACHE_DIR=$PWD/.zoo PYTHONPATH=$PWD/lib bash benchmarks/gpu.sh
# About 5 minutes on an H200, most of it the float32 baseline and the compiling.
set -euo pipefail
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python loss.py --fused --device cuda --bf16 --repeat 5 --rows 2 --length 8192
python loss.py --fused --device cuda --bf16 --repeat 5 --rows 4 --length 512
python loss.py --fused --device cuda --repeat 3 --rows 2 --length 8192 --students llama3 qwen3
