//! The score part: the bound terms (`Bound::score`, what kernels consume) against the
//! pairwise reference (`Bound::score_at`, the statement as written) on random pairs; the
//! ALiBi slopes against the authors' `get_slopes`, written out here; T5's buckets against
//! their closed form in exact integer arithmetic; every plan-time score error.

use cm_ir::score::{alibi_slope, alibi_slopes, t5_bucket};
use cm_ir::{Bound, Program, Shape, Value};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn compile(src: &str) -> Program {
    let (p, diags) = cm_stdlib::compile(src);
    p.unwrap_or_else(|| panic!("{src}: {diags:?}"))
}

fn shape(q_len: i64, kv_len: i64, num_heads: i64) -> Shape {
    Shape {
        q_len,
        kv_len,
        batch: 1,
        num_heads,
    }
}

fn bind<'p>(p: &'p Program, s: Shape, params: &[(&str, Value)]) -> cm_ir::PResult<Bound<'p>> {
    let values: BTreeMap<String, Value> = params
        .iter()
        .map(|(n, v)| (n.to_string(), v.clone()))
        .collect();
    p.bind(s, &values)
}

/// `s2` from the bound terms, written from the contract: softcap, then the linear bias,
/// then the table entry.
fn from_terms(b: &Bound<'_>, q: i64, k: i64, h: i64, raw: f64, table: &[f64]) -> f64 {
    let t = b.score.as_ref().expect("score terms");
    let mut s = match t.softcap {
        Some(c) => f64::from(c) * (raw / f64::from(c)).tanh(),
        None => raw,
    };
    if let Some(l) = &t.linear {
        let x = i64::from(l.q_coef) * q + i64::from(l.k_coef) * k + l.offset;
        s += f64::from(l.slopes[h as usize]) * x as f64;
    }
    if let Some(tb) = &t.table {
        let d = (q - k + b.shape.kv_len - 1) as usize;
        let bucket = tb.bucket[d] as usize;
        let at = if tb.per_head {
            h as usize * tb.num_buckets as usize + bucket
        } else {
            bucket
        };
        s += table[at];
    }
    s
}

/// Programs whose bound terms must agree with the statement as written.
const PROGRAMS: &[&str] = &[
    "mask = k <= q;\nscore = score - alibi_slopes(num_heads)[h] * (q - k);",
    "mask = k <= q + kv_len - q_len;\nscore = score - alibi_slopes(num_heads)[h] * (q + kv_len - q_len - k);",
    "param cap: int = 20;\nmask = k <= q;\nscore = softcap(score, cap);",
    "tensor rel: [num_heads, 32];\nmask = k < kv_len;\nscore = score + rel[h][t5_bucket(k - q, 32, 128, true)];",
    "tensor rel: [num_heads, 32];\nmask = k <= q;\nscore = score + rel[h][t5_bucket(k - q, 32, 128, false)];",
    "tensor rel: [17];\nmask = k < kv_len;\nscore = softcap(score, 30.0) + rel[min(max(q - k, -8), 8) + 8] - 0.25 * [1.0, 2.0, 0.5][h % 3] * (2 * q - 3 * k + q_len);",
    "mask = k <= q;\nscore = score - (h + 1) * (q - k) / 16.0;",
    "mask = k <= q;\nscore = score + 0.5 - h;",
    "tensor sinks: [num_heads];\ntensor rel: [8];\nmask = q - 4 < k <= q;\nsink = sinks[h];\nscore = score + rel[(k - q) % 8];",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bound_terms_agree_with_the_statement_as_written(
        which in 0..PROGRAMS.len(),
        q_len in 1i64..300,
        kv_len in 1i64..300,
        heads in 1i64..13,
        pairs in prop::collection::vec((0.0f64..1.0, 0.0f64..1.0, 0.0f64..1.0, -40.0f64..40.0), 32),
    ) {
        let p = compile(PROGRAMS[which]);
        let b = bind(&p, shape(q_len, kv_len, heads), &[]).unwrap();
        let table: Vec<f64> = (0..heads * 32).map(|i| (i as f64 * 0.37).sin()).collect();
        let tensors = [("rel", table.as_slice()), ("sinks", table.as_slice())];
        for (fq, fk, fh, raw) in pairs {
            let q = (fq * q_len as f64) as i64;
            let k = (fk * kv_len as f64) as i64;
            let h = (fh * heads as f64) as i64;
            let want = b.score_at(q, k, 0, h, raw, &tensors).unwrap();
            let got = from_terms(&b, q, k, h, raw, &table);
            prop_assert!((want - got).abs() <= 1e-5 * (1.0 + want.abs()), "{} q {q} k {k} h {h}: {want} vs {got}", PROGRAMS[which]);
        }
    }
}

