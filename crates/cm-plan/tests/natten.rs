//! NATTEN 2D neighbourhood attention with dilation as written in
//! examples/masks/natten_2d.cmask: every row against the pairwise semantics and against
//! NATTEN's own window rule (`get_window_start` of NATTEN's unfused reference, written here
//! independently of the mask file), tiles against a dense evaluation, on random grids
//! (square and not), odd kernels and dilations, with rows past the grid. Then the solver's
//! strided boxes in general (chains of range and residue conditions on one grid's key
//! coordinates: random atoms, grids in 2D and 3D, offsets, `q_len != kv_len`) against the
//! pairwise semantics, and the work NATTEN 2D costs at 362 x 362.

#[allow(dead_code)]
mod common;
use cm_ir::Value;
use cm_plan::plan::row_intervals;
use cm_plan::symbolic::Solver;
use cm_plan::TileShape;
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;

const SRC: &str = include_str!("../../../examples/masks/natten_2d.cmask");

/// NATTEN's first coordinate of the window of `index` on an axis of `length`, for an odd
/// `kernel` and `dilation`; the window is `start, start + dilation, ...` (`kernel` of them).
fn window_start(index: i64, length: i64, kernel: i64, dilation: i64) -> i64 {
    let ns = kernel / 2;
    if dilation <= 1 {
        let shift = if index + ns >= length {
            length - index - ns - 1
        } else {
            0
        };
        return (index - ns).max(0) + shift;
    }
    if index - ns * dilation < 0 {
        return index % dilation;
    }
    if index + ns * dilation >= length {
        let imodd = index % dilation;
        let a = (length / dilation) * dilation;
        let b = length - a;
        return if imodd < b {
            length - b + imodd - 2 * ns * dilation
        } else {
            a + imodd - kernel * dilation
        };
    }
    index - ns * dilation
}

/// The keys of query `q` by NATTEN's rule, as maximal intervals.
fn natten_row(q: i64, (h, w): (i64, i64), kernel: i64, dilation: i64) -> Vec<(u32, u32)> {
    let (y, x) = (q / w, q % w);
    let (sy, sx) = (
        window_start(y, h, kernel, dilation),
        window_start(x, w, kernel, dilation),
    );
    let mut keys = Vec::new();
    for i in 0..kernel {
        for j in 0..kernel {
            keys.push((sy + i * dilation) * w + sx + j * dilation);
        }
    }
    keys.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for k in keys {
        match out.last_mut() {
            Some(last) if last.1 == k as u32 => last.1 += 1,
            _ => out.push((k as u32, k as u32 + 1)),
        }
    }
    out
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 40, 0x9a77))]

    #[test]
    fn natten_2d_equals_natten_and_brute_force(
        half in 0i64..4,
        dilation in 1i64..5,
        (dh, dw) in (0i64..9, 0i64..9),
        (bm, bn) in (1u32..40, 1u32..40),
        past in 0i64..4,
    ) {
        let kernel = 2 * half + 1;
        let (h, w) = (kernel * dilation + dh, kernel * dilation + dw);
        let n = h * w;
        // Rows past the grid see only themselves.
        let len = n + past;
        let values = params(&[
            ("height", Value::Int(h)),
            ("width", Value::Int(w)),
            ("kernel", Value::Int(kernel)),
            ("dilation", Value::Int(dilation)),
        ]);
        let tile = TileShape { block_m: bm, block_n: bn };
        let plan = check_against_brute_force(&compile(SRC), shape(len, len), &values, tile);
        for q in 0..len {
            let want = if q < n {
                natten_row(q, (h, w), kernel, dilation)
            } else {
                vec![(q as u32, q as u32 + 1)]
            };
            prop_assert_eq!(
                row_pairs(&plan.masks[0].rows, q as u32),
                want,
                "q = {}, {}x{}, kernel {}, dilation {}", q, h, w, kernel, dilation
            );
        }
    }
}

