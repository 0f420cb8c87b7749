//! A small hand-written SVG line plot (no dependencies): axes with ticks and grid lines, an
//! optional log2 x axis, one colour per series from a colour-blind-friendly palette, markers,
//! a legend and notes under the plot.

use std::fmt::Write as _;

/// One line of a [`Plot`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Legend entry.
    pub name: String,
    /// `(x, y)` points, joined in the given order; non-finite points (and those beyond
    /// ±1e150, and on a log2 x axis those with `x <= 0`) are skipped and break the line.
    pub points: Vec<(f64, f64)>,
    /// Draw the line dashed.
    pub dashed: bool,
    /// Colour (an index into [`PALETTE`]) and marker; None: by the series' position. Two
    /// series of one method (solid and dashed) can share a colour this way.
    pub style: Option<usize>,
}

/// A line plot, rendered by [`Plot::to_svg`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plot {
    /// Title above the plot.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label beside the y axis.
    pub y_label: String,
    /// Log2 x axis, ticks at powers of two (`8`, `16`, ..., `1024`).
    pub log2_x: bool,
    /// The lines, coloured in order from [`PALETTE`].
    pub series: Vec<Series>,
    /// Small text lines printed under the plot (assumptions, sources); long ones are wrapped
    /// at spaces to fit the width.
    pub notes: Vec<String>,
}

/// Series colours, in order (Okabe–Ito, colour-blind friendly; yellow last as it is faint on
/// white). A ninth series and beyond reuse the colours with another marker shape.
pub const PALETTE: [&str; 8] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
];

/// Canvas width in pixels.
const WIDTH: f64 = 800.0;
/// Canvas height in pixels without the notes.
const HEIGHT: f64 = 500.0;
/// Plot area: left, top and bottom edges (the right edge depends on the legend's width).
const PLOT_LEFT: f64 = 75.0;
const PLOT_TOP: f64 = 45.0;
const PLOT_BOTTOM: f64 = 430.0;
/// Height of one note line.
const NOTE_LINE: f64 = 15.0;
/// Characters of a note line that fit the width (11 px sans-serif).
const NOTE_CHARS: usize = 125;
/// Coordinates at or beyond this magnitude are not drawn (their range would overflow).
const MAX_ABS: f64 = 1e150;
/// Most ticks on an axis.
const MAX_TICKS: usize = 8;

/// The data range of an axis and where its ticks go.
struct Axis {
    /// Low and high ends, in axis units (log2 of the value on a log2 axis).
    lo: f64,
    hi: f64,
    /// Tick positions, in axis units, with their labels.
    ticks: Vec<(f64, String)>,
}

