#!/usr/bin/env bash
# GPU check (issue 4): the CUDA tests, the CUDA kernels against dequantizing (benches/cuda_kernels.py), then pinned
# H2D bandwidth vs cudaMemcpyAsync peak and the overlap ratio while streaming a 70B-shaped synthetic model under a
# small device budget. Run from the repository root on a machine
# with a CUDA GPU, with ntio installed (e.g. the abi3 wheel: pip install --no-deps dist/ntio-*.whl).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
python -m pytest -q tests/test_gpu.py tests/test_cuda_kernels.py tests/test_bitnet.py tests/test_quant.py \
    tests/test_reader.py -k "cuda or gpu or pinned"
python benches/cuda_kernels.py --model "$(python -c 'from ntio.fetch import fetch_default_model as f; print(f())')"
python benches/gpu_check.py "$@"
