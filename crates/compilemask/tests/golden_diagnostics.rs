//! Golden tests for rendered diagnostics: one program per stable code of
//! docs/language.md, rendered without colour exactly as users see them.
//!
//! - Compile-time codes (CM01xx syntax, CM02xx names and types, the CM0250 warning) are
//!   rendered with `compilemask::render(source, name, &diagnostics)`.
//! - Plan-time codes (CM03xx values, CM04xx limits) come from `Program::plan` and are
//!   rendered with `Program::render_error`.
//! - Plan-time warnings (CM026x) come from `Program::plan_warnings` and are rendered with
//!   `compilemask::render`, the renderer of errors: `[CODE] Warning:` where an error says
//!   `[CODE] Error:`.
//!
//! Each test also asserts the code itself, so a snapshot can never silently switch to
//! another error. Snapshots live in `tests/snapshots/`; regenerate with
//! `INSTA_UPDATE=always cargo test -p compilemask --test golden_diagnostics` and review.

use compilemask::{PackedShape, PlanOptions, Value};

const NAME: &str = "mask.cmask";

/// Compiles `src`, which must fail (or warn, for CM0250), and snapshots every diagnostic.
fn compile_golden(code: &str, src: &str) {
    let diags = match compilemask::compile_named(src, NAME) {
        Err(e) => e.diagnostics,
        Ok(p) => p.warnings().to_vec(),
    };
    assert!(
        diags.iter().any(|d| d.code == code),
        "expected {code}, got {:?}",
        diags.iter().map(|d| d.code).collect::<Vec<_>>()
    );
    let rendered = compilemask::render(src, NAME, &diags);
    assert!(
        !rendered.contains('\x1b'),
        "rendered output has colour codes"
    );
    insta::assert_snapshot!(
        code.to_lowercase(),
        format!("--- source\n{src}\n--- rendered\n{rendered}")
    );
}

/// Compiles `src` (which must check) and plans it with `options`, which must fail with
/// `code`; snapshots the rendered plan error.
fn plan_golden(code: &str, src: &str, options: &PlanOptions) {
    let program = compilemask::compile_named(src, NAME)
        .unwrap_or_else(|e| panic!("{code}: program should check:\n{}", e.rendered));
    let err = program
        .plan(options)
        .expect_err("planning should fail for this program");
    assert_eq!(err.code, code, "wrong code: {err}");
    let rendered = program.render_error(&err);
    assert!(
        !rendered.contains('\x1b'),
        "rendered output has colour codes"
    );
    insta::assert_snapshot!(
        code.to_lowercase(),
        format!(
            "--- source\n{src}\n--- options\nq_len={} kv_len={:?} batch={} num_heads={} tile={}x{} params={:?}\n--- rendered\n{rendered}",
            options.q_len,
            options.kv_len,
            options.batch,
            options.num_heads,
            options.tile.block_m,
            options.tile.block_n,
            options.params
        )
    );
}

fn opts(q_len: i64) -> PlanOptions {
    PlanOptions::new(q_len)
}

// ---- CM01xx: syntax ------------------------------------------------------------------

#[test]
fn cm0101_unexpected_character() {
    compile_golden("CM0101", "mask = k <= q $ 1;\n");
}

/// A typeset character pasted for an operator: its hint names the ASCII spelling, and the
/// statement reports nothing after it.
#[test]
fn cm0101_lookalike_character() {
    insta::with_settings!({snapshot_suffix => "lookalike"}, {
        compile_golden("CM0101", "param w: int = 8;\nmask = q \u{2013} w < k <= q;\n");
    });
}

#[test]
fn cm0102_unterminated_string() {
    compile_golden(
        "CM0102",
        "require q_len > 1 else \"too short;\nmask = k <= q;\n",
    );
}

#[test]
fn cm0102_unclosed_brace_in_message() {
    // Same code, other cause: `{` opened in a require message and never closed.
    let src = "require q_len > 1 else \"q_len is {q_len\";\nmask = k <= q;\n";
    let e = compilemask::compile_named(src, NAME).unwrap_err();
    assert!(e.diagnostics.iter().any(|d| d.code == "CM0102"));
    insta::assert_snapshot!(
        "cm0102_brace",
        format!(
            "--- source\n{src}\n--- rendered\n{}",
            compilemask::render(src, NAME, &e.diagnostics)
        )
    );
}

#[test]
fn cm0103_integer_too_large() {
    compile_golden("CM0103", "mask = k <= q + 99999999999999999999;\n");
}

#[test]
fn cm0104_unexpected_token() {
    compile_golden("CM0104", "mask = k <= ;\n");
}