#[test]
fn alibi_terms_are_the_negated_slopes_of_q_minus_k() {
    let p = compile(PROGRAMS[1]);
    let b = bind(&p, shape(3, 7, 4), &[]).unwrap();
    let l = b.score.as_ref().unwrap().linear.clone().unwrap();
    assert_eq!(l.slopes, [-0.25f32, -0.0625, -0.015625, -0.00390625]);
    assert_eq!((l.q_coef, l.k_coef, l.offset), (1, -1, 4));
    let t = b.score.as_ref().unwrap();
    assert!(t.reads_positions() && t.softcap.is_none() && t.table.is_none() && t.sink.is_none());
    let p = compile(PROGRAMS[2]);
    let t = bind(&p, shape(5, 5, 2), &[("cap", Value::Int(7))])
        .unwrap()
        .score
        .unwrap();
    assert_eq!(t.softcap, Some(7.0));
    assert!(!t.reads_positions());
    let p = compile("tensor sinks: [num_heads];\nmask = k <= q;\nsink = sinks[h];");
    let t = bind(&p, shape(5, 5, 2), &[]).unwrap().score.unwrap();
    assert_eq!(t.sink.as_deref(), Some("sinks"));
    assert!(t.linear.is_none() && t.table.is_none() && t.softcap.is_none());
    assert!(bind(&compile("mask = k <= q;"), shape(2, 2, 1), &[])
        .unwrap()
        .score
        .is_none());
}

/// `get_slopes` of Press et al.'s repository (attention_with_linear_biases), as written
/// there: powers of a start ratio, and for counts that are not powers of two the slopes of
/// the power below plus every other slope of twice that.
fn get_slopes(n: usize) -> Vec<f64> {
    fn power_of_2(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
        (0..n).map(|i| start * start.powi(i as i32)).collect()
    }
    if (n as f64).log2().fract() == 0.0 {
        power_of_2(n)
    } else {
        let closest = 1usize << ((n as f64).log2().floor() as u32);
        let mut out = power_of_2(closest);
        out.extend(
            get_slopes(2 * closest)
                .into_iter()
                .step_by(2)
                .take(n - closest),
        );
        out
    }
}

/// Binding reads one slope per head, each the list's negated (the program subtracts the
/// bias), at the largest head count (2^16); the binder once rebuilt the whole list for every
/// head (O(num_heads^2), 20 s in release), so this test also keeps that cost out of the suite.
#[test]
fn alibi_slopes_bind_per_head_at_the_head_limit() {
    let p = compile(PROGRAMS[0]);
    let n = 1usize << 16;
    let b = bind(&p, shape(2, 2, n as i64), &[]).unwrap();
    let l = b.score.unwrap().linear.unwrap();
    let all = alibi_slopes(n);
    assert_eq!(l.slopes.len(), n);
    for (h, (bound, listed)) in l.slopes.iter().zip(&all).enumerate() {
        assert_eq!(
            bound.to_bits(),
            (-*listed as f32).to_bits(),
            "head {h} of {n}"
        );
    }
    for m in [1, 2, 3, 12, 100, 130, 4096, 5000] {
        for (i, s) in alibi_slopes(m).iter().enumerate() {
            assert_eq!(
                alibi_slope(m, i).to_bits(),
                s.to_bits(),
                "{m} heads, head {i}"
            );
        }
    }
}

