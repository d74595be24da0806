//! `cargo xtask prepare-data`, `stratify` and `balance-report`: MLPerf HDF5 shards from text,
//! length bins, and the load-balance report of the samplers.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use ember_data::balance::{BalanceRow, BalanceSettings, balance_report};
use ember_data::prepare::{PrepareOptions, prepare_shards};
use ember_data::shard::{self, Compression, Layout};
use ember_data::stratify::stratify;
use ember_data::{
    PretrainingConfig, ShardedDataset, WordPieceTokenizer, default_corpus_path, default_vocab_path,
};
use indicatif::{ProgressBar, ProgressStyle};

fn parse_compression(s: &str) -> Result<Compression, String> {
    match s.split_once(':') {
        None if s == "none" => Ok(Compression::None),
        None if s == "gzip" => Ok(Compression::Gzip(4)),
        Some(("gzip", level)) => match level.parse::<u8>() {
            Ok(l @ 1..=9) => Ok(Compression::Gzip(l)),
            _ => Err(format!("gzip level `{level}` is not 1..9")),
        },
        _ => Err(format!(
            "unknown compression `{s}` (none, gzip or gzip:LEVEL)"
        )),
    }
}

/// Flags of `prepare-data`.
#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// Corpus file or folder of .txt files: one sentence per line, a blank line between
    /// documents [default: the embedded Wikipedia corpus]
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// WordPiece vocab.txt [default: bert-base-uncased's]
    #[arg(long)]
    vocab: Option<PathBuf>,
    /// Output folder for part-XXXXX-of-YYYYY.hdf5 shards
    #[arg(long)]
    out: PathBuf,
    /// Longest sample in tokens (S)
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Most masked positions per sample (P); MLPerf uses 76 at S = 512
    #[arg(long, default_value_t = 20)]
    max_pred: usize,
    /// Number of shards (each from a contiguous part of the documents)
    #[arg(long, default_value_t = 16)]
    num_shards: usize,
    /// Passes over each part's documents with fresh masks
    #[arg(long, default_value_t = 10)]
    dupe_factor: usize,
    /// Fraction of tokens masked
    #[arg(long, default_value_t = 0.15)]
    masked_lm_prob: f64,
    /// Probability of a shorter target length
    #[arg(long, default_value_t = 0.1)]
    short_seq_prob: f64,
    /// Seed; shard k uses seed + k
    #[arg(long, default_value_t = 12345)]
    seed: u64,
    /// none, gzip or gzip:LEVEL
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    compression: Compression,
    /// Worker threads [default: the number of cores]
    #[arg(long)]
    jobs: Option<usize>,
    /// Documents at the end of the corpus left out of the shards: train's data.eval_documents
    /// (300 by default) evaluates on them. 0 keeps every document
    #[arg(long, default_value_t = 300)]
    holdout_documents: usize,
    /// Stop at a corpus line that is not UTF-8 instead of skipping it with a warning
    #[arg(long)]
    strict: bool,
}

/// Peak resident memory of this process (VmHWM), MiB, where Linux reports it.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