/// One condition on axis `a` of a grid `G` (the other axis `o`, for a condition reading
/// the query's other coordinate), of kind `kind`, with small constants `c`, `e` and a
/// modulus `m >= 1`. Kinds 0-9 are the forms a strided box takes (ranges with any sign and
/// coefficient, clamps, `==`, residues by the query's coordinate, by a constant, shifted,
/// by another axis, by another modulus); 10-12 are forms it leaves to the general
/// evaluation (`!=`, a residue scaled by 2, a negative modulus), so both paths and their
/// mixtures are checked. 13-14 are ranges whose q-side value reads `q` other than as the
/// fastest coordinate (directly, or with the other axis), which the box must not read
/// from another grid line's evaluation.
fn axis_atom(kind: u8, a: &str, o: &str, c: i64, e: i64, m: i64) -> String {
    let coef = [-3, -2, 2, 3][(c.rem_euclid(4)) as usize];
    match kind {
        0 => format!("G.{a}(k) >= G.{a}(q) - {c}"),
        1 => format!("G.{a}(k) <= G.{a}(q) + {e}"),
        2 => format!("G.{a}(k) in G.{a}(q) - {c} ..= G.{a}(q) + {e}"),
        3 => format!("{coef} * G.{a}(k) + 1 < G.{a}(q) + {e}"),
        4 => format!("G.{a}(k) == min(max(G.{a}(q) - {c}, 0), {e})"),
        5 => format!("G.{a}(k) % {m} == (G.{a}(q) + {c}) % {m}"),
        6 => format!("G.{a}(k) % {m} == {}", c % m),
        7 => format!("(G.{a}(k) + {c}) % {m} == G.{o}(q) % {m}"),
        8 => format!("G.{a}(k) % {m} == G.{a}(q) % {}", m + 1),
        9 => format!(
            "G.{a}(k) in {m} * (G.{a}(q) / {m}) - {c} .. {m} * max(G.{a}(q) / {m}, 1) + {e}"
        ),
        13 => format!("G.{a}(k) <= G.{a}(q) + q % {m} + {e}"),
        14 => format!("G.{a}(k) >= G.{a}(q) / {m} + G.{o}(q) % {m} - {c}"),
        10 => format!("G.{a}(k) != {c}"),
        11 => format!("2 * (G.{a}(k) % {m}) == 2 * (G.{a}(q) % {m})"),
        _ => format!("G.{a}(k) % -{m} == G.{a}(q) % -{m}"),
    }
}

/// A grid chain, its grid's shape (`[t,] h, w` and offset) and the lengths.
#[derive(Debug, Clone)]
struct Chain {
    dims: Vec<i64>,
    at: i64,
    /// Atoms as (axis, kind, c, e, m).
    atoms: Vec<(usize, u8, i64, i64, i64)>,
    /// A flat bound `k <= q + clip` after the atoms.
    clip: Option<i64>,
    q_len: i64,
    kv_len: i64,
}

impl Chain {
    fn source(&self) -> String {
        let names: &[&str] = if self.dims.len() == 3 {
            &["t", "y", "x"]
        } else {
            &["y", "x"]
        };
        let dims: Vec<String> = self.dims.iter().map(i64::to_string).collect();
        let mut terms = vec!["k in G".to_string()];
        for &(axis, kind, c, e, m) in &self.atoms {
            let other = names[(axis + 1) % names.len()];
            terms.push(axis_atom(kind, names[axis], other, c, e, m));
        }
        if let Some(c) = self.clip {
            terms.push(format!("k <= q + {c}"));
        }
        format!(
            "grid G = [{}] at {};\nmask = if q in G then {} else k == q;",
            dims.join(", "),
            self.at,
            terms.join(" & ")
        )
    }

    /// Whether the strided box must solve it: no form it leaves out, at most one residue
    /// per axis.
    fn boxed(&self) -> bool {
        let mut residues = [0; 3];
        for &(axis, kind, ..) in &self.atoms {
            if (10..=12).contains(&kind) {
                return false;
            }
            if (5..=8).contains(&kind) {
                residues[axis] += 1;
            }
        }
        residues.iter().all(|&r| r <= 1)
    }
}

