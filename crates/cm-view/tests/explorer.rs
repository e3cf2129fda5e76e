//! The explorer page's embedded data against the plan it encodes: the row runs decode to
//! every row's intervals exactly and the tile runs to every tile's class (for masks of
//! every shape of run: affine bands, packed documents, modular patterns, per-head masks,
//! empty rows); the runs stay a handful for masks the solver plans in a few pieces at
//! 128K tokens; the page is self-contained and its data readable as JSON. The page in a
//! browser is tested by tests/browser (scripts/test-browser.sh).

use base64::Engine as _;
use cm_view::explorer::{explorer, row_runs, tile_runs};
use cm_view::raster::{tile_class, TileClass};
use cm_view::{Subject, View, ViewError};
use compilemask::{MaskPlan, Plan, PlanOptions};

/// Rows of intervals from [`row_runs`]' encoding, decoded by its documented layout.
fn decode_rows(runs: &[i32], q_len: u32) -> Vec<Vec<(u32, u32)>> {
    let mut rows = Vec::new();
    let mut i = 0;
    while i < runs.len() {
        let (q0, n, m) = (runs[i], runs[i + 1], runs[i + 2] as usize);
        assert_eq!(q0 as usize, rows.len(), "runs cover rows in order");
        let first = &runs[i + 3..i + 3 + 2 * m];
        let steps = if n > 1 {
            &runs[i + 3 + 2 * m..i + 3 + 4 * m]
        } else {
            &[][..]
        };
        for d in 0..n {
            rows.push(
                (0..m)
                    .map(|j| {
                        let (ds, de) = if n > 1 {
                            (steps[2 * j], steps[2 * j + 1])
                        } else {
                            (0, 0)
                        };
                        (
                            (first[2 * j] + d * ds) as u32,
                            (first[2 * j + 1] + d * de) as u32,
                        )
                    })
                    .collect(),
            );
        }
        i += 3 + 2 * m + if n > 1 { 2 * m } else { 0 };
    }
    assert_eq!(rows.len(), q_len as usize);
    rows
}

fn plan_rows(mask: &MaskPlan) -> Vec<Vec<(u32, u32)>> {
    (0..mask.rows.q_len())
        .map(|q| {
            mask.rows
                .row_expanded(q)
                .iter()
                .map(|iv| (iv.start, iv.end))
                .collect()
        })
        .collect()
}

/// Every tile's class from [`tile_runs`], decoded by its documented layout, against the
/// descriptor's lists.
fn check_tiles(mask: &MaskPlan) {
    let (ptr, runs) = tile_runs(mask);
    let t = &mask.tiles;
    assert_eq!(ptr.len(), t.num_m_blocks as usize + 1);
    for m in 0..t.num_m_blocks {
        let mine = &runs[3 * ptr[m as usize] as usize..3 * ptr[m as usize + 1] as usize];
        for w in mine.chunks(3).collect::<Vec<_>>().windows(2) {
            assert!(w[0][1] <= w[1][0], "runs ascending and apart: {w:?}");
            assert!(
                w[0][1] < w[1][0] || w[0][2] != w[1][2],
                "neighbours of one class are one run"
            );
        }
        for n in 0..t.num_n_blocks {
            let got = mine
                .chunks(3)
                .find(|r| r[0] as u32 <= n && n < r[1] as u32)
                .map_or(TileClass::Empty, |r| match r[2] {
                    1 => TileClass::Partial,
                    2 => TileClass::Full,
                    c => panic!("class {c}"),
                });
            assert_eq!(got, tile_class(mask, m, n), "tile ({m}, {n})");
        }
    }
}

fn plan(source: Option<&str>, builtin: Option<&str>, options: &PlanOptions) -> Plan {
    let program = match (source, builtin) {
        (Some(s), _) => compilemask::compile(s).unwrap(),
        (_, Some(b)) => compilemask::builtin(b).unwrap(),
        _ => unreachable!(),
    };
    program.plan(options).unwrap()
}

#[test]
fn runs_decode_to_every_row_and_tile() {
    let cases: Vec<(Option<&str>, Option<&str>, PlanOptions)> = vec![
        (None, Some("causal"), PlanOptions::new(1000).tile(64, 64)),
        (
            None,
            Some("sliding_window"),
            PlanOptions::new(700)
                .tile(32, 48)
                .param("window", compilemask::Value::Int(90)),
        ),
        (None, Some("hstu"), PlanOptions::new(2000).tile(64, 64)),
        (None, Some("shared_prefix"), PlanOptions::new(3000)),
        (None, Some("document_causal"), PlanOptions::new(5000)),
        (
            None,
            Some("clear"),
            PlanOptions::new(512 + 400).tile(16, 16),
        ),
        // Modular patterns (rows alternate), sinks (two intervals), rows that see nothing.
        (
            Some("mask = (q + k) % 3 == 0 & k <= q;"),
            None,
            PlanOptions::new(97).tile(8, 8),
        ),
        (
            Some("mask = (k <= q & q - k < 20) | k < 4;"),
            None,
            PlanOptions::new(301).kv_len(350).tile(16, 32),
        ),
        (
            Some("mask = k < q - 5;"),
            None,
            PlanOptions::new(40).tile(8, 8),
        ),
        (Some("mask = k > q + 100;"), None, PlanOptions::new(30)),
    ];
    for (src, b, options) in &cases {
        let p = plan(*src, *b, options);
        let mask = p.mask(0, 0);
        assert_eq!(
            decode_rows(&row_runs(&mask.rows), p.q_len),
            plan_rows(mask),
            "{src:?} {b:?}"
        );
        check_tiles(mask);
    }
    // A mask that differs per head: each (b, h) mask decodes to its own rows.
    let p = plan(
        Some("mask = k <= q & q - k < 4 * (h + 1);"),
        None,
        &PlanOptions {
            num_heads: 3,
            ..PlanOptions::new(64).tile(8, 8)
        },
    );
    for h in 0..3 {
        let mask = p.mask(0, h);
        assert_eq!(decode_rows(&row_runs(&mask.rows), 64), plan_rows(mask));
        check_tiles(mask);
    }
}

