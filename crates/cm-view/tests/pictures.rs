//! Pictures against independent references: every token cell's pixel colour against the
//! pairwise reference semantics (`brute_force_row`) and tile classes from a dense
//! evaluation of each tile; sizes; the SVG's text; zoom and (b, h) views; a mask far too
//! long for any dense array.

use cm_view::raster::{
    EMPTY_DARK, EMPTY_LIGHT, FULL_DARK, FULL_LIGHT, PARTIAL_DARK, PARTIAL_LIGHT,
};
use cm_view::{figure, Picture, Subject, View, ViewError};
use compilemask::{Plan, PlanOptions, Program};

struct Case {
    program: Program,
    options: PlanOptions,
    plan: Plan,
}

fn planned(program: Program, options: PlanOptions) -> Case {
    let plan = program.plan(&options).unwrap();
    Case {
        program,
        options,
        plan,
    }
}

fn case(source: &str, options: PlanOptions) -> Case {
    planned(compilemask::compile(source).unwrap(), options)
}

fn builtin(name: &str, options: PlanOptions) -> Case {
    planned(compilemask::builtin(name).unwrap(), options)
}

fn draw(c: &Case, view: &View) -> (Picture, Vec<u8>) {
    let structure = c.program.structure(&c.options).unwrap();
    let subject = Subject {
        plan: &c.plan,
        name: "test mask",
        structure: Some(&structure),
    };
    let picture = figure(&subject, view).unwrap();
    let png = picture.png().unwrap();
    (picture, png)
}

/// Decodes an 8-bit RGB PNG: (width, height, pixels).
fn decode(png: &[u8]) -> (u32, u32, Vec<u8>) {
    let mut reader = png::Decoder::new(std::io::Cursor::new(png))
        .read_info()
        .unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    (info.width, info.height, buf)
}

fn pixel(img: &(u32, u32, Vec<u8>), x: u32, y: u32) -> [u8; 3] {
    let i = ((y * img.0 + x) * 3) as usize;
    [img.2[i], img.2[i + 1], img.2[i + 2]]
}

/// Every token cell of the view, by the reference: the colour of its visibility in the
/// class of its tile, the class computed from every pair of the tile.
fn check_cells(c: &Case, view: &View) {
    let (picture, png) = draw(c, view);
    let img = decode(&png);
    assert_eq!((img.0, img.1), (picture.width, picture.height));
    let (sx, sy) = picture.scale();
    assert!(
        sx >= 6.0 && sy >= 6.0,
        "cells too small to test: {sx} x {sy}"
    );
    let (b, h) = (i64::from(view.b), i64::from(view.h));
    let q_len = c.plan.q_len;
    let kv_len = c.plan.kv_len;
    let rows: Vec<Vec<bool>> = (0..q_len)
        .map(|q| {
            let ivs = c
                .program
                .brute_force_row(&c.options, i64::from(q), b, h)
                .unwrap();
            (0..kv_len)
                .map(|k| ivs.iter().any(|&(s, e)| s <= k && k < e))
                .collect()
        })
        .collect();
    let t = c.plan.tile;
    let class = |q: u32, k: u32| {
        let (m0, n0) = (q / t.block_m * t.block_m, k / t.block_n * t.block_n);
        let (m1, n1) = ((m0 + t.block_m).min(q_len), (n0 + t.block_n).min(kv_len));
        let seen = (m0..m1)
            .flat_map(|i| (n0..n1).map(move |j| (i, j)))
            .filter(|&(i, j)| rows[i as usize][j as usize])
            .count() as u32;
        if seen == 0 {
            0
        } else if seen == (m1 - m0) * (n1 - n0) {
            2
        } else {
            1
        }
    };
    for q in picture.rows.0..picture.rows.1 {
        for k in picture.cols.0..picture.cols.1 {
            let want = match (class(q, k), rows[q as usize][k as usize]) {
                (2, true) => FULL_DARK,
                (1, true) => PARTIAL_DARK,
                (1, false) => PARTIAL_LIGHT,
                (0, false) => EMPTY_LIGHT,
                other => panic!("impossible class {other:?}"),
            };
            let (x, y) = picture.pixel_of(q, k).unwrap();
            assert_eq!(
                pixel(&img, x, y),
                want,
                "token ({q}, {k}) at pixel ({x}, {y})"
            );
        }
    }
}

