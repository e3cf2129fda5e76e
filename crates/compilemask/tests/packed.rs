//! The facade's packed planning: `Program::plan_packed` with `PackedShape`, its errors
//! (bad offsets CM0409, token orders CM0410), and `attention` on a packed plan.

use compilemask::{attention, AttentionShape, OrderRequest, PackedShape, PlanOptions, Value};

#[test]
fn plan_packed_rows_and_stats() {
    let program = compilemask::builtin("sliding_window").unwrap();
    let options = PlanOptions::default()
        .param("window", Value::Int(2))
        .tile(4, 4);
    let plan = program
        .plan_packed(
            &PackedShape::new([0, 5, 12], [0, 5, 12]).num_heads(3),
            &options,
        )
        .unwrap();
    assert_eq!(
        (plan.q_len, plan.kv_len, plan.batch, plan.num_heads),
        (12, 12, 1, 3)
    );
    let packing = plan.packing.as_ref().unwrap();
    assert_eq!(packing.batch(), 2);
    assert_eq!(packing.cu_seqlens_q(), [0, 5, 12]);
    // Row 5 is sample 1's row 0: it sees itself only; row 6 sees [5, 7).
    let rows = &plan.mask(0, 2).rows;
    assert_eq!((rows.row(5)[0].start, rows.row(5)[0].end), (5, 6));
    assert_eq!((rows.row(6)[0].start, rows.row(6)[0].end), (5, 7));
    assert_eq!((rows.row(4)[0].start, rows.row(4)[0].end), (3, 5));
    // 2 + 2 * 4 + 1 visible pairs in sample 0, 1 + 2 * 6 in sample 1, times three heads.
    assert_eq!(plan.visible_pairs(), 3 * (9 + 13));
    assert_eq!(plan.masks.len(), 1);
}

#[test]
fn packed_errors() {
    let program = compilemask::builtin("causal").unwrap();
    let options = PlanOptions::default();
    let e = program
        .plan_packed(&PackedShape::new([0, 5, 3], [0, 5, 6]), &options)
        .unwrap_err();
    assert_eq!(e.code, "CM0409");
    let rendered = program.render_error(&e);
    assert!(
        rendered.starts_with("[CM0409] Error: cu_seqlens_q decreases"),
        "{rendered}"
    );
    assert!(
        rendered.contains("Help: cu_seqlens are prefix sums"),
        "{rendered}"
    );
    let e = program
        .plan_packed(&PackedShape::new([0, 5], [0, 5, 6]), &options)
        .unwrap_err();
    assert_eq!(e.code, "CM0409");
    let ordered = PlanOptions {
        order: OrderRequest::Auto,
        ..PlanOptions::default()
    };
    let e = program
        .plan_packed(&PackedShape::self_attention([0, 4]), &ordered)
        .unwrap_err();
    assert_eq!(e.code, "CM0410");
    assert!(e.message.contains("token orders are not supported"));
}

#[test]
fn attention_on_a_packed_plan() {
    // Two samples of causal attention packed: sample 1's first row sees only its own key,
    // so its output is that key's value.
    let program = compilemask::builtin("causal").unwrap();
    let plan = program
        .plan_packed(
            &PackedShape::self_attention([0, 2, 3]),
            &PlanOptions::default(),
        )
        .unwrap();
    let shape = AttentionShape {
        batch: 1,
        num_heads: 1,
        num_kv_heads: 1,
        q_len: 3,
        kv_len: 3,
        head_dim: 1,
        head_dim_v: 1,
    };
    let (q, k, v) = (vec![1.0f64; 3], vec![0.0f64; 3], vec![1.0, 3.0, 7.0]);
    let out = attention(&shape, &q, &k, &v, &plan, 1.0).unwrap();
    assert_eq!(out.out, vec![1.0, 2.0, 7.0]);
    assert_eq!(out.lse[2], 0.0);
}
