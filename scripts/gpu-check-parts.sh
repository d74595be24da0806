#!/usr/bin/env bash
# The parts of `scripts/gpu-check.sh run`, a function each (`part_NAME`, `-` as `_`), sourced
# by the runner, which sets what they use: $dir (the binaries), $out (the logs), $torch_python
# (the Python with torch, or empty), `bounded N command...` (a timeout cut to the run's
# deadline), `failed $?` (a command of the part failed; one cut is not) and `cut_short` (a
# command of the part was cut: what reads its output is skipped). What each part runs and
# checks:
#
#   launch         the launch path of a fresh machine: `ember gpu-libs` (where the driver, NVRTC
#                  and NCCL were found, by the names pip's wheels ship, with no links made by
#                  hand), a 2-step training run (its log names the GPU's UUID and bus id, and
#                  in bf16, CUDA's default, `reduced_after_backward`: only the embeddings'
#                  parameters should be left for after backward), and
#                  real torchrun with 2 ranks exchanging a blob through the agent's store
#                  (`comm-check --rendezvous`; no GPU needed) when the machine's Python has torch.
#   embed          `xtask bench embed --device cuda`: sentence embeddings of all-MiniLM-L6-v2's and
#                  BERT-base's shape, batch 32 and 1, against sentence-transformers on the same GPU
#                  when the machine's Python has it (else ember alone), the vectors compared.
#   step           `xtask bench step --check`: the device reducer against the host path on the
#                  tiny model (NCCL with a world of one, 3 steps, weights within 1e-5), then
#                  BERT-base and BERT-large training steps at sequence length 128: step time,
#                  backward time, host synchronisations and kernel launches per step (the
#                  GPU-speed issue's target: at most 1,500 launches per BERT-large step),
#                  device vs host buckets, and the 15 kernels launched most per step; then
#                  BERT-large again with `--qkv-projections separate` (three Q, K, V dense
#                  layers) to set beside the packed default's row (Note [Packed QKV]), and
#                  with `--clip bucket` (each of its ~55 buckets clipped by its own norm,
#                  two launches a bucket: Note [Clipped by its own norm]).
#   gemm           the GEMM kernels (`model.gemm`, Note [GPU GEMMs] in backend-ext/src/gemm.rs):
#                  `bench gemm` (every product of a BERT-large step at seq 128 and 512 alone,
#                  TFLOP/s of autotune, cmma and cuBLASLt in f32 and bf16 against torch.matmul on
#                  the GPU), then `bench step` on BERT-large (seq 128, batch 32, device buckets)
#                  with `cmma` (one tensor-core kernel family, what ran before), with `autotune`
#                  (cubek times its kernels per shape) twice, in separate processes sharing
#                  EMBER_KERNEL_CACHE, and with `cublaslt` (NVIDIA's GEMMs) twice: two host
#                  waits per window of products, then `--cublaslt-sync device` (flags in GPU
#                  memory, no host wait; Note [Device-side GEMM windows]): step time, launches,
#                  host syncs, and the time to the first step (the second autotune process
#                  reads compiled kernels and autotune results from the cache; target <= 10 s).
#                  `bench gemm` times cuBLASLt with both syncs too, and prints a second
#                  table: the dense layers' bias gradient in the weight gradient's epilogue
#                  (BGRADA) against the same products and a `sum_dim` (ratio > 1: it pays;
#                  "epilogue refused" if cuBLASLt took the kind without it), in bf16 also
#                  with `dW` and `db` written in f32 (what autocast trains with) against the
#                  bf16 products, the `sum_dim` and two casts.
#   kernels        the kernel tests on CUDA (tests/tests/integration/kernels/, module
#                  `kernels::cuda` of the integration test binary built with `--features cuda`):
#                  every fused op against the reference (bias + GELU in both forms, erf and
#                  tanh, each reference also against its f64 formula: Note [Two GELUs]), the
#                  dropout masks keyed by sample and position (kernels = host masks, with a
#                  sample offset) and the dropout op; the
#                  kernels with bf16 storage against the f32 reference (`half_precision.rs`);
#                  cuBLASLt's products (`model.gemm = "cublaslt"`) against the host in f32 and
#                  bf16, each of which must have run on cuBLASLt (`cublaslt.rs`; the dense
#                  backward's `db` from the BGRADA epilogue, no reduction launch; with bf16
#                  operands, autocast's `dW` and `db` written in f32, no cast launch), with host
#                  waits and with device-side windows (launches and host syncs counted); the
#                  window kernel alone (`gemm_window.rs`: released, expired); the masked
#                  softmax in each of its layouts (`softmax.rs`: a warp per row up to 512 keys,
#                  a cube per row in registers, the streaming form past 4,096 keys); the dense
#                  op and the fused bias + GELU and LayerNorm of f32 masters and bf16 copies
#                  (`dense.rs`, `layer_masters.rs`: the parameters' gradients written in f32,
#                  fewer launches than the copies' casts back); the buckets taken apart at
#                  CUDA's 512-byte alignment (`flatten.rs`: aligned parts as views, adjacent
#                  misaligned parts copied in one launch; Note [Unflattened by views]); the
#                  losses' cross-entropy against the host in f64 (`cross_entropy.rs`: the
#                  masked-LM width, 65,535 and 70,000 rows; a label out of range gives NaN);
#                  gradient clipping (`clip.rs`: bit for bit the composition, in place only
#                  where a bucket's memory is its own; a bucket clipped by its own norm in two
#                  launches, Note [Clipped by its own norm]); in bf16, LayerNorm's statistics
#                  kept in f32 (Note [LayerNorm statistics in f32]) and the flattening's scale
#                  multiplied as Burn's mul_scalar does (`half_precision.rs`); a bucket written
#                  in place after the communication thread last met the compute stream, read
#                  by that thread only after those writes (`streams.rs`, Note [A bucket's
#                  writes, awaited]: the race NCCL's device buckets had with accumulated
#                  micro-batches and bucket-wise clipping, which wgpu's one queue cannot show).
#   bench-kernels  `xtask bench kernels`, f32 then bf16 (with the masked-LM cross-entropy row: the
#                  fused loss against Burn's log_softmax + gather + mean, Note [Cross-entropy in
#                  one pass]), then the LayerNorm and softmax rows again
#                  in bf16 with `--row-reductions tree` (the shared-memory tree the row kernels
#                  used before; the default reduces within warps first: Note [Row reductions];
#                  the softmax then also takes a warp per row, Note [Softmax rows in
#                  registers], so the two softmax rows compare warp-per-row with cube-per-row).
#                  Then, where the bf16 table names ops slower fused than composed (its
#                  `slower fused:` line), a BERT-large step (seq 128, batch 32, cmma GEMMs)
#                  with those ops as `--reference-ops` against all fused (Note [Fused where it
#                  pays]; up to 4 more minutes).
#                  Then, where the machine's Python has torch, the attention core in bf16 against
#                  PyTorch's scaled_dot_product_attention (`--reference pytorch`; the issue's
#                  "attention at seq 512 no slower than PyTorch's SDPA in the same run").
#   resume         checkpoints on CUDA (fused optimizer, device tensors): the tiny model with
#                  dropout on, 12 steps straight against `--resume` from that run's step-6
#                  checkpoint copied to another folder; prints
#                  whether the losses and the final weights are the same bit for bit (they
#                  are on NdArray; on a GPU, atomics in reductions may make them differ).
#   onebit         1-bit Adam and 1-bit LAMB on CUDA, one rank, BERT-base at sequence length 128:
#                  median step time of the warm-up (exact optimizer, fused kernels) against the
#                  compression stage, which runs on the host (crate::onebit: gradients read to the
#                  host, momenta compressed there, parameters written back). One rank compresses
#                  nothing (the average of one), so this measures the host path's cost alone.
#   headline       the GPU-speed issue's headline alone, run before the kernel tests: `xtask bench
#                  train-step --device cuda`, BERT-large bf16 at sequence length 128, batch 32,
#                  against PyTorch eager (as train-step below; 300 s: its first process autotunes
#                  every GEMM shape of the step). Where it fails (not where it is cut), once
#                  more with `--gemm cmma`, the GEMM kernel the first GPU session ran, so that the
#                  call still measures a step (its results in `train-step-cmma/`, a row of its
#                  own in the summary); the part is failed either way.
#   train-step     `xtask bench train-step --device cuda`: the GPU-speed issue's targets, BERT-large
#                  at sequence length 128 (batch 32) and 512 (batch 16), bf16 then f32 (ember's
#                  autocast against torch.autocast; seq 128 bf16 first, unless `headline` ran it
#                  in this run, then 512 both, then 128 f32: a process each), ember's step against
#                  Hugging Face + fused torch.optim.AdamW (eager) on the same GPU when the
#                  machine's Python has torch (/opt/torch/.venv), else ember alone: samples/s,
#                  ratio, MFU against each precision's GEMM peak, ember's kernel launches per
#                  step (target <= 1,500), each side's reserved GPU memory; then ember alone
#                  with `--gemm cublaslt --cublaslt-sync device` at seq 128 batch 32 (the same
#                  columns, to set beside the first rows' default GEMMs), and last bf16 at seq
#                  128 against torch.compile (whose compilation takes minutes).