#[test]
fn every_cell_matches_the_reference() {
    check_cells(
        &builtin("causal", PlanOptions::new(10).tile(4, 4)),
        &View::default(),
    );
    check_cells(
        &builtin(
            "sliding_window",
            PlanOptions::new(48)
                .tile(8, 16)
                .param("window", compilemask::Value::Int(5)),
        ),
        &View::default(),
    );
    check_cells(
        &builtin(
            "hstu",
            PlanOptions::new(64).tile(8, 8).param(
                "lengths",
                compilemask::Value::Array(vec![20, 30, 14].into()),
            ),
        ),
        &View::default(),
    );
    // q_len != kv_len, top-left aligned.
    check_cells(
        &builtin("causal", PlanOptions::new(12).kv_len(30).tile(4, 8)),
        &View::default(),
    );
}

#[test]
fn zoom_draws_the_window_only() {
    let c = builtin("causal", PlanOptions::new(300).tile(32, 32));
    let view = View {
        rows: Some((100, 140)),
        cols: Some((90, 150)),
        ..View::default()
    };
    check_cells(&c, &view);
    let (p, _) = draw(&c, &view);
    assert_eq!((p.rows, p.cols), ((100, 140), (90, 150)));
    // Token cells are whole pixels: 640 / 60 keys -> 10 px each.
    assert_eq!(p.plot[2], 60 * 10);
    assert_eq!(p.plot[3], 40 * 10);
    // Visible pairs in the window, counted independently.
    let want: u64 = (100u64..140)
        .map(|q| (90..150).filter(|&k| k <= q).count() as u64)
        .sum();
    assert_eq!(p.visible, want);
    assert!(p
        .svg()
        .unwrap()
        .contains("view: rows 100:140 × keys 90:150"));
}

#[test]
fn head_and_batch_views() {
    let src = "mask = k <= q - h | (b == 1 & k == 0);";
    let c = case(src, {
        let mut o = PlanOptions::new(16).tile(4, 4);
        o.num_heads = 3;
        o.batch = 2;
        o
    });
    for b in 0..2 {
        for h in 0..3 {
            check_cells(
                &c,
                &View {
                    b,
                    h,
                    ..View::default()
                },
            );
        }
    }
    let (p, _) = draw(
        &c,
        &View {
            b: 1,
            h: 2,
            ..View::default()
        },
    );
    let svg = p.svg().unwrap();
    assert!(
        svg.contains("b 1 of 2") && svg.contains("h 2 of 3"),
        "{svg}"
    );
    let subject = Subject {
        plan: &c.plan,
        name: "m",
        structure: None,
    };
    assert_eq!(
        figure(
            &subject,
            &View {
                h: 3,
                ..View::default()
            }
        )
        .unwrap_err(),
        ViewError::Index {
            what: "h",
            value: 3,
            limit_name: "num_heads",
            limit: 3
        }
    );
    let err = figure(
        &subject,
        &View {
            rows: Some((10, 17)),
            ..View::default()
        },
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("rows 10:17 is out of range"),
        "{err}"
    );
    // Planned with one head, a mask that reads h says so on the picture.
    let one = case(src, PlanOptions::new(16));
    let (p, _) = draw(&one, &View::default());
    assert!(p
        .svg()
        .unwrap()
        .contains("depends on the head (reads h or num_heads) but was planned with num_heads = 1"));
}

