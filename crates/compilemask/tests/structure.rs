//! `Program::structure`: segments, parts, pieces and grids at given lengths, against the
//! lengths the test gives.

use compilemask::{PlanOptions, StructureKind, Value};

#[test]
fn segments_parts_and_grids() {
    let hstu = compilemask::builtin("hstu").unwrap();
    let o = PlanOptions::new(100).param("lengths", Value::Array(vec![40, 24, 36].into()));
    let s = hstu.structure(&o).unwrap();
    let seg = s
        .groups
        .iter()
        .find(|g| g.kind == StructureKind::Segments)
        .unwrap();
    assert_eq!(seg.name, "user");
    let spans: Vec<(i64, i64)> = seg.spans.iter().map(|sp| sp.rows).collect();
    assert_eq!(spans, [(0, 40), (40, 64), (64, 100)]);
    assert_eq!(seg.spans[1].label, "user 1");
    assert!(seg.spans.iter().all(|sp| sp.rows == sp.keys));
    // targets: the last max(1, len / 8) positions of each user.
    let part = s
        .groups
        .iter()
        .find(|g| g.kind == StructureKind::Part)
        .unwrap();
    assert_eq!(part.name, "user.targets");
    let spans: Vec<(i64, i64)> = part.spans.iter().map(|sp| sp.rows).collect();
    assert_eq!(spans, [(35, 40), (61, 64), (96, 100)]);

    let clear = compilemask::builtin("clear").unwrap();
    let s = clear.structure(&PlanOptions::new(512 + 180 * 180)).unwrap();
    let grid = s
        .groups
        .iter()
        .find(|g| g.kind == StructureKind::Grid)
        .unwrap();
    assert_eq!(grid.spans[0].rows, (512, 512 + 180 * 180));
    assert_eq!(grid.spans[0].label, "img 180x180");
}

#[test]
fn packed_samples() {
    let causal = compilemask::builtin("causal").unwrap();
    let plan = causal
        .plan_packed(
            &compilemask::PackedShape::new([0, 5, 12], [0, 3, 12]),
            &PlanOptions::default(),
        )
        .unwrap();
    let s = compilemask::Structure::packed(plan.packing.as_ref().unwrap());
    let g = &s.groups[0];
    assert_eq!(g.kind, StructureKind::Samples);
    assert_eq!(g.spans[1].rows, (5, 12));
    assert_eq!(g.spans[1].keys, (3, 12));
    assert_eq!(g.spans[1].label, "sample 1");
}