#   largest-batch  `xtask bench train-step --largest-batch`: the largest batch whose BERT-large
#                  training step (bf16, seq 512) fits in the GPU's memory, ember's (a process per
#                  try) against PyTorch's (one process catching torch.cuda.OutOfMemoryError), by
#                  doubling from 16 and bisecting in multiples of 8 (Note [Largest batch] in
#                  xtask/src/bench_largest_batch.rs): the issue's "largest batch that fits".
#                  GEMMs by `cmma`: the same tensors as autotune's, without tuning every new
#                  shape in every try.
#   streaming      shards streamed per rank on a GPU's step time: `prepare-data` (seq 512, 76
#                  predictions, uncompressed and gzip), then BERT-large batch 16 for 12 steps on
#                  each; prints the mean data wait per step against the step time (on the CPU it
#                  is 0% of a BERT-base step; the target is < 5%), the peak host memory, and
#                  checks the MLPerf log with mlperf-logging when the machine's Python has it.
#   precision      mixed precision (Note [Autocast]): BERT-large at sequence length 128 (batch 32)
#                  and 512 (batch 8), 20 steps each in f32, bf16 and fp16 (dynamic loss scaling)
#                  on the same batches: samples/s (mean step after the third), peak GPU memory
#                  (nvidia-smi, sampled every 100 ms), the largest relative difference of the 20
#                  losses from f32's, skipped steps. Targets: bf16 >= 3x f32's samples/s at 512,
#                  losses within 1% of f32's.
#   init-passes    `train.init_passes` (Note [Init passes] in trainer/src/train/init_passes.rs):
#                  BERT-large (seq 128, batch 32) in a process with an empty kernel cache and
#                  one init pass before the first step: the pass's seconds (kernel compilation,
#                  what Samsung's ten passes keep out of MLPerf's timed run), the time to the
#                  first step, and the first step's seconds against the mean of the later ones
#                  (what the first step still holds: the optimizer's first update, its moments
#                  allocated and its kernels compiled; Note [Init passes]).
#   vocab          the vocabulary padded (`model.make_vocab_size_divisible_by`, Note [Padded
#                  vocabulary] in model/src/vocab_padding.rs): the MLM decoder's three products
#                  of BERT-large alone at 30,522, 30,528 (8, NVIDIA's) and 30,592 (128) rows on
#                  every GEMM path in f32 and bf16 (and torch.matmul), the cuBLASLt step unpadded
#                  and padded to 8, and `bench train-step` bf16 at seq 128 with both models
#                  padded to 8 against PyTorch. About 3 minutes (estimated; not run yet).
#   unpad          padding removed (`model.unpad`, Note [Padding removed] in model/src/unpad.rs):
#                  `bench step` on BERT-large, padded and unpadded, on the embedded corpus with
#                  dynamic padding, seq 128 batch 32 and seq 512 batch 16: step time, samples/s,
#                  the unpadded row's ratio to the padded one (`× padded`), launches (the
#                  gathers and scatters around the attention core add 4 a layer and 5 a
#                  step: about 100 for BERT-large), host syncs per step (none more than
#                  padded); then `bench
#                  train-step --lengths stratified --unpad false,true` at seq 512 batch 16 bf16
#                  against PyTorch on the same padded batch (MLPerf's stratified mix, about
#                  half padding; the first losses must agree). About 7 minutes (estimated; not
#                  run yet).