impl Plot {
    /// The plot as a complete SVG document, about 800x500 pixels (taller by a line per note),
    /// ending with `</svg>\n`. The y axis starts at 0 (at the data minimum if that is
    /// negative) and ends at a rounded value above the data maximum, with 5 to 8 ticks; a
    /// dashed reference line marks y = 1 (the "no speedup" line) when it is in range. All text
    /// is XML-escaped. Never panics: an empty plot gets default axes.
    pub fn to_svg(&self) -> String {
        let segments: Vec<Vec<Vec<(f64, f64)>>> =
            self.series.iter().map(|s| self.segments(s)).collect();
        let pts = || segments.iter().flatten().flatten();
        let (mut x_min, mut x_max, mut y_min, mut y_max) = (
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::INFINITY,
            f64::NEG_INFINITY,
        );
        for &(x, y) in pts() {
            x_min = x_min.min(x);
            x_max = x_max.max(x);
            y_min = y_min.min(y);
            y_max = y_max.max(y);
        }
        let have_data = x_min.is_finite();
        let x_axis = if self.log2_x {
            if have_data {
                log2_axis(x_min, x_max)
            } else {
                log2_axis(8.0, 1024.0)
            }
        } else if have_data {
            linear_axis(x_min, x_max)
        } else {
            linear_axis(0.0, 1.0)
        };
        let y_axis = if have_data {
            linear_axis(y_min.min(0.0), y_max)
        } else {
            linear_axis(0.0, 1.0)
        };

        let legend_chars = self
            .series
            .iter()
            .map(|s| s.name.chars().count())
            .max()
            .unwrap_or(0);
        let legend_w = if self.series.is_empty() {
            0.0
        } else {
            (48.0 + 7.0 * legend_chars as f64).clamp(100.0, 300.0)
        };
        let plot_right = if self.series.is_empty() {
            WIDTH - 25.0
        } else {
            WIDTH - 20.0 - legend_w - 15.0
        };
        let note_lines: Vec<String> = self
            .notes
            .iter()
            .flat_map(|n| wrap(n, NOTE_CHARS))
            .collect();
        let height = if note_lines.is_empty() {
            HEIGHT
        } else {
            HEIGHT + NOTE_LINE * note_lines.len() as f64 + 5.0
        };
        let sx = |u: f64| {
            PLOT_LEFT + (u - x_axis.lo) / (x_axis.hi - x_axis.lo) * (plot_right - PLOT_LEFT)
        };
        let sy = |v: f64| {
            PLOT_BOTTOM - (v - y_axis.lo) / (y_axis.hi - y_axis.lo) * (PLOT_BOTTOM - PLOT_TOP)
        };
        let to_x = |x: f64| if self.log2_x { x.log2() } else { x };

        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">"#
        );
        let _ = writeln!(
            s,
            r#"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="26" font-size="16" font-weight="bold" text-anchor="middle">{}</text>"#,
            WIDTH / 2.0,
            escape(&self.title)
        );