#[test]
fn cm0105_nesting_too_deep() {
    // Deep `let` chains are the realistic way to hit the limit (parentheses give it too):
    // one error, at the first `let` past the limit, however long the chain goes on.
    let mut src = String::from("let a0 = q;\n");
    for i in 1..=5000 {
        src.push_str(&format!("let a{i} = a{} + 1;\n", i - 1));
    }
    src.push_str("mask = k <= a5000;\n");
    let e = compilemask::compile_named(&src, NAME).unwrap_err();
    assert_eq!(e.diagnostics.len(), 1, "{:?}", e.diagnostics);
    assert_eq!(e.diagnostics[0].code, "CM0105");
    insta::assert_snapshot!(
        "cm0105",
        format!(
            "--- source\nlet a0 = q;\nlet a1 = a0 + 1;\n... (to a5000)\nmask = k <= a5000;\n\n--- rendered\n{}",
            compilemask::render(&src, NAME, &e.diagnostics)
        )
    );
}

#[test]
fn cm0105_parentheses_too_deep() {
    // Same code from the parser: 200 nested parentheses.
    let src = format!("mask = k <= {}q{};\n", "(".repeat(200), ")".repeat(200));
    let e = compilemask::compile_named(&src, NAME).unwrap_err();
    assert_eq!(e.diagnostics[0].code, "CM0105");
    insta::assert_snapshot!(
        "cm0105_parens",
        format!(
            "--- source\n{src}\n--- rendered (first diagnostic of {})\n{}",
            e.diagnostics.len(),
            compilemask::render(&src, NAME, &e.diagnostics[..1])
        )
    );
}

#[test]
fn cm0106_expected_statement() {
    compile_golden("CM0106", "window = 3;\nmask = k <= q;\n");
}

// ---- CM02xx: names and types ---------------------------------------------------------

#[test]
fn cm0201_unknown_name() {
    compile_golden(
        "CM0201",
        "param window: int = 8;\nmask = q - windw < k <= q;\n",
    );
}

#[test]
fn cm0202_duplicate_name() {
    compile_golden("CM0202", "let lo = 1;\nlet lo = 2;\nmask = lo <= k <= q;\n");
}

#[test]
fn cm0203_type_mismatch() {
    compile_golden("CM0203", "mask = k <= q + true;\n");
}

/// `+` of arrays adds entry by entry: with lengths the program fixes and that differ, the
/// check fails and points at `concat`.
#[test]
fn cm0203_array_plus_is_not_append() {
    insta::with_settings!({snapshot_suffix => "array_plus"}, {
        compile_golden(
            "CM0203",
            "param docs: [int] = [512, 384];\nparam pad: int = 128;\nsegments doc = docs + [pad];\nmask = k in doc(q);\n",
        );
    });
}

/// With lengths given at plan time, the same confusion is a plan-time error with the hint.
#[test]
fn cm0308_array_plus_of_given_lengths() {
    insta::with_settings!({snapshot_suffix => "array_plus"}, {
        plan_golden(
            "CM0308",
            "param docs: [int];\nparam pad: [int] = [128];\nsegments doc = docs + pad;\nmask = k in doc(q);\n",
            &opts(8).param("docs", Value::Array(vec![3, 5].into())),
        );
    });
}

/// A parameter default cannot read a segmentation: binding lays them out later.
#[test]
fn cm0208_structure_read_too_early() {
    insta::with_settings!({snapshot_suffix => "structure"}, {
        compile_golden(
            "CM0208",
            "segments doc = [4, 4];\nparam n: int = doc.count;\nmask = k in doc(q) & k < n;\n",
        );
    });
}

/// The variable of `any` / `all` needs a name of its own.
#[test]
fn cm0202_quantifier_variable() {
    insta::with_settings!({snapshot_suffix => "quantifier"}, {
        compile_golden(
            "CM0202",
            "param g: [int] = [0, 9];\nmask = k <= q | any g in 0 .. count(g): k == g[0];\n",
        );
    });
}

#[test]
fn cm0204_wrong_arity() {
    compile_golden("CM0204", "mask = k <= abs(q, 1);\n");
}

#[test]
fn cm0205_no_mask() {
    compile_golden("CM0205", "param w: int = 3;\n");
}

#[test]
fn cm0206_k_in_condition() {
    compile_golden("CM0206", "mask = if k < 3 then k <= q else k < kv_len;\n");
}

#[test]
fn cm0207_unsolvable_comparison() {
    compile_golden("CM0207", "mask = k * k * q < 64;\n");
}