# `python_reference MODULES`: `reference` is a benchmark's PyTorch reference (the Python
# with torch) where that Python also imports MODULES (Python's import list), else ember alone.
python_reference() {
    reference=(--reference none)
    if [ -n "$torch_python" ] && "$torch_python" -c "import $1" 2>/dev/null; then
        reference=(--reference pytorch --python "$torch_python")
    fi
}
# `bench gemm`'s torch.matmul; `bench train-step`'s Hugging Face BertForPreTraining.
# `sed -n "$table"`: `bench train-step`'s output from its table on, and any error line.
table='/^| model | params/,$p; /rror/p'
torch_reference() { python_reference torch; }
hf_reference() { python_reference "transformers, safetensors"; }

part_launch() {
    echo "== launch: GPU libraries found by ember, the GPU named, torchrun's store"
    "$dir/xtask" gpu-libs 2>&1 | tee "$out/gpu-libs.txt" || failed $?
    bounded 120 "$dir/xtask" train --device cuda --steps 2 --eval-every 2 --eval-samples 16 \
        --no-progress --out "$out/launch-run" 2>&1 | grep -E "GPU [0-9]+ of|cudarc opens|starting again|reduced_after_backward|error|ember:" \
        | tee "$out/launch.txt" || failed $?
    torchrun="$(dirname "${torch_python:-/nonexistent}")/torchrun"
    if [ -x "$torchrun" ]; then
        bounded 60 "$torchrun" --nproc-per-node 2 --no-python "$dir/xtask" comm-check \
            --rendezvous --timeout 30 2>&1 | grep -E "^rank|rror" | tee -a "$out/launch.txt" || failed $?
    else
        echo "no torchrun beside the machine's torch: rendezvous not checked" | tee -a "$out/launch.txt"
    fi
}