fn chain() -> impl Strategy<Value = Chain> {
    (
        prop_oneof![
            (1i64..9, 1i64..9).prop_map(|(h, w)| vec![h, w]),
            (1i64..4, 1i64..6, 1i64..6).prop_map(|(t, h, w)| vec![t, h, w]),
        ],
        0i64..3,
        proptest::collection::vec((0usize..3, 0u8..15, 0i64..5, -1i64..6, 1i64..5), 1..6),
        proptest::option::of(-3i64..20),
        (0i64..4, -2i64..4),
    )
        .prop_map(|(dims, at, atoms, clip, (dq, dk))| {
            let nd = dims.len();
            let size: i64 = dims.iter().product();
            Chain {
                atoms: atoms
                    .into_iter()
                    .map(|(axis, kind, c, e, m)| (axis % nd, kind, c, e, m))
                    .collect(),
                clip,
                q_len: at + size + dq,
                kv_len: (at + size + dk).max(1),
                dims,
                at,
            }
        })
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 200, 0x9a78))]

    /// Random chains of range and residue conditions on a grid's key coordinates: every row
    /// against the pairwise semantics and tiles against a dense evaluation; where the chain
    /// is of the strided box's form, the solver took it.
    #[test]
    fn grid_chains_equal_brute_force(c in chain(), (bm, bn) in (1u32..20, 1u32..20)) {
        let src = c.source();
        let program = compile(&src);
        let tile = TileShape { block_m: bm, block_n: bn };
        let sh = shape(c.q_len, c.kv_len);
        check_against_brute_force(&program, sh, &params(&[]), tile);
        let bound = program.bind(sh, &params(&[])).unwrap();
        let solver = Solver::new(&bound);
        row_intervals(&solver, 0, 0, &mut 0).unwrap();
        if c.boxed() {
            prop_assert!(solver.grid_boxes.get() > 0, "not solved as a box:\n{}", src);
            // The keys were never sorted by value one atom at a time.
            prop_assert_eq!(solver.key_evals.get(), 0, "{}", src);
        }
    }
}

/// At 362 x 362 (q_len 131044) NATTEN 2D is a few pieces per grid row: one for the
/// window's interior, one per clamped group index at each edge (a piece of `dilation` rows
/// each, as the window start `x % d` wraps), and no key-side sort (the atoms' keys are
/// boxes, not sets of keys sorted by value). Sampled rows against NATTEN's rule.
#[test]
fn natten_2d_at_362_plans_in_pieces_per_grid_row() {
    let program = compile(SRC);
    let side = 362i64;
    let n = side * side;
    for (kernel, dilation) in [(7i64, 2i64), (13, 4), (7, 1), (1, 1), (3, 120)] {
        let values = params(&[
            ("kernel", Value::Int(kernel)),
            ("dilation", Value::Int(dilation)),
        ]);
        let bound = program.bind(shape(n, n), &values).unwrap();
        let solver = Solver::new(&bound);
        let mut pieces = 0;
        let rows = row_intervals(&solver, 0, 0, &mut pieces).unwrap();
        let per_row = pieces / side as u64;
        // The interior, `kernel / 2` group indices at the left edge, and `kernel / 2 + 1`
        // at the right, each cut in two where the groups' lengths differ (362 % 4 == 2:
        // groups 0 and 1 hold one more coordinate than 2 and 3, so their last windows start
        // one group later, and the start jumps inside a run of `d` columns).
        let half = kernel as u64 / 2;
        let most = 1 + half + 2 * (half + 1);
        assert!(
            per_row <= most,
            "kernel {kernel}, dilation {dilation}: {pieces} pieces, {per_row} per grid row"
        );
        assert_eq!(solver.key_evals.get(), 0);
        for q in (0..n).step_by(997).chain([0, side - 1, n - side, n - 1]) {
            assert_eq!(
                row_pairs(&rows, q as u32),
                natten_row(q, (side, side), kernel, dilation),
                "q = {q}, kernel {kernel}, dilation {dilation}"
            );
        }
    }
}