pub fn prepare(args: PrepareArgs) -> Result<()> {
    let corpus = match args.corpus {
        Some(path) => path,
        None => default_corpus_path()?,
    };
    let vocab = match args.vocab {
        Some(path) => path,
        None => default_vocab_path()?,
    };
    let tokenizer = WordPieceTokenizer::from_vocab_file(&vocab)?;
    let jobs = args.jobs.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let options = PrepareOptions {
        instances: PretrainingConfig {
            max_seq_length: args.seq_len,
            max_predictions_per_seq: args.max_pred,
            masked_lm_prob: args.masked_lm_prob,
            short_seq_prob: args.short_seq_prob,
            dupe_factor: args.dupe_factor,
            seed: args.seed,
        },
        num_shards: args.num_shards,
        compression: args.compression,
        jobs,
        holdout_documents: args.holdout_documents,
        strict: args.strict,
    };
    let start = Instant::now();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} documents ({elapsed})")
            .expect("valid template"),
    );
    bar.set_message("prepare-data");
    // prepare_shards counts the documents first; the bar learns the total with the first
    // finished shard.
    let summary = prepare_shards(&corpus, &tokenizer, &args.out, &options, &|n, total| {
        bar.set_length(total as u64);
        bar.inc(n as u64)
    })?;
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "prepare-data: {} documents ({} held out) → {} samples, {} tokens in {} shards under {} (S = {}, P = {})",
        summary.documents,
        summary.held_out,
        summary.samples,
        summary.tokens,
        summary.shards.len(),
        args.out.display(),
        args.seq_len,
        args.max_pred
    );
    if summary.skipped_lines > 0 {
        println!(
            "prepare-data: skipped {} corpus line(s) that were not UTF-8 (see the warnings; \
             --strict stops at the first)",
            summary.skipped_lines
        );
    }
    println!(
        "throughput: {:.0} tokens/s ({seconds:.1} s, {jobs} worker(s)); peak memory {}",
        summary.tokens as f64 / seconds,
        peak_rss_mib().map_or("unknown".into(), |m| format!("{m:.0} MiB"))
    );
    Ok(())
}

/// Flags of `stratify`.
#[derive(Args, Debug)]
pub struct StratifyArgs {
    /// Folder of shards (or one shard)
    #[arg(long = "in")]
    input: PathBuf,
    /// Output folder: one len_<lo>-<hi>/ folder per bin
    #[arg(long)]
    out: PathBuf,
    /// Upper edges of the length bins, ascending
    #[arg(long, default_value = "128,256,384,512", value_delimiter = ',')]
    bins: Vec<usize>,
    /// Shards per bin (fewer when a bin has fewer samples)
    #[arg(long, default_value_t = 4)]
    num_shards: usize,
    /// Vocabulary the ids are checked against [default: bert-base-uncased's]
    #[arg(long)]
    vocab: Option<PathBuf>,
    /// none, gzip or gzip:LEVEL
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    compression: Compression,
}

pub fn stratify_command(args: StratifyArgs) -> Result<()> {
    let vocab = match args.vocab {
        Some(path) => path,
        None => default_vocab_path()?,
    };
    let vocab_size = WordPieceTokenizer::from_vocab_file(&vocab)?.vocab_size();
    let edges: Vec<usize> = args.bins.clone();
    let summary = stratify(
        &args.input,
        &args.out,
        &edges,
        args.num_shards,
        args.compression,
        vocab_size,
    )?;
    for (bin, count, files) in &summary.bins {
        println!(
            "{:>12}: {count:>8} samples in {} shard(s)",
            bin.dir_name(),
            files.len()
        );
    }
    Ok(())
}

