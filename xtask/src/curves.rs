//! `curves.png` beside a run's `metrics.jsonl`: training losses, held-out accuracies, learning
//! rate and gradient norm against the step, redrawn at each evaluation (and at the end).

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

use crate::plot::{Chart, legend, register_font, swatch};

/// One metric's points, (step, value).
type Series = Vec<(f64, f64)>;

/// A panel: its title and its lines (series index, legend label, colour).
type Panel<'a> = (&'a str, &'a [(usize, &'a str, RGBColor)]);

/// The series of `metrics.jsonl`: from `train` records the losses, learning rate and gradient
/// norm; from `eval` records the accuracies.
fn read(metrics: &Path) -> Result<[Series; 7]> {
    let text = std::fs::read_to_string(metrics).with_context(|| metrics.display().to_string())?;
    let mut out: [Series; 7] = Default::default();
    for line in text.lines() {
        let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(step) = record["step"].as_f64() else {
            continue;
        };
        let keys: &[(usize, &str)] = match record["event"].as_str() {
            Some("train") => &[
                (0, "loss"),
                (1, "mlm_loss"),
                (2, "nsp_loss"),
                (5, "lr"),
                (6, "grad_norm"),
            ],
            Some("eval") => &[(3, "mlm_accuracy"), (4, "nsp_accuracy")],
            _ => &[],
        };
        for &(i, key) in keys {
            if let Some(v) = record[key].as_f64().filter(|v| v.is_finite()) {
                out[i].push((step, v));
            }
        }
    }
    Ok(out)
}

fn range(series: &[&Series]) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
    let points = || series.iter().flat_map(|s| s.iter());
    let x_max = points().map(|p| p.0).fold(1.0, f64::max);
    let (lo, hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(1e-9);
    (0.0..x_max, (lo - pad)..(hi + pad))
}

/// Draws `curves.png` next to `metrics` (through a temporary file and a rename).
///
/// # Errors
/// The metrics cannot be read, no font is installed, or the PNG cannot be written.
pub fn draw(metrics: &Path) -> Result<()> {
    register_font()?;
    let series = read(metrics)?;
    let path = metrics.with_file_name("curves.png");
    let tmp = metrics.with_file_name(".curves.png.tmp.png");
    let panels: [Panel; 4] = [
        (
            "training loss",
            &[
                (0, "total", BLACK),
                (1, "masked LM", BLUE),
                (2, "next sentence", RED),
            ],
        ),
        (
            "held-out accuracy",
            &[(3, "masked LM", BLUE), (4, "next sentence", RED)],
        ),
        ("learning rate", &[(5, "lr", GREEN)]),
        (
            "gradient norm (before clipping)",
            &[(6, "L2 norm", MAGENTA)],
        ),
    ];
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(&tmp, (1200, 800)).into_drawing_area();
        root.fill(&WHITE)?;
        for (area, (title, lines)) in root.split_evenly((2, 2)).iter().zip(panels) {
            let shown: Vec<&Series> = lines.iter().map(|(i, _, _)| &series[*i]).collect();
            let (x, y) = range(&shown);
            let mut chart: Chart = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(60)
                .build_cartesian_2d(x, y)?;
            chart.configure_mesh().x_desc("step").draw()?;
            for (i, label, color) in lines {
                chart
                    .draw_series(std::iter::once(PathElement::new(series[*i].clone(), color)))?
                    .label(*label)
                    .legend(swatch(*color));
            }
            legend(&mut chart)?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| path.display().to_string())
}

/// The trainer's evaluation hook ([`ember_trainer::RunOptions::on_eval`]): a plot that cannot
/// be drawn (no font installed, say) warns once and never stops the run.
pub fn on_eval(metrics: &Path) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if let Err(e) = draw(metrics) {
        WARNED.call_once(|| tracing::warn!("curves.png not drawn: {e:#}"));
    }
}