/// The term at fault is marked with what is wrong with it.
#[test]
fn cm0207_names_the_term_at_fault() {
    insta::with_settings!({snapshot_suffix => "modulo"}, {
        compile_golden("CM0207", "mask = (k * q) % 3 < 1 & k <= q;\n");
    });
}

/// Each source compiles with no error and no warning.
fn compiles_clean(sources: &[&str]) {
    for ok in sources {
        let p = compilemask::compile_named(ok, NAME).unwrap_or_else(|e| panic!("{}", e.rendered));
        assert!(p.warnings().is_empty(), "{ok}");
    }
}

/// `k` inside `abs` is solvable in a comparison; inside a function of q-side values it is
/// `CM0206` at that argument.
/// `abs`, `min` and `max` of linear terms are split into cases (`min(k, q) < 5` plans);
/// of a term that is not linear, the comparison stays CM0207, naming that term.
#[test]
fn cm0207_case_splits_need_linear_terms() {
    compiles_clean(&[
        "mask = min(k, q) < 5;\n",
        "mask = max(q - k, 0) <= 3;\n",
        "mask = abs(k - q) % 3 == 0;\n",
    ]);
    insta::with_settings!({snapshot_suffix => "case_split"}, {
        compile_golden("CM0207", "mask = min(k * q, 4) % 3 == 0;\n");
    });
}

/// `abs`, `min` and `max` nested in each other, of any number of terms, are split too; past
/// the 256 cases one comparison may have, CM0207 names that limit and the count of cases
/// the comparison's terms give, not a term that is "not linear".
#[test]
fn cm0207_past_the_case_limit() {
    compiles_clean(&[
        "mask = min(abs(k-q), abs(k-q+1), abs(k-q+2)) < 3;\n",
        "mask = min(min(abs(k-q),abs(k-q+1)),abs(k-q+2)) < 3;\n",
        "mask = max(min(abs(k - q), abs(k - q - 3)), min(abs(k - q + 1), k - 2)) % 4 == 1;\n",
    ]);
    insta::with_settings!({snapshot_suffix => "case_limit"}, {
        compile_golden(
            "CM0207",
            "mask = min(abs(k - q), abs(k - q + 1), abs(k - q + 2), abs(k - q - 5), abs(k - q - 7), abs(k - q + 9)) % 3 == 1;\n",
        );
    });
}

#[test]
fn cm0206_points_at_the_argument() {
    insta::with_settings!({snapshot_suffix => "argument"}, {
        compile_golden("CM0206", "param w: int = 4;\nmask = abs(q - k) <= w & k < [abs(k), 2][0];\n");
    });
}

#[test]
fn cm0208_wrong_context() {
    compile_golden("CM0208", "param w: int = q;\nmask = k <= w;\n");
}

#[test]
fn cm0209_unknown_field() {
    compile_golden(
        "CM0209",
        "segments doc = [4, 4];\nmask = k in doc(q).start .. doc(q).middle;\n",
    );
}

#[test]
fn cm0210_two_masks() {
    compile_golden("CM0210", "mask = k <= q;\nmask = k < q;\n");
}

#[test]
fn cm0211_distance_comparison() {
    compile_golden("CM0211", "grid img = [4, 4];\nmask = l2(img) > 2;\n");
}

