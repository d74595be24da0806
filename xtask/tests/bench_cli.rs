//! `cargo xtask bench train-step` as a user runs it, without the PyTorch reference (CI has no
//! torch): the step runs, and the JSON it writes holds the configuration's model FLOPs
//! (`BertConfig::train_step_flops`), phases that add up to the step, and an untrained model's
//! loss. On the CPU always, under both GEMM settings (a row each); on wgpu (Mesa's lavapipe)
//! with the `wgpu` feature, f32 and fp16, and without it `--device wgpu` is a clear error; a
//! precision the device lacks is a clear error.

use std::path::Path;
use std::process::{Command, Output};

use ember_model::{BertConfig, Preset};
use serde_json::Value;
use xtask::{BenchInputs, BenchLengths};

mod common;
use common::{BATCH, MAX_PREDICTIONS, SEQ_LEN, result_json, train_step_bench as bench};

/// The run's JSON, checked: one row for tiny at the requested shape per GEMM setting
/// (`gemm_threads`, `None` on GPUs), its FLOPs the formula's, its phases summing to the step,
/// its first loss that of a model that predicts uniformly (ln 30522 + ln 2 ≈ 11.0 for MLM +
/// NSP).
fn check_results(device: &str, out: &Path, output: &Output, gemm_threads: &[Option<&str>]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "bench on {device} failed: {stderr}"
    );
    let (json, results) = result_json(out);
    let markdown = std::fs::read_to_string(json.with_extension("md")).expect("the markdown table");
    assert!(markdown.contains("| tiny |"), "{markdown}");
    assert_eq!(results["device"], device);
    let rows = results["rows"].as_array().expect("rows");
    assert_eq!(
        rows.len(),
        gemm_threads.len(),
        "one preset × batch × seq per GEMM setting: {rows:?}"
    );
    let rates = results["gemm_gflops"]["ember_by_setting"]
        .as_array()
        .expect("ember's GEMM rate per setting");
    assert_eq!(rates.len(), gemm_threads.len(), "{rates:?}");
    assert!(
        rates
            .iter()
            .all(|r| r["gflops"].as_f64().is_some_and(|g| g > 0.0)),
        "{rates:?}"
    );
    for (row, setting) in rows.iter().zip(gemm_threads) {
        assert_eq!(row["gemm_threads"].as_str(), *setting, "{row}");
        if let Some(setting) = setting {
            assert!(markdown.contains(&format!("| {setting} |")), "{markdown}");
        }
        check_row(row, "f32");
        // Launches and device memory are counted by CubeCL's runtime: not on NdArray.
        let ember = &row["ember"];
        assert!(ember["launches_per_step"].is_null(), "{ember}");
        assert!(ember["reserved_bytes"].is_null(), "{ember}");
    }
}

fn check_row(row: &Value, precision: &str) {
    assert_eq!(row["preset"], "tiny");
    assert_eq!(row["precision"], precision);
    assert_eq!(row["batch_size"], BATCH);
    assert_eq!(row["seq_len"], SEQ_LEN);
    let flops =
        BertConfig::preset(Preset::Tiny).train_step_flops(BATCH, SEQ_LEN, BATCH * MAX_PREDICTIONS);
    assert_eq!(row["step_flops"].as_f64(), Some(flops));
    let ember = &row["ember"];
    let number = |key: &str| {
        ember[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {ember}"))
    };
    let step = number("step_s");
    let phases = number("forward_s") + number("backward_s") + number("optimizer_s");
    assert!(step > 0.0);
    // Medians of each phase and of the whole step over two steps: the sums agree to rounding.
    assert!(
        (phases - step).abs() <= 1e-6 * step + 1e-9,
        "phases {phases} s, step {step} s"
    );
    assert!((number("samples_per_s") - BATCH as f64 / step).abs() < 1e-9 * number("samples_per_s"));
    assert!(number("mfu") > 0.0);
    let loss = number("first_loss");
    assert!((10.5..11.5).contains(&loss), "untrained first loss {loss}");
}

#[test]
fn train_step_bench_on_the_cpu_writes_its_results() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("cpu", out.path(), &["--gemm-threads", "rayon,blas"]);
    check_results("cpu", out.path(), &output, &[Some("rayon"), Some("blas")]);
}

