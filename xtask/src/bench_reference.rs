//! The two sides' inputs of `bench train-step`: the batch both steps train on (ember's
//! tensors and the reference's safetensors file, from the same vectors), and the PyTorch
//! reference process (`bench/reference/train_step.py`) with its JSON-lines protocol, and the
//! virtualenv that `cargo xtask bench --setup-reference` makes for it.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};
use burn::tensor::{Int, Tensor, TensorData};
use ember_data::Batch;
use ember_trainer::config::OptimizerConfig;
use serde_json::{Value, json};

/// The Python that runs the reference: `--python`, else the virtualenv of
/// `cargo xtask bench --setup-reference`.
pub(crate) fn reference_python(given: Option<&Path>) -> Result<PathBuf> {
    let path = match given {
        Some(path) => path.to_path_buf(),
        None => reference_venv().join("bin/python"),
    };
    if !path.is_file() {
        bail!(
            "{}: no such Python; run `cargo xtask bench --setup-reference` once (installs torch and transformers, a large download) or pass --python PATH, or --reference none",
            path.display()
        );
    }
    Ok(path)
}

/// Runs the shipped reference script `name` (written into `dir`) with `python` and `args`, and
/// returns the one JSON object it prints: the one-shot references (`gemm.py`, `attention.py`).
///
/// # Errors
/// Python not starting, the script failing (its stderr is in the error), or output that is
/// not JSON.
pub(crate) fn run_script(
    python: &Path,
    dir: &Path,
    name: &str,
    args: &[std::ffi::OsString],
) -> Result<Value> {
    let script = crate::shipped::write_script(name, dir)?;
    let output = Command::new(python)
        .arg(&script)
        .args(args)
        .output()
        .with_context(|| format!("starting {}", python.display()))?;
    if !output.status.success() {
        bail!(
            "the PyTorch reference ({name}) failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "the reference ({name}) printed {:?}, not JSON",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// The virtualenv of `cargo xtask bench --setup-reference`: `reference-venv` in ember's cache
/// folder (`ember_data::embedded::cache_dir`: `$EMBER_CACHE_DIR`, else `~/.cache/ember`).
fn reference_venv() -> PathBuf {
    ember_data::embedded::cache_dir().join("reference-venv")
}

/// The base path of a benchmark's results, `OUT/NAME-<unix seconds>` (add `.md`, `.json`), with
/// OUT `--out` or `bench/results/` in the working directory (git-ignored in a checkout),
/// created.
///
/// # Errors
/// When the folder cannot be created (it is named).
pub(crate) fn results_base(out: Option<&Path>, name: &str) -> Result<PathBuf> {
    let out = out.map_or_else(|| PathBuf::from("bench/results"), Path::to_path_buf);
    std::fs::create_dir_all(&out).with_context(|| out.display().to_string())?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(out.join(format!("{name}-{stamp}")))
}

/// `cargo xtask bench --setup-reference`: the reference virtualenv with torch, transformers,
/// sentence-transformers, safetensors, numpy and h5py from PyPI (`bench train-step`, `bench
/// data` and `bench embed`).
pub fn setup_reference() -> Result<()> {
    let dir = reference_venv();
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&dir)
        .status()
        .context("running python3 -m venv (Debian: apt install python3-venv)")?;
    if !status.success() {
        bail!("python3 -m venv {} failed ({status})", dir.display());
    }
    let pip = dir.join("bin/pip");
    let status = Command::new(&pip)
        .args([
            "install",
            "torch",
            "transformers",
            "sentence-transformers",
            "safetensors",
            "numpy",
            "h5py",
        ])
        .status()
        .with_context(|| pip.display().to_string())?;
    if !status.success() {
        bail!(
            "{} install torch transformers safetensors failed ({status})",
            pip.display()
        );
    }
    println!(
        "ember: reference ready: {}",
        dir.join("bin/python").display()
    );
    Ok(())
}

/// The inputs of one configuration, on the host (ember's tensors and the reference's file are
/// made from the same vectors).
pub struct HostInputs {
    batch_size: usize,
    seq_len: usize,
    /// Each sample's real tokens; the rest of its `seq_len` is padding.
    lengths: Vec<usize>,
    input_ids: Vec<i64>,
    segment_ids: Vec<i64>,
    positions: Vec<i64>, // [B, P] positions within each sequence
    labels: Vec<i64>,    // [B, P]
    next_sentence: Vec<i64>,
}

/// The samples' lengths in a benchmark's batch (`--lengths`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lengths {
    /// Every sample `seq_len` real tokens: no padding.
    Full,
    /// MLPerf's stratified batches as Samsung's MLPerf BERT draws them (`--split_batch_cnt 6
    /// 3 2 5`): of every 16 samples, 6 / 3 / 2 / 5 from the four quarters of `seq_len`
    /// (1–128, 129–256, 257–384 and 385–512 tokens at 512), each length uniform in its
    /// quarter but above the masked positions; the batch padded to `seq_len`.
    Stratified,
}

impl Lengths {
    /// The flag's value.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Lengths::Full => "full",
            Lengths::Stratified => "stratified",
        }
    }

    /// The real tokens of sample `i` of a batch padded to `seq_len` with `predictions` masked
    /// positions per sample, `draw(n)` uniform in `0..n`.
    fn of(
        self,
        i: usize,
        seq_len: usize,
        predictions: usize,
        draw: &mut impl FnMut(usize) -> i64,
    ) -> usize {
        match self {
            Lengths::Full => seq_len,
            Lengths::Stratified => {
                const QUOTA: [usize; 16] = [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3];
                let bin = QUOTA[i % 16];
                let low = (bin * seq_len / 4 + 1).max(predictions + 1).min(seq_len);
                let high = ((bin + 1) * seq_len / 4).max(low);
                low + draw(high - low + 1) as usize
            }
        }
    }
}