/// Every score statement error of the checker (CM0212 forms, CM0213 repeats, and the
/// type and context errors of floats, tensors and the raw score), rendered one after the
/// other in one snapshot.
#[test]
fn cm0212_score_forms() {
    let cases: &[(&str, &str)] = &[
        ("CM0212", "score = score * 2.0;"),
        ("CM0212", "score = 1.0 - score;"),
        ("CM0212", "score = score + score;"),
        ("CM0212", "score = (q - k) * 0.5;"),
        ("CM0212", "score = softcap(score + 1.0, 5.0);"),
        ("CM0212", "score = softcap(score, q + 1);"),
        ("CM0212", "score = score + (q - k) * (q - k);"),
        ("CM0212", "score = score + 0.5 * q + 0.25 * k;"),
        ("CM0212", "score = score + abs(q - k) * 0.5;"),
        ("CM0212", "score = score + 1.0 / (q - k);"),
        ("CM0212", "score = score + (q - k) / 2 * 0.5;"),
        ("CM0212", "score = score + 0.5 * (q - k + h);"),
        ("CM0212", "score = score + b * 1.0;"),
        ("CM0212", "tensor t: [8];\nscore = score + t[q - k + 1 - k];"),
        ("CM0212", "tensor t: [8];\nscore = score + t[h];"),
        ("CM0212", "tensor t: [num_heads, 8];\nscore = score + t[0][q - k];"),
        ("CM0212", "tensor t: [num_heads, 8];\nscore = score + t[q - k];"),
        ("CM0212", "tensor t: [8];\nscore = score + t[0] + t[1];"),
        ("CM0212", "tensor t: [8];\nscore = score - t[0];"),
        ("CM0212", "tensor t: [8];\nscore = score + 2.0 * t[0];"),
        ("CM0212", "tensor t: [4, 4, 4];\nscore = score;"),
        ("CM0212", "tensor t: [4, 4];\nscore = score + t[h][q - k][0];"),
        ("CM0212", "grid g = [4, 4];\ntensor t: [num_heads, 49];\nscore = score + t[h][(g.y(q) - g.y(k) + 3) * 7 + g.x(q) - g.x(k) + 3];"),
        ("CM0212", "tensor t: [8];\nscore = score + t;"),
        ("CM0212", "tensor s: [num_heads];\nsink = s[0];"),
        ("CM0212", "param s: [int] = [1];\nsink = s[h];"),
        ("CM0212", "tensor S: [num_heads, 2];\nsink = S[h][0];"),
        ("CM0201", "sink = U[h];"),
        ("CM0212", "sink = 1.5;"),
        ("CM0213", "score = score;\nscore = score;"),
        ("CM0213", "tensor s: [num_heads];\nsink = s[h];\nsink = s[h];"),
        ("CM0203", "param w: int = 1.5;"),
        ("CM0203", "score = score + [0.5, 0.25];"),
        ("CM0208", "let x = score;\nscore = x;"),
        ("CM0208", "tensor t: [4];\nparam n: int = t[0];"),
        ("CM0208", "param w: int = t5_bucket(1, 32, 128, true);"),
        ("CM0208", "grid g = [2, 2];\nscore = score + l2(g) * 1.0;"),
        ("CM0202", "param score: int = 1;"),
        ("CM0103", "score = score + 1e999;"),
        ("CM0103", "score = score + 1e-400 * (q - k);"),
        ("CM0203", "score = score % 2.0;"),
        ("CM0203", "score = score + (score + 1.0)[0];"),
        ("CM0212", "score = score + 0.5 * (q - k) * 0.5 + 0.5 * q;"),
    ];
    let mut all = String::new();
    for (code, body) in cases {
        let src = format!("mask = k <= q;\n{body}\n");
        let diags = match compilemask::compile_named(&src, NAME) {
            Err(e) => e.diagnostics,
            Ok(_) => panic!("{body} checked"),
        };
        assert!(
            diags.iter().any(|d| d.code == *code),
            "{body}: expected {code}, got {:?}",
            diags.iter().map(|d| d.code).collect::<Vec<_>>()
        );
        all.push_str(&format!(
            "--- source\n{src}--- rendered\n{}\n",
            compilemask::render(&src, NAME, &diags)
        ));
    }
    insta::assert_snapshot!("cm0212_score_forms", all);
}

#[test]
fn cm0250_unused_let() {
    compile_golden("CM0250", "let unused = 5;\nmask = k <= q;\n");
}

/// Compiles and plans `src` with `options` (which must succeed) and snapshots its
/// plan-time warnings, which must include `code`.
fn warning_golden(code: &str, src: &str, options: &PlanOptions) {
    let program = compilemask::compile_named(src, NAME)
        .unwrap_or_else(|e| panic!("{code}: program should check:\n{}", e.rendered));
    let plan = program.plan(options).expect("the plan succeeds");
    let warnings = program.plan_warnings(options, &plan);
    assert!(
        warnings.iter().any(|d| d.code == code && !d.is_error()),
        "expected warning {code}, got {warnings:?}"
    );
    let rendered = compilemask::render(src, NAME, &warnings);
    assert!(
        rendered.starts_with(&format!("[{code}] Warning: ")),
        "{rendered}"
    );
    insta::assert_snapshot!(
        code.to_lowercase(),
        format!("--- source\n{src}\n--- rendered\n{rendered}")
    );
}

// ---- CM026x: plan-time warnings --------------------------------------------------------

#[test]
fn cm0260_no_visible_pair() {
    warning_golden("CM0260", "mask = k > q + 100;\n", &opts(8));
}

#[test]
fn cm0261_rows_that_see_no_key() {
    warning_golden("CM0261", "mask = k < q;\n", &opts(8));
}

#[test]
fn cm0262_head_index_with_one_head() {
    warning_golden("CM0262", "mask = k <= q + h;\n", &opts(8));
}

#[test]
fn cm0263_batch_index_with_one_batch() {
    warning_golden("CM0263", "mask = k <= q - b;\n", &opts(8));
}

