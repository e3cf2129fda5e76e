//! Fuzzing the whole pipeline on the stable toolchain (proptest as the engine): the built-in
//! masks and a few more valid programs, mutated at the byte, token and line level (deletions,
//! duplications, swaps, insertions of tokens and keywords, hostile numbers), go through
//! parse, check, bind (random lengths, tiles and parameter values: negative, zero,
//! `i64::MAX`, empty arrays, wrong types) and plan. Nothing may panic, every failure is an
//! error with a `CM` code, and where the pairwise reference semantics is cheap to run the
//! planner fails exactly when it does (with the same code) and otherwise agrees with it on
//! every row.
//!
//! Case counts: `CM_FUZZ_CASES` (default: a quick CI run), e.g.
//! `CM_FUZZ_CASES=20000 cargo test -p cm-plan --test fuzz -- --nocapture` (prints what
//! happened to the cases). `CM_FUZZ_VERBOSE=1` also prints slow cases; `CM_FUZZ_TRACE=FILE`
//! writes each case to FILE before running it (for crashes that abort the process).

use cm_ir::{PlanError, Shape, Value};
use cm_plan::plan::row_intervals;
use cm_plan::symbolic::Solver;
use cm_plan::{plan, TileShape};
use cm_testkit::config::fuzz_config;
use cm_testkit::source::{comparison_chain, disjunction_chain, floor_boundary};
use cm_testkit::{shape, tokens};
use proptest::prelude::*;
use proptest::sample::Index;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::LazyLock;

/// Valid programs beyond the built-ins: the examples of docs/language.md and programs
/// that use every construct.
const EXTRA: &[&str] = &[
    "param qlens: [int] = [150, 150];\nparam klens: [int] = [70, 110];\nsegments qdoc = qlens;\n\
     segments kdoc = klens fill kv_len;\nmask = k in kdoc[qdoc.index(q)];\n",
    "param windows: [int] = [128, 256, 512, 1024];\nmask = q - windows[h % count(windows)] < k <= q;\n",
    "param n: [int] = [1, 2];\nmask = if q < n[b] then k <= q else k < kv_len;\n",
    "grid img = [6, 5] at 3;\nmask = if q in img then k < 3 | l2(img) < 3 else k < kv_len;\n",
    "param r: int = 2;\ngrid v = [2, 3, 4] at 1;\n\
     mask = l1(v) <= r | linf(v) < r - 1 | (if q in v then box(v, v.t(q) ..= v.t(q), 0 .. v.y(q), v.x(q) - 1 .. v.x(q) + 2) else false);\n",
    "param lens: [int] = [5, 0, 3, 9];\nsegments s = lens;\npart s.head = 0 .. min(2, len);\n\
     part s.tail = len - len / 3 .. len;\nsegments c = { p: [2, 3], r: [1, 4, 0] * 2 };\n\
     let u = s(q);\nmask = (k in s.head(q) | k in u.start ..= q) - (k in s.tail(q) & q != k) | k in c.r(q) | k in c.p(q).start .. q;\n",
    "param d: int = 3;\nparam w: int = 9;\nrequire d >= 1 else \"d must be >= 1, got {d}\";\n\
     mask = (k + 1) / d == q / d | (q - k) % d == 0 & q - w < k <= q | -(2 * k) + q > -5 & !(k == q / 2);\n",
    "param a: [int] = [3, 1, 2];\nmask = elementwise(k * k <= q + a[k % count(a)]) | k >= q + kv_len - q_len;\n",
    "mask = if b == 1 then k <= q else (if h > 0 then k >= q else k != q) & (k - q) % (h + 2) != 1;\n",
    "param p: int = isqrt(q_len);\nlet x = max(abs(q - p), 1);\nmask = k in q - x .. q + x & k / x <= q / x;\n",
];

/// Tokens and keywords to insert.
static TOKENS: LazyLock<Vec<&str>> = LazyLock::new(|| {
    tokens::concat(&[
        tokens::KEYWORDS,
        tokens::NAMES,
        &[".start", ".end", ".len", ".index", ".count"],
        tokens::SYMBOLS,
        tokens::DOTS,
        EXTRA_TOKENS,
    ])
});