impl HostInputs {
    /// A random batch: tokens drawn from the `tokens` ids of the vocabulary (the tokenizer's:
    /// below a padded model's padding rows) above the special ids, each sample `lengths`
    /// long and padded with id 0 (`[PAD]`, segment 0, mask 0) to `seq_len`, segment B the
    /// second half of its real tokens, `predictions` distinct sorted positions among its real
    /// tokens (never [CLS] at 0), labels drawn from the vocabulary. SplitMix64 from a fixed
    /// seed; `Lengths::Full` draws the batch of before `--lengths` existed.
    pub fn random(
        tokens: usize,
        batch_size: usize,
        seq_len: usize,
        predictions: usize,
        lengths: Lengths,
    ) -> Self {
        let mut next = uniform(0x5eed);
        let vocab = tokens - 1000;
        let mut inputs = HostInputs {
            batch_size,
            seq_len,
            lengths: Vec::new(),
            input_ids: Vec::new(),
            segment_ids: Vec::new(),
            positions: Vec::new(),
            labels: Vec::new(),
            next_sentence: Vec::new(),
        };
        // Stratified lengths from a generator of their own: the full batch's draws unchanged.
        let mut draw_length = uniform(0x1e_9775);
        for sample in 0..batch_size {
            let len = lengths.of(sample, seq_len, predictions, &mut draw_length);
            inputs.lengths.push(len);
            inputs
                .input_ids
                .extend((0..seq_len).map(|i| if i < len { 1000 + next(vocab) } else { 0 }));
            inputs
                .segment_ids
                .extend((0..seq_len).map(|i| i64::from(i >= len / 2 && i < len)));
            let mut chosen: Vec<i64> = Vec::new();
            while chosen.len() < predictions {
                let p = 1 + next(len - 1);
                if !chosen.contains(&p) {
                    chosen.push(p);
                }
            }
            chosen.sort_unstable();
            inputs.positions.extend(&chosen);
            inputs
                .labels
                .extend((0..predictions).map(|_| 1000 + next(vocab)));
            inputs.next_sentence.push(next(2));
        }
        inputs
    }

    pub(crate) fn predictions(&self) -> usize {
        self.positions.len()
    }

    /// `[B, S]` row-major: 1 at each sample's real tokens, 0 at its padding.
    pub fn input_mask(&self) -> Vec<i64> {
        self.lengths
            .iter()
            .flat_map(|&len| (0..self.seq_len).map(move |i| i64::from(i < len)))
            .collect()
    }

    /// The real tokens of the batch.
    pub fn real_tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// Each sample's real tokens.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// `[B, S]` row-major token ids, 0 (`[PAD]`) at the padding.
    pub fn input_ids(&self) -> &[i64] {
        &self.input_ids
    }

    /// `[B, P]` row-major masked positions within each sample.
    pub fn positions(&self) -> &[i64] {
        &self.positions
    }

    pub(crate) fn batch<B: burn::tensor::backend::Backend>(&self, device: &B::Device) -> Batch<B> {
        let (b, s, n) = (self.batch_size, self.seq_len, self.predictions());
        let int2 = |values: &[i64]| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(values.to_vec(), [b, s]), device)
        };
        let int1 = |values: Vec<i64>| {
            let len = values.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(values, [len]), device)
        };
        let per_row = n / b;
        let flat = self
            .positions
            .iter()
            .enumerate()
            .map(|(i, p)| (i / per_row * s) as i64 + p)
            .collect();
        Batch {
            input_ids: int2(&self.input_ids),
            segment_ids: int2(&self.segment_ids),
            input_mask: int2(&self.input_mask()),
            masked_lm_flat_positions: int1(flat),
            masked_lm_labels: int1(self.labels.clone()),
            next_sentence_labels: int1(self.next_sentence.clone()),
            real_rows: int1(ember_data::real_rows(&self.input_mask())),
        }
    }

    /// The reference's batch file (see `bench/reference/train_step.py`).
    pub(crate) fn write_safetensors(&self, path: &Path) -> Result<()> {
        use safetensors::tensor::{Dtype, TensorView};
        let (b, s, p) = (
            self.batch_size,
            self.seq_len,
            self.predictions() / self.batch_size,
        );
        let bytes = |values: &[i64]| values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let ones: Vec<u8> = (0..b * p).flat_map(|_| 1.0f32.to_le_bytes()).collect();
        let tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = vec![
            ("input_ids", Dtype::I64, vec![b, s], bytes(&self.input_ids)),
            (
                "token_type_ids",
                Dtype::I64,
                vec![b, s],
                bytes(&self.segment_ids),
            ),
            (
                "attention_mask",
                Dtype::I64,
                vec![b, s],
                bytes(&self.input_mask()),
            ),
            (
                "masked_lm_positions",
                Dtype::I64,
                vec![b, p],
                bytes(&self.positions),
            ),
            ("masked_lm_ids", Dtype::I64, vec![b, p], bytes(&self.labels)),
            ("masked_lm_weights", Dtype::F32, vec![b, p], ones),
            (
                "next_sentence_labels",
                Dtype::I64,
                vec![b],
                bytes(&self.next_sentence),
            ),
        ];
        let views = tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                TensorView::new(*dtype, shape.clone(), data).map(|view| (name.to_string(), view))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        safetensors::serialize_to_file(views, None, path)
            .with_context(|| path.display().to_string())
    }
}