#[test]
fn cm0264_parameter_set_but_not_read() {
    warning_golden(
        "CM0264",
        "param window: int = 4;\nmask = k <= q;\n",
        &opts(8).param("window", Value::Int(2)),
    );
}

#[test]
fn cm0265_large_elementwise() {
    warning_golden("CM0265", "mask = elementwise(k <= q);\n", &opts(1001));
}

#[test]
fn cm0266_tree_past_the_lengths() {
    warning_golden(
        "CM0266",
        "param parents: [int] = [-1, 0, 1, 1, 0, 4, 4, 6];\ntree t = parents;\nmask = k in t.path(q);\n",
        &opts(4),
    );
}

// ---- CM03xx: plan-time values ---------------------------------------------------------

#[test]
fn cm0301_division_by_zero() {
    plan_golden(
        "CM0301",
        "param chunk: int = 4;\nmask = k / chunk == q / chunk;\n",
        &opts(8).param("chunk", Value::Int(0)),
    );
}

#[test]
fn cm0302_overflow() {
    plan_golden(
        "CM0302",
        "param scale: int = 2;\nmask = k <= q * scale;\n",
        &opts(8).param("scale", Value::Int(i64::MAX)),
    );
}

/// The CM0302 that `source` with `param = value` raises on every entry that evaluates a
/// bound program (plan, the row-range solver, the brute-force reference, packed planning)
/// ends its message naming `param = value`.
fn overflow_names_value_on_every_entry(source: &str, param: &str, value: i64) {
    let program = compilemask::compile_named(source, NAME).unwrap();
    let options = opts(8).param(param, Value::Int(value));
    let errors = [
        program.plan(&options).unwrap_err(),
        program.row_range(&options, 0, 0, 2..3).unwrap_err(),
        program.brute_force_row(&options, 2, 0, 0).unwrap_err(),
        program
            .plan_packed(&PackedShape::self_attention([0, 3, 8]), &options)
            .unwrap_err(),
    ];
    for err in errors {
        assert_eq!(err.code, "CM0302", "{err}");
        let named = format!(", where {param} = {value}");
        assert!(err.message.contains(&named), "{}", err.message);
    }
}

/// Every entry names the parameter values of a failing expression, as `plan` does above.
#[test]
fn arithmetic_errors_name_parameter_values_on_every_entry() {
    overflow_names_value_on_every_entry(
        "param scale: int = 2;\nmask = k <= q * scale;\n",
        "scale",
        i64::MAX,
    );
}

/// Arithmetic errors of binding (a grid's size here, a tree's prompt offset) name the
/// parameter values as well, on every entry.
#[test]
fn binding_arithmetic_errors_name_parameter_values() {
    overflow_names_value_on_every_entry(
        "param n: int = 2;\ngrid g = [9223372036854775807, n];\nmask = k in g;\n",
        "n",
        3,
    );
}

/// A default that reads the lengths has a value per packed sample: the error names the
/// failing sample's value. `q * s * 2^61` overflows at row 1 when `s = q_len = 4`, not when
/// it is 2.
#[test]
fn a_packed_sample_error_names_that_samples_parameter_values() {
    let program = compilemask::compile_named(
        "param s: int = q_len;\nmask = k <= q * s * 2305843009213693952;\n",
        NAME,
    )
    .unwrap();
    let err = program
        .plan_packed(
            &PackedShape::self_attention([0, 2, 6]),
            &PlanOptions::default(),
        )
        .unwrap_err();
    assert_eq!(err.code, "CM0302", "{err}");
    assert!(
        err.message
            .ends_with(", where s = 4 (packed sample b = 1: q_len = 4, kv_len = 4)"),
        "{}",
        err.message
    );
}

#[test]
fn cm0303_outside_segmentation() {
    plan_golden(
        "CM0303",
        "segments doc = [2] fill 4;\nmask = k in doc(q);\n",
        &opts(8),
    );
}

#[test]
fn cm0304_index_out_of_range() {
    plan_golden(
        "CM0304",
        "param cut: [int] = [1, 2];\nmask = k <= cut[q];\n",
        &opts(4),
    );
}

#[test]
fn cm0305_require_failed() {
    plan_golden(
        "CM0305",
        "param window: int = 4;\nrequire window >= 1 else \"window must be >= 1, got {window}\";\nmask = q - window < k <= q;\n",
        &opts(8).param("window", Value::Int(-3)),
    );
}

#[test]
fn cm0306_segments_add_no_tokens() {
    plan_golden(
        "CM0306",
        "param lengths: [int] = [4];\nsegments doc = lengths;\nmask = k in doc(q);\n",
        &opts(8).param("lengths", Value::Array(vec![0, 0].into())),
    );
}

