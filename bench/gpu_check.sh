#!/usr/bin/env bash
# The GPU checks, in parts, each with its own time limit, so that a slow part leaves the others
# their time and a part stopped at its limit still leaves the rows it printed. Every log is
# written to $OUT (or /tmp/gpu_check). A session's device lease is 15 minutes with the
# machine's start (1-2 minutes), and one command may run 10 minutes: choose the parts that fit
# (`diagnose tests` is about 460 s at most, `shapes` 200 s).
#
#   bash bench/gpu_check.sh                    # tests paired shapes (limits: 150 + 300 + 200 s)
#   bash bench/gpu_check.sh diagnose tests     # the parts named, in that order
#
# Parts (measured on one H200, torch 2.11, 2026-12-04; see bench/README.md "On a GPU"):
#   tests     tests/test_gpu.py: the numerical contract's premises on the device's kernels, the
#             book-keeping operator without host synchronisation, the hostile removal ratios,
#             the device step against the CPU step (18 passed in 76 s on 2026-12-04; since then a
#             whole noisy DP-SGD step and the batched attention backward, 6 cases, were added)
#   diagnose  the GPT-2 DP step that failed to launch a kernel ("CUDA driver error: invalid
#             argument"), with its traceback, under Inductor's defaults and with each suspect
#             switched off (static launcher, mix-order reductions, 3D tiling), and at a
#             vocabulary that keeps batch x vocabulary under 65536 (about 5 minutes)
#   paired    bench_paired.py for mlp and encoder with Poisson sizes (each compiles about ten
#             graphs: more than 60 s per model there)
#   shapes    bench_shapes.py on the realistic shapes
#   sdpa      bench_sdpa.py: attention nodes, compile and step time against P
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
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee -a "$out/versions.txt"

gpt2_dp() {  # one GPT-2 DP row with its traceback: gpt2_dp LIMIT LABEL [ENV=VALUE ...] -- [bench_shapes options]
    local limit=$1 label=$2; shift 2
    local envs=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    echo "### diagnose: $label" | tee -a "$out/diagnose.txt"
    env "${envs[@]}" timeout "$limit" python3 bench/bench_shapes.py --models gpt2_t256_b8 --rows dp_default \
        --rounds 3 --warmup 1 --device cuda --verbose "$@" 2>&1 | grep -v -E '^W[0-9]{4} |warnings.warn' | tee -a "$out/diagnose.txt"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests paired shapes)
for part in "${parts[@]}"; do
    case $part in
    tests)
        timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/test_gpu.txt" ;;
    diagnose)
        gpt2_dp 70 "Inductor defaults" --
        gpt2_dp 60 "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 (Triton's own launcher)" TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 --
        gpt2_dp 60 "TORCHINDUCTOR_MIX_ORDER_REDUCTION=0" TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 --
        gpt2_dp 60 "triton.max_tiles=2 (no 3D tiling: Grid3D has no y/z overflow guard)" -- --inductor triton.max_tiles=2
        gpt2_dp 60 "vocabulary 4096 (B x V = 32768)" -- --vocab 4096 ;;
    paired)
        for m in mlp encoder; do
            timeout 150 python3 bench/bench_paired.py --models $m --rounds 20 --poisson 3 --device cuda 2>&1 | tee -a "$out/paired.txt"
        done ;;
    shapes)
        timeout 200 python3 bench/bench_shapes.py --models gpt2_t256_b8,vit_b16,llama_t512,gpt2_lora,gpt2_t512_b8 \
            --rows np_grad,np_backward,dp_default --rounds 10 --device cuda 2>&1 | tee "$out/shapes.txt" ;;
    sdpa)
        timeout 120 python3 bench/bench_sdpa.py --sizes 8,32 --rounds 10 --device cuda 2>&1 | tee "$out/sdpa.txt" ;;
    *)
        echo "unknown part: $part (tests, diagnose, paired, shapes, sdpa)"; exit 2 ;;
    esac
done
echo "=== summary (the full logs are in $out)"
grep -h -E '^\||^#|^###|passed|failed|Error' "$out"/*.txt 2>/dev/null | grep -v -E '^\|---' | cut -c1-400