        // Grid lines and tick labels.
        for (u, label) in &x_axis.ticks {
            let x = sx(*u);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{PLOT_TOP}" x2="{x:.1}" y2="{PLOT_BOTTOM}" stroke="#e0e0e0" stroke-width="1"/>"##
            );
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{PLOT_BOTTOM}" x2="{x:.1}" y2="{:.1}" stroke="#333333" stroke-width="1"/>"##,
                PLOT_BOTTOM + 5.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
                PLOT_BOTTOM + 19.0,
                escape(label)
            );
        }
        for (v, label) in &y_axis.ticks {
            let y = sy(*v);
            let _ = writeln!(
                s,
                r##"<line x1="{PLOT_LEFT}" y1="{y:.1}" x2="{plot_right:.1}" y2="{y:.1}" stroke="#e0e0e0" stroke-width="1"/>"##
            );
            let _ = writeln!(
                s,
                r##"<line x1="{:.1}" y1="{y:.1}" x2="{PLOT_LEFT}" y2="{y:.1}" stroke="#333333" stroke-width="1"/>"##,
                PLOT_LEFT - 5.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">{}</text>"#,
                PLOT_LEFT - 8.0,
                y + 4.0,
                escape(label)
            );
        }
        if y_axis.lo < 1.0 && 1.0 <= y_axis.hi {
            let y = sy(1.0);
            let _ = writeln!(
                s,
                r##"<line x1="{PLOT_LEFT}" y1="{y:.1}" x2="{plot_right:.1}" y2="{y:.1}" stroke="#888888" stroke-width="1" stroke-dasharray="3 3"/>"##
            );
            let tick_nearby = y_axis.ticks.iter().any(|(v, _)| (sy(*v) - y).abs() < 12.0);
            if !tick_nearby {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">1</text>"#,
                    PLOT_LEFT - 8.0,
                    y + 4.0
                );
            }
        }
        // Axes.
        let _ = writeln!(
            s,
            r##"<rect x="{PLOT_LEFT}" y="{PLOT_TOP}" width="{:.1}" height="{:.1}" fill="none" stroke="#333333" stroke-width="1"/>"##,
            plot_right - PLOT_LEFT,
            PLOT_BOTTOM - PLOT_TOP
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="13" text-anchor="middle">{}</text>"#,
            (PLOT_LEFT + plot_right) / 2.0,
            PLOT_BOTTOM + 42.0,
            escape(&self.x_label)
        );
        let (ylx, yly) = (20.0, (PLOT_TOP + PLOT_BOTTOM) / 2.0);
        let _ = writeln!(
            s,
            r#"<text x="{ylx}" y="{yly:.1}" font-size="13" text-anchor="middle" transform="rotate(-90 {ylx} {yly:.1})">{}</text>"#,
            escape(&self.y_label)
        );

        // Lines and markers.
        for (i, (series, segs)) in self.series.iter().zip(&segments).enumerate() {
            let i = series.style.unwrap_or(i);
            let colour = PALETTE[i % PALETTE.len()];
            let dash = if series.dashed {
                r#" stroke-dasharray="7 4""#
            } else {
                ""
            };
            for seg in segs.iter().filter(|seg| seg.len() > 1) {
                let coords: Vec<String> = seg
                    .iter()
                    .map(|&(x, y)| format!("{:.1},{:.1}", sx(to_x(x)), sy(y)))
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>"#,
                    coords.join(" ")
                );
            }
            for &(x, y) in segs.iter().flatten() {
                marker(&mut s, i, sx(to_x(x)), sy(y), colour);
            }
        }

        // Legend.
        if !self.series.is_empty() {
            let lx = plot_right + 15.0;
            let lh = 10.0 + 20.0 * self.series.len() as f64;
            let _ = writeln!(
                s,
                r##"<rect x="{lx:.1}" y="{PLOT_TOP}" width="{legend_w:.1}" height="{lh:.1}" fill="white" stroke="#999999" stroke-width="1"/>"##
            );
            for (i, series) in self.series.iter().enumerate() {
                let y = PLOT_TOP + 15.0 + 20.0 * i as f64;
                let i = series.style.unwrap_or(i);
                let colour = PALETTE[i % PALETTE.len()];
                let dash = if series.dashed {
                    r#" stroke-dasharray="7 4""#
                } else {
                    ""
                };
                let _ = writeln!(
                    s,
                    r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="2"{dash}/>"#,
                    lx + 8.0,
                    lx + 36.0
                );
                marker(&mut s, i, lx + 22.0, y, colour);
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
                    lx + 42.0,
                    y + 4.0,
                    escape(&series.name)
                );
            }
        }

        // Notes.
        for (i, note) in note_lines.iter().enumerate() {
            let _ = writeln!(
                s,
                r##"<text x="10" y="{:.1}" font-size="11" fill="#444444">{}</text>"##,
                HEIGHT + NOTE_LINE * i as f64 - 2.0,
                escape(note)
            );
        }
        s.push_str("</svg>\n");
        s
    }

    /// The drawable runs of `series`' points: split at non-finite or huge points (and at
    /// `x <= 0` on a log2 axis).
    fn segments(&self, series: &Series) -> Vec<Vec<(f64, f64)>> {
        let mut segs = vec![Vec::new()];
        for &(x, y) in &series.points {
            let ok = x.abs() < MAX_ABS && y.abs() < MAX_ABS && (!self.log2_x || x > 0.0);
            if ok {
                segs.last_mut().expect("never empty").push((x, y));
            } else if !segs.last().expect("never empty").is_empty() {
                segs.push(Vec::new());
            }
        }
        segs.retain(|seg| !seg.is_empty());
        segs
    }
}

/// `text` split at spaces into lines of at most `width` characters (a longer word keeps its
/// own line); at least one line.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        } else if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

/// Draws the marker of series `i` (circle, square, triangle or diamond) at `(x, y)`.
fn marker(s: &mut String, i: usize, x: f64, y: f64, colour: &str) {
    let _ = match (i + i / PALETTE.len()) % 4 {
        0 => writeln!(
            s,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{colour}"/>"#
        ),
        1 => writeln!(
            s,
            r#"<rect x="{:.1}" y="{:.1}" width="7" height="7" fill="{colour}"/>"#,
            x - 3.5,
            y - 3.5
        ),
        2 => writeln!(
            s,
            r#"<polygon points="{x:.1},{:.1} {:.1},{:.1} {:.1},{:.1}" fill="{colour}"/>"#,
            y - 4.5,
            x + 4.5,
            y + 3.5,
            x - 4.5,
            y + 3.5
        ),
        _ => writeln!(
            s,
            r#"<polygon points="{x:.1},{:.1} {:.1},{y:.1} {x:.1},{:.1} {:.1},{y:.1}" fill="{colour}"/>"#,
            y - 4.5,
            x + 4.5,
            y + 4.5,
            x - 4.5
        ),
    };
}

