//! Times the planner's phases (bind, rows, tiles) on a built-in mask or a mask file, the
//! first run (fresh memory, as a single `compilemask plan` call sees it) and the best of 30:
//! `cargo run --release -p cm-plan --example plan_phases -- clear 32912` or
//! `... -- examples/masks/natten_2d.cmask 131044 kernel=13 dilation=4` (integer parameters).

use std::collections::BTreeMap;
use std::time::Instant;

fn main() {
    let usage = "usage: plan_phases BUILTIN|FILE.cmask Q_LEN [NAME=INT ...]";
    let mut args = std::env::args().skip(1);
    let name = args.next().expect(usage);
    let q: i64 = args.next().and_then(|s| s.parse().ok()).expect(usage);
    let mut values = BTreeMap::new();
    for a in args {
        let (k, v) = a.split_once('=').expect(usage);
        let v: i64 = v.parse().expect(usage);
        values.insert(k.to_string(), cm_ir::Value::Int(v));
    }
    let source = if name.ends_with(".cmask") {
        std::fs::read_to_string(&name).expect("a readable mask file")
    } else {
        cm_stdlib::get(&name)
            .expect("a built-in mask")
            .source
            .to_string()
    };
    let (p, _) = cm_stdlib::compile(&source);
    let p = p.expect("a mask that checks");
    let shape = cm_ir::Shape {
        q_len: q,
        kv_len: q,
        batch: 1,
        num_heads: 1,
    };
    let mut first = [0.0; 3];
    let mut best = [f64::MAX; 3];
    for run in 0..30 {
        let t0 = Instant::now();
        let b = p.bind(shape, &values).unwrap();
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
        let ms = [t1 - t0, t2 - t1, t3 - t2].map(|d| d.as_secs_f64() * 1e3);
        if run == 0 {
            first = ms;
        }
        for (b, m) in best.iter_mut().zip(ms) {
            *b = b.min(m);
        }
        std::hint::black_box((pieces, t.kv_indices.len()));
    }
    println!(
        "{name}: first bind {:.3} rows {:.3} tiles {:.3} ms; min of 30: bind {:.3} rows {:.3} tiles {:.3} ms",
        first[0], first[1], first[2], best[0], best[1], best[2]
    );
}