#[test]
fn cm0307_negative_segment_length() {
    plan_golden(
        "CM0307",
        "param lengths: [int] = [4];\nsegments doc = lengths;\nmask = k in doc(q);\n",
        &opts(8).param("lengths", Value::Array(vec![3, -1].into())),
    );
}

#[test]
fn cm0308_missing_parameter() {
    plan_golden(
        "CM0308",
        "param window: int;\nmask = q - window < k <= q;\n",
        &opts(8),
    );
}

#[test]
fn cm0308_wrong_type() {
    let src = "param window: int = 4;\nmask = q - window < k <= q;\n";
    let program = compilemask::compile_named(src, NAME).unwrap();
    let err = program
        .plan(&opts(8).param("window", Value::Array(vec![1, 2].into())))
        .unwrap_err();
    assert_eq!(err.code, "CM0308");
    insta::assert_snapshot!(
        "cm0308_wrong_type",
        format!(
            "--- source\n{src}\n--- params\nwindow=1,2\n--- rendered\n{}",
            program.render_error(&err)
        )
    );
}

#[test]
fn cm0309_unknown_parameter() {
    plan_golden(
        "CM0309",
        "param window: int = 4;\nmask = q - window < k <= q;\n",
        &opts(8).param("windw", Value::Int(2)),
    );
}

#[test]
fn cm0310_grid_coordinate_outside_grid() {
    plan_golden(
        "CM0310",
        "grid img = [2, 2] at 2;\nmask = k <= img.x(q);\n",
        &opts(6),
    );
}

/// CM0310's hint guards the side whose position failed: a query's coordinates with `if q in
/// G`, a key's with `k in G & ...` (an `if` condition cannot read `k`), and the guard it
/// suggests plans, exactly.
#[test]
fn cm0310_hint_guards_the_side_that_failed() {
    let hint = |src: &str| {
        let program = compilemask::compile_named(src, NAME).unwrap();
        let err = program.plan(&opts(6)).unwrap_err();
        assert_eq!(err.code, "CM0310", "{err}");
        err.hint.unwrap()
    };
    assert_eq!(
        hint("grid img = [2, 2] at 2;\nmask = k <= img.x(q);\n"),
        "guard coordinates with `if q in img then ... else ...`"
    );
    assert_eq!(
        hint("grid img = [2, 2] at 2;\nmask = img.y(k) == 1;\n"),
        "guard key coordinates with `k in img & ...`: `&` evaluates its right side only where \
         its left side holds"
    );
    let guarded = "grid img = [2, 2] at 2;\nmask = k in img & img.y(k) == 1;\n";
    let plan = compilemask::compile_named(guarded, NAME)
        .unwrap()
        .plan(&opts(6))
        .unwrap();
    let rows = &plan.mask(0, 0).rows;
    for q in 0..6 {
        let row: Vec<(u32, u32)> = rows.row(q).iter().map(|i| (i.start, i.end)).collect();
        assert_eq!(row, [(4, 6)], "row {q}");
    }
}

#[test]
fn cm0311_bad_grid_extent() {
    plan_golden(
        "CM0311",
        "param side: int = 2;\ngrid img = [side, side];\nmask = k in img;\n",
        &opts(4).param("side", Value::Int(0)),
    );
}

#[test]
fn cm0312_isqrt_negative() {
    plan_golden("CM0312", "mask = k <= isqrt(q - 3);\n", &opts(6));
}

// ---- CM04xx: planning limits ----------------------------------------------------------

#[test]
fn cm0313_bad_tree() {
    plan_golden(
        "CM0313",
        "param parents: [int] = [-1, 0, 3, 2];\ntree draft = parents at 4;\nmask = k < 4 & k <= q | k in draft.path(q);\n",
        &opts(8),
    );
}

