#!/usr/bin/env bash
# The step-time comparison of compare.py on one GPU (not part of CI), the one-line
# drop-in (zeroshard-jit) included. With one device
# the variants differ only in zeroshard's own work (slicing, the non-finite check), so
# this measures the library's overhead over plain optax. It uses the python3 of the
# GPU machine, which must already have jax with CUDA, optax and matplotlib (nothing is
# downloaded); zeroshard itself is taken from this checkout.
#   bash benchmarks/gpu_check.sh            # results under benchmarks/results/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-benchmarks/results}/gpu"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONPATH=. JAX_PLATFORMS=cuda "$py" -c "import jax; print(jax.__version__, jax.devices())"
PYTHONPATH=. JAX_PLATFORMS=cuda "$py" benchmarks/compare.py --devices 1 \
    --widths 2048 8192 --layers 8 --batch 512 --steps 50 --warmup 5 --out "$out"
# The quantized collectives' encode + decode on the GPU (one device sends nothing, so
# the quantized step itself equals the exact one there): their cost per buffer.
PYTHONPATH=. JAX_PLATFORMS=cuda "$py" benchmarks/codec.py --sizes 16000000 128000000 --out "$out"
