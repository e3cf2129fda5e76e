//! docs/language.md's "Limits" table against the constants the compiler enforces: every
//! public limit has its row, with its value, so the documentation cannot drift.

/// The value column of the row whose first column starts with `what`.
fn documented(what: &str) -> String {
    let doc = include_str!("../../../docs/language.md");
    let table = doc
        .split("## Limits")
        .nth(1)
        .expect("docs/language.md has a Limits section");
    let row = table
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .find(|l| l.starts_with(&format!("| {what}")))
        .unwrap_or_else(|| panic!("no Limits row for {what}"));
    row.split('|').nth(2).expect("a value column").to_string()
}

/// `2^n` for a power of two, else the number.
fn written(v: u64) -> String {
    if v.is_power_of_two() && v >= 1 << 10 {
        format!("2^{}", v.trailing_zeros())
    } else {
        v.to_string()
    }
}

#[test]
fn every_public_limit_is_documented_with_its_value() {
    use cm_ir::bind::{
        MAX_BATCH, MAX_BATCH_HEADS, MAX_HEADS, MAX_LEN, MAX_QUANT_DEPTH, MAX_QUANT_TERMS,
        MAX_SEGMENTS,
    };
    use cm_ir::tree::MAX_TREE_INTERVALS;
    use cm_plan::plan::{MAX_INTERVALS, MAX_PLAN_ROW_BYTES, MAX_TILE_ENTRIES};
    use cm_plan::symbolic::{MAX_ELEMENTWISE_PAIRS, MAX_QUANT_EVALS};
    for (row, value) in [
        ("`q_len`, `kv_len`", MAX_LEN as u64),
        ("`batch` |", MAX_BATCH as u64),
        ("`num_heads`", MAX_HEADS as u64),
        ("`batch x num_heads`", MAX_BATCH_HEADS as u64),
        ("segments", MAX_SEGMENTS as u64),
        ("pairs evaluated one by one", MAX_ELEMENTWISE_PAIRS),
        ("intervals of one mask", MAX_INTERVALS as u64),
        ("tile-descriptor entries", MAX_TILE_ENTRIES as u64),
        (
            "row arrays of a plan's distinct masks",
            MAX_PLAN_ROW_BYTES as u64,
        ),
        (
            "unit intervals of one mask's strided runs",
            compilemask::MAX_EXPANDED_INTERVALS as u64,
        ),
        ("a dense export (", compilemask::DENSE_LIMIT),
        ("a dense export written as JSON", compilemask::JSON_LIMIT),
        ("`cu_seqlens` totals", MAX_LEN as u64),
        (
            "elements of one `tensor`",
            cm_ir::score::MAX_TENSOR_ELEMENTS as u64,
        ),
        ("integers one `any`", MAX_QUANT_TERMS as u64),
        ("nesting of `any`", MAX_QUANT_DEPTH as u64),
        ("terms of `any` / `all` evaluated", MAX_QUANT_EVALS),
        ("nodes of one tree", MAX_LEN as u64),
        ("path intervals of one tree", MAX_TREE_INTERVALS as u64),
        (
            "cases one comparison with `k` is split into",
            cm_ir::check::MAX_COMPARISON_CASES,
        ),
        ("bytes of one name", cm_syntax::lexer::MAX_NAME_BYTES as u64),
    ] {
        let row = row.trim_end_matches(" |");
        let cell = documented(row);
        let mut words = cell.split(|c: char| !(c.is_ascii_alphanumeric() || c == '^'));
        assert!(
            words.any(|w| w == written(value)),
            "the Limits row `{row}` says {cell:?}, the compiler's limit is {}",
            written(value)
        );
    }
}
