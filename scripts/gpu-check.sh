#!/usr/bin/env bash
# GPU check on an NVIDIA GPU, in parts that each stay within a few minutes.
#
#   scripts/gpu-check.sh build          # here (no GPU needed): builds the CUDA binaries and packs
#                                       # them with the shared libraries they need (HDF5, OpenBLAS
#                                       # and theirs, not glibc's) into gpu-check/bins.tar.xz; carry
#                                       # that file (binaries and libraries ~180 MB unpacked,
#                                       # over the device machine's 64 MiB carry; 35 MB packed,
#                                       # 2026-12-08, 20 minutes on 2 cores)
#   scripts/gpu-check.sh run [PART...]  # on the GPU machine; PART: launch, headline, step, gemm,
#                                       # kernels, bench-kernels, resume, onebit, train-step,
#                                       # largest-batch, streaming, precision, embed, init-passes,
#                                       # vocab, unpad, or all
#                                       # (default: launch headline kernels train-step step gemm, as
#                                       # many as fit the deadline); logs in $OUT (or
#                                       # gpu-check/out), one table per part, then
#                                       # `xtask bench summary`: one table of the parts (how
#                                       # each ended), the kernel tests and the training
#                                       # steps against the issue's targets (summary.md)
#
# The run ends by a deadline, GPU_CHECK_DEADLINE_S seconds after it starts (default 540,
# inside the device machine's 600-second call): every command's timeout is cut to the time
# left, parts that cannot start in time are skipped (parts.tsv says so), and the summary is
# printed last. GPU_CHECK_DIR (default gpu-check) is where the binaries are.
#
# What each part runs and checks: scripts/gpu-check-parts.sh, a function per part.
#
# The GPU machine needs the NVIDIA driver, and NCCL for `step`: cubecl-cuda and cudarc load
# libcuda, nvrtc and libnccl at run time. ember finds NVRTC and NCCL by itself (Note [CUDA
# library names] in trainer/src/cuda/libs.rs) in the Python environments on PATH: the script
# puts the `bin/` of the Python that has torch first on PATH, as an activated virtualenv does.
# The packed HDF5/OpenBLAS libraries sit in gpu-check/lib, which the binaries' RPATH
# ($ORIGIN/lib) finds; nothing else sees them (python3 and nvidia-smi keep the system's).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${GPU_CHECK_DIR:-gpu-check}"