/// Masks planned in a few affine pieces are a few runs at any length: the page embeds
/// runs, not rows.
#[test]
fn runs_are_few_for_affine_masks_at_128k() {
    let runs = |b: &str| {
        let p = plan(None, Some(b), &PlanOptions::new(131_072));
        let r = row_runs(&p.mask(0, 0).rows);
        let (ptr, tiles) = tile_runs(p.mask(0, 0));
        (r.len(), ptr.len() + tiles.len())
    };
    // One run of one interval: q0, n, m, start, end, dstart, dend.
    assert_eq!(runs("causal").0, 7);
    // The window's start is 0, then moves with q: two runs.
    assert_eq!(runs("sliding_window").0, 14);
    // Tiles: one full run and one partial run per query block (causal, 1024 blocks).
    assert_eq!(runs("causal").1, 1025 + 1024 * 3 * 2 - 3);
}

fn subject(p: &Plan) -> Subject<'_> {
    Subject {
        plan: p,
        name: "a</script><!--<script>&b",
        structure: None,
    }
}

/// The JSON inside the page's data element.
fn data(page: &str) -> serde_json::Value {
    let open = "<script id=\"cm-data\" type=\"application/json\">";
    let start = page.find(open).unwrap() + open.len();
    let end = start + page[start..].find("</script>").unwrap();
    serde_json::from_str(&page[start..end]).unwrap()
}

#[test]
fn the_page_is_self_contained_and_its_data_is_the_plan() {
    let p = plan(
        Some("mask = (k <= q & q - k < 20) | k < 4;"),
        None,
        &PlanOptions::new(200).tile(32, 32),
    );
    let view = View {
        rows: Some((10, 50)),
        ..View::default()
    };
    let page = explorer(&subject(&p), &view, Some(1.5)).unwrap();
    for reference in ["http://", "https://", "<link", " src="] {
        assert!(!page.contains(reference), "{reference}");
    }
    // The name can neither close the data element early nor, through `<!--<script>`, make
    // the parser take the page's script into it (the page then drew nothing): the element
    // holds no `<` at all.
    let open = "<script id=\"cm-data\" type=\"application/json\">";
    let start = page.find(open).unwrap() + open.len();
    let end = start + page[start..].find("</script>").unwrap();
    assert!(
        !page[start..end].contains(['<', '>', '&']),
        "{}",
        &page[start..end]
    );
    let d = data(&page);
    assert_eq!(d["name"], "a</script><!--<script>&b");
    assert_eq!(
        (d["q_len"].as_u64(), d["kv_len"].as_u64()),
        (Some(200), Some(200))
    );
    assert_eq!(d["view"], serde_json::json!([10, 50, 0, 200]));
    assert_eq!(d["block"], serde_json::json!([32, 32]));
    let ints = |key: &str| -> Vec<i32> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(d[key].as_str().unwrap())
            .unwrap();
        bytes
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let mask = p.mask(0, 0);
    assert_eq!(ints("rows"), row_runs(&mask.rows));
    let (ptr, tiles) = tile_runs(mask);
    assert_eq!((ints("tile_ptr"), ints("tiles")), (ptr, tiles));
    let stats: Vec<(String, String)> = serde_json::from_value(d["stats"].clone()).unwrap();
    let get = |k: &str| stats.iter().find(|(a, _)| a == k).unwrap().1.clone();
    assert!(get("visible pairs").starts_with(&format!("{} ", mask.rows.visible_pairs())));
    let c = mask.tiles.counts();
    assert_eq!(
        get("tiles"),
        format!("{} full, {} partial, {} empty", c.full, c.partial, c.empty)
    );
    assert_eq!(get("plan time"), "1.50 ms");
}

#[test]
fn views_outside_the_plan_are_refused() {
    let p = plan(None, Some("causal"), &PlanOptions::new(100));
    for (view, want) in [
        (
            View {
                h: 1,
                ..View::default()
            },
            "h = 1 is out of range",
        ),
        (
            View {
                rows: Some((50, 120)),
                ..View::default()
            },
            "rows 50:120 is out of range",
        ),
    ] {
        let e: ViewError = explorer(&subject(&p), &view, None).unwrap_err();
        assert!(e.to_string().starts_with(want), "{e}");
    }
}

/// The page embeds plain intervals, so a dilated window at 128K (one strided run per row,
/// 264M unit intervals written out) is refused with the plan's own `CM0412` error: its
/// code, message and hint, as the exports and token orders refuse it.
#[test]
fn strided_runs_past_the_expansion_limit_are_cm0412() {
    let p = plan(None, Some("dilated_window"), &PlanOptions::new(131072));
    let e = explorer(&subject(&p), &View::default(), None).unwrap_err();
    let ViewError::Strides(x) = &e else {
        panic!("expected ViewError::Strides, got {e:?}")
    };
    assert_eq!(x.intervals, 264_243_200);
    let want = compilemask::expand_error(x.clone());
    assert_eq!(want.code, "CM0412");
    assert_eq!(e.to_string(), want.to_string());
    assert!(
        e.to_string()
            .starts_with("[CM0412] Error: the mask's strided runs expand to 264243200"),
        "{e}"
    );
}
