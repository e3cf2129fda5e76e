//! Arrays and segmentations chosen per batch index: `concat`, slices and element-wise `+`
//! inside the mask (reading `b`, `h` and `q`), and segmentations whose lengths read `b`,
//! planned at several batch sizes against the pairwise semantics (rows and tiles).

#[allow(dead_code)]
mod common;
use cm_ir::Shape;
use cm_plan::TileShape;
use common::*;

const TILE: TileShape = TileShape {
    block_m: 8,
    block_n: 8,
};

fn shape_b(q_len: i64, kv_len: i64, batch: i64, num_heads: i64) -> Shape {
    Shape {
        q_len,
        kv_len,
        batch,
        num_heads,
    }
}

/// A document mask whose documents differ per sample: sample b's lengths are
/// `lens[offs[b] .. offs[b + 1]]`, cycled to fill the sequence, queries and keys alike.
#[test]
fn documents_per_batch_index() {
    let program = compile(
        "param lens: [int] = [5, 3, 8, 1, 2, 7, 4];\n\
         param offs: [int] = [0, 2, 3, 7];\n\
         segments qdoc = lens[offs[b] .. offs[b + 1]];\n\
         segments kdoc = concat(lens[offs[b] .. offs[b + 1]], [0]) fill kv_len;\n\
         mask = k in kdoc[qdoc.index(q) % kdoc.count] & k <= q + kv_len - q_len;",
    );
    for (q_len, kv_len) in [(23, 23), (17, 30), (40, 19)] {
        let plan =
            check_against_brute_force(&program, shape_b(q_len, kv_len, 3, 1), &params(&[]), TILE);
        assert_eq!(plan.masks.len(), 3, "one mask per sample");
    }
    // Given values replace the defaults, and every sample's slice is checked.
    let err = program
        .bind(
            shape_b(8, 8, 3, 1),
            &params(&[("offs", arr(&[0, 2, 3, 9]))]),
        )
        .and_then(|b| cm_plan::plan(&b, TILE).map(|_| ()))
        .unwrap_err();
    assert_eq!(err.code.as_str(), "CM0304");
    assert!(
        err.message.contains("slice 3..9") && err.message.contains("at b = 2"),
        "{}",
        err.message
    );
}

/// A segmentation whose fill and piece counts read `b`.
#[test]
fn composite_and_fill_per_batch_index() {
    let program = compile(
        "param p: [int] = [4, 6];\nparam r: [int] = [2, 3, 1];\n\
         segments s = { prompt: p, resp: r * (b + 1) } fill q_len - b;\n\
         mask = if q < q_len - b then k in s.prompt(q) | k in s.resp(q).start ..= q else k <= q;",
    );
    for batch in [1, 4] {
        check_against_brute_force(&program, shape_b(29, 29, batch, 1), &params(&[]), TILE);
    }
}

/// Array expressions in the mask are evaluated per batch and head (not at b = h = 0) and
/// per row where they read `q`.
#[test]
fn array_expressions_read_b_h_and_q() {
    let program = compile(
        "param w: [int] = [1, 4, 2];\n\
         mask = q - concat(w, [b + h])[(b + h) % 4] <= k <= q \
         | k == concat([q / 2], w)[0] | k < sum(w[h % 2 .. 3]) - 6;",
    );
    check_against_brute_force(&program, shape_b(21, 25, 3, 2), &params(&[]), TILE);
    check_against_brute_force(
        &program,
        shape_b(13, 13, 2, 2),
        &params(&[("w", arr(&[3, 0, 9]))]),
        TILE,
    );
}