/// A log2 axis covering `[lo, hi]` (both positive): whole powers of two at the ends, a tick
/// at every power (every second, fourth ... when there would be more than [`MAX_TICKS`]).
fn log2_axis(lo: f64, hi: f64) -> Axis {
    let mut e_lo = lo.log2().floor();
    let mut e_hi = hi.log2().ceil();
    if e_hi <= e_lo {
        e_lo -= 1.0;
        e_hi += 1.0;
    }
    let span = e_hi - e_lo;
    let mut step = 1.0;
    while span / step + 1.0 > MAX_TICKS as f64 + 0.5 {
        step *= 2.0;
    }
    let mut ticks = Vec::new();
    let mut e = e_lo;
    while e <= e_hi + 1e-9 {
        ticks.push((e, pow2_label(e)));
        e += step;
    }
    Axis {
        lo: e_lo,
        hi: e_hi,
        ticks,
    }
}

/// The label of `2^e`: an integer up to `2^20`, a decimal down to `2^-6`, `2^e` beyond.
fn pow2_label(e: f64) -> String {
    if (0.0..=20.0).contains(&e) {
        format!("{}", 1u64 << (e as u32))
    } else if (-6.0..0.0).contains(&e) {
        trim_number(format!("{:.6}", e.exp2()))
    } else {
        format!("2^{e}")
    }
}

/// A linear axis covering `[lo, hi]` with ends at multiples of a 1/2/2.5/5 x 10^k step, the
/// smallest such step that gives at most [`MAX_TICKS`] ticks.
fn linear_axis(lo: f64, hi: f64) -> Axis {
    let (lo, hi) = if hi - lo > (1e-9 * lo.abs().max(hi.abs())).max(1e-100) {
        (lo, hi)
    } else if lo.abs() < 1e-100 {
        (0.0, 1.0)
    } else {
        // One value: a range around it that includes 0 when the value is positive.
        let pad = lo.abs() * 0.5;
        (if lo > 0.0 { 0.0 } else { lo - pad }, hi + pad)
    };
    let raw = (hi - lo) / (MAX_TICKS - 1) as f64;
    let mut exp = raw.log10().floor() - 1.0;
    let (step, t_lo, t_hi) = 'search: loop {
        for m in [1.0, 2.0, 2.5, 5.0] {
            let step = m * 10f64.powf(exp);
            let t_lo = (lo / step).floor() * step;
            let t_hi = (hi / step).ceil() * step;
            if (((t_hi - t_lo) / step).round() as usize) < MAX_TICKS {
                break 'search (step, t_lo, t_hi);
            }
        }
        exp += 1.0;
    };
    let n = ((t_hi - t_lo) / step).round() as usize;
    let ticks = (0..=n)
        .map(|k| {
            let v = t_lo + k as f64 * step;
            // Snap to the step's precision so labels read `0.3`, not `0.30000000000000004`.
            let v = (v / step).round() * step;
            (v, number_label(v, step))
        })
        .collect();
    Axis {
        lo: t_lo,
        hi: t_hi,
        ticks,
    }
}

/// `v` with as many decimals as `step` needs.
fn number_label(v: f64, step: f64) -> String {
    let decimals = (-(step.log10().floor()) + 1.0).clamp(0.0, 12.0) as usize;
    let text = trim_number(format!("{v:.decimals$}"));
    if text == "-0" {
        "0".into()
    } else {
        text
    }
}

