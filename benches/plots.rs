//! The README's plots, drawn from one benchmark run with `plotters` as SVG
//! (text is left to the viewer's fonts, so nothing here needs a font file).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

/// One bar of [`rates`]: a case and measure, its rate, and which kind of
/// measure it is (bars of a kind share a colour).
pub struct Bar {
    /// What the bar is, shown beside it ("tcp, 1 rank: commit, pull").
    pub label: String,
    /// Its rate in GB/s.
    pub gb_per_s: f64,
    /// Index of its kind in the legend's order.
    pub kind: usize,
}

/// Writes a horizontal bar chart of rates (icheck's commits and restarts
/// beside raw fabric RMA and memcpy of the same run) to `path`.
pub fn rates(path: &Path, title: &str, kinds: &[&str], bars: &[Bar]) -> Result<()> {
    let plot_err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", path.display());
    let rows = i32::try_from(bars.len())?;
    let max = bars.iter().map(|b| b.gb_per_s).fold(0.0, f64::max).max(0.1) * 1.1;
    let height = 120 + 22 * bars.len() as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(330)
        .build_cartesian_2d(0f64..max, (0..rows).into_segmented())
        .map_err(|e| plot_err(&e))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc("GB/s")
        .y_labels(bars.len())
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => {
                usize::try_from(*i).ok().and_then(|i| bars.get(i)).map_or(String::new(), |b| b.label.clone())
            }
            _ => String::new(),
        })
        .draw()
        .map_err(|e| plot_err(&e))?;
    for (kind, name) in kinds.iter().enumerate() {
        let colour = Palette99::pick(kind).to_rgba();
        let mine = bars.iter().enumerate().filter(|(_, b)| b.kind == kind);
        chart
            .draw_series(mine.map(|(row, bar)| {
                let row = i32::try_from(row).unwrap_or(i32::MAX);
                let mut rect = Rectangle::new(
                    [(0.0, SegmentValue::Exact(row)), (bar.gb_per_s, SegmentValue::Exact(row + 1))],
                    colour.filled(),
                );
                rect.set_margin(3, 3, 0, 0);
                rect
            }))
            .map_err(|e| plot_err(&e))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| plot_err(&e))?;
    root.present().map_err(|e| plot_err(&e))?;
    Ok(())
}

/// Writes commit time against the changed fraction of a rank's memory
/// (each curve: a name and its points, percent changed and milliseconds)
/// beside the plain commit and the checksum pass alone, to `path`.
pub fn incremental(
    path: &Path,
    title: &str,
    curves: &[(&str, Vec<(f64, f64)>)],
    plain_ms: f64,
    floor_ms: f64,
) -> Result<()> {
    let plot_err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", path.display());
    let max = curves.iter().flat_map(|(_, points)| points.iter().map(|p| p.1)).fold(plain_ms, f64::max) * 1.15;
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..100f64, 0f64..max)
        .map_err(|e| plot_err(&e))?;
    chart
        .configure_mesh()
        .x_desc("memory changed since the previous commit (%, one contiguous range)")
        .y_desc("commit time (ms)")
        .draw()
        .map_err(|e| plot_err(&e))?;
    // Curves take the first colours, the reference lines the next ones.
    for (index, (name, points)) in curves.iter().enumerate() {
        let mut sorted = points.clone();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let colour = Palette99::pick(if index == 0 { 0 } else { index + 2 }).to_rgba();
        chart
            .draw_series(LineSeries::new(sorted.iter().copied(), colour.stroke_width(2)))
            .map_err(|e| plot_err(&e))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
        chart.draw_series(sorted.iter().map(|p| Circle::new(*p, 4, colour.filled()))).map_err(|e| plot_err(&e))?;
    }
    for (kind, (name, ms)) in
        [("plain commit (every byte sent)", plain_ms), ("checksum pass alone", floor_ms)].into_iter().enumerate()
    {
        let colour = Palette99::pick(kind + 1).to_rgba();
        chart
            .draw_series(LineSeries::new([(0.0, ms), (100.0, ms)], colour.stroke_width(2)))
            .map_err(|e| plot_err(&e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| plot_err(&e))?;
    root.present().map_err(|e| plot_err(&e))?;
    Ok(())
}
