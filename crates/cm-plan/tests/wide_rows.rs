//! Masks of many pieces with many intervals per row, whose kept first rows and slopes pass
//! `cm_plan::plan::KEPT_MAX`: the solver then writes every later piece straight into the
//! rows' array (its room estimated from the rows so far, grown where later rows are wider).
//! The rows equal brute force on either side of the switch.

#[allow(dead_code)]
mod common;

use cm_plan::plan::{row_intervals_runs, KEPT_MAX};
use cm_plan::symbolic::Solver;
use cm_plan::TileShape;
use common::*;
use std::collections::BTreeMap;

/// The intervals the solver keeps for the pieces of `rows` (first row, and slopes for a
/// piece of several rows) up to row `upto`, and the widest row there.
fn kept_upto(rows: &cm_plan::RowIntervals, runs: &[u32], upto: u32) -> (usize, usize) {
    let mut kept = 0;
    let mut widest = 0;
    for (i, &a) in runs.iter().enumerate() {
        let b = runs.get(i + 1).copied().unwrap_or(rows.q_len());
        if a >= upto {
            break;
        }
        let len = rows.row_runs(a).len();
        kept += if b - a > 1 { 2 * len } else { len };
        widest = widest.max(len);
    }
    (kept, widest)
}

/// Plans `src` at `q_len x kv_len` against brute force and returns the rows, the first row
/// of every piece, and the first row whose piece pushes the kept lists past `KEPT_MAX`.
fn check(src: &str, q_len: i64, kv_len: i64) -> (cm_plan::RowIntervals, Vec<u32>, u32) {
    let program = compile(src);
    let values = BTreeMap::new();
    for tile in [
        TileShape::default(),
        TileShape {
            block_m: 64,
            block_n: 48,
        },
    ] {
        check_against_brute_force(&program, shape(q_len, kv_len), &values, tile);
    }
    let bound = program.bind(shape(q_len, kv_len), &values).unwrap();
    let solver = Solver::new(&bound);
    let mut runs = Vec::new();
    let rows = row_intervals_runs(&solver, 0, 0, &mut 0, &mut runs).unwrap();
    let switch = runs
        .iter()
        .map(|&a| a + 1)
        .find(|&upto| kept_upto(&rows, &runs, upto).0 > KEPT_MAX)
        .unwrap_or_else(|| panic!("{src}: the kept lists stay below KEPT_MAX"));
    (rows, runs, switch)
}

#[test]
fn rows_written_as_solved_equal_brute_force() {
    // 410 pieces of 5 rows, 128 intervals each: the switch comes a quarter of the way in.
    let (rows, _, switch) = check("mask = k % 16 < 1 + q % 5;", 2048, 2048);
    assert!(switch < rows.q_len() / 2, "switch at row {switch}");
    // Fewer keys than rows, and more.
    check("mask = k % 16 < 1 + q % 5;", 2048, 1500);
    check("mask = k % 16 < 1 + q % 5 & k < 3 * q;", 1200, 3000);
}

#[test]
fn rows_wider_than_estimated_grow_and_equal_brute_force() {
    // Row q holds about q / 4 intervals: at the switch the rows to come are estimated twice
    // as wide as the widest so far, and the last rows are wider still.
    let (rows, runs, switch) = check("mask = k <= q & k % 4 < 2;", 2048, 2048);
    let (_, widest_before) = kept_upto(&rows, &runs, switch);
    assert!(
        rows.max_intervals_per_row() as usize > 2 * widest_before,
        "the last rows ({}) are not wider than twice the widest before the switch ({widest_before})",
        rows.max_intervals_per_row()
    );
}