/// What [`Reference::steps`] measured.
pub(crate) struct ReferenceSteps {
    /// Each step's wall time, seconds.
    pub(crate) seconds: Vec<f64>,
    /// `torch.cuda.max_memory_reserved` after the steps, bytes (`None` on the CPU).
    pub(crate) reserved_bytes: Option<u64>,
}

/// The reference process: one JSON request and one JSON reply per line.
pub(crate) struct Reference {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub(crate) ready: Value,
}

impl Reference {
    pub(crate) fn start(
        python: &Path,
        dir: &Path,
        threads: usize,
        optimizer: &OptimizerConfig,
        compile: bool,
        device: &str,
        precision: ember_model::Precision,
    ) -> Result<Self> {
        let script = crate::shipped::write_script("train_step.py", dir)?;
        let mut command = Command::new(python);
        command
            .arg(&script)
            .arg("--model")
            .arg(dir)
            .arg("--batch")
            .arg(dir.join("batch.safetensors"))
            .args(["--threads", &threads.to_string()])
            .args(["--lr", &optimizer.lr.to_string()])
            .args(["--beta1", &optimizer.beta1.to_string()])
            .args(["--beta2", &optimizer.beta2.to_string()])
            .args(["--eps", &optimizer.epsilon.to_string()])
            .args(["--weight-decay", &optimizer.weight_decay.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if compile {
            command.arg("--compile");
        }
        command.args(["--device", device]);
        command.args(["--precision", &precision.to_string()]);
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {} {}", python.display(), script.display()))?;
        let stdin = child.stdin.take().context("the reference's stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("the reference's stdout")?);
        let mut reference = Reference {
            child,
            stdin,
            stdout,
            ready: Value::Null,
        };
        reference.ready = reference.read()?;
        Ok(reference)
    }

    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .context("reading the reference's reply")?;
        if line.is_empty() {
            let status = self.child.wait()?;
            bail!("the PyTorch reference exited ({status}) before replying; its error is above");
        }
        let value: Value = serde_json::from_str(&line)
            .with_context(|| format!("the reference replied {line:?}, not JSON"))?;
        if let Some(error) = value.get("error") {
            bail!("the reference: {error}");
        }
        Ok(value)
    }

    pub(crate) fn ask(&mut self, request: Value) -> Result<Value> {
        writeln!(self.stdin, "{request}").context("writing to the reference")?;
        self.read()
    }

    pub(crate) fn number(value: &Value, key: &str) -> Result<f64> {
        value[key]
            .as_f64()
            .with_context(|| format!("the reference's reply {value} lacks {key}"))
    }

    /// `n` training steps: their seconds, and the peak memory of PyTorch's CUDA caching
    /// allocator (`torch.cuda.max_memory_reserved`; `None` on the CPU).
    pub(crate) fn steps(&mut self, n: usize) -> Result<ReferenceSteps> {
        let reply = self.ask(json!({"cmd": "steps", "n": n}))?;
        let seconds = reply["seconds"]
            .as_array()
            .with_context(|| format!("the reference's reply {reply} lacks seconds"))?
            .iter()
            .map(|s| s.as_f64().context("a step time that is not a number"))
            .collect::<Result<_>>()?;
        Ok(ReferenceSteps {
            seconds,
            reserved_bytes: reply["reserved_bytes"].as_u64(),
        })
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "quit"}));
        let _ = self.child.wait();
    }
}

/// SplitMix64's increment (Steele, Lea & Flood 2014).
const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64 from `state`: each call draws a value in `0..bound`.
fn uniform(mut state: u64) -> impl FnMut(usize) -> i64 {
    move |bound: usize| {
        let value = splitmix64(state);
        state = state.wrapping_add(SPLITMIX_GAMMA);
        (value % bound as u64) as i64
    }
}

/// SplitMix64's output for `state`: the state advanced by [`SPLITMIX_GAMMA`], finalised.
fn splitmix64(state: u64) -> u64 {
    let mut z = state.wrapping_add(SPLITMIX_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
