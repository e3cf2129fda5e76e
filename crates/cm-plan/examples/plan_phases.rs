//! Times the planner's phases (bind, rows, tiles) on a built-in mask, best of 30 runs:
//! `cargo run --release -p cm-plan --example plan_phases -- clear 32912`.

use std::time::Instant;
fn main() {
    let name = std::env::args()
        .nth(1)
        .expect("usage: plan_phases BUILTIN Q_LEN");
    let q: i64 = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .expect("usage: plan_phases BUILTIN Q_LEN");
    let (p, _) = cm_stdlib::compile(cm_stdlib::get(&name).unwrap().source);
    let p = p.unwrap();
    let shape = cm_ir::Shape {
        q_len: q,
        kv_len: q,
        batch: 1,
        num_heads: 1,
    };
    let mut best = [f64::MAX; 3];
    for _ in 0..30 {
        let t0 = Instant::now();
        let b = p.bind(shape, &Default::default()).unwrap();
        let t1 = Instant::now();
        let solver = cm_plan::symbolic::Solver::new(&b);
        let mut pieces = 0;
        let mut runs = Vec::new();
        let rows =
            cm_plan::plan::row_intervals_runs(&solver, 0, 0, &mut pieces, &mut runs).unwrap();
        let t2 = Instant::now();
        // As `plan` does: the tiles classified per piece of affine rows.
        let t = cm_plan::TileDescriptor::try_build_runs(
            &rows,
            &runs,
            cm_plan::TileShape::default(),
            usize::MAX,
        )
        .unwrap();
        let t3 = Instant::now();
        best[0] = best[0].min((t1 - t0).as_secs_f64() * 1e3);
        best[1] = best[1].min((t2 - t1).as_secs_f64() * 1e3);
        best[2] = best[2].min((t3 - t2).as_secs_f64() * 1e3);
        std::hint::black_box((pieces, t.kv_indices.len()));
    }
    println!(
        "{name}: bind {:.3} rows {:.3} tiles {:.3} ms (min of 30)",
        best[0], best[1], best[2]
    );
}