part_embed() {
    echo "== sentence embeddings on CUDA against sentence-transformers"
    python_reference sentence_transformers
    bounded 240 "$dir/xtask" bench embed --device cuda --sentences 512 --rounds 3 \
        "${reference[@]}" --out "$out/embed" 2>&1 | tail -8 || failed $?
}

part_step() {
    echo "== bench step: device reducer check, then BERT-base/large steps (seq 128)"
    bounded 360 "$dir/xtask" bench step --device cuda --check --presets base,large \
        --batch-size 64,32 --seq-len 128 --steps 4 --top-kernels 15 2>&1 \
        | tee "$out/step.md" || failed $?
    echo "   BERT-large with the Q, K and V projections separate (the rows above: packed)"
    bounded 200 "$dir/xtask" bench step --device cuda --presets large --batch-size 32 \
        --seq-len 128 --steps 4 --buckets device --qkv-projections separate 2>&1 \
        | grep -E "^\| (model|large)|rror" | tee -a "$out/step.md" || failed $?
    echo "   BERT-large with bucket-wise clipping (Samsung's; the rows above: global)"
    bounded 200 "$dir/xtask" bench step --device cuda --presets large --batch-size 32 \
        --seq-len 128 --steps 4 --buckets device --clip bucket 2>&1 \
        | grep -E "^\| (model|large)|rror" | tee -a "$out/step.md" || failed $?
}