case "${1:-}" in
build)
    mkdir -p "$dir"
    # The kernel tests are a module of the integration test binary (one build of CubeCL's
    # generics for its tests); built with CUDA, it is carried as `kernels`.
    cargo test -p ember-tests --features cuda --test integration --no-run --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*integration-[^"]*"' | head -1 | cut -d'"' -f4 > "$dir/.kernels-path" || true
    if [ ! -s "$dir/.kernels-path" ]; then
        # The JSON run hides cargo's errors (a missing libhdf5-dev, a compile error): show them.
        echo "the CUDA kernel tests did not build:" >&2
        cargo test -p ember-tests --features cuda --test integration --no-run >&2 || true
        exit 1
    fi
    cp "$(cat "$dir/.kernels-path")" "$dir/kernels"
    cargo build -p xtask --features cuda --bin xtask
    cp target/debug/xtask "$dir/xtask"
    strip "$dir/kernels" "$dir/xtask"
    # Every shared library the binaries need but glibc's own (the machine has those), for
    # `lib/` beside them (their RPATH is $ORIGIN/lib; the kernel tests get LD_LIBRARY_PATH).
    rm -rf "$dir/lib" && mkdir -p "$dir/lib"
    ldd "$dir/xtask" "$dir/kernels" | awk '/=> \//{print $3}' | sort -u \
        | grep -vE '/(libc|libm|libgcc_s|libdl|libpthread|librt|libresolv|ld-linux[^/]*)\.so' \
        | xargs -r -I{} cp -L {} "$dir/lib/"
    tar -C "$dir" -cf - kernels xtask lib | xz -T2 -6 > "$dir/bins.tar.xz.tmp"
    mv "$dir/bins.tar.xz.tmp" "$dir/bins.tar.xz"
    ls -la "$dir" "$dir/lib"
    echo "carry gpu-check/bins.tar.xz ($(du -h "$dir/bins.tar.xz" | cut -f1)); on the GPU machine: scripts/gpu-check.sh run"
    ;;
run)
    shift
    all=(launch headline step gemm kernels bench-kernels resume onebit train-step largest-batch streaming precision embed init-passes vocab unpad)
    parts=("$@")
    # No part named: the issue's measurements in the order they matter (the launch path, the
    # headline step against PyTorch, the kernel tests, the other training steps against
    # PyTorch, the step's launches, the GEMMs), as many as the deadline lets run; `all`: every
    # part in order, far more than one call's 10 minutes. Every name is checked before the
    # first part spends a minute.
    [ ${#parts[@]} -gt 0 ] || parts=(launch headline kernels train-step step gemm)
    [ "${parts[*]}" != all ] || parts=("${all[@]}")
    for part in "${parts[@]}"; do
        known=0
        for name in "${all[@]}"; do
            [ "$part" != "$name" ] || known=1
        done
        if [ $known = 0 ]; then
            echo "unknown part $part (${all[*]}; or all, alone)" >&2
            exit 2
        fi
    done
    out="${OUT:-$dir/out}"
    mkdir -p "$out"
    # Note [One table per GPU check] (xtask/src/bench_summary.rs): the run ends by its
    # deadline, inside the device machine's 10-minute call. Each command's timeout is cut to
    # the time left, a part that cannot start in time is skipped, and the summary keeps the
    # last seconds: what the session sees last is one table of what ran and what it measured.
    deadline=$(( SECONDS + ${GPU_CHECK_DEADLINE_S:-540} ))
    reserve=10
    left() { echo $(( deadline - SECONDS - reserve )); }
    # What the parts' pipelines filter away (`2>&1 | grep ...`) must still reach the log.
    exec 3>&2
    # `bounded N command...`: `timeout N command...`, N cut to the time left (10 s at least);
    # nothing run (exit 124, as a timeout) when under 10 s are left. SIGTERM first, SIGKILL
    # 5 s later: `xtask train` answers SIGTERM by finishing its step and writing a checkpoint,
    # which for BERT-large would outlast the deadline. Only a command cut at the deadline (its
    # timeout the time left, run out) or not run returns 124 or 137, and leaves
    # $out/.timed-out (in a pipeline, a variable would stay in its subshell). One stopped by
    # its own timeout (it hung) or killed before it (SIGKILL from elsewhere: out of memory)
    # failed: exit 1, with a line saying so.
    bounded() {
        local want=$1 room rc=0 t0=$SECONDS clipped=0
        shift
        room=$(left)
        if [ "$room" -lt 10 ]; then
            echo "   not run, the deadline is near: ${*:2:2}" >&3
            : > "$out/.timed-out"
            return 124
        fi
        [ "$want" -le "$room" ] || { want=$room; clipped=1; }
        [ "$want" -ge 10 ] || want=10
        timeout -k 5 "$(( want - 5 ))" "$@" || rc=$?
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
            if [ "$clipped" = 1 ] && [ $(( SECONDS - t0 )) -ge $(( want - 6 )) ]; then
                : > "$out/.timed-out"
            else
                echo "   stopped after $(( SECONDS - t0 )) s of its $want (hung into its own timeout, or killed: out of memory?): ${*:2:2}" >&3
                rc=1
            fi
        fi
        return "$rc"
    }
    # A part's command failed: `cmd | filter || failed $?`. A command cut at the deadline
    # (124 or 137 from `bounded`, the pipeline's first) is the part's result (`.timed-out`),
    # not a failure, even where the filter after it then found nothing; and never the run's
    # exit status, which the device machine's tool would read as its own call timed out.
    failed() {
        case "${PIPESTATUS[0]}/$1" in
        124/* | 137/* | */124 | */137) ;;
        *) status=$1 part_failed=$1 ;;
        esac
    }
    # Whether a command of the current part was cut: what would read its output is skipped.
    cut_short() { [ -e "$out/.timed-out" ]; }
    # Parts cut or skipped: the run exits 3 if nothing failed.
    incomplete=0
    : > "$out/parts.tsv"
    if [ ! -x "$dir/xtask" ] || [ ! -x "$dir/kernels" ]; then
        [ -f "$dir/bins.tar.xz" ] || { echo "no $dir/bins.tar.xz: run '$0 build' first and carry it" >&2; exit 2; }
        xz -dc "$dir/bins.tar.xz" | tar -C "$dir" -xf -
    fi
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt" || true
    # The Python with torch (train-step's reference; its pip wheels hold NCCL and NVRTC), first
    # on PATH as an activated virtualenv would be: ember searches the environments on PATH.
    torch_python=""
    for py in /opt/torch/.venv/bin/python python3; do
        if "$py" -c "import torch" 2>/dev/null; then
            torch_python="$(command -v "$py")"
            export PATH="$(dirname "$torch_python"):$PATH"
            break
        fi
    done
    # A GEMM window whose release never comes (Note [Device-side GEMM windows]) shows within
    # seconds here, not after the default 2^28 polls (minutes of the call).
    export EMBER_GEMM_WINDOW_MAX_POLLS="${EMBER_GEMM_WINDOW_MAX_POLLS:-16777216}"
    # The parts, a function each.
    source scripts/gpu-check-parts.sh
    status=0
    for part in "${parts[@]}"; do
        start=$SECONDS
        part_failed=0
        rm -f "$out/.timed-out"
        if [ "$(left)" -lt 20 ]; then
            echo "== skipped, the deadline is near: $part"
            printf '%s\t0\tskipped: the deadline\n' "$part" >> "$out/parts.tsv"
            incomplete=1
            continue
        fi
        # Called as the left side of `||`, the part runs without `set -e`: a command that
        # fails unguarded ends neither the part nor the run, and the summary is still printed.
        "part_${part//-/_}" || failed $?
        result=""
        [ "$part_failed" = 0 ] || result="failed (exit $part_failed)"
        if [ -e "$out/.timed-out" ]; then
            result="${result:+$result; }cut at the deadline"
            incomplete=1
            rm -f "$out/.timed-out"
        fi
        [ -n "$result" ] || result=ok
        echo "== $(( SECONDS - start )) s: $part ($result)"
        printf '%s\t%s\t%s\n' "$part" "$(( SECONDS - start ))" "$result" >> "$out/parts.tsv"
    done
    echo
    timeout 30 "$dir/xtask" bench summary "$out" || status=$?
    # 0: every part ran and passed; 3: nothing failed, but parts were cut or skipped; else the
    # exit status of the last command that failed (never 124 or 137).
    [ "$status" != 0 ] || [ "$incomplete" = 0 ] || status=3
    case $status in 124 | 137) status=1 ;; esac
    exit "$status"
    ;;
*)
    echo "usage: $0 build | run [all | launch|headline|step|gemm|kernels|bench-kernels|resume|onebit|train-step|largest-batch|streaming|precision|embed|init-passes|vocab|unpad ...]" >&2
    exit 2
    ;;
esac