#[test]
fn alibi_slopes_are_the_papers() {
    for n in 1..=130 {
        let ours = alibi_slopes(n);
        let theirs = get_slopes(n);
        assert_eq!(ours.len(), n);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!((a - b).abs() <= 1e-12 * b, "n {n} head {i}: {a} vs {b}");
        }
    }
    assert_eq!(
        alibi_slopes(8),
        [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    );
    // 12 heads (BLOOM's extra heads): 8 powers of 2^-1, then odd powers of 2^-0.5.
    let twelve = alibi_slopes(12);
    for (i, x) in [
        0.5f64.sqrt(),
        0.5f64.powf(1.5),
        0.5f64.powf(2.5),
        0.5f64.powf(3.5),
    ]
    .iter()
    .enumerate()
    {
        assert!((twelve[8 + i] - x).abs() < 1e-15);
    }
}

/// T5's bucket by its closed form, in exact integers: with `m = max_exact` and `r =
/// max_distance / m` a power of two `2^e`, `n >= m` is bucket `m + j` for the largest `j`
/// with `n^(nb - m) >= m^(nb - m) * 2^(e * j)` (`ln(n / m) / ln(r) * (nb - m) >= j`), at most
/// `nb - 1`.
fn t5_exact(rel: i64, bidirectional: bool, num_buckets: u32, max_distance: u128) -> i64 {
    let mut nb = num_buckets;
    let mut out = 0i64;
    let n = if bidirectional {
        nb /= 2;
        if rel > 0 {
            out += i64::from(nb);
        }
        rel.unsigned_abs() as u128
    } else {
        (-rel.min(0)) as u128
    };
    let m = u128::from(nb / 2);
    if n < m {
        return out + n as i64;
    }
    // At max_distance and beyond, every n is the last bucket.
    let n = n.min(max_distance);
    let e = (max_distance / m).ilog2();
    let span = nb - nb / 2;
    let lhs = n.pow(span);
    let mut j = 0u32;
    while j < span && lhs >= m.pow(span) * (1u128 << (e * (j + 1))) {
        j += 1;
    }
    out + i64::from((nb / 2 + j).min(nb - 1))
}

#[test]
fn t5_buckets_match_their_closed_form() {
    // T5's defaults: 32 buckets, max_distance 128, both directions (the encoder) and one
    // (the decoder); and smaller tables.
    for (nb, md) in [(32u32, 128u128), (16, 64), (8, 16)] {
        for bidirectional in [true, false] {
            for rel in -600i64..600 {
                let ours = t5_bucket(rel, bidirectional, i64::from(nb), md as i64, None).unwrap();
                assert_eq!(
                    ours,
                    t5_exact(rel, bidirectional, nb, md),
                    "rel {rel} nb {nb} md {md} bidirectional {bidirectional}"
                );
            }
        }
    }
    // Hand-derived thresholds of the defaults, bidirectional: n = 8..11 -> 8, 12 -> 9,
    // 16 -> 10, 23 -> 11, 32 -> 12, 46 -> 13, 64 -> 14, 91 and beyond -> 15; keys after
    // the query add 16.
    let b = |rel| t5_bucket(rel, true, 32, 128, None).unwrap();
    assert_eq!(
        [-8, -11, -12, -15, -16, -22, -23, -32, -45, -46, -64, -90, -91, -5000].map(b),
        [8, 8, 9, 9, 10, 10, 11, 12, 12, 13, 14, 14, 15, 15]
    );
    assert_eq!([0, 1, 7, 8, 91].map(b), [0, 17, 23, 24, 31]);
    // Unidirectional: keys after the query share bucket 0.
    let u = |rel| t5_bucket(rel, false, 32, 128, None).unwrap();
    assert_eq!(
        [5, 1, 0, -1, -15, -16, -100, -128, -100000].map(u),
        [0, 0, 0, 1, 15, 16, 30, 31, 31]
    );
    for (nb, md, bi) in [
        (1, 128, false),
        (3, 128, true),
        (32, 16, false),
        (32, 8, true),
    ] {
        let e = t5_bucket(0, bi, nb, md, None).unwrap_err();
        assert_eq!(e.code, "CM0314", "{nb} {md} {bi}");
    }
}

