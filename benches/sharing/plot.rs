//! The sharing bench's pictures: each server's memory over a row's time, its phases marked,
//! as an SVG beside the JSON (plotters' SVG backend: text is left to the viewer's fonts).

use std::path::Path;

use plotters::prelude::*;

/// One line per server over time.
pub struct Lines<'a> {
    /// The picture's title.
    pub title: &'a str,
    /// What the lines are, on the y axis.
    pub unit: &'a str,
    /// Per sample: seconds, then one value per server.
    pub points: &'a [(f64, Vec<f64>)],
    /// Seconds at which each phase started (phase `p` is server `p`'s burst).
    pub phases: &'a [f64],
    /// A horizontal line (M / 3, a server's guarantee), if any.
    pub mark: Option<(f64, &'a str)>,
}

/// Draws `lines` into an SVG at `path`.
pub fn draw(path: &Path, lines: &Lines) -> Result<(), String> {
    draw_in(path, lines).map_err(|e| format!("{}: {e}", path.display()))
}

fn draw_in(path: &Path, lines: &Lines) -> Result<(), Box<dyn std::error::Error>> {
    let x_end = lines.points.last().map_or(1.0, |p| p.0).max(1.0);
    let y_top = lines
        .points
        .iter()
        .flat_map(|p| p.1.iter().copied())
        .chain(lines.mark.map(|m| m.0))
        .fold(1.0f64, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(lines.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_end, 0f64..y_top)?;
    chart
        .configure_mesh()
        .x_desc("seconds into the row")
        .y_desc(lines.unit)
        .draw()?;
    for (p, at) in lines.phases.iter().enumerate() {
        let colour = Palette99::pick(p).mix(0.5);
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(*at, 0.0), (*at, y_top)],
            colour.stroke_width(1),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            format!("phase {p}: server {p}'s burst"),
            (*at + x_end * 0.005, y_top * 0.97),
            ("sans-serif", 12),
        )))?;
    }
    if let Some((y, label)) = lines.mark {
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(0.0, y), (x_end, y)],
            BLACK.mix(0.4).stroke_width(1),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            label.to_string(),
            (x_end * 0.01, y),
            ("sans-serif", 12),
        )))?;
    }
    let servers = lines.points.first().map_or(0, |p| p.1.len());
    for s in 0..servers {
        let colour = Palette99::pick(s);
        let series = lines.points.iter().map(|(t, v)| (*t, v[s]));
        chart
            .draw_series(LineSeries::new(series, colour.stroke_width(2)))?
            .label(format!("server {s}"))
            .legend(move |(x, y)| {
                PathElement::new(
                    vec![(x, y), (x + 18, y)],
                    Palette99::pick(s).stroke_width(2),
                )
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
