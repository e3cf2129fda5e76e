//! Every built-in mask, planned at small and odd sizes, equals the brute-force semantics.

// Each test binary uses a different subset of the shared helpers.
#[allow(dead_code)]
mod common;
use cm_plan::TileShape;
use common::*;

const TILES: &[TileShape] = &[
    TileShape {
        block_m: 128,
        block_n: 128,
    },
    TileShape {
        block_m: 7,
        block_n: 5,
    },
    TileShape {
        block_m: 16,
        block_n: 64,
    },
];

#[test]
fn causal_and_windows() {
    for (q, kv) in [
        (1, 1),
        (2, 2),
        (127, 127),
        (129, 129),
        (300, 180),
        (180, 300),
    ] {
        for t in TILES {
            check_against_brute_force(&builtin("causal"), shape(q, kv), &params(&[]), *t);
            check_against_brute_force(
                &builtin("causal_bottom_right"),
                shape(q, kv),
                &params(&[]),
                *t,
            );
            check_against_brute_force(
                &builtin("sliding_window"),
                shape(q, kv),
                &params(&[("window", cm_ir::Value::Int(17))]),
                *t,
            );
            check_against_brute_force(
                &builtin("prefix_lm"),
                shape(q, kv),
                &params(&[("prefix", cm_ir::Value::Int(33))]),
                *t,
            );
        }
    }
}

#[test]
fn structured() {
    let t = TileShape {
        block_m: 16,
        block_n: 24,
    };
    for q in [1, 97, 400, 1000] {
        check_against_brute_force(
            &builtin("document_causal"),
            shape(q, q),
            &params(&[("lengths", arr(&[40, 0, 7, 100, 1]))]),
            t,
        );
        check_against_brute_force(
            &builtin("hstu"),
            shape(q, q),
            &params(&[
                ("lengths", arr(&[64, 5, 1, 130, 9])),
                ("contextual", cm_ir::Value::Int(3)),
            ]),
            t,
        );
        check_against_brute_force(
            &builtin("shared_prefix"),
            shape(q, q),
            &params(&[
                ("prompts", arr(&[30, 0, 12])),
                ("responses", arr(&[5, 9, 0, 3, 17])),
                ("group", cm_ir::Value::Int(3)),
            ]),
            t,
        );
        check_against_brute_force(
            &builtin("chunked_causal"),
            shape(q, q),
            &params(&[("chunk", cm_ir::Value::Int(13))]),
            t,
        );
        check_against_brute_force(
            &builtin("block_causal"),
            shape(q, q),
            &params(&[("block", cm_ir::Value::Int(13))]),
            t,
        );
        check_against_brute_force(
            &builtin("sink_local"),
            shape(q, q),
            &params(&[
                ("sink", cm_ir::Value::Int(3)),
                ("window", cm_ir::Value::Int(20)),
            ]),
            t,
        );
        check_against_brute_force(
            &builtin("global_local"),
            shape(q, q),
            &params(&[
                ("global", cm_ir::Value::Int(3)),
                ("radius", cm_ir::Value::Int(20)),
            ]),
            t,
        );
        check_against_brute_force(
            &builtin("global_local"),
            shape(q, q),
            &params(&[
                ("global", cm_ir::Value::Int(0)),
                ("globals", arr(&[q - 1, 40, 7, 40, -5, q + 3, 100])),
                ("radius", cm_ir::Value::Int(9)),
            ]),
            t,
        );
        check_against_brute_force(
            &builtin("dilated_window"),
            shape(q, q),
            &params(&[
                ("window", cm_ir::Value::Int(30)),
                ("dilation", cm_ir::Value::Int(3)),
            ]),
            t,
        );
    }
}

#[test]
fn trace_workloads() {
    let t = TileShape {
        block_m: 64,
        block_n: 64,
    };
    for q in [500, 2000] {
        check_against_brute_force(&builtin("trace_documents"), shape(q, q), &params(&[]), t);
        check_against_brute_force(
            &builtin("trace_prompt_groups"),
            shape(q, q),
            &params(&[]),
            t,
        );
    }
}

#[test]
fn grids() {
    let t = TileShape {
        block_m: 32,
        block_n: 16,
    };
    for (n, text, r) in [(8, 5, 3), (13, 0, 4), (20, 17, 6), (5, 3, 16)] {
        check_against_brute_force(
            &builtin("clear"),
            shape(text + n * n, text + n * n),
            &params(&[
                ("text", cm_ir::Value::Int(text)),
                ("radius", cm_ir::Value::Int(r)),
            ]),
            t,
        );
    }
    check_against_brute_force(
        &builtin("neighborhood_2d"),
        shape(19 * 23 + 4, 19 * 23 + 4),
        &params(&[
            ("prefix", cm_ir::Value::Int(4)),
            ("height", cm_ir::Value::Int(19)),
            ("kernel", cm_ir::Value::Int(5)),
        ]),
        t,
    );
    check_against_brute_force(
        &builtin("neighborhood_3d"),
        shape(4 * 6 * 7, 4 * 6 * 7),
        &params(&[
            ("frames", cm_ir::Value::Int(4)),
            ("height", cm_ir::Value::Int(6)),
            ("width", cm_ir::Value::Int(7)),
            ("dt_radius", cm_ir::Value::Int(1)),
            ("radius", cm_ir::Value::Int(2)),
        ]),
        t,
    );
    check_against_brute_force(&builtin("tree"), shape(127, 127), &params(&[]), t);
    // Column bounds for every key (one per key: empty runs `0, 0` past the first few).
    let pad = |v: &[i64]| {
        let mut v = v.to_vec();
        v.resize(17, 0);
        arr(&v)
    };
    check_against_brute_force(
        &builtin("flashmask"),
        shape(13, 17),
        &params(&[
            ("uts", pad(&[0, 0, 2, 5, 0])),
            ("ute", pad(&[0, 3, 4, 9, 13])),
            ("lts", pad(&[8, 1, 12])),
            ("lte", pad(&[13, 2, 20])),
        ]),
        t,
    );
    // After a prompt, a tree numbered out of order, longer than the queries.
    check_against_brute_force(
        &builtin("tree"),
        shape(9, 11),
        &params(&[
            ("prompt", cm_ir::Value::Int(4)),
            ("parents", arr(&[3, 3, -1, 2, 0, 4, 2])),
        ]),
        t,
    );
    // A draft tree at the end of the sequence, numbered out of order; the default tree.
    for (n, parents) in [
        (7, &[3, 3, -1, 2, 0, 4, 2][..]),
        (129, &[-1, 0, 1, 1, 0][..]),
    ] {
        check_against_brute_force(
            &builtin("tree_decode"),
            shape(n, n),
            &params(&[("parents", arr(parents))]),
            t,
        );
    }
    check_against_brute_force(&builtin("tree_decode"), shape(200, 200), &params(&[]), t);
}