/// Flags of `balance-report`.
#[derive(Args, Debug)]
pub struct BalanceArgs {
    /// Shards: a folder of *.hdf5, or a stratified folder of len_<lo>-<hi>/ bins
    #[arg(long)]
    data: PathBuf,
    /// Simulated ranks W (a list reports each)
    #[arg(long, default_value = "8,64,1024", value_delimiter = ',')]
    world_size: Vec<usize>,
    /// Samples per rank per step (B)
    #[arg(long, default_value_t = 16)]
    local_batch: usize,
    /// Simulated steps
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Ranks per presort group (G; one node)
    #[arg(long, default_value_t = 8)]
    presort_group: usize,
    /// Samples per bin in each local batch, e.g. 6,3,2,5 [default: proportional]
    #[arg(long, value_delimiter = ',')]
    bin_quota: Option<Vec<usize>>,
    /// Micro-batches of the length-grouped padding mode (a list reports each)
    #[arg(long, default_value = "2,4", value_delimiter = ',')]
    grouped_k: Vec<usize>,
    /// Hidden size H of the compute model a·s + b·s², b/a = 1/(6H) [BERT-large]
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Maximum sequence length [default: the shards' S]
    #[arg(long)]
    seq_len: Option<usize>,
    /// Sampler seed
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Folder for balance.md and balance.png
    #[arg(long, default_value = "balance-report")]
    out: PathBuf,
    /// Skip unreadable shards with a warning instead of stopping
    #[arg(long)]
    skip_bad_shards: bool,
}

pub fn balance(args: BalanceArgs) -> Result<()> {
    let dataset = ShardedDataset::open(&args.data, args.skip_bad_shards)?;
    for skipped in &dataset.skipped {
        tracing::warn!("skipped a bad shard: {skipped}");
    }
    let seq_len = match args.seq_len {
        Some(s) => s,
        None => {
            let first = &dataset.shards.iter().flatten().next().context("no shard")?;
            let info = shard::shard_info(first)?;
            match info.layout {
                Layout::Fixed => info.seq_len,
                Layout::VarLen => dataset.bins.iter().map(|b| b.hi).max().unwrap_or(512),
            }
        }
    };
    let longest = dataset.lengths.iter().flatten().copied().max().unwrap_or(0) as usize;
    if longest > seq_len {
        bail!(
            "{}: a sample has {longest} tokens, more than --seq-len {seq_len}",
            args.data.display()
        );
    }
    let mut tables = Vec::new();
    for &world_size in &args.world_size {
        let settings = BalanceSettings {
            world_size,
            local_batch: args.local_batch,
            steps: args.steps,
            max_seq_length: seq_len,
            hidden: args.hidden,
            presort_group: args.presort_group,
            bin_quota: args.bin_quota.clone(),
            seed: args.seed,
        };
        let rows = balance_report(&dataset, &settings, &args.grouped_k)
            .with_context(|| format!("{}: simulating W = {world_size}", args.data.display()))?;
        tables.push((world_size, rows));
    }
    let markdown = report_markdown(&dataset, &args, seq_len, &tables);
    print!("{markdown}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("{}: cannot create the report folder", args.out.display()))?;
    let md_path = args.out.join("balance.md");
    write_atomically(&md_path, markdown.as_bytes())?;
    let png_path = args.out.join("balance.png");
    plot(&png_path, &dataset, &tables)?;
    println!("\nwrote {} and {}", md_path.display(), png_path.display());
    Ok(())
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| format!("{}: cannot write", path.display()))
}

fn report_markdown(
    dataset: &ShardedDataset,
    args: &BalanceArgs,
    seq_len: usize,
    tables: &[(usize, Vec<BalanceRow>)],
) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Load balance: {} ({} samples, {} bin(s), S = {seq_len})\n",
        args.data.display(),
        dataset.num_samples(),
        dataset.bins.len()
    );
    let _ = writeln!(
        md,
        "B = {} per rank, {} steps, presort group G = {}, compute per sample s + s²/(6·{}) \
         (s = padded length). Efficiency: real / computed tokens. Imbalance: mean over steps of \
         max / mean rank compute. Step time: Σ slowest rank, relative to random + max padding.\n",
        args.local_batch, args.steps, args.presort_group, args.hidden
    );
    let _ = writeln!(md, "| bin | samples |\n|---|---|");
    for (bin, lengths) in dataset.bins.iter().zip(dataset.lengths.iter()) {
        let _ = writeln!(md, "| {}–{} | {} |", bin.lo, bin.hi, lengths.len());
    }
    for (w, rows) in tables {
        let _ = writeln!(
            md,
            "\n**W = {w}**\n\n| sampler | padding | efficiency | imbalance | step time |\n|---|---|---|---|---|"
        );
        for r in rows {
            let _ = writeln!(
                md,
                "| {} | {} | {:.3} | {:.3} | {:.3} |",
                r.sampler,
                r.padding_label(),
                r.padding_efficiency,
                r.imbalance,
                r.step_time_ratio
            );
        }
    }
    md
}