#[test]
fn table_buckets_cover_every_distance() {
    let p = compile(PROGRAMS[3]);
    let b = bind(&p, shape(5, 3, 2), &[]).unwrap();
    let t = b.score.as_ref().unwrap().table.clone().unwrap();
    assert_eq!(
        (t.tensor.as_str(), t.num_buckets, t.per_head),
        ("rel", 32, true)
    );
    // Distances q - k = -2 ..= 4; rel = k - q = 2 ..= -4.
    let want: Vec<u32> = (-2i64..=4)
        .map(|d| t5_bucket(-d, true, 32, 128, None).unwrap() as u32)
        .collect();
    assert_eq!(t.bucket, want);
    assert_eq!(t.bucket_of(0, 2, 3), want[0]);
    assert_eq!(t.index(4, 0, 1, 3), 32 + want[6] as usize);
}

#[test]
fn bad_score_values_fail_at_plan_time() {
    for (src, s, code, message) in [
        (
            "param cap: int = 0;\nmask = k <= q;\nscore = softcap(score, cap);",
            shape(4, 4, 1),
            "CM0314",
            "softcap 0: expected a positive finite number that f32 holds (1.1754944e-38 to 3.4028235e38)",
        ),
        (
            "mask = k <= q;\nscore = softcap(score, 1e-50);",
            shape(4, 4, 1),
            "CM0314",
            "softcap 1e-50: expected a positive finite number that f32 holds (1.1754944e-38 to 3.4028235e38)",
        ),
        (
            "mask = k <= q;\nscore = score + 1e300 * 1e300 * (q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is inf, which the kernels take as an f32, and it is not a finite number; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = score + 0.5 * (q - k + 9223372036854775807);",
            shape(4, 4, 1),
            "CM0314",
            "the positions of the bias reach the offset = 9223372036854775807; expected at most 2^24 in magnitude",
        ),
        (
            "mask = k <= q;\nscore = score + 0.5 * (3 * q - k);",
            shape(8_000_000, 4, 1),
            "CM0314",
            "the positions of the bias reach q_coef * q = 23999997; expected at most 2^24 in magnitude",
        ),
        (
            "mask = k <= q;\nscore = score + 1e300 * (q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is 1e300, which the kernels take as an f32, and f32 rounds it to infinity; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        // Nonzero constants that f32 rounds to 0 would drop the term without a word, however
        // they are written: a literal, a product, an entry of a per-head array, a constant.
        (
            "mask = k <= q;\nscore = score + 1e-46 * (q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is 1e-46, which the kernels take as an f32, and f32 rounds it to 0; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = score + 1e-300 * (q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is 1e-300, which the kernels take as an f32, and f32 rounds it to 0; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = score - 1e-30 * 1e-30 * (q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is -1.0000000000000001e-60, which the kernels take as an f32, and f32 rounds it to 0; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = score + [0.5, 1e-46][h] * (q - k);",
            shape(4, 4, 2),
            "CM0314",
            "the bias coefficient of head 1 is 1e-46, which the kernels take as an f32, and f32 rounds it to 0; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = score + 1e-46;",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is 1e-46, which the kernels take as an f32, and f32 rounds it to 0; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = score + 1e39 * (q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is 1e39, which the kernels take as an f32, and f32 rounds it to infinity; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = score + (1e300 * 1e300 - 1e300 * 1e300) * (q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the bias coefficient of head 0 is NaN, which the kernels take as an f32, and it is not a finite number; expected 0 or a magnitude from 1e-45 to 3.4028235e38",
        ),
        (
            "mask = k <= q;\nscore = softcap(score, 1e-45);",
            shape(4, 4, 1),
            "CM0314",
            "softcap 1e-45: expected a positive finite number that f32 holds (1.1754944e-38 to 3.4028235e38)",
        ),
        (
            "mask = k <= q;\nscore = score + 0.5 * (3000000000 * q - k);",
            shape(4, 4, 1),
            "CM0314",
            "the q coefficient of the bias is 3000000000; expected a 32-bit integer",
        ),
        (
            "tensor t: [num_heads, 8];\nmask = k <= q;\nscore = score + t[h][t5_bucket(k - q, 8, 2, false)];",
            shape(4, 4, 1),
            "CM0314",
            "t5_bucket(num_buckets = 8, max_distance = 2) has 4 exact buckets and needs max_distance above them",
        ),
        (
            "tensor t: [num_heads, 8];\nmask = k <= q;\nscore = score + t[h][t5_bucket(k - q, -64, 128, false)];",
            shape(4, 4, 1),
            "CM0314",
            "t5_bucket(num_buckets = -64, max_distance = 128) has no exact bucket; expected num_buckets >= 2",
        ),
        (
            "tensor t: [num_heads, 8];\nmask = k <= q;\nscore = score + t[h][t5_bucket(k - q, 3, 128, true)];",
            shape(4, 4, 1),
            "CM0314",
            "t5_bucket(num_buckets = 3, max_distance = 128, bidirectional) has no exact bucket; expected num_buckets >= 4",
        ),
        (
            "tensor t: [8];\nmask = k <= q;\nscore = score + t[q - k];",
            shape(9, 4, 1),
            "CM0315",
            "the bucket of distance q - k = -3 is -3, outside tensor `t`'s 8 buckets",
        ),
        (
            "tensor t: [8, 8];\nmask = k <= q;\nscore = score + t[h][0];",
            shape(4, 4, 2),
            "CM0315",
            "tensor `t` is a bias table indexed by `h`, so its first extent must be num_heads = 2, got 8",
        ),
        (
            "tensor s: [3];\nmask = k <= q;\nsink = s[h];",
            shape(4, 4, 2),
            "CM0315",
            "tensor `s` is the sinks, indexed by `h`, so its first extent must be num_heads = 2, got 3",
        ),
        (
            "tensor t: [num_heads, 4294967295];\nmask = k <= q;\nscore = score + t[h][0];",
            shape(4, 4, 65536),
            "CM0315",
            "tensor `t` is [65536, 4294967295], 281474976645120 elements; expected at most 2^31 = 2147483648",
        ),
        (
            "tensor t: [num_heads, 1073741825];\nmask = k <= q;\nscore = score + t[h][0];",
            shape(4, 4, 2),
            "CM0315",
            "tensor `t` is [2, 1073741825], 2147483650 elements; expected at most 2^31 = 2147483648",
        ),
        (
            "tensor s: [q_len - 4];\nmask = k <= q;\nsink = s[h];",
            shape(4, 4, 2),
            "CM0315",
            "tensor `s` has extent 0; expected 1 ..= 4294967295",
        ),
        (
            "mask = k <= q;\nscore = score + alibi_slopes(0)[h] * (q - k);",
            shape(4, 4, 2),
            "CM0314",
            "alibi_slopes(0): expected a head count in 1 ..= 65536",
        ),
        (
            "mask = k <= q;\nscore = score + alibi_slopes(2)[h] * (q - k);",
            shape(4, 4, 3),
            "CM0304",
            "index 2 is out of range for a float array of length 2",
        ),
    ] {
        let p = compile(src);
        let e = bind(&p, s, &[]).unwrap_err();
        assert_eq!((e.code.as_str(), e.message.as_str()), (code, message), "{src}");
        assert!(e.span.is_some(), "{src}");
    }
    // A tensor of exactly 2^31 elements binds, its last bucket an int32.
    let p = compile("tensor t: [num_heads, 1073741824];\nmask = k <= q;\nscore = score + t[h][q - k + 1073741820];");
    let b = bind(&p, shape(4, 4, 2), &[]).unwrap();
    let t = b.score.as_ref().unwrap().table.as_ref().unwrap();
    assert_eq!((t.num_buckets, t.bucket[6]), (1 << 30, 1073741823));
    // Zero, the smallest f32 (a subnormal: the kernels do not flush them) and values near
    // f32's largest bind to the f32 nearest them.
    for (c, want) in [
        ("0.0", 0.0f32),
        ("1e-45", f32::from_bits(1)),
        ("1e-46 * 20.0", f32::from_bits(1)),
        ("-3e38", -3e38),
    ] {
        let p = compile(&format!("mask = k <= q;\nscore = score + {c} * (q - k);"));
        let b = bind(&p, shape(4, 4, 1), &[]).unwrap();
        let slopes = &b.score.as_ref().unwrap().linear.as_ref().unwrap().slopes;
        assert_eq!(slopes, &[want], "{c}");
    }
}