#[test]
fn sizes_title_and_legend() {
    // Ten tokens: upscaled to 48 px cells (the largest), a 480 x 480 plot.
    let c = builtin("causal", PlanOptions::new(10));
    let (p, png) = draw(&c, &View::default());
    assert_eq!((p.plot[2], p.plot[3]), (480, 480));
    let img = decode(&png);
    assert_eq!((img.0, img.1), (p.width, p.height));
    assert!(p.width > 480 && p.height > 480);
    let svg = p.svg().unwrap();
    for text in [
        "test mask",
        "q_len 10 × kv_len 10",
        "visible 55.0% (55 pairs)",
        "tiles 128×128: 0 full, 1 partial, 0 empty",
        "visible, full tile",
        "visible, partial tile",
        "hidden, partial tile",
        "empty tile",
        "key k",
        "query q",
        ">9</text>",
    ] {
        assert!(svg.contains(text), "{text} missing");
    }
    // The SVG is well formed: resvg parses it, at the picture's size.
    let tree = resvg::usvg::Tree::from_str(&svg, &resvg::usvg::Options::default()).unwrap();
    assert_eq!(tree.size().width() as u32, p.width);
    // Title text is drawn: the title's row of the PNG has dark pixels, the margin between
    // title and subtitle has none left of the plot.
    let dark = |y: u32| (0..p.width).any(|x| pixel(&img, x, y).iter().all(|&c| c < 90));
    assert!((8..26).any(dark), "no title text drawn");
    // One row by 100,000 keys: 80 pixels tall, 640 wide, not 1 x 1024.
    let wide = builtin("causal", PlanOptions::new(1).kv_len(100_000));
    let (p, _) = draw(&wide, &View::default());
    assert_eq!((p.plot[2], p.plot[3]), (640, 80));
    // One visible pair is "1 pair".
    let one = builtin("causal", PlanOptions::new(1));
    let svg = draw(&one, &View::default()).0.svg().unwrap();
    assert!(svg.contains("visible 100.0% (1 pair)"), "{svg}");
}

#[test]
fn downsampled_blocks_shade_by_visible_fraction() {
    // 6400 tokens in 640 px: 10 x 10 tokens per pixel. A block below the diagonal in a
    // full tile is exactly dark green, one above it in an empty tile exactly light grey.
    let c = builtin("causal", PlanOptions::new(6400).tile(640, 640));
    let (p, png) = draw(&c, &View::default());
    let img = decode(&png);
    assert_eq!((p.plot[2], p.plot[3]), (640, 640));
    let (x, y) = p.pixel_of(5000, 1005).unwrap();
    assert_eq!(pixel(&img, x, y), FULL_DARK);
    let (x, y) = p.pixel_of(1005, 5000).unwrap();
    assert_eq!(pixel(&img, x, y), EMPTY_LIGHT);
    // On the diagonal: a partial tile, 55 of 100 pairs visible, between its two tints.
    let (x, y) = p.pixel_of(3005, 3005).unwrap();
    let c = pixel(&img, x, y);
    for i in 0..3 {
        let (lo, hi) = (
            PARTIAL_DARK[i].min(PARTIAL_LIGHT[i]),
            PARTIAL_DARK[i].max(PARTIAL_LIGHT[i]),
        );
        assert!(lo < c[i] && c[i] < hi, "{c:?}");
    }
    let _ = (FULL_LIGHT, EMPTY_DARK);
}