/// A decimal number without trailing zeros after the point (`2.50` -> `2.5`, `3.0` -> `3`).
fn trim_number(text: String) -> String {
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// `text` escaped for SVG text and attribute values; control characters XML forbids dropped.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(' '),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep() -> Plot {
        let sizes: Vec<f64> = (3..=10).map(|e| f64::from(1u32 << e)).collect();
        Plot {
            title: "Speedup <vs> raw & co".into(),
            x_label: "message size (KiB)".into(),
            y_label: "speedup over raw".into(),
            log2_x: true,
            series: vec![
                Series {
                    name: "delta <fast> & \"good\"".into(),
                    points: sizes.iter().map(|&x| (x, 1.0 + x / 512.0)).collect(),
                    dashed: false,
                    style: None,
                },
                Series {
                    name: "raw".into(),
                    points: sizes.iter().map(|&x| (x, 1.0)).collect(),
                    dashed: true,
                    style: None,
                },
            ],
            notes: vec!["assumes 400 Gb/s links; 1 < 2".into()],
        }
    }

    #[test]
    fn document_shape() {
        let svg = sweep().to_svg();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<svg").count(), 1);
        assert!(svg.contains(r#"fill="white""#));
        assert!(
            svg.contains(r#"height="520""#),
            "500 + one note line + padding"
        );
        assert!(svg.contains("stroke-dasharray=\"7 4\""));
        assert!(svg.contains(PALETTE[0]) && svg.contains(PALETTE[1]));
    }

    #[test]
    fn text_is_escaped() {
        let svg = sweep().to_svg();
        assert!(svg.contains("delta &lt;fast&gt; &amp; &quot;good&quot;"));
        assert!(svg.contains("Speedup &lt;vs&gt; raw &amp; co"));
        assert!(svg.contains(">assumes 400 Gb/s links; 1 &lt; 2</text>"));
        assert!(!svg.contains("<fast>"));
        assert!(!svg.contains("& "));
        assert_eq!(escape("a\u{1}b'"), "ab&apos;");
    }

    #[test]
    fn log2_ticks() {
        let svg = sweep().to_svg();
        for label in ["8", "16", "32", "64", "128", "256", "512", "1024"] {
            assert!(svg.contains(&format!(">{label}</text>")), "tick {label}");
        }
        assert!(!svg.contains(">2048</text>"));
        assert!(!svg.contains(">4</text>"));
        let axis = log2_axis(8.0, 1024.0);
        assert_eq!((axis.lo, axis.hi), (3.0, 10.0));
        assert_eq!(axis.ticks.len(), 8);
        let wide = log2_axis(1.0, (1u64 << 20) as f64);
        let labels: Vec<&str> = wide.ticks.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(labels, ["1", "16", "256", "4096", "65536", "1048576"]);
        assert_eq!(pow2_label(-2.0), "0.25");
        assert_eq!(pow2_label(24.0), "2^24");
    }

    #[test]
    fn linear_ticks() {
        let labels = |a: Axis| -> Vec<String> { a.ticks.into_iter().map(|(_, l)| l).collect() };
        assert_eq!(
            labels(linear_axis(0.0, 3.0)),
            ["0", "0.5", "1", "1.5", "2", "2.5", "3"]
        );
        assert_eq!(
            labels(linear_axis(0.0, 1.7)),
            ["0", "0.25", "0.5", "0.75", "1", "1.25", "1.5", "1.75"]
        );
        assert_eq!(
            labels(linear_axis(0.0, 12.0)),
            ["0", "2", "4", "6", "8", "10", "12"]
        );
        assert_eq!(
            labels(linear_axis(0.0, 0.3)),
            ["0", "0.05", "0.1", "0.15", "0.2", "0.25", "0.3"]
        );
        assert_eq!(labels(linear_axis(-1.0, 1.0)).first().unwrap(), "-1");
        let one = linear_axis(1.0, 1.0);
        assert_eq!((one.lo, one.hi), (0.0, 1.5));
        for (lo, hi) in [
            (0.0, 3.0),
            (0.0, 1.7),
            (0.0, 12.0),
            (0.0, 97.0),
            (0.0, 0.013),
        ] {
            let n = linear_axis(lo, hi).ticks.len();
            assert!((5..=8).contains(&n), "{lo}..{hi}: {n} ticks");
        }
    }

    #[test]
    fn long_notes_wrap() {
        assert_eq!(wrap("aa bb cc", 5), ["aa bb", "cc"]);
        assert_eq!(wrap("aaaaaaa b", 5), ["aaaaaaa", "b"]);
        assert_eq!(wrap("", 5), [""]);
        let mut plot = sweep();
        plot.notes = vec!["word ".repeat(50), "short".into()];
        let svg = plot.to_svg();
        // 250 characters wrap to two lines of at most 125, plus "short": three lines.
        assert!(svg.contains(r#"height="550""#), "{svg}");
        assert_eq!(svg.matches(r#"font-size="11""#).count(), 3);
    }

    #[test]
    fn reference_line_at_one() {
        let svg = sweep().to_svg();
        assert!(svg.contains(r#"stroke-dasharray="3 3""#));
        // y from 0 to 3 in steps of 0.5: "1" is a tick label.
        assert!(svg.contains(">1</text>"));
    }

    #[test]
    fn nan_and_inf_are_skipped() {
        let mut plot = sweep();
        plot.series[0].points[3] = (f64::NAN, 2.0);
        plot.series[1].points[2] = (64.0, f64::INFINITY);
        plot.series[1].points.push((0.0, 1.0)); // x <= 0 on a log2 axis
        let svg = plot.to_svg();
        assert!(!svg.contains("NaN"));
        assert!(!svg.to_ascii_lowercase().contains("inf"));
        // Series 0 is split in two runs around the NaN: two polylines.
        assert_eq!(svg.matches(PALETTE[0]).count(), 2 + 7 + 2);
        assert!(svg.ends_with("</svg>\n"));
    }

    #[test]
    fn degenerate_plots() {
        let empty = Plot::default().to_svg();
        assert!(empty.starts_with("<svg") && empty.ends_with("</svg>\n"));
        assert!(!empty.contains("NaN"));
        assert!(!empty.contains("<polyline"));

        let single = Plot {
            log2_x: true,
            series: vec![Series {
                name: "one".into(),
                points: vec![(64.0, 2.0)],
                dashed: false,
                style: None,
            }],
            ..Plot::default()
        }
        .to_svg();
        assert!(!single.contains("NaN") && !single.contains("inf"));
        assert!(!single.contains("<polyline"));
        assert!(single.contains("<circle"));
        assert!(single.contains(">32</text>") && single.contains(">128</text>"));

        let all_nan = Plot {
            series: vec![Series {
                name: "nan".into(),
                points: vec![(f64::NAN, f64::NAN)],
                dashed: true,
                style: None,
            }],
            ..Plot::default()
        }
        .to_svg();
        assert!(!all_nan.contains("NaN"));
        assert!(all_nan.contains(">nan</text>"));

        let many = Plot {
            series: (0..10)
                .map(|i| Series {
                    name: format!("s{i}"),
                    points: vec![(i as f64, -(i as f64)), (i as f64 + 1.0, 0.5)],
                    dashed: i % 2 == 1,
                    style: None,
                })
                .collect(),
            ..Plot::default()
        }
        .to_svg();
        assert_eq!(many.matches("<polyline").count(), 10);
        assert!(!many.contains("NaN"));
    }

    /// Two series with one style share its colour (one method drawn solid and dashed).
    #[test]
    fn a_style_shares_a_colour() {
        let svg = Plot {
            series: ["a", "b"]
                .iter()
                .map(|n| Series {
                    name: n.to_string(),
                    points: vec![(1.0, 1.0), (2.0, 2.0)],
                    dashed: *n == "b",
                    style: Some(3),
                })
                .collect(),
            ..Plot::default()
        }
        .to_svg();
        assert!(svg.contains(PALETTE[3]));
        assert!(!svg.contains(PALETTE[0]) && !svg.contains(PALETTE[1]));
    }
}
