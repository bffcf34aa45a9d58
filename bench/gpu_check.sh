#!/usr/bin/env bash
# On a CUDA machine: the GPU tests, the kernel benchmarks (the noise + diffusion loss ops, the mixed loss
# op) and the throughput tables (timestep machinery; small batch on one GPU: eager, compiled, compiled +
# CUDA graph), the step against diffusers' train_unconditional.py and train_text_to_image.py loops;
# numbers land in bench/results/gpu-* (and mixed-loss-cuda.*, peer-text-to-image-cuda.*).
# Budget: about 15 minutes on one H100/H200 (native build ~1 min, tests ~2-3 min, kernels ~2 min, mixed
# loss < 1 min, throughput ~4 min, the two diffusers peer loops ~2 and ~3 min, neither run on a GPU yet;
# each part has its own timeout so a slow one cannot starve the rest).
# The install builds fasttrain._C with its CUDA ops where nvcc is present (FASTTRAIN_CUDA_ARCHS, default
# sm_80 + sm_90); the native CUDA tests and the benchmark's native column skip or drop out without it.
# Uses a python3 that already has a CUDA torch (the lent GPU machines have one and no network),
# installing fasttrain into it without dependencies; otherwise builds .venv from constraints.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt torch 'setuptools>=64' wheel \
      && .venv/bin/pip install -q --no-build-isolation -c constraints.txt -e '.[dev]' || exit 1
  fi
  PY=.venv/bin/python
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
else
  $PY -m pip install -q --no-deps --no-index --no-build-isolation -e . || exit 1
fi
mkdir -p bench/results
$PY -c "from fasttrain.kernels import native; print('fasttrain._C:', 'CUDA ops built' if native.available('cuda') else native.why_not('cuda'))" \
  2>&1 | tee bench/results/native-cuda.txt
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.inductor-cache}"
rc=0
# tests/kernels/test_aot.py compiles for sm_80/sm_90 without a GPU (CI runs it); test_gpu.py checks the
# driver's spill count of what the ops compiled here.
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/kernels tests/diffusion tests/parallel/test_graphs.py \
  "tests/pretrained/test_lora.py::test_on_cuda_the_base_is_held_in_bf16_by_default_and_the_run_trains_and_samples" -m "not slow" \
  --ignore=tests/kernels/test_aot.py \
  2>&1 | tee bench/results/gpu-tests.txt || rc=1
timeout 150 $PY -m pytest -q -p no:cacheprovider bench/bench_diffusion_loss.py --benchmark-only \
  2>&1 | tee bench/results/gpu-kernels.txt || rc=1
timeout 60 $PY bench/bench_mixed_loss.py 2>&1 | tee bench/results/gpu-mixed-loss.txt || rc=1
timeout 240 $PY bench/throughput.py --small-batch --threads 8 --steps 60 --round 20 --warmup 8 \
  2>&1 | tee bench/results/gpu-throughput.txt || rc=1
# fasttrain's step against diffusers' example loop (bench/peer_diffusers.py; CPU table: peer-diffusers-cpu.md)
timeout 240 $PY bench/peer_diffusers.py --threads 8 --steps 50 --rounds 3 \
  2>&1 | tee bench/results/gpu-peer-diffusers.txt || rc=1
timeout 240 $PY bench/peer_text_to_image.py --device cuda --threads 8 --rounds 5 --steps 20 \
  2>&1 | tee bench/results/gpu-peer-text-to-image.txt || rc=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> bench/results/gpu-tests.txt 2>&1
exit $rc
