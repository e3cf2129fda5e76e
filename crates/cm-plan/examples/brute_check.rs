//! Compares the planner with the brute-force semantics on a program file, row by row:
//! `cargo run -p cm-plan --example brute_check -- FILE Q_LEN KV_LEN [BATCH]`.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: brute_check FILE Q_LEN KV_LEN [BATCH]";
    let src = std::fs::read_to_string(args.get(1).expect(usage)).expect("readable file");
    let num = |i: usize, d: i64| args.get(i).map_or(d, |s| s.parse().expect(usage));
    let (p, diags) = cm_stdlib::compile(&src);
    let Some(p) = p else {
        println!("does not compile: {diags:?}");
        return;
    };
    let shape = cm_ir::Shape {
        q_len: num(2, 10),
        kv_len: num(3, 10),
        batch: num(4, 1),
        num_heads: 1,
    };
    let b = match p.bind(shape, &Default::default()) {
        Ok(b) => b,
        Err(e) => return println!("bind error: {e}"),
    };
    let plan = cm_plan::plan(&b, cm_plan::TileShape::default());
    for bi in 0..shape.batch {
        for q in 0..shape.q_len {
            let want = b.brute_force_row(q, bi, 0);
            let got = plan.as_ref().map(|pl| {
                pl.mask(bi as u32, 0)
                    .rows
                    .row(q as u32)
                    .iter()
                    .map(|iv| (iv.start, iv.end))
                    .collect::<Vec<_>>()
            });
            match (&want, &got) {
                (Ok(w), Ok(g)) if w == g => {}
                _ => return println!("b={bi} q={q}: brute {want:?} planner {got:?}"),
            }
        }
    }
    println!("all rows agree");
}