/// Comments, quotes, numbers (`i64::MIN` among them) and a whole statement.
const EXTRA_TOKENS: &[&str] = &[
    "#",
    "\"",
    "0",
    "1",
    "-1",
    "2",
    "7",
    "4096",
    "9223372036854775807",
    "(-9223372036854775807 - 1)",
    "mask = k <= q;",
    "\n",
];

/// Numbers to substitute for literals.
const HOSTILE: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "-1",
    "-7",
    "127",
    "4096",
    "65536",
    "67108864",
    "67108865",
    "4294967296",
    "3037000500",
    "9223372036854775807",
    "9223372036854775806",
    "(-9223372036854775807 - 1)",
    "(0 - 9223372036854775807)",
];

#[derive(Clone, Debug)]
enum Mutation {
    DeleteBytes(Index, usize),
    DuplicateBytes(Index, usize),
    InsertToken(Index, &'static str),
    DeleteToken(Index),
    DuplicateToken(Index),
    SwapTokens(Index, Index),
    ReplaceNumber(Index, &'static str),
    ReplaceToken(Index, &'static str),
    CopyIdent(Index, Index),
    DeleteLine(Index),
    DuplicateLine(Index),
    SwapLines(Index, Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let tok = proptest::sample::select(TOKENS.as_slice());
    prop_oneof![
        1 => (any::<Index>(), 1usize..8).prop_map(|(i, n)| Mutation::DeleteBytes(i, n)),
        1 => (any::<Index>(), 1usize..12).prop_map(|(i, n)| Mutation::DuplicateBytes(i, n)),
        3 => (any::<Index>(), tok.clone()).prop_map(|(i, t)| Mutation::InsertToken(i, t)),
        2 => any::<Index>().prop_map(Mutation::DeleteToken),
        1 => any::<Index>().prop_map(Mutation::DuplicateToken),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::SwapTokens(a, b)),
        5 => (any::<Index>(), proptest::sample::select(HOSTILE))
            .prop_map(|(i, n)| Mutation::ReplaceNumber(i, n)),
        2 => (any::<Index>(), tok).prop_map(|(i, t)| Mutation::ReplaceToken(i, t)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::CopyIdent(a, b)),
        1 => any::<Index>().prop_map(Mutation::DeleteLine),
        1 => any::<Index>().prop_map(Mutation::DuplicateLine),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
    ]
}

/// A rough tokenizer (words, numbers, runs of symbols, whitespace) for mutations.
fn tokens(src: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut cur = String::new();
    let class = |c: char| {
        if c.is_alphanumeric() || c == '_' {
            0
        } else if c.is_whitespace() {
            1
        } else {
            2 + c as u32
        }
    };
    for c in src.chars() {
        if let Some(last) = cur.chars().last() {
            if class(last) != class(c) || class(c) >= 2 {
                out.push(std::mem::take(&mut cur));
            }
        }
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn mutate(src: &str, m: &Mutation) -> String {
    let is_word = |t: &str| {
        t.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
    };
    let is_num = |t: &str| t.chars().next().is_some_and(|c| c.is_ascii_digit());
    let mut toks = tokens(src);
    let mut lines: Vec<&str> = src.split_inclusive('\n').collect();
    match m {
        Mutation::DeleteBytes(i, n) => {
            let a = floor_boundary(src, i.index(src.len() + 1));
            let b = floor_boundary(src, a + n);
            return format!("{}{}", &src[..a], &src[b..]);
        }
        Mutation::DuplicateBytes(i, n) => {
            let a = floor_boundary(src, i.index(src.len() + 1));
            let b = floor_boundary(src, a + n);
            return format!("{}{}", &src[..b], &src[a..]);
        }
        Mutation::InsertToken(i, t) => {
            toks.insert(i.index(toks.len() + 1), format!(" {t} "));
        }
        Mutation::DeleteToken(i) if !toks.is_empty() => {
            toks.remove(i.index(toks.len()));
        }
        Mutation::DuplicateToken(i) if !toks.is_empty() => {
            let j = i.index(toks.len());
            toks.insert(j, toks[j].clone());
        }
        Mutation::SwapTokens(a, b) if !toks.is_empty() => {
            let (a, b) = (a.index(toks.len()), b.index(toks.len()));
            toks.swap(a, b);
        }
        Mutation::ReplaceNumber(i, n) => {
            let nums: Vec<usize> = (0..toks.len()).filter(|&j| is_num(&toks[j])).collect();
            if !nums.is_empty() {
                toks[nums[i.index(nums.len())]] = n.to_string();
            }
        }
        Mutation::ReplaceToken(i, t) if !toks.is_empty() => {
            let j = i.index(toks.len());
            toks[j] = format!(" {t} ");
        }
        Mutation::CopyIdent(a, b) => {
            let words: Vec<usize> = (0..toks.len()).filter(|&j| is_word(&toks[j])).collect();
            if !words.is_empty() {
                let (a, b) = (words[a.index(words.len())], words[b.index(words.len())]);
                toks[a] = toks[b].clone();
            }
        }
        Mutation::DeleteLine(i) if !lines.is_empty() => {
            lines.remove(i.index(lines.len()));
            return lines.concat();
        }
        Mutation::DuplicateLine(i) if !lines.is_empty() => {
            let j = i.index(lines.len());
            lines.insert(j, lines[j]);
            return lines.concat();
        }
        Mutation::SwapLines(a, b) if !lines.is_empty() => {
            let (a, b) = (a.index(lines.len()), b.index(lines.len()));
            lines.swap(a, b);
            return lines.concat();
        }
        _ => {}
    }
    toks.concat()
}

const INTS: &[i64] = &[
    0,
    1,
    2,
    3,
    -1,
    -2,
    7,
    16,
    100,
    4096,
    -4096,
    1 << 26,
    1 << 31,
    3_037_000_500,
    1 << 40,
    i64::MAX / 2,
    i64::MAX - 1,
    i64::MAX,
    i64::MIN + 1,
    i64::MIN,
];

/// A parameter value: the default (`None`), or an integer and an array (maybe empty) of
/// which the one matching the parameter's type is used, except now and then.
#[derive(Clone, Debug)]
struct Val {
    given: bool,
    wrong_type: bool,
    int: i64,
    array: Vec<i64>,
}

fn value() -> impl Strategy<Value = Val> {
    let int = prop_oneof![
        3 => proptest::sample::select(INTS),
        4 => -20i64..=70,
    ];
    (
        prop::bool::weighted(0.6),
        prop::bool::weighted(0.05),
        int.clone(),
        proptest::collection::vec(int, 0..6),
    )
        .prop_map(|(given, wrong_type, int, array)| Val {
            given,
            wrong_type,
            int,
            array,
        })
}

#[derive(Clone, Debug)]
struct Setup {
    shape: Shape,
    tile: TileShape,
    values: Vec<Val>,
}

fn setup() -> impl Strategy<Value = Setup> {
    let len = prop_oneof![
        30 => proptest::sample::select(&[1i64, 2, 3, 5, 7, 16, 33, 64][..]),
        1 => proptest::sample::select(&[0i64, -1, (1 << 26) + 1, i64::MAX, i64::MIN][..]),
    ];
    let side = prop_oneof![
        30 => 1u32..=70,
        1 => Just(0u32),
        1 => Just(1u32 << 16),
        1 => Just(u32::MAX),
    ];
    (
        (len.clone(), len, 1i64..=3, 1i64..=3),
        (side.clone(), side),
        proptest::collection::vec(value(), 8),
    )
        .prop_map(
            |((q_len, kv_len, batch, num_heads), (bm, bn), values)| Setup {
                shape: shape(q_len, kv_len, batch, num_heads),
                tile: TileShape {
                    block_m: bm,
                    block_n: bn,
                },
                values,
            },
        )
}

/// What happened to the cases of a run.
#[derive(Default, Debug)]
struct Stats {
    cases: u64,
    compiled: u64,
    bound: u64,
    planned: u64,
    agreed: u64,
    both_failed: u64,
    codes: BTreeMap<&'static str, u64>,
}

thread_local! {
    static STATS: RefCell<Stats> = RefCell::new(Stats::default());
}

fn code_ok(e: &PlanError) {
    assert!(
        e.code.as_str().starts_with("CM") && e.code.as_str().len() == 6,
        "bad error code: {e}"
    );
}

/// Brute force is only run where it is cheap.
const BRUTE_PAIRS: i64 = 40_000;

fn run_pipeline(src: &str, s: &Setup) {
    STATS.with(|st| st.borrow_mut().cases += 1);
    let (program, diags) = cm_stdlib::compile(src);
    for d in &diags {
        assert!(d.code.as_str().starts_with("CM"), "{d:?}");
        assert!(d.span.start <= d.span.end && d.span.end as usize <= src.len());
    }
    let Some(program) = program else { return };
    STATS.with(|st| st.borrow_mut().compiled += 1);
    let mut values = BTreeMap::new();
    for (p, v) in program.params.iter().zip(&s.values) {
        if v.given {
            let value = if p.is_array != v.wrong_type {
                Value::Array(v.array.clone().into())
            } else {
                Value::Int(v.int)
            };
            values.insert(p.name.clone(), value);
        }
    }
    let bound = match program.bind(s.shape, &values) {
        Ok(b) => b,
        Err(e) => {
            code_ok(&e);
            STATS.with(|st| *st.borrow_mut().codes.entry(e.code.as_str()).or_default() += 1);
            return;
        }
    };
    STATS.with(|st| st.borrow_mut().bound += 1);
    // No panic is excused: proptest turns one into a failing, shrunk case.
    let planned = plan(&bound, s.tile);
    if let Ok(p) = &planned {
        for m in &p.masks {
            m.rows.validate().unwrap_or_else(|e| panic!("{e}\n{src}"));
        }
    }
    if let Err(e) = &planned {
        code_ok(e);
        STATS.with(|st| *st.borrow_mut().codes.entry(e.code.as_str()).or_default() += 1);
    }
    let sh = s.shape;
    let bs = if program.uses_b { sh.batch } else { 1 };
    let hs = if program.uses_h { sh.num_heads } else { 1 };
    if sh.q_len * sh.kv_len * bs * hs > BRUTE_PAIRS || s.tile.block_m == 0 || s.tile.block_n == 0 {
        if planned.is_ok() {
            STATS.with(|st| st.borrow_mut().planned += 1);
        }
        return;
    }
    let mut brute_err = None;
    'rows: for b in 0..bs {
        for h in 0..hs {
            for q in 0..sh.q_len {
                match bound.brute_force_row(q, b, h) {
                    Err(e) => {
                        code_ok(&e);
                        brute_err = Some(e);
                        break 'rows;
                    }
                    Ok(want) => {
                        if let Ok(p) = &planned {
                            let got: Vec<(u32, u32)> = p
                                .mask(b as u32, h as u32)
                                .rows
                                .row_expanded(q as u32)
                                .iter()
                                .map(|iv| (iv.start, iv.end))
                                .collect();
                            assert_eq!(
                                got, want,
                                "row {q} (b={b}, h={h}) differs from brute force; shape {sh:?}, values {values:?}\n{src}"
                            );
                        }
                    }
                }
            }
        }
    }
    match (&brute_err, &planned) {
        (None, Ok(_)) => STATS.with(|st| {
            let mut st = st.borrow_mut();
            st.planned += 1;
            st.agreed += 1;
        }),
        (Some(want), Err(got)) => {
            assert_eq!(
                got.code, want.code,
                "the planner fails with {got}, the reference semantics with {want}; shape {sh:?}, values {values:?}\n{src}"
            );
            STATS.with(|st| st.borrow_mut().both_failed += 1);
        }
        (Some(want), Ok(_)) => panic!(
            "the reference semantics fails with {want}, the planner does not; shape {sh:?}, values {values:?}\n{src}"
        ),
        (None, Err(got)) => panic!(
            "the planner fails with {got}, the reference semantics does not; shape {sh:?}, values {values:?}\n{src}"
        ),
    }
}

fn report(name: &str) {
    STATS.with(|st| {
        let st = st.borrow();
        eprintln!(
            "{name}: {} cases, {} compiled, {} bound, {} planned, \
             {} agreed with brute force, {} failed in both with the same code",
            st.cases, st.compiled, st.bound, st.planned, st.agreed, st.both_failed,
        );
        eprintln!("{name}: error codes {:?}", st.codes);
    });
}

fn corpus() -> Vec<&'static str> {
    cm_stdlib::BUILTINS
        .iter()
        .map(|b| b.source)
        .chain(EXTRA.iter().copied())
        .collect()
}

fn run(name: &str, default_cases: u32, strategy: impl Strategy<Value = (String, Setup)>) {
    STATS.with(|st| *st.borrow_mut() = Stats::default());
    let mut runner = proptest::test_runner::TestRunner::new(fuzz_config(default_cases));
    let trace = std::env::var("CM_FUZZ_TRACE").ok();
    let result = runner.run(&strategy, |(src, setup)| {
        if let Some(path) = &trace {
            // The case about to run, for crashes that cannot be caught (stack overflow,
            // allocation failure).
            let _ = std::fs::write(path, format!("{setup:?}\n{src}"));
        }
        let t = std::time::Instant::now();
        run_pipeline(&src, &setup);
        let dt = t.elapsed();
        if dt.as_millis() > 200 && std::env::var("CM_FUZZ_VERBOSE").is_ok() {
            eprintln!("slow case ({dt:?}): {setup:?}\n{src}");
        }
        Ok(())
    });
    report(name);
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Every program of the corpus compiles and plans at its defaults (the mutations start
/// from valid programs).
#[test]
fn corpus_is_valid() {
    for src in corpus() {
        let (p, diags) = cm_stdlib::compile(src);
        let p = p.unwrap_or_else(|| panic!("{diags:?}\n{src}"));
        let shape = shape(127, 127, 2, 2);
        if let Ok(bound) = p.bind(shape, &BTreeMap::new()) {
            plan(&bound, TileShape::default()).unwrap_or_else(|e| panic!("{e}\n{src}"));
        }
    }
}

/// Valid programs with random parameter values, lengths and tiles.
#[test]
fn hostile_values() {
    let corpus = corpus();
    let strategy = (proptest::sample::select(corpus), setup())
        .prop_map(|(src, setup)| (src.to_string(), setup));
    run("hostile_values", 3000, strategy);
}

/// Mutated valid programs through every stage.
#[test]
fn mutated_programs() {
    let corpus = corpus();
    let strategy = (
        proptest::sample::select(corpus),
        proptest::collection::vec(mutation(), 1..5),
        setup(),
    )
        .prop_map(|(src, muts, setup)| {
            let mut s = src.to_string();
            for m in &muts {
                s = mutate(&s, m);
            }
            (s, setup)
        });
    run("mutated_programs", 6000, strategy);
}

/// Flat chains as long as the checker accepts (128 operators) still plan (the planner
/// recurses on the region tree).
#[test]
fn long_region_chains_plan() {
    for n in [50, 120] {
        for src in [
            format!("mask = {};", vec!["k < q"; n].join(" & ")),
            disjunction_chain(n, "=="),
            comparison_chain(n),
            format!("mask = k < q{};", " - 0".repeat(n)),
        ] {
            let (p, diags) = cm_stdlib::compile(&src);
            let p = p.unwrap_or_else(|| panic!("{diags:?}"));
            let shape = shape(300, 300, 1, 1);
            let bound = p.bind(shape, &BTreeMap::new()).unwrap();
            plan(&bound, TileShape::default()).unwrap();
        }
    }
}

/// Fixed: a 10_000-term comparison chain compiled and overflowed the stack in the planner;
/// now it is refused (CM0105).
#[test]
fn long_region_chain_10000_is_refused() {
    let src = comparison_chain(10_000);
    let (p, diags) = cm_stdlib::compile(&src);
    assert!(p.is_none());
    assert!(diags.iter().any(|d| d.code == "CM0105"), "{diags:?}");
}

/// Fixed: a tile far larger than the sequence cost memory in proportion to the tile
/// (`partial_row_first` held `block_m` entries per partial tile: 16 GiB for `u32::MAX x 1`).
#[test]
fn huge_tile_costs_no_memory_per_block_row() {
    let (p, _) = cm_stdlib::compile("mask = k <= q;");
    let shape = shape(2, 2, 1, 1);
    let p = p.unwrap();
    let bound = p.bind(shape, &BTreeMap::new()).unwrap();
    let tile = TileShape {
        block_m: u32::MAX,
        block_n: 1,
    };
    let plan = plan(&bound, tile).unwrap();
    let m = &plan.masks[0];
    assert!(m.tiles.partial_rows(&m.rows).partial_row_first.len() <= 2 * 2);
}

/// Fixed: a distance ball cost one step (and 16 bytes) per grid row within the radius, even
/// when `kv_len` was 1: 67M grid rows took seconds and 1 GiB; `grid g = [n, n]; mask =
/// linf(g) <= n;` with `n = 1000000000` asked for 32 GB and aborted. Ball rows are now
/// bounded by `kv_len`: the one key lies in grid row 0, so the solver builds one run, not
/// one per grid row within the radius (67108864).
#[test]
fn regression_ball_cost_is_bounded_by_kv_len() {
    let (p, _) = cm_stdlib::compile("grid g = [67108864, 1];\nmask = l1(g) <= 67108864;");
    let p = p.unwrap();
    let shape = shape(1, 1, 1, 1);
    let bound = p.bind(shape, &BTreeMap::new()).unwrap();
    let solver = Solver::new(&bound);
    let rows = row_intervals(&solver, 0, 0, &mut 0).unwrap();
    assert_eq!(solver.ball_runs_built.get(), 1);
    let row: Vec<(u32, u32)> = rows.row(0).iter().map(|iv| (iv.start, iv.end)).collect();
    assert_eq!(row, bound.brute_force_row(0, 0, 0).unwrap());
    assert_eq!(row, [(0, 1)]);
}

/// Fixed: `k / d` with `d = i64::MIN` panicked (the planner negated the divisor without a
/// check, "negate with overflow"); now it plans or is an error with a code.
#[test]
fn regression_division_by_i64_min_does_not_panic() {
    for (src, values) in [
        ("mask = k / (-9223372036854775807 - 1) == 0;", vec![]),
        (
            "param chunk: int = 8;\nmask = k / chunk == q / chunk & k <= q;",
            vec![("chunk", Value::Int(i64::MIN))],
        ),
    ] {
        let (p, diags) = cm_stdlib::compile(src);
        let p = p.unwrap_or_else(|| panic!("{diags:?}"));
        let shape = shape(4, 4, 1, 1);
        let values: BTreeMap<String, Value> = values
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let bound = p.bind(shape, &values).unwrap();
        if let Err(e) = plan(&bound, TileShape::default()) {
            assert!(e.code.as_str().starts_with("CM"));
        }
    }
}

/// Fixed: `l1(g) < r` / `linf(g) < r` with `r = i64::MIN` panicked (`r - 1` overflowed in
/// the planner, "subtract with overflow"); now the ball is empty.
#[test]
fn regression_ball_radius_near_i64_min_is_empty() {
    for metric in ["l1", "linf"] {
        let src = format!("param r: int = 1;\ngrid g = [2, 2];\nmask = {metric}(g) < r;");
        let (p, diags) = cm_stdlib::compile(&src);
        let p = p.unwrap_or_else(|| panic!("{diags:?}"));
        let shape = shape(4, 4, 1, 1);
        let values: BTreeMap<String, Value> = [("r".to_string(), Value::Int(i64::MIN))].into();
        let bound = p.bind(shape, &values).unwrap();
        let plan = plan(&bound, TileShape::default()).unwrap();
        assert_eq!(plan.visible_pairs(), 0);
    }
}
