//! Strided runs (docs/language.md, "Strided runs"): a window of one residue every `m`
//! keys intersected with intervals (a dilated window) is one run per interval, `(start,
//! end, stride)`, instead of one interval per key. Random strides, offsets, odd and unequal
//! lengths and tile shapes (one-key tiles, a one-key last tile, strides wider than a tile)
//! against the pairwise semantics (rows expanded, tile classes against a dense
//! evaluation); the expansion for consumers without strides and its limit (CM0412); the
//! cost of a dilated window at 128K.

#[allow(dead_code)]
mod common;
use cm_plan::{plan, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;

/// Masks with a single-residue window on either side of `&`, under `if`s, joined with other
/// regions (which expand the runs where they meet them).
const MASKS: &[&str] = &[
    // The dilated causal window of the standard library.
    "mask = q - w < k <= q & (q - k) % m == 0;",
    // The residue on the left, a symmetric band on the right.
    "mask = (k - q) % m == c & abs(q - k) <= w;",
    // A key residue (the same keys on every row) inside a causal band.
    "mask = k % m == c & q - w < k <= q + 2;",
    // `!=` of a stride of two is one residue too.
    "mask = (q - k) % 2 != 0 & k < q + w;",
    // Behind an `if` on the row and on literals.
    "mask = if q % 3 == 0 then q - w < k <= q & (q - k) % m == 0 else k == q;",
    "mask = if 2 > 1 then q - w < k & k <= q & (q - k) % m == 0 else k <= q;",
    // Joined with global tokens: apart or touching the runs, expanded where they meet.
    "mask = q - w < k <= q & (q - k) % m == 0 | k < c;",
    "mask = (q - w < k <= q & (q - k) % m == 0) | k == q + 1 | k == q - 1;",
    // Cut by another region, and removed from one.
    "mask = (q - w < k <= q & (q - k) % m == 0) & k > c;",
    "mask = (k <= q) - (q - w < k & (q - k) % m == 0);",
    // Two bands: one run each.
    "mask = (k < c + 3 | q - w < k <= q) & (q - k) % m == 0;",
    // The residue first, then the band's sides one by one: runs cut by further intervals.
    "mask = (q - k) % m == 0 & k > q - w & k <= q;",
    "mask = k % m == c & k >= q - w & k < q + 3 & k != q - 1;",
];

const TILES: &[TileShape] = &[
    TileShape {
        block_m: 16,
        block_n: 16,
    },
    TileShape {
        block_m: 7,
        block_n: 5,
    },
    TileShape {
        block_m: 3,
        block_n: 1,
    },
    TileShape {
        block_m: 4,
        block_n: 2,
    },
];

fn source(mask: &str, w: i64, m: i64, c: i64) -> String {
    format!("param w: int = {w};\nparam m: int = {m};\nparam c: int = {c};\n{mask}")
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 200, 0x57_21de))]

    /// Every row equals the pairwise semantics and every tile class a dense evaluation, at
    /// any stride (1 and wider than a tile included), offset and shape.
    #[test]
    fn strided_masks_equal_brute_force(
        mask in proptest::sample::select(MASKS),
        w in 1i64..40,
        m in 1i64..9,
        c in -3i64..12,
        q_len in 1i64..70,
        kv_len in 1i64..70,
        tile in proptest::sample::select(TILES),
    ) {
        let program = compile(&source(mask, w, m, c));
        check_against_brute_force(&program, shape(q_len, kv_len), &params(&[]), tile);
    }

    /// The last tile holds one key (`kv_len % block_n == 1`): a strided key there makes the
    /// tile full for its row.
    #[test]
    fn one_key_last_tile(
        w in 1i64..30,
        m in 2i64..6,
        blocks in 1i64..6,
        q_len in 1i64..50,
    ) {
        let program = compile(&source(MASKS[0], w, m, 0));
        let tile = TileShape { block_m: 8, block_n: 8 };
        check_against_brute_force(&program, shape(q_len, blocks * 8 + 1), &params(&[]), tile);
    }
}

/// A dilated window is one strided run per row, and expands to exactly the unit rows the
/// pairwise semantics gives.
#[test]
fn dilated_window_is_one_run_per_row() {
    let program = builtin("dilated_window");
    let values = params(&[
        ("window", cm_ir::Value::Int(64)),
        ("dilation", cm_ir::Value::Int(4)),
    ]);
    let bound = program.bind(shape(300, 300), &values).unwrap();
    let p = plan(&bound, TileShape::default()).unwrap();
    let rows = &p.masks[0].rows;
    assert!(rows.has_strides());
    assert_eq!(rows.max_runs_per_row(), 1);
    let unit = rows.expanded().unwrap();
    assert!(!unit.has_strides());
    // In maximal intervals a row holds its keys: 64 / 4 at most, as in the expanded rows.
    assert_eq!(rows.max_intervals_per_row(), 16);
    assert_eq!(unit.max_intervals_per_row(), 16);
    assert_eq!(p.max_intervals_per_row(), 16);
    unit.validate().unwrap();
    for q in 0..300 {
        let want = bound.brute_force_row(q, 0, 0).unwrap();
        let got: Vec<(u32, u32)> = unit
            .row(q as u32)
            .iter()
            .map(|iv| (iv.start, iv.end))
            .collect();
        assert_eq!(got, want, "row {q}");
        assert_eq!(&*rows.row_expanded(q as u32), unit.row(q as u32));
        for k in 0..300u32 {
            assert_eq!(
                rows.is_visible(q as u32, k),
                want.iter().any(|&(s, e)| s <= k && k < e),
                "({q}, {k})"
            );
        }
    }
    assert_eq!(rows.visible_pairs(), unit.visible_pairs());
    assert_eq!(rows.expanded_len(), unit.all_runs().len() as u64);
}

