//! NATTEN 2D neighbourhood attention with dilation as written in
//! examples/masks/natten_2d.cmask: every row against the pairwise semantics and against
//! NATTEN's own window rule (`get_window_start` of NATTEN's unfused reference, written here
//! independently of the mask file), tiles against a dense evaluation, on random grids
//! (square and not), odd kernels and dilations.

#[allow(dead_code)]
mod common;
use cm_ir::Value;
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
    ) {
        let kernel = 2 * half + 1;
        let (h, w) = (kernel * dilation + dh, kernel * dilation + dw);
        let n = h * w;
        let values = params(&[
            ("height", Value::Int(h)),
            ("width", Value::Int(w)),
            ("kernel", Value::Int(kernel)),
            ("dilation", Value::Int(dilation)),
        ]);
        let tile = TileShape { block_m: bm, block_n: bn };
        let plan = check_against_brute_force(&compile(SRC), shape(n, n), &values, tile);
        for q in 0..n {
            prop_assert_eq!(
                row_pairs(&plan.masks[0].rows, q as u32),
                natten_row(q, (h, w), kernel, dilation),
                "q = {}, {}x{}, kernel {}, dilation {}", q, h, w, kernel, dilation
            );
        }
    }
}
