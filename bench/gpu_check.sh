#!/usr/bin/env bash
# The GPU checks, in one run of under ten minutes on one GPU: the numerical contract's premises
# on the device's kernels and the hostile removal ratios (tests/test_gpu.py), then the paired
# bench and the realistic shapes with --device cuda. Each part has its own time limit, so a
# slow part leaves the others their time; every log is written to $OUT (or /tmp/gpu_check).
#
# The device image has torch, Triton and transformers but not optree or dp-accounting. Fetch
# their wheels once, here, into an ignored folder that travels with the working tree:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl optree dp-accounting
#
# then run `bash bench/gpu_check.sh` there with `.whl` carried. The package runs from the
# working tree (PYTHONPATH), not installed, so the image's torch is the one used: its version
# is printed first and belongs in any table made from these logs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$out/versions.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/test_gpu.txt"
timeout 170 python3 bench/bench_paired.py --models mlp,encoder --rounds 30 --poisson 6 --device cuda 2>&1 \
    | tee "$out/paired.txt"
timeout 190 python3 bench/bench_shapes.py --models gpt2_t256_b8,gpt2_t512_b8,llama_t512 \
    --rows np_grad,np_backward,dp_default --rounds 10 --device cuda 2>&1 | tee "$out/shapes.txt"