/// A run cut by a further plain interval stays a run: the dilated window written residue
/// first, `(q - k) % m == 0 & k > q - w & k <= q`, is one run per row like the standard
/// library's form (it was one interval per key, CM0404 at 128K with window 4096).
#[test]
fn runs_cut_by_further_intervals_stay_runs() {
    let src =
        "param w: int = 64;\nparam m: int = 4;\nmask = (q - k) % m == 0 & k > q - w & k <= q;";
    let program = compile(src);
    let bound = program.bind(shape(300, 300), &params(&[])).unwrap();
    let p = plan(&bound, TileShape::default()).unwrap();
    let rows = &p.masks[0].rows;
    assert!(rows.has_strides());
    assert_eq!(rows.max_runs_per_row(), 1);
    // The band's sides cut before the residue, as in the band-first form: its pieces, not
    // a piece every few rows where a residue run to the last key changes length.
    let band_first =
        compile("param w: int = 64;\nparam m: int = 4;\nmask = q - w < k <= q & (q - k) % m == 0;");
    let bf = band_first.bind(shape(300, 300), &params(&[])).unwrap();
    assert_eq!(p.pieces, plan(&bf, TileShape::default()).unwrap().pieces);
    for q in 0..300u32 {
        let want = bound.brute_force_row(i64::from(q), 0, 0).unwrap();
        let got: Vec<(u32, u32)> = rows
            .row_expanded(q)
            .iter()
            .map(|iv| (iv.start, iv.end))
            .collect();
        assert_eq!(got, want, "row {q}");
    }
}

/// Consumers without strides refuse an expansion past the limit with CM0412, naming the
/// count; below it they get the unit rows.
#[test]
fn expansion_limit_is_a_clear_error() {
    let program = builtin("dilated_window");
    let bound = program.bind(shape(8192, 8192), &params(&[])).unwrap();
    let p = plan(&bound, TileShape::default()).unwrap();
    let rows = &p.masks[0].rows;
    let need = rows.expanded_len();
    assert_eq!(
        need,
        rows.visible_pairs(),
        "one unit interval per key at dilation 2"
    );
    let e = rows.expanded_within(1000).unwrap_err();
    assert_eq!((e.intervals, e.limit), (need, 1000));
    let pe = cm_plan::expand_error(e);
    assert_eq!(pe.code, cm_syntax::Code::StridesTooMany);
    assert!(pe.message.contains(&need.to_string()), "{}", pe.message);
    assert!(rows.expanded_within(need as usize).is_ok());
}

/// Rows built from runs are checked: a stride that does not end one past a key, a run of
/// one key, a zero stride.
#[test]
fn bad_runs_are_refused() {
    assert!(cm_plan::RowIntervals::from_row_runs(10, &[vec![(0, 5, 2)]]).is_ok());
    for bad in [(0, 4, 2), (3, 4, 2), (0, 5, 0), (0, 11, 2)] {
        let e = cm_plan::RowIntervals::from_row_runs(10, &[vec![bad]]).unwrap_err();
        assert!(e.contains("row 0"), "{bad:?}: {e}");
    }
    // Touching runs are refused as touching intervals are.
    assert!(cm_plan::RowIntervals::from_row_runs(10, &[vec![(0, 3, 2), (3, 5, 1)]]).is_err());
}

/// The dilated window at 128K: pieces only where the band is clipped at key 0 (one per
/// `dilation` rows there), one run per row. These bound the cost: a piece per row would be
/// 131072 pieces, and the keys as intervals 2048 a row.
#[test]
fn dilated_window_at_128k() {
    let program = builtin("dilated_window");
    let bound = program.bind(shape(131072, 131072), &params(&[])).unwrap();
    let p = plan(&bound, TileShape::default()).unwrap();
    let rows = &p.masks[0].rows;
    assert!(p.pieces <= 4096 / 2 + 2, "{} pieces", p.pieces);
    assert_eq!(rows.max_runs_per_row(), 1);
    // Rows q >= 4095 see 2048 keys, row q < 4095 sees q / 2 + 1.
    let want: u64 = (0..131072u64).map(|q| q.min(4095) / 2 + 1).sum();
    assert_eq!(rows.visible_pairs(), want);
    for q in [0u32, 1, 4094, 4095, 70001, 131071] {
        assert_eq!(
            rows.row_expanded(q).len() as u64,
            u64::from(q.min(4095)) / 2 + 1,
            "row {q}"
        );
    }
}
