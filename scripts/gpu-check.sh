#!/usr/bin/env bash
# GPU check of ember-backend-ext's kernels on an NVIDIA GPU, time-boxed to a few minutes.
#
#   scripts/gpu-check.sh build   # here (no GPU needed): builds the CUDA binaries into gpu-check/
#   scripts/gpu-check.sh run     # on the GPU machine: kernel tests on CUDA (f32), the kernel
#                                # benchmark (f32, then bf16), one table per part; logs in $OUT
#                                # (or gpu-check/out)
#
# The GPU machine needs the NVIDIA driver only: cubecl-cuda and cudarc load libcuda/nvrtc at
# run time. Test binary: backend-ext/tests/kernels.rs (its `cuda::` module); benchmark:
# `xtask bench kernels`.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=gpu-check

case "${1:-}" in
build)
    mkdir -p "$dir"
    cargo test -p ember-backend-ext --features cuda --test kernels --no-run --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*kernels-[^"]*"' | head -1 | cut -d'"' -f4 > "$dir/.kernels-path"
    cp "$(cat "$dir/.kernels-path")" "$dir/kernels"
    cargo build -p xtask --features cuda --bin xtask
    cp target/debug/xtask "$dir/xtask"
    strip "$dir/kernels" "$dir/xtask"
    ls -la "$dir"
    ;;
run)
    out="${OUT:-$dir/out}"
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt" || true
    echo "== kernel tests on CUDA (f32): forward and backward vs the reference composition"
    status=0
    timeout 240 "$dir/kernels" cuda:: --test-threads 1 2>&1 | tee "$out/kernels.log" || status=$?
    echo "== kernel benchmark, f32"
    timeout 150 "$dir/xtask" bench kernels --device cuda --dtype f32 --iters 20 2>&1 | tee "$out/bench-f32.md" || status=$?
    echo "== kernel benchmark, bf16"
    timeout 120 "$dir/xtask" bench kernels --device cuda --dtype bf16 --iters 20 2>&1 | tee "$out/bench-bf16.md" || status=$?
    echo "== summary"
    grep -E "^test |test result" "$out/kernels.log" || true
    exit $status
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