part_gemm() {
    echo "== GEMM kernels (model.gemm): a BERT-large step (seq 128, batch 32, device buckets)"
    echo "   with cmma, then autotune in two processes (the second reads the kernel cache)"
    local -x EMBER_KERNEL_CACHE="$out/kernel-cache"
    torch_reference
    echo "   bench gemm: each product of a BERT-large step alone, autotune, cmma and cublaslt, f32 and bf16"
    bounded 300 "$dir/xtask" bench gemm --device cuda --preset large --iters 5 \
        "${reference[@]}" --out "$out/gemm" 2>&1 | grep -vE "^\s*$|INFO" \
        | tee "$out/bench-gemm.md" || failed $?
    for gemm in cmma autotune autotune cublaslt; do
        bounded 300 "$dir/xtask" bench step --device cuda --presets large --batch-size 32 \
            --seq-len 128 --steps 4 --buckets device --gemm "$gemm" 2>&1 \
            | grep -E "^GEMMs|^\| (model|large)|rror" | tee -a "$out/gemm.md" || failed $?
    done
    # cuBLASLt ordered on the device (a stuck window expires in seconds: the run's
    # EMBER_GEMM_WINDOW_MAX_POLLS).
    bounded 150 "$dir/xtask" bench step --device cuda --presets large --batch-size 32 \
        --seq-len 128 --steps 4 --buckets device --gemm cublaslt --cublaslt-sync device 2>&1 \
        | grep -E "^GEMMs|^\| (model|large)|rror|cublaslt_sync" | tee -a "$out/gemm.md" || failed $?
    du -sh "$out/kernel-cache"/build-*/* 2>/dev/null || echo "no kernel cache written"
}

part_kernels() {
    echo "== kernel tests on CUDA (f32): forward and backward vs the reference composition"
    # The test binary opens NVRTC through cudarc as ember does, without ember's start-up:
    # it gets ember's library path, and the packed libraries.
    LD_LIBRARY_PATH="$dir/lib:$("$dir/xtask" gpu-libs --ld-library-path)" \
        bounded 200 "$dir/kernels" kernels::cuda:: --test-threads 1 2>&1 | tee "$out/kernels.log" || failed $?
    grep -E "^test |test result" "$out/kernels.log" || true
}

part_bench_kernels() {
    echo "== kernel benchmark, f32"
    bounded 120 "$dir/xtask" bench kernels --device cuda --dtype f32 --iters 10 2>&1 | tee "$out/bench-f32.md" || failed $?
    echo "== kernel benchmark, bf16"
    bounded 90 "$dir/xtask" bench kernels --device cuda --dtype bf16 --iters 10 2>&1 | tee "$out/bench-bf16.md" || failed $?
    echo "== kernel benchmark, bf16, the row kernels reducing by a tree (before: the rows above reduce by warps)"
    bounded 90 "$dir/xtask" bench kernels --device cuda --dtype bf16 --iters 10 --row-reductions tree --ops layer_norm,attention 2>&1 \
        | grep -E "^\| (op|bias_dropout|masked_softmax|attention)|rror" | tee "$out/bench-bf16-tree.md" || failed $?
    # Note [Fused where it pays]: the ops the bf16 table found slower fused than their
    # reference (its `slower fused:` line), taken out of a BERT-large step's fused path.
    slower="$(sed -n 's/^slower fused: //p' "$out/bench-bf16.md" 2>/dev/null | tail -1)" || true
    if [ -n "$slower" ] && [ "$slower" != none ]; then
        echo "== BERT-large bf16 step with --reference-ops $slower against all fused"
        : > "$out/bench-reference-ops.md"
        for ops in none "$slower"; do
            # GEMMs by cmma: both runs alike, without autotuning every shape again.
            bounded 120 "$dir/xtask" bench step --device cuda --presets large --batch-size 32 \
                --seq-len 128 --steps 4 --buckets device --gemm cmma --reference-ops "$ops" 2>&1 \
                | grep -E "^GEMMs|^\| (model|large)|rror" | tee -a "$out/bench-reference-ops.md" || failed $?
        done
    fi
    if [ -n "$torch_python" ]; then
        echo "== attention against PyTorch's scaled_dot_product_attention, bf16, seq 128 and 512"
        bounded 90 "$dir/xtask" bench kernels --device cuda --dtype bf16 --iters 10 --ops attention \
            --shapes large-128,base-512,large-512 --reference pytorch --python "$torch_python" 2>&1 \
            | sed -n '/^Attention core against/,$p; /rror/p' | tee "$out/bench-sdpa.md" || failed $?
    fi
}

part_resume() {
    echo "== resume on CUDA: 12 steps straight against --resume from step 6 (tiny, dropout on)"
    r="$out/resume"
    rm -rf "$r" && mkdir -p "$r"
    printf '[model]\npreset = "tiny"\n[instances]\nmax_seq_length = 64\ndupe_factor = 1\n[train]\nbatch_size = 8\neval_every = 6\neval_samples = 64\nlog_every = 1\n[checkpoint]\nevery = 6\n' > "$r/train.toml"
    run_train() { bounded 120 "$dir/xtask" train --device cuda --config "$r/train.toml" --no-progress "$@" 2>&1 | tail -1; }
    run_train --steps 12 --out "$r/full" || failed $?
    cut_short && return
    # The step-6 checkpoint alone in another folder, as a run killed after step 6.
    mkdir -p "$r/cut/checkpoints" && cp -r "$r/full/checkpoints/step-0000006" "$r/cut/checkpoints/" || failed $?
    run_train --steps 12 --out "$r/cut" --resume "$r/cut" || failed $?
    cut_short && return
    losses() { grep '"event":"train"' "$1/metrics.jsonl" | grep -o '"loss":[^,]*'; }
    if cmp -s "$r/full/model.safetensors" "$r/cut/model.safetensors" \
        && diff <(losses "$r/full") <(losses "$r/cut") > /dev/null; then
        verdict="bit for bit"
    else
        verdict="differ: $(diff <(losses "$r/full") <(losses "$r/cut") | grep -c '^>' || true) of 12 losses"
    fi
    echo "| resume on CUDA (tiny, 6 + 6 steps) | $verdict |" | tee "$out/resume.md"
}

part_onebit() {
    echo "== 1-bit Adam/LAMB on CUDA: warm-up vs compression-stage step time (base, seq 128)"
    o="$out/onebit"
    rm -rf "$o" && mkdir -p "$o"
    echo "| optimizer | warm-up step s (median) | compression step s (median) |" | tee "$o.md"
    echo "|---|---:|---:|" | tee -a "$o.md"
    for opt in onebit-adam onebit-lamb; do
        bounded 240 "$dir/xtask" train --device cuda --preset base --seq-len 128 --batch-size 32 \
            --steps 12 --freeze-step 6 --eval-every 12 --log-every 1 --optimizer "$opt" \
            --no-progress --out "$o/$opt" 2>&1 | tail -1 || failed $?
        med() { sort -g | awk '{a[NR]=$1} END {print (NR ? a[int((NR+1)/2)] : "n/a")}'; }
        steps() { grep '"event":"train"' "$o/$opt/metrics.jsonl" | grep "\"compressed\":$1" | grep -o '"step_s":[^,}]*' | cut -d: -f2 | tail -n +2; }
        echo "| $opt | $(steps false | med) | $(steps true | med) |" | tee -a "$o.md"
    done
}

# `headline_train_step FLAGS...`: the issue's headline shape, BERT-large bf16 at seq 128 batch
# 32, against the reference, with `bench train-step`'s other FLAGS (its `--out` among them).
headline_train_step() {
    bounded 300 "$dir/xtask" bench train-step --device cuda --presets large --batch-size 32 \
        --seq-len 128 --precision bf16 --steps 3 --rounds 2 "${reference[@]}" "$@" 2>&1 \
        | sed -n "$table"
}

part_headline() {
    echo "== the issue's headline: BERT-large bf16, seq 128, batch 32, against PyTorch eager"
    hf_reference
    headline_done=1
    # (The runner's pipefail: the function's status is the benchmark's, not its table filter's.)
    local rc=0
    headline_train_step --out "$out/train-step" || rc=$?
    [ "$rc" != 0 ] || return 0
    failed "$rc"
    if ! cut_short; then
        # Its own folder: the summary's row must not pass for the default GEMMs' result.
        echo "   failed (exit $rc): once more with --gemm cmma, the GEMMs of the first GPU session"
        headline_train_step --gemm cmma --out "$out/train-step-cmma" || failed $?
    fi
}

part_train_step() {
    echo "== training step against PyTorch on CUDA (large; seq 128 batch 32, seq 512 batch 16; bf16, f32)"
    hf_reference
    compile=()
    [ "${reference[1]}" = none ] || compile=(--compile)
    # A process per shape, the issue's headline (seq 128, bf16) first where the headline part
    # has not run it: a command cut at the deadline loses its own rows only.
    shapes=(128:32:bf16 512:16:bf16,f32 128:32:f32)
    [ -z "${headline_done:-}" ] || shapes=("${shapes[@]:1}")
    for shape in "${shapes[@]}"; do
        IFS=: read -r seq batch prec <<< "$shape"
        bounded 200 "$dir/xtask" bench train-step --device cuda --presets large --batch-size "$batch" \
            --seq-len "$seq" --precision "$prec" --steps 3 --rounds 2 "${reference[@]}" \
            --out "$out/train-step" 2>&1 | sed -n "$table" || failed $?
    done
    echo "   the same step with cuBLASLt's GEMMs ordered on the device (model.gemm = cublaslt, cublaslt_sync = device), ember alone"
    bounded 180 "$dir/xtask" bench train-step --device cuda --presets large --batch-size 32 \
        --seq-len 128 --precision f32,bf16 --steps 3 --rounds 2 --reference none \
        --gemm cublaslt --cublaslt-sync device --out "$out/train-step-cublaslt" 2>&1 | sed -n "$table" || failed $?
    if [ ${#compile[@]} -gt 0 ]; then
        echo "   bf16 at seq 128 against torch.compile too (its compilation takes minutes: last)"
        bounded 300 "$dir/xtask" bench train-step --device cuda --presets large --batch-size 32 \
            --seq-len 128 --precision bf16 --steps 3 --rounds 2 "${reference[@]}" "${compile[@]}" \
            --out "$out/train-step-compile" 2>&1 | sed -n "$table" || failed $?
    fi
}

part_largest_batch() {
    echo "== the largest batch that fits: BERT-large, bf16, seq 512 (ember against PyTorch)"
    hf_reference
    bounded 480 "$dir/xtask" bench train-step --device cuda --presets large --seq-len 512 \
        --batch-size 16 --precision bf16 --gemm cmma --largest-batch --largest-batch-timeout-s 90 \
        "${reference[@]}" \
        --out "$out/largest-batch" 2>&1 | grep -vE "INFO" | tail -16 || failed $?
}

part_streaming() {
    echo "== streamed shards: data wait against the step (BERT-large, batch 16, seq 512)"
    d="$out/streaming"
    rm -rf "$d" && mkdir -p "$d"
    echo "| shards | step s (mean, after the first) | data wait s (mean) | wait % | first step wait s | peak host MiB |" | tee "$d.md"
    echo "|---|---:|---:|---:|---:|---:|" | tee -a "$d.md"
    for comp in none gzip; do
        bounded 120 "$dir/xtask" prepare-data --out "$d/$comp" --seq-len 512 --max-pred 76 \
            --num-shards 4 --dupe-factor 1 --compression "$comp" 2>&1 | tail -1 || failed $?
        cut_short && return
        mkdir -p "$d/eval-$comp" && mv "$d/$comp/part-00003-of-00004.hdf5" "$d/eval-$comp/" || failed $?
        bounded 240 "$dir/xtask" train --device cuda --preset large --seq-len 512 \
            --max-predictions 76 --batch-size 16 --steps 12 --eval-every 12 --eval-samples 256 \
            --log-every 1 --data "$d/$comp" --eval-data "$d/eval-$comp" --mllog "$d/$comp.mllog" \
            --no-progress --out "$d/run-$comp" 2>&1 | tail -2 || failed $?
        cut_short && return
        python3 - "$d/run-$comp/metrics.jsonl" "$comp" <<'PY' | tee -a "$d.md" || failed $?
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in records if r["event"] == "train"]
end = [r for r in records if r["event"] == "end"][0]
rest = train[1:]
step = sum(r["step_s"] for r in rest) / len(rest)
wait = sum(r["data_wait_s"] for r in rest) / len(rest)
print(f"| {sys.argv[2]} | {step:.3f} | {wait:.4f} | {100 * wait / step:.1f}% | {train[0]['data_wait_s']:.3f} | {end['peak_rss_mib']:.0f} |")
PY
        for py in /opt/torch/.venv/bin/python python3; do
            if "$py" -c "import mlperf_logging.compliance_checker" 2>/dev/null; then
                bounded 60 "$py" -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 \
                    --log_output "$d/$comp.checker" "$d/$comp.mllog" 2>&1 | tail -1 || failed $?
                break
            fi
        done
    done
}

part_precision() {
    echo "== mixed precision: BERT-large, f32 / bf16 / fp16, 20 steps on the same batches"
    m="$out/precision"
    rm -rf "$m" && mkdir -p "$m"
    for shape in 128:32 512:8; do
        seq=${shape%:*}; batch=${shape#*:}
        for prec in f32 bf16 fp16; do
            run="$m/$seq-$prec"
            nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$run.mem" &
            smi=$!
            bounded 150 "$dir/xtask" train --device cuda --preset large --seq-len "$seq" \
                --batch-size "$batch" --steps 20 --eval-every 20 --eval-samples 64 --log-every 1 \
                --precision "$prec" --no-progress --out "$run" 2>&1 | tail -1 || failed $?
            kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null || true
        done
    done
    python3 - "$m" <<'PY' | tee "$m.md" || failed $?
import json, sys
root = sys.argv[1]
print("| seq | batch | precision | samples/s | x f32 | peak GPU MiB | max loss diff vs f32 | skipped |")
print("|---:|---:|---|---:|---:|---:|---:|---:|")
for seq, batch in ((128, 32), (512, 8)):
    runs = {}
    for prec in ("f32", "bf16", "fp16"):
        try:
            records = [json.loads(l) for l in open(f"{root}/{seq}-{prec}/metrics.jsonl")]
        except OSError:
            print(f"| {seq} | {batch} | {prec} | failed | | | | |")
            continue
        train = [r for r in records if r["event"] == "train"]
        if not train:
            print(f"| {seq} | {batch} | {prec} | no step logged | | | | |")
            continue
        steps = train[3:] or train
        rate = batch / (sum(r["step_s"] for r in steps) / len(steps))
        mem = [int(x) for x in open(f"{root}/{seq}-{prec}.mem").read().split() if x.isdigit()]
        runs[prec] = (rate, [r["loss"] for r in train], max(mem, default=0),
                      train[-1].get("skipped_steps", 0))
    for prec, (rate, losses, mem, skipped) in runs.items():
        base = runs.get("f32")
        ratio = f"{rate / base[0]:.2f}" if base else "n/a"
        diff = max((abs(a - b) / abs(a) for a, b in zip(base[1], losses)), default=0) if base else 0
        print(f"| {seq} | {batch} | {prec} | {rate:.1f} | {ratio} | {mem} | {diff:.2e} | {skipped} |")
PY
}

part_init_passes() {
    echo "== init passes: BERT-large, empty kernel cache, one pass before the first step"
    run="$out/init-passes"
    rm -rf "$run" "$out/kernel-cache-init"
    EMBER_KERNEL_CACHE="$out/kernel-cache-init" bounded 240 "$dir/xtask" train --device cuda \
        --preset large --seq-len 128 --batch-size 32 --steps 5 --eval-every 5 --eval-samples 32 \
        --log-every 1 --init-passes 1 --no-progress --out "$run" 2>&1 \
        | grep -E "init passes done|first step done|rror" | tee "$run.txt" || failed $?
    cut_short && return
    python3 - "$run/metrics.jsonl" <<'PY' | tee -a "$run.txt" || failed $?
import json, sys
records = [json.loads(l) for l in open(sys.argv[1])]
passes = [r for r in records if r["event"] == "init_passes"]
steps = [r["step_s"] for r in records if r["event"] == "train"]
end = [r for r in records if r["event"] == "end"]
later = sum(steps[1:]) / max(len(steps) - 1, 1)
print("| init pass s | time to first step s | first step s | later steps s (mean) | first / later |")
print("|---:|---:|---:|---:|---:|")
print(f"| {passes[0]['seconds']:.1f} | {end[0]['time_to_first_step_s']:.1f} | {steps[0]:.3f} | {later:.3f} | {steps[0] / later:.2f} |")
PY
}

part_vocab() {
    echo "== the vocabulary padded (model.make_vocab_size_divisible_by): BERT-large's MLM decoder"
    echo "   products alone at 30,522, 30,528 and 30,592 rows, then the cuBLASLt step unpadded and padded to 8"
    local -x EMBER_KERNEL_CACHE="$out/kernel-cache"
    torch_reference
    for multiple in 1 8 128; do
        bounded 120 "$dir/xtask" bench gemm --device cuda --preset large --iters 10 \
            --only mlm-decoder --make-vocab-size-divisible-by "$multiple" \
            "${reference[@]}" --out "$out/vocab-gemm-$multiple" 2>&1 \
            | grep -vE "^\s*$|INFO" | tee -a "$out/vocab.md" || failed $?
    done
    for multiple in 1 8; do
        bounded 150 "$dir/xtask" bench step --device cuda --presets large --batch-size 32 \
            --seq-len 128 --steps 4 --buckets device --gemm cublaslt \
            --make-vocab-size-divisible-by "$multiple" 2>&1 \
            | grep -E "^GEMMs|^\| (model|large)|rror" | tee -a "$out/vocab.md" || failed $?
    done
    echo "   against PyTorch, both models padded to 30,528 (NVIDIA's MLPerf BERT), bf16, seq 128, batch 32"
    hf_reference
    bounded 180 "$dir/xtask" bench train-step --device cuda --presets large --batch-size 32 \
        --seq-len 128 --precision bf16 --steps 3 --rounds 2 "${reference[@]}" \
        --make-vocab-size-divisible-by 8 --out "$out/vocab-train-step" 2>&1 | sed -n "$table" || failed $?
}

part_unpad() {
    echo "== padding removed (model.unpad): BERT-large steps padded and unpadded on the embedded corpus"
    echo "   (dynamic padding: each batch to its longest sample), seq 128 batch 32, seq 512 batch 16"
    bounded 240 "$dir/xtask" bench step --device cuda --presets large --batch-size 32 \
        --seq-len 128 --steps 4 --buckets device --unpad false,true 2>&1 \
        | grep -E "^GEMMs|^\| (model|large)|rror" | tee "$out/unpad.md" || failed $?
    bounded 240 "$dir/xtask" bench step --device cuda --presets large --batch-size 16 \
        --seq-len 512 --max-predictions 76 --steps 4 --buckets device --unpad false,true 2>&1 \
        | grep -E "^\| (model|large)|rror" | tee -a "$out/unpad.md" || failed $?
    echo "   MLPerf's stratified batches (6/3/2/5 per 16 from the quarters of 512 tokens, about half"
    echo "   padding), bf16, seq 512 batch 16: ember padded and unpadded against PyTorch (padded)"
    hf_reference
    bounded 240 "$dir/xtask" bench train-step --device cuda --presets large --batch-size 16 \
        --seq-len 512 --max-predictions 76 --precision bf16 --lengths stratified \
        --unpad false,true --steps 3 --rounds 2 "${reference[@]}" \
        --out "$out/unpad-train-step" 2>&1 | tail -16 | tee -a "$out/unpad.md" || failed $?
}
