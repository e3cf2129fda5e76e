//! The planner's tile descriptor (classified per affine piece of rows,
//! `TileDescriptor::try_build_runs`) equals, bit for bit, the straightforward per-row
//! classification (`TileDescriptor::build` / `try_build`) of the same rows: on CLEAR-like
//! grids (a text prefix, then an image whose tokens see a disc, diamond or square of image
//! tokens) with random radii, prefixes, grid shapes, key lengths and tile shapes (non-square,
//! one-token, taller than a kernel block, larger than the sequence), on 3D neighbourhoods and
//! on the workloads. The limit on descriptor entries is hit at the same count by both. Runs
//! found in the rows alone (`RowIntervals::affine_runs`) serve as well as the solver's.
//!
//! Case counts: `CM_PROPTEST_CASES` (default: a quick run with a fixed seed).

#[allow(dead_code)]
mod common;

use cm_ir::{Shape, Value};
use cm_plan::plan::row_intervals_runs;
use cm_plan::symbolic::Solver;
use cm_plan::{TileDescriptor, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// `CM_PROPTEST_CASES`, else `default` cases with a fixed seed.
fn config(default: u32) -> ProptestConfig {
    env_config(PROPTEST_CASES, default, 0x711e_5eed)
}

fn side() -> BoxedStrategy<u32> {
    prop_oneof![
        1 => Just(1u32),
        1 => Just(3u32),
        1 => Just(16u32),
        2 => Just(64u32),
        2 => Just(128u32),
        1 => Just(130u32),
        // Taller than a kernel block (another per-row stride) and larger than any sequence
        // here (clamped to it).
        1 => Just(1500u32),
        1 => Just(5000u32),
        6 => 1u32..=300,
    ]
    .boxed()
}

fn builtin_source(name: &str) -> String {
    cm_stdlib::get(name).expect("built-in").source.to_string()
}

/// Plans `src` at `shape` and checks the planner's descriptor against the per-row one of
/// the same rows, and both builders against an entry limit of `limit`.
fn check(
    src: &str,
    shape: Shape,
    values: &BTreeMap<String, Value>,
    tile: TileShape,
    limit: usize,
) -> Result<(), TestCaseError> {
    let program = compile(src);
    let bound = program
        .bind(shape, values)
        .map_err(|e| TestCaseError::fail(format!("bind: {e}\n{src}")))?;
    let plan = cm_plan::plan(&bound, tile)
        .map_err(|e| TestCaseError::fail(format!("plan: {e}\n{src}")))?;
    let m = &plan.masks[0];
    let slow = TileDescriptor::build(&m.rows, tile);
    prop_assert!(
        m.tiles == slow,
        "descriptors differ: {} at {:?}, {:?}",
        src,
        shape,
        tile
    );

    let solver = Solver::new(&bound);
    let mut runs = Vec::new();
    let rows = row_intervals_runs(&solver, 0, 0, &mut 0, &mut runs)
        .map_err(|e| TestCaseError::fail(format!("rows: {e}")))?;
    prop_assert!(rows == m.rows);
    prop_assert_eq!(runs.len() as u64, plan.pieces);
    let fast = TileDescriptor::try_build_runs(&rows, &runs, tile, limit);
    let slow = TileDescriptor::try_build(&rows, tile, limit);
    prop_assert!(
        fast == slow,
        "limited to {}: {:?} vs {:?}",
        limit,
        fast.err(),
        slow.err()
    );
    // Runs found in the rows alone (as for rows in a token order) give the same descriptor,
    // and no more runs than the solver's pieces: being affine holds for every stretch of
    // an affine run, so the greedy maximal runs are the fewest.
    let found = rows.affine_runs();
    prop_assert!(
        found.len() <= runs.len(),
        "{} runs for {} pieces",
        found.len(),
        runs.len()
    );
    let from_found = TileDescriptor::try_build_runs(&rows, &found, tile, limit);
    prop_assert!(
        from_found == slow,
        "descriptors differ with the runs found in the rows"
    );
    Ok(())
}

proptest! {
    #![proptest_config(config(300))]

    /// The built-in CLEAR mask: a text prefix, then an n x n image seeing a strict disc.
    #[test]
    fn clear_builtin(
        n in 1i64..=45,
        text in 0i64..=80,
        radius in 0i64..=24,
        bm in side(),
        bn in side(),
        limit in prop_oneof![Just(usize::MAX), 0usize..20_000],
    ) {
        let q = text + n * n;
        let values = params(&[("text", Value::Int(text)), ("radius", Value::Int(radius))]);
        let tile = TileShape { block_m: bm, block_n: bn };
        check(&builtin_source("clear"), shape(q, q), &values, tile, limit)?;
    }

    /// CLEAR-like masks on rectangular grids with every metric, strict or not, and key
    /// lengths shorter or longer than the queries.
    #[test]
    fn clear_like(
        h in 1i64..=30,
        w in 1i64..=50,
        text in 0i64..=70,
        radius in 0i64..=20,
        metric in prop_oneof![Just("l1"), Just("l2"), Just("linf")],
        op in prop_oneof![Just("<"), Just("<=")],
        extra in -40i64..=40,
        bm in side(),
        bn in side(),
    ) {
        let q = text + h * w;
        let kv = (q + extra).max(1);
        let src = format!(
            "grid img = [{h}, {w}] at {text};\n\
             mask = if q in img then k < {text} | {metric}(img) {op} {radius} else k < kv_len;"
        );
        let tile = TileShape { block_m: bm, block_n: bn };
        check(&src, shape(q, kv), &BTreeMap::new(), tile, usize::MAX)?;
    }

    /// 3D neighbourhoods (box regions on a video grid).
    #[test]
    fn video(
        frames in 1i64..=5,
        height in 1i64..=12,
        width in 1i64..=14,
        dt in 0i64..=2,
        r in 0i64..=5,
        bm in side(),
        bn in side(),
    ) {
        let q = frames * height * width;
        let values = params(&[
            ("frames", Value::Int(frames)),
            ("height", Value::Int(height)),
            ("width", Value::Int(width)),
            ("dt_radius", Value::Int(dt)),
            ("radius", Value::Int(r)),
        ]);
        let tile = TileShape { block_m: bm, block_n: bn };
        check(&builtin_source("neighborhood_3d"), shape(q, q), &values, tile, usize::MAX)?;
    }
}

proptest! {
    #![proptest_config(config(300))]

    /// Sawtooth rows: intervals whose ends jump together at the periods of `q % m`, in
    /// pieces of a few rows, so that many rows are classified in stretches rather than
    /// runs, and a key can belong to one interval on one row and to the next on the
    /// following row (which a stretch must not let into its intersection).
    #[test]
    fn sawtooth(
        m in 2i64..=9,
        m2 in 1i64..=9,
        c in 0i64..=6,
        gap in 1i64..=8,
        len in 1i64..=20,
        far in 0i64..=40,
        q_len in 1i64..=200,
        extra in 0i64..=30,
        bm in prop_oneof![1u32..=4, 1u32..=24],
        bn in prop_oneof![1u32..=4, 1u32..=24],
    ) {
        let src = format!(
            "mask = k < q % {m} + {c} | (q % {m} + {} <= k & k < q % {m} + {}) | \
             (q % {m2} + {} <= k & k < q % {m2} + {});",
            c + gap,
            c + gap + len,
            c + gap + len + 1 + far,
            c + gap + len + 1 + far + len,
        );
        let tile = TileShape { block_m: bm, block_n: bn };
        check(&src, shape(q_len, q_len + extra), &BTreeMap::new(), tile, usize::MAX)?;
    }
}

proptest! {
    #![proptest_config(config(300))]

    /// Steep bands: interval ends moving by several keys per row (up or down), over pieces
    /// of many rows, so that some move by more than a tile per row.
    #[test]
    fn steep(
        a in -4i64..=4,
        b in -4i64..=4,
        c in -40i64..=60,
        width in 1i64..=30,
        gap in 1i64..=20,
        width2 in 1i64..=30,
        q_len in 1i64..=300,
        kv_len in 1i64..=600,
        bm in prop_oneof![1u32..=4, 1u32..=64],
        bn in prop_oneof![1u32..=4, 1u32..=64],
    ) {
        let src = format!(
            "mask = (q * {a} + {c} <= k & k < q * {a} + {}) | \
             (q * {b} + {} <= k & k < q * {b} + {});",
            c + width,
            c + width + gap,
            c + width + gap + width2,
        );
        let tile = TileShape { block_m: bm, block_n: bn };
        check(&src, shape(q_len, kv_len), &BTreeMap::new(), tile, usize::MAX)?;
    }
}

/// The workloads and other built-ins at lengths spanning many blocks, at kernel tile
/// shapes and an odd one.
#[test]
fn workloads() {
    let none = BTreeMap::new();
    for (name, q) in [
        ("causal", 8192),
        ("hstu", 8192),
        ("shared_prefix", 8192),
        ("clear", 512 + 90 * 90),
        ("sliding_window", 8192),
        ("document_causal", 8192),
        ("trace_documents", 8192),
        ("trace_prompt_groups", 8192),
        ("dilated_window", 3000),
        ("chunked_causal", 5000),
        ("sink_local", 5000),
        ("global_local", 5000),
        ("block_causal", 5000),
    ] {
        for (bm, bn) in [(64, 64), (128, 128), (64, 128), (128, 64), (100, 37)] {
            let tile = TileShape {
                block_m: bm,
                block_n: bn,
            };
            check(&builtin_source(name), shape(q, q), &none, tile, usize::MAX)
                .unwrap_or_else(|e| panic!("{name} at {q}, {bm}x{bn}: {e}"));
        }
    }
}