#[test]
fn structure_is_named() {
    let c = builtin(
        "hstu",
        PlanOptions::new(4096).param(
            "lengths",
            compilemask::Value::Array(vec![1024, 2048, 1024].into()),
        ),
    );
    let (p, _) = draw(&c, &View::default());
    let svg = p.svg().unwrap();
    for text in [
        "segments user: 3 segments",
        "part user.targets: 3 spans",
        ">user 1</text>",
    ] {
        assert!(svg.contains(text), "{text} missing from the picture");
    }
    // Segment boundaries at 1024 and 3072 cross the plot as dashed lines, both ways.
    let dashes = svg
        .lines()
        .find(|l| l.contains("stroke-dasharray"))
        .unwrap();
    assert_eq!(dashes.matches('H').count(), 2, "{dashes}");
    assert_eq!(dashes.matches('V').count(), 2, "{dashes}");
    // Zoomed in, the targets part (the last 128 rows of user 0) is tall enough to name.
    let (p, _) = draw(
        &c,
        &View {
            rows: Some((0, 1024)),
            cols: Some((0, 1024)),
            ..View::default()
        },
    );
    let svg = p.svg().unwrap();
    assert!(
        svg.contains(">targets</text>") && svg.contains("1 in view"),
        "{svg}"
    );
    // The zoomed view holds no segment boundary, so no dashed line crosses it.
    assert!(!svg.contains("stroke-dasharray"));
    let clear = builtin("clear", PlanOptions::new(32912));
    let (p, _) = draw(&clear, &View::default());
    assert!(p.svg().unwrap().contains("grid img 180x180 at 512"));
}

/// 2^20 x 2^20 pairs (a dense mask would be a terabyte, and fail to allocate): drawn from
/// the intervals. What guards the time is only that it finishes (a pass over every pair,
/// 2^40 of them, would not), left to the harness; the view's visible pairs are counted
/// from the intervals, exactly.
#[test]
fn a_million_rows_draw_without_a_dense_array() {
    let n: u64 = 1 << 20;
    let c = builtin("causal", PlanOptions::new(n as i64).tile(8192, 8192));
    let (p, png) = draw(&c, &View::default());
    assert_eq!(p.visible, n * (n + 1) / 2);
    let img = decode(&png);
    let (x, y) = p.pixel_of(900_000, 10_000).unwrap();
    assert_eq!(pixel(&img, x, y), FULL_DARK);
    let (x, y) = p.pixel_of(10_000, 900_000).unwrap();
    assert_eq!(pixel(&img, x, y), EMPTY_LIGHT);
}

/// The query axis's label, centred on the plot's left side, stays between the subtitle and
/// the legend however few rows the plot has (one row drew it across both).
#[test]
fn the_row_label_fits_beside_short_plots() {
    let number = |svg: &str, before: &str, after: &str| -> f64 {
        let start = svg
            .find(before)
            .unwrap_or_else(|| panic!("{before} missing"))
            + before.len();
        let end = start + svg[start..].find(after).unwrap();
        svg[start..end].parse().unwrap()
    };
    for options in [
        PlanOptions::new(1),
        PlanOptions::new(3).kv_len(100_000),
        PlanOptions::new(10),
    ] {
        let c = builtin("causal", options);
        let svg = draw(&c, &View::default()).0.svg().unwrap();
        let label_at = svg
            .find("rotate(-90)\" text-anchor=\"middle\" font-size=\"12\"")
            .unwrap();
        let translate = svg[..label_at].rfind("translate(16.0,").unwrap();
        let centre = number(&svg[translate..], "translate(16.0,", ")");
        let text_start = label_at + svg[label_at..].find('>').unwrap() + 1;
        let text = &svg[text_start..text_start + svg[text_start..].find('<').unwrap()];
        assert!(text.starts_with("query q"), "{text}");
        // At most 0.62 em a character (DejaVu Sans averages less).
        let half = text.chars().count() as f64 * 12.0 * 0.62 / 2.0;
        let sub_at = svg.find("fill=\"#444\">visible").unwrap();
        let subtitle = number(&svg[svg[..sub_at].rfind("<text").unwrap()..], "y=\"", "\"");
        let legend = number(&svg, "<rect x=\"12.0\" y=\"", "\" width=\"14\"");
        assert!(
            centre - half > subtitle + 4.0,
            "{text}: {centre} - {half} vs subtitle {subtitle}"
        );
        assert!(
            centre + half < legend,
            "{text}: {centre} + {half} vs legend {legend}"
        );
    }
}