/// Every plan-time score error: bad values (CM0314), tables and tensor extents (CM0315),
/// positions under a token order or packed samples (CM0411).
#[test]
fn cm0314_cm0315_cm0411_score_values() {
    let cases: &[(&str, &str, i64, i64)] = &[
        ("CM0314", "param cap: int = 0;\nmask = k <= q;\nscore = softcap(score, cap);", 4, 1),
        ("CM0314", "mask = k <= q;\nscore = score + 1e300 * 1e300 * (q - k);", 4, 1),
        ("CM0314", "mask = k <= q;\nscore = score + 1e-46 * (q - k);", 4, 1),
        ("CM0314", "mask = k <= q;\nscore = score + 0.5 * (3000000000 * q - k);", 4, 1),
        ("CM0314", "tensor t: [num_heads, 8];\nmask = k <= q;\nscore = score + t[h][t5_bucket(k - q, 8, 2, false)];", 4, 1),
        ("CM0314", "mask = k <= q;\nscore = score + alibi_slopes(0)[h] * (q - k);", 4, 2),
        ("CM0315", "tensor t: [8];\nmask = k <= q;\nscore = score + t[q - k];", 9, 1),
        ("CM0315", "tensor t: [8, 8];\nmask = k <= q;\nscore = score + t[h][0];", 4, 2),
        ("CM0315", "tensor s: [3];\nmask = k <= q;\nsink = s[h];", 4, 2),
        ("CM0315", "tensor s: [q_len - 4];\nmask = k <= q;\nsink = s[h];", 4, 2),
        ("CM0304", "mask = k <= q;\nscore = score + alibi_slopes(2)[h] * (q - k);", 4, 3),
        ("CM0301", "mask = k <= q;\nscore = score + 1.0 / 0.0 * (q - k);", 4, 1),
    ];
    let mut all = String::new();
    for (code, body, q_len, heads) in cases {
        let src = format!("{body}\n");
        let program = compilemask::compile_named(&src, NAME).unwrap();
        let mut options = opts(*q_len);
        options.num_heads = *heads;
        let err = program.plan(&options).unwrap_err();
        assert_eq!(err.code, *code, "{body}: {err}");
        all.push_str(&format!(
            "--- source\n{src}--- q_len={q_len} num_heads={heads}\n{}\n",
            program.render_error(&err)
        ));
    }
    let alibi = "mask = k <= q;\nscore = score - alibi_slopes(num_heads)[h] * (q - k);\n";
    let program = compilemask::compile_named(alibi, NAME).unwrap();
    let options = PlanOptions {
        order: compilemask::OrderRequest::Explicit(vec![1, 0, 2, 3]),
        ..opts(4)
    };
    let err = program.plan(&options).unwrap_err();
    assert_eq!(err.code, "CM0411");
    all.push_str(&format!(
        "--- source\n{alibi}--- order 1,0,2,3\n{}\n",
        program.render_error(&err)
    ));
    let (cq, ck) = (vec![0i64, 3, 7], vec![0i64, 4, 7]);
    let err = program
        .plan_packed(
            &compilemask::PackedShape::new(cq.clone(), ck.clone()),
            &PlanOptions::default(),
        )
        .unwrap_err();
    assert_eq!(err.code, "CM0411");
    all.push_str(&format!(
        "--- source\n{alibi}--- cu_seqlens_q {cq:?} cu_seqlens_k {ck:?}\n{}\n",
        program.render_error(&err)
    ));
    for (body, cu) in [
        (
            "mask = k <= q;\nscore = score + 0.5 * q;\n",
            vec![0i64, 3, 7],
        ),
        (
            "mask = k <= q;\nscore = softcap(score, q_len);\n",
            vec![0, 3, 7],
        ),
        (
            "tensor t: [16];\nmask = k <= q;\nscore = score + t[min(q - k + q_len, 15)];\n",
            vec![0, 3, 7],
        ),
    ] {
        let program = compilemask::compile_named(body, NAME).unwrap();
        let err = program
            .plan_packed(
                &compilemask::PackedShape::self_attention(cu.clone()),
                &PlanOptions::default(),
            )
            .unwrap_err();
        assert_eq!(err.code, "CM0411");
        all.push_str(&format!(
            "--- source\n{body}--- cu_seqlens {cu:?}\n{}\n",
            program.render_error(&err)
        ));
    }
    insta::assert_snapshot!("cm0314_cm0315_cm0411_score_values", all);
}

/// Past the pair limit, before any pair is evaluated: the count of the pairs the regions
/// around the predicate leave open, and the limit.
#[test]
fn cm0404_elementwise_pairs_counted_up_front() {
    insta::with_settings!({snapshot_suffix => "elementwise"}, {
        plan_golden(
            "CM0404",
            "mask = q - 9000 < k <= q & elementwise((q * 7 + k * 3) % 11 < 5);\n",
            &opts(40000),
        );
    });
}

#[test]
fn cm0401_zero_tile_side() {
    plan_golden("CM0401", "mask = k <= q;\n", &opts(8).tile(0, 4));
}

#[test]
fn cm0402_length_out_of_range() {
    plan_golden("CM0402", "mask = k <= q;\n", &opts(0));
}

#[test]
fn cm0402_kv_len_too_large() {
    let program = compilemask::compile_named("mask = k <= q;\n", NAME).unwrap();
    let err = program.plan(&opts(8).kv_len((1 << 26) + 1)).unwrap_err();
    assert_eq!(err.code, "CM0402");
    insta::assert_snapshot!("cm0402_kv_len", program.render_error(&err));
}