/// Left: the histogram of real lengths, coloured by bin. Right: rank imbalance per sampler and
/// padding mode for each simulated world size.
fn plot(path: &Path, dataset: &ShardedDataset, tables: &[(usize, Vec<BalanceRow>)]) -> Result<()> {
    use plotters::prelude::*;
    crate::plot::register_font()?;
    let tmp = path.with_file_name(".balance.png.tmp.png");
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(&tmp, (1400, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(560);
        let palette = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

        // Histogram, 8-token buckets.
        let longest = dataset.bins.iter().map(|b| b.hi).max().unwrap_or(8);
        let buckets = longest.div_ceil(8);
        let mut counts = vec![vec![0usize; buckets]; dataset.bins.len()];
        for (b, lengths) in dataset.lengths.iter().enumerate() {
            for &l in lengths {
                counts[b][(l as usize).saturating_sub(1) / 8] += 1;
            }
        }
        let top = counts.iter().flatten().copied().max().unwrap_or(1) as f64 * 1.05;
        let mut chart = ChartBuilder::on(&left)
            .caption("sample lengths by bin", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..(buckets * 8) as f64, 0f64..top)?;
        chart
            .configure_mesh()
            .x_desc("real length (tokens)")
            .y_desc("samples")
            .draw()?;
        for (b, bin_counts) in counts.iter().enumerate() {
            let color = palette[b % palette.len()];
            chart
                .draw_series(bin_counts.iter().enumerate().filter(|(_, c)| **c > 0).map(
                    |(i, &c)| {
                        Rectangle::new(
                            [((i * 8) as f64, 0.0), ((i * 8 + 8) as f64, c as f64)],
                            color.mix(0.6).filled(),
                        )
                    },
                ))?
                .label(format!("{}–{}", dataset.bins[b].lo, dataset.bins[b].hi))
                .legend(crate::plot::swatch(color));
        }
        crate::plot::legend(&mut chart)?;

        // Imbalance bars: one group per sampler × padding, one bar per world size.
        let rows = tables.first().map(|(_, r)| r.len()).unwrap_or(0);
        let worst = tables
            .iter()
            .flat_map(|(_, r)| r.iter().map(|x| x.imbalance))
            .fold(1.0, f64::max);
        let labels: Vec<String> = tables
            .first()
            .map(|(_, r)| {
                r.iter()
                    .map(|x| format!("{} {}", x.sampler, x.padding_label()))
                    .collect()
            })
            .unwrap_or_default();
        let mut chart = ChartBuilder::on(&right)
            .caption("rank imbalance (max / mean compute)", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(150)
            .y_label_area_size(60)
            .build_cartesian_2d(
                0f64..rows as f64,
                1.0f64..(1.0 + (worst - 1.0) * 1.1).max(1.01),
            )?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|_| String::new())
            .y_desc("imbalance")
            .draw()?;
        // Category names under the bars, drawn on the whole canvas (absolute pixels) so that
        // they are not clipped to the plotting area.
        let label_style = ("sans-serif", 13)
            .into_font()
            .transform(FontTransform::Rotate90);
        for (i, label) in labels.iter().enumerate() {
            let (px, py) = chart.backend_coord(&(i as f64 + 0.5, 1.0));
            root.draw(&Text::new(
                label.clone(),
                (px + 6, py + 8),
                label_style.clone(),
            ))?;
        }
        let n = tables.len().max(1) as f64;
        for (t, (w, table)) in tables.iter().enumerate() {
            let color = palette[t % palette.len()];
            chart
                .draw_series(table.iter().enumerate().map(|(i, r)| {
                    let x0 = i as f64 + 0.1 + 0.8 * t as f64 / n;
                    Rectangle::new([(x0, 1.0), (x0 + 0.8 / n, r.imbalance)], color.filled())
                }))?
                .label(format!("W = {w}"))
                .legend(crate::plot::swatch(color));
        }
        crate::plot::legend(&mut chart)?;
        root.present()?;
        Ok(())
    };
    if let Err(e) = draw() {
        let _ = std::fs::remove_file(&tmp);
        bail!("{}: cannot draw the plot: {e}", path.display());
    }
    std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot write", path.display()))
}
