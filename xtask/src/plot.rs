//! What the PNG plots share: the font, the chart type, legends.

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{Context, Result};

/// Registers the font of the plots' text once per process: `EMBER_FONT`, else Debian's
/// DejaVu Sans.
///
/// # Errors
/// The font file cannot be read or is not TrueType (the message says how to install one).
pub fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| load_font().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn load_font() -> Result<()> {
    let path = std::env::var_os("EMBER_FONT")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf".into());
    let bytes = std::fs::read(&path).with_context(|| {
        format!(
            "{}: the plot needs a TrueType font (Debian: apt-get install fonts-dejavu-core, or set EMBER_FONT)",
            path.display()
        )
    })?;
    plotters::style::register_font(
        "sans-serif",
        plotters::style::FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| anyhow::anyhow!("{}: not a usable TrueType font", path.display()))
}

pub type Chart<'a, 'b> = plotters::chart::ChartContext<
    'a,
    plotters::prelude::BitMapBackend<'b>,
    plotters::coord::cartesian::Cartesian2d<
        plotters::coord::types::RangedCoordf64,
        plotters::coord::types::RangedCoordf64,
    >,
>;

/// The legend box of a chart, top right.
pub fn legend<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// A legend entry's colour swatch.
pub fn swatch(
    color: plotters::style::RGBColor,
) -> impl Fn((i32, i32)) -> plotters::element::Rectangle<(i32, i32)> {
    use plotters::style::Color;
    move |(x, y)| plotters::element::Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
}