/// `--make-vocab-size-divisible-by 8`: both models padded to 30,528 rows, said in the table and
/// the JSON, the step's FLOPs those of the padded model, the first loss a uniform predictor's
/// over the padded vocabulary.
#[test]
fn train_step_bench_pads_the_vocabulary() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("cpu", out.path(), &["--make-vocab-size-divisible-by", "8"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (json, results) = result_json(out.path());
    let markdown = std::fs::read_to_string(json.with_extension("md")).unwrap();
    assert!(markdown.contains("padded to a multiple of 8"), "{markdown}");
    assert_eq!(results["make_vocab_size_divisible_by"], 8);
    let row = &results["rows"][0];
    let padded = BertConfig {
        vocab_size: 30_528,
        ..BertConfig::preset(Preset::Tiny)
    };
    let flops = padded.train_step_flops(BATCH, SEQ_LEN, BATCH * MAX_PREDICTIONS);
    assert_eq!(row["step_flops"].as_f64(), Some(flops));
    let loss = row["ember"]["first_loss"].as_f64().unwrap();
    assert!((10.5..11.5).contains(&loss), "untrained first loss {loss}");
}

/// `--lengths stratified --unpad false,true`: a row each for the padded and the unpadded
/// encoder on the same padded batch (Samsung's 6 / 3 / 2 / 5 quota: both samples of a batch of
/// 2 from the first quarter of 32 tokens, above the 4 masked positions), their first losses
/// the same within f32 rounding, the real tokens counted, the table saying what the batch is.
#[test]
fn train_step_bench_times_stratified_batches_padded_and_unpadded() {
    let out = tempfile::tempdir().unwrap();
    let output = bench(
        "cpu",
        out.path(),
        &["--lengths", "stratified", "--unpad", "false,true"],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (json, results) = result_json(out.path());
    let markdown = std::fs::read_to_string(json.with_extension("md")).unwrap();
    assert!(markdown.contains("`--lengths stratified`"), "{markdown}");
    let rows = results["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{rows:?}");
    let mut losses = Vec::new();
    for (row, unpad) in rows.iter().zip([false, true]) {
        assert_eq!(row["unpad"], unpad, "{row}");
        assert_eq!(row["lengths"], "stratified");
        let real = row["real_tokens"].as_u64().unwrap() as usize;
        assert!(
            (2 * (MAX_PREDICTIONS + 1)..=2 * SEQ_LEN / 4).contains(&real),
            "real tokens {real}"
        );
        check_row(row, "f32");
        losses.push(row["ember"]["first_loss"].as_f64().unwrap());
    }
    assert!(
        (losses[0] - losses[1]).abs() <= 1e-5 * losses[0],
        "padded {} and unpadded {} first losses",
        losses[0],
        losses[1]
    );
}

/// A half precision where the backend has none is refused before any step, naming the flag.
#[test]
fn train_step_bench_refuses_a_precision_the_device_lacks_and_a_sync_without_cublaslt() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("cpu", out.path(), &["--precision", "f32,bf16"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--precision bf16: --device cpu does not compute in bf16"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
    // A setting without effect beside the GEMM chosen is refused, naming both.
    let output = bench("cpu", out.path(), &["--cublaslt-sync", "device"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--cublaslt-sync device has no effect beside --gemm auto"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
}

/// On wgpu (lavapipe): an f32 and an fp16 row (lavapipe has shader f16), each with the kernel
/// launches of its step and the device memory CubeCL's pools hold; fp16 launches more (the
/// casts of autocast).
#[cfg(feature = "wgpu")]
#[test]
fn train_step_bench_on_wgpu_writes_its_results() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("wgpu", out.path(), &["--precision", "f32,fp16"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (_, results) = result_json(out.path());
    let rows = results["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let launches: Vec<u64> = rows
        .iter()
        .zip(["f32", "fp16"])
        .map(|(row, precision)| {
            check_row(row, precision);
            let ember = &row["ember"];
            assert!(ember["reserved_bytes"].as_u64().unwrap() > 0, "{ember}");
            ember["launches_per_step"].as_u64().unwrap()
        })
        .collect();
    assert!(launches[0] > 0 && launches[1] > launches[0], "{launches:?}");
}

#[cfg(not(feature = "wgpu"))]
#[test]
fn train_step_bench_on_wgpu_without_the_feature_says_so() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("wgpu", out.path(), &[]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--device wgpu needs the wgpu feature"),
        "{stderr}"
    );
}

/// `bench embed` without the sentence-transformers side (CI has no torch), on a given model
/// folder (the tests' small random BERT): a row per batch size with the sentences embedded and
/// a rate; batch 1 takes a quarter of the sentences.
#[test]
fn embed_bench_writes_its_results() {
    let dir = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/st_tiny");
    let output = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["bench", "embed", "--reference", "none", "--model"])
        .arg(&model)
        .args([
            "--batch-size",
            "4,1",
            "--sentences",
            "12",
            "--rounds",
            "1",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .expect("running xtask");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (_, results) = result_json(dir.path());
    let rows = results["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (
            rows[0]["batch_size"].as_u64(),
            rows[0]["sentences"].as_u64()
        ),
        (Some(4), Some(12))
    );
    assert_eq!(
        (
            rows[1]["batch_size"].as_u64(),
            rows[1]["sentences"].as_u64()
        ),
        (Some(1), Some(3))
    );
    for row in rows {
        assert!(row["ember_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["reference_s"].is_null(), "{row}");
    }
    assert!(
        stdout.contains("| ember sentences/s |") || stdout.contains("ember sentences/s"),
        "{stdout}"
    );
}

/// `bench gemm` on the CPU without the PyTorch side (CI has no torch): the attention products
/// of the tiny model, each timed, written with the shapes `BertConfig::train_step_gemms` gives;
/// bf16 on the CPU, cuBLASLt off CUDA and mismatched shape lists are clear errors.
#[test]
fn gemm_bench_times_the_step_products() {
    let dir = tempfile::tempdir().unwrap();
    let gemm = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["bench", "gemm", "--device", "cpu", "--preset", "tiny"])
            .args(["--reference", "none", "--iters", "1", "--out"])
            .arg(dir.path())
            .args(extra)
            .output()
            .expect("running xtask")
    };
    let output = gemm(&[
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--max-predictions",
        "4",
        "--only",
        "attn ",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (_, results) = result_json(dir.path());
    let shape = &results.as_array().unwrap()[0];
    let expected: Vec<_> = BertConfig::preset(Preset::Tiny)
        .train_step_gemms(2, 32, 8)
        .into_iter()
        .filter(|g| g.name.starts_with("attn "))
        .collect();
    assert_eq!(expected.len(), 6);
    assert_eq!(shape["gemms"], serde_json::to_value(&expected).unwrap());
    let paths = shape["paths"].as_array().unwrap();
    assert_eq!(paths.len(), 1, "NdArray's one path: {paths:?}");
    assert_eq!(paths[0]["name"], "ember ndarray f32");
    let seconds = paths[0]["seconds"].as_array().unwrap();
    assert_eq!(seconds.len(), 6);
    assert!(
        seconds.iter().all(|s| s.as_f64().unwrap() > 0.0),
        "{seconds:?}"
    );
    assert!(
        stdout.contains("| attn Q·Kᵀ fwd | 2 | 4 × 32 × 64 × 32ᵀ |"),
        "{stdout}"
    );

    let bf16 = gemm(&["--dtypes", "bf16"]);
    assert!(!bf16.status.success());
    assert!(
        String::from_utf8_lossy(&bf16.stderr).contains("--dtypes bf16 needs --device cuda"),
        "{}",
        String::from_utf8_lossy(&bf16.stderr)
    );
    // NVIDIA's library is for --device cuda only, whatever the build.
    let cublaslt = gemm(&["--gemm", "cublaslt"]);
    assert!(!cublaslt.status.success());
    assert!(
        String::from_utf8_lossy(&cublaslt.stderr)
            .contains("model.gemm = \"cublaslt\" runs on --device cuda only"),
        "{}",
        String::from_utf8_lossy(&cublaslt.stderr)
    );
    // The MLM decoder's products with the vocabulary padded (NVIDIA's 30,528 rows); 0 refused.
    let padded = gemm(&[
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--max-predictions",
        "4",
        "--only",
        "mlm-decoder",
        "--make-vocab-size-divisible-by",
        "8",
    ]);
    assert!(
        padded.status.success(),
        "{}",
        String::from_utf8_lossy(&padded.stderr)
    );
    assert!(
        String::from_utf8_lossy(&padded.stdout)
            .contains("| mlm-decoder fwd | 1 | 1 × 8 × 128 × 30528ᵀ |"),
        "{}",
        String::from_utf8_lossy(&padded.stdout)
    );
    let zero = gemm(&["--make-vocab-size-divisible-by", "0"]);
    assert!(!zero.status.success());
    assert!(
        String::from_utf8_lossy(&zero.stderr).contains("--make-vocab-size-divisible-by"),
        "{}",
        String::from_utf8_lossy(&zero.stderr)
    );
    let mismatched = gemm(&["--seq-len", "128,512", "--batch-size", "8"]);
    assert!(!mismatched.status.success());
    assert!(
        String::from_utf8_lossy(&mismatched.stderr).contains("one value each per sequence length"),
        "{}",
        String::from_utf8_lossy(&mismatched.stderr)
    );
}

/// `bench kernels --reference pytorch` on the CPU, the Python a stand-in that records what it
/// was asked and answers as `bench/reference/attention.py` does (CI has no torch): it gets the
/// run's shapes (heads, head size, the scale 1/√64) and settings, and the SDPA table holds its
/// times against ember's attention rows, with their ratio.
#[test]
fn kernel_bench_sets_attention_against_sdpa() {
    let dir = tempfile::tempdir().unwrap();
    let asked = dir.path().join("asked");
    let python = dir.path().join("python");
    std::fs::write(
        &python,
        format!(
            "#!/bin/sh\nshift\necho \"$@\" > {asked}\nwhile [ $# -gt 0 ]; do [ \"$1\" = --shapes ] && cp \"$2\" {asked}.json; shift; done\n\
             echo '{{\"forward_s\": [0.002, 0.008], \"forward_backward_s\": [0.006, 0.024], \"device\": \"cpu\", \"torch\": \"9.9\"}}'\n",
            asked = asked.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["bench", "kernels", "--device", "cpu", "--batch-size", "2"])
        .args([
            "--shapes",
            "base-16,large-32",
            "--iters",
            "1",
            "--copy-mib",
            "1",
        ])
        .args(["--ops", "attention", "--reference", "pytorch", "--python"])
        .arg(&python)
        .output()
        .expect("running xtask");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let args = std::fs::read_to_string(&asked).unwrap();
    assert!(
        args.contains("--device cpu --dtype f32 --dropout 0.1 --iters 1"),
        "{args}"
    );
    let shapes: Value =
        serde_json::from_str(&std::fs::read_to_string(asked.with_extension("json")).unwrap())
            .unwrap();
    assert_eq!(shapes.as_array().unwrap().len(), 2);
    for (shape, (heads, seq)) in shapes.as_array().unwrap().iter().zip([(12, 16), (16, 32)]) {
        assert_eq!(shape["batch"], 2);
        assert_eq!(shape["heads"], heads);
        assert_eq!(shape["seq"], seq);
        assert_eq!(shape["head_dim"], 64);
        assert_eq!(shape["scale"], 0.125);
    }
    assert!(
        stdout.contains("PyTorch 9.9's scaled_dot_product_attention on cpu"),
        "{stdout}"
    );
    // ember's attention rows and the table's: the same fused times, the stand-in's beside them.
    let ember: Vec<(f64, f64)> = stdout
        .lines()
        .filter(|l| l.starts_with("| attention_core |"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[3].parse().unwrap(), cells[6].parse().unwrap())
        })
        .collect();
    let sdpa: Vec<Vec<&str>> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("| shape | fwd ember ms"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    assert_eq!((ember.len(), sdpa.len()), (2, 2), "{stdout}");
    // Note [Fused where it pays]: the verdict line names attention where the large shape's
    // forward + backward speed-up is below 1 (NdArray's host loops against the composition:
    // either may win on a loaded CPU; an undecidable 1.00x is skipped).
    let verdict: ember_model::ReferenceOps = stdout
        .lines()
        .find_map(|l| l.strip_prefix("slower fused: "))
        .unwrap_or_else(|| panic!("no `slower fused:` line: {stdout}"))
        .parse()
        .unwrap();
    let large = stdout
        .lines()
        .find(|l| l.starts_with("| attention_core | large-32"))
        .unwrap();
    let speed_up = large.split('|').map(str::trim).nth(8).unwrap();
    if speed_up != "1.00x" {
        let slower = speed_up.trim_end_matches('x').parse::<f64>().unwrap() < 1.0;
        assert_eq!(
            verdict,
            if slower {
                ember_model::ReferenceOps::NONE.with(ember_model::FusedOp::Attention)
            } else {
                ember_model::ReferenceOps::NONE
            },
            "{stdout}"
        );
    }
    for ((fwd, fwd_bwd), (cells, (torch_fwd, torch_fwd_bwd))) in
        ember.iter().zip(sdpa.iter().zip([(2.0, 6.0), (8.0, 24.0)]))
    {
        let number = |i: usize| cells[i].trim_end_matches('x').parse::<f64>().unwrap();
        assert_eq!((number(2), number(5)), (*fwd, *fwd_bwd));
        assert_eq!((number(3), number(6)), (torch_fwd, torch_fwd_bwd));
        // The ratio is taken from the unrounded times: it must lie within what the printed
        // times (3 decimals, ms) and the printed ratio (2 decimals) allow.
        let within = |ratio: f64, torch: f64, ember: f64| {
            let (low, high) = (torch / (ember + 5e-4), torch / (ember - 5e-4).max(1e-9));
            low - 5e-3 - 1e-9 <= ratio && ratio <= high + 5e-3 + 1e-9
        };
        assert!(within(number(4), torch_fwd, *fwd), "{stdout}");
        assert!(within(number(7), torch_fwd_bwd, *fwd_bwd), "{stdout}");
    }
}

fn kernel_row(op: &'static str, shape: &str, fused: f64, reference: f64) -> xtask::KernelRow {
    xtask::KernelRow {
        op,
        shape: shape.to_string(),
        fused_fwd: 1.0,
        reference_fwd: 1.0,
        fused_fwd_bwd: fused,
        reference_fwd_bwd: reference,
        bytes: 0.0,
    }
}

/// `bench kernels`' verdict (Note [Fused where it pays]): only the large shapes decide where
/// there are any; the rows map to `model.reference_ops`' names; a NaN time (an op that failed)
/// decides nothing; the masked softmax alone and the optimizers are no setting.
#[test]
fn kernel_bench_names_the_ops_slower_fused_at_the_large_shapes() {
    use ember_model::FusedOp;
    let rows = [
        kernel_row("bias_gelu", "base-128 [32x128]", 2.0, 1.0),
        kernel_row("bias_gelu", "large-128 [32x128]", 1.0, 2.0),
        kernel_row(
            "bias_dropout_add_layer_norm",
            "large-128 [32x128]",
            1.0,
            1.5,
        ),
        kernel_row(
            "bias_dropout_add_layer_norm",
            "large-512 [32x512]",
            4.0,
            3.0,
        ),
        kernel_row("masked_softmax_dropout", "large-128 [32x128]", 2.0, 1.0),
        kernel_row("attention_core", "large-128 [32x128]", 2.0, 1.0),
        kernel_row("attention_core", "large-512 [32x512]", 5.0, 4.0),
        kernel_row(
            "cross_entropy",
            "large-512 [32x512] [2432x30522 logits]",
            f64::NAN,
            1.0,
        ),
        kernel_row("adamw_multi_tensor", "large", 2.0, 1.0),
    ];
    assert_eq!(
        xtask::slower_fused(&rows),
        vec![
            (FusedOp::LayerNorm, "large-512: 0.75x".to_string()),
            (
                FusedOp::Attention,
                "large-128: 0.50x, large-512: 0.80x".to_string()
            ),
        ]
    );
    // Without large shapes the base ones decide.
    assert_eq!(
        xtask::slower_fused(&rows[..1]),
        vec![(FusedOp::BiasGelu, "base-128: 0.50x".to_string())]
    );
}

/// Samsung's quota per 16 samples from the quarters of the sequence, every length above
/// the masked positions, the padding masked, and every masked position a real token.
#[test]
fn stratified_batches_take_six_three_two_five_from_the_quarters() {
    let (batch, seq_len, predictions) = (32, 512, 76);
    let inputs = BenchInputs::random(
        30_522,
        batch,
        seq_len,
        predictions,
        BenchLengths::Stratified,
    );
    let mut per_quarter = [0usize; 4];
    for &len in inputs.lengths() {
        assert!((predictions + 1..=seq_len).contains(&len), "length {len}");
        per_quarter[(len - 1) / (seq_len / 4)] += 1;
    }
    assert_eq!(per_quarter, [12, 6, 4, 10]);
    let mask = inputs.input_mask();
    for (sample, &len) in inputs.lengths().iter().enumerate() {
        let row = &mask[sample * seq_len..(sample + 1) * seq_len];
        assert_eq!(row.iter().sum::<i64>(), len as i64);
        assert!(row[..len].iter().all(|&m| m == 1));
        let ids = &inputs.input_ids()[sample * seq_len..(sample + 1) * seq_len];
        assert!(ids[len..].iter().all(|&id| id == 0), "padding is [PAD]");
        let positions = &inputs.positions()[sample * predictions..(sample + 1) * predictions];
        assert!(positions.iter().all(|&p| p >= 1 && (p as usize) < len));
    }
    assert_eq!(inputs.real_tokens(), inputs.lengths().iter().sum::<usize>());
    // About half of MLPerf's stratified batch is padding.
    let fill = inputs.real_tokens() as f64 / (batch * seq_len) as f64;
    assert!((0.35..0.65).contains(&fill), "fill {fill}");
    // Full lengths: no padding, the batch of before `--lengths`.
    let full = BenchInputs::random(30_522, 4, 64, 8, BenchLengths::Full);
    assert_eq!(full.real_tokens(), 4 * 64);
    assert!(full.input_mask().iter().all(|&m| m == 1));
}
