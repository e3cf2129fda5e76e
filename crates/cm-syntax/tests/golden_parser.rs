//! Golden tests for the parser: the syntax tree (`Debug`, with spans) and diagnostics of a
//! handful of programs that together use every statement form of docs/language.md
//! (`param` scalar / array / typeless / no default, `let`, `segments` plain / `fill` /
//! composite, `part`, `grid` 2D / 3D / `at`, `require` with interpolation and `\{`, `mask`)
//! and most expression forms, plus one program with syntax errors to pin recovery.
//!
//! Snapshots live in `tests/snapshots/`; regenerate with `INSTA_UPDATE=always cargo test -p
//! cm-syntax --test golden_parser` and review the diff.

fn golden(name: &str, src: &str) {
    let (program, diags) = cm_syntax::parse(src);
    let out = format!("--- source\n{src}\n--- ast\n{program:#?}\n--- diagnostics\n{diags:#?}\n");
    insta::assert_snapshot!(name, out);
}

#[test]
fn parse_params_and_lets() {
    golden(
        "params_and_lets",
        "# parameters of every kind\n\
         param w: int = 4 * 2;\n\
         param lens: [int] = [3, 1_000];\n\
         param flat = [1, -2];\n\
         param n: int;\n\
         let lo = max(q - w, 0);\n\
         mask = lo <= k <= q;\n",
    );
}

#[test]
fn parse_segments_and_parts() {
    golden(
        "segments_and_parts",
        "param lens: [int] = [4, 2];\n\
         segments doc = lens;\n\
         segments kdoc = lens fill kv_len;\n\
         segments sample = { prompt: [3], response: lens * 2 };\n\
         part doc.head = 0 .. len / 2;\n\
         mask = k in kdoc[doc.index(q)] | k in doc.head(q) & k in sample.response(q).start ..= q;\n",
    );
}

#[test]
fn parse_grids_and_require() {
    golden(
        "grids_and_require",
        "grid img = [4, 4] at 2;\n\
         grid vid = [2, 3, 3];\n\
         require q_len == 18 else \"need 18 tokens, got {q_len} \\{literal}\";\n\
         mask = if q in img then k < 2 | l2(img) < 2 else box(vid, 0..2, 0..=1, 1..3);\n",
    );
}

#[test]
fn parse_expressions() {
    golden(
        "expressions",
        "mask = !(k > q) and not false or (q - k) % 3 == 0 & (k / 4 == q / 4) \
         | elementwise(k * k < abs(-q)) - (if b == 0 then k == h else true);\n",
    );
}

#[test]
fn parse_recovers_from_errors() {
    golden(
        "recovers_from_errors",
        "param w: int = ;\nfoo = 3;\nlet a = (1 + ;\nmask = k <= q $;\n",
    );
}