#[test]
fn cm0409_bad_cu_seqlens() {
    let program = compilemask::compile_named("mask = k <= q;\n", NAME).unwrap();
    let packed = compilemask::PackedShape::new([0, 5, 3], [0, 5, 6]);
    let err = program
        .plan_packed(&packed, &PlanOptions::default())
        .unwrap_err();
    assert_eq!(err.code, "CM0409");
    insta::assert_snapshot!("cm0409", program.render_error(&err));
}

#[test]
fn cm0410_order_with_packing() {
    let program = compilemask::compile_named("mask = k <= q;\n", NAME).unwrap();
    let options = PlanOptions {
        order: compilemask::OrderRequest::Auto,
        ..PlanOptions::default()
    };
    let err = program
        .plan_packed(&compilemask::PackedShape::self_attention([0, 4]), &options)
        .unwrap_err();
    assert_eq!(err.code, "CM0410");
    insta::assert_snapshot!("cm0410", program.render_error(&err));
}

/// A dilated window at 128K is one strided run per row; what reads plain intervals (here a
/// token order) would need 264M of them.
#[test]
fn cm0412_strided_runs_past_the_expansion_limit() {
    let program = compilemask::builtin("dilated_window").unwrap();
    let n = 131072u32;
    let options = PlanOptions {
        order: compilemask::OrderRequest::Explicit((0..n).rev().collect()),
        ..opts(i64::from(n))
    };
    let err = program.plan(&options).unwrap_err();
    assert_eq!(err.code, "CM0412");
    insta::assert_snapshot!("cm0412", program.render_error(&err));
    // The exports refuse it the same way.
    let plan = program.plan(&opts(i64::from(n))).unwrap();
    let e = compilemask::export::cudnn_endpoints(&plan.mask(0, 0).rows).unwrap_err();
    assert_eq!(e.code(), compilemask::Code::StridesTooMany);
    assert_eq!(e.message(), err.message);
    // So does the CPU reference, reading as the same error (code, message and hint).
    let shape = compilemask::AttentionShape {
        batch: 1,
        num_heads: 1,
        num_kv_heads: 1,
        q_len: n as usize,
        kv_len: n as usize,
        head_dim: 1,
        head_dim_v: 1,
    };
    let x = vec![0f32; n as usize];
    let e = compilemask::attention(&shape, &x, &x, &x, &plan, 1.0).unwrap_err();
    assert!(
        matches!(e, compilemask::AttentionError::Strides(_)),
        "{e:?}"
    );
    assert_eq!(e.to_string(), err.to_string());
}

#[test]
fn unknown_builtin_lists_the_available_ones() {
    let e = compilemask::builtin("causl").unwrap_err();
    assert_eq!(e.diagnostics[0].code, "CM0201");
    insta::assert_snapshot!("unknown_builtin", e.rendered);
}

#[test]
fn dense_export_above_limit() {
    let program = compilemask::builtin("causal").unwrap();
    let plan = program.plan(&opts(20_000)).unwrap();
    let err = compilemask::export::dense(&plan.mask(0, 0).rows).unwrap_err();
    insta::assert_snapshot!("dense_export_too_large", err.to_string());
}

/// One renderer: an error reads the same with a span (drawn against the source) and without
/// one; the header line is the same text, and the hint is the `Help:` line in both.
#[test]
fn errors_read_the_same_with_and_without_a_span() {
    let src = "param window: int = 4;\nrequire window >= 1 else \"window must be >= 1, got {window}\";\nmask = q - window < k <= q;\n";
    let program = compilemask::compile_named(src, NAME).unwrap();
    let err = program
        .plan(&opts(8).param("window", Value::Int(0)))
        .unwrap_err();
    assert!(err.span.is_some(), "{err:?}");
    let spanned = program.render_error(&err);
    let bare = compilemask::PlanError {
        span: None,
        hint: Some("a hint".into()),
        ..err.clone()
    };
    let unspanned = program.render_error(&bare);
    assert_eq!(
        spanned.lines().next(),
        unspanned.lines().next(),
        "{spanned}\n{unspanned}"
    );
    assert_eq!(
        unspanned,
        format!("[CM0305] Error: {}\n    Help: a hint\n", err.message)
    );
    assert_eq!(unspanned, format!("{bare}\n"));
    let with_hint = program.render_error(&compilemask::PlanError {
        hint: Some("a hint".into()),
        ..err
    });
    assert!(with_hint.contains("│ Help: a hint"), "{with_hint}");
}
