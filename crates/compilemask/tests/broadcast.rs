//! A plan of batch 1 (one head) whose masks do not depend on the batch (heads), reading
//! neither `b` nor `batch` (`h`, `num_heads`), serves tensors of any batch (head count), as
//! `compilemask.attention` broadcasts it in Python, with and without score terms; a plan
//! whose masks do, and a packed plan's batch, do not.
//! Reference: the same attention planned at the tensors' own batch and heads.

use compilemask::{
    attention, attention_backward_with_scores, attention_with_scores, compile, AttentionError,
    AttentionShape, PackedShape, PlanOptions,
};

const N: usize = 5;

fn shape(batch: usize, num_heads: usize) -> AttentionShape {
    AttentionShape {
        batch,
        num_heads,
        num_kv_heads: num_heads,
        q_len: N,
        kv_len: N,
        head_dim: 2,
        head_dim_v: 2,
    }
}

/// Deterministic values in [-1, 1) that differ per element.
fn values(len: usize, seed: u64) -> Vec<f64> {
    (0..len as u64)
        .map(|i| {
            let x = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ seed.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

fn plan(source: &str, batch: i64, num_heads: i64) -> compilemask::Plan {
    let mut options = PlanOptions::new(N as i64);
    options.batch = batch;
    options.num_heads = num_heads;
    compile(source).unwrap().plan(&options).unwrap()
}

/// Forward and backward of the broadcast plan equal those of the plan made at the tensors'
/// shape, bit for bit (the same masks in the same reference).
fn assert_broadcasts(source: &str, planned: (i64, i64), tensors: (usize, usize)) {
    let (batch, heads) = tensors;
    let small = plan(source, planned.0, planned.1);
    let full = plan(source, batch as i64, heads as i64);
    assert!(
        small.masks.len() > 1,
        "{source}: the case needs several masks"
    );
    let sh = shape(batch, heads);
    let len = batch * heads * N * 2;
    let (q, k, v, dout) = (
        values(len, 1),
        values(len, 2),
        values(len, 3),
        values(len, 4),
    );
    let got = attention_with_scores(&sh, &q, &k, &v, &small, 0.7, &[]).unwrap();
    let want = attention_with_scores(&sh, &q, &k, &v, &full, 0.7, &[]).unwrap();
    assert_eq!(got.out, want.out, "{source}");
    assert_eq!(got.lse, want.lse, "{source}");
    let got =
        attention_backward_with_scores(&sh, &q, &k, &v, &dout, None, &small, 0.7, &[]).unwrap();
    let want =
        attention_backward_with_scores(&sh, &q, &k, &v, &dout, None, &full, 0.7, &[]).unwrap();
    let (g, w) = (got.grads, want.grads);
    assert_eq!((g.dq, g.dk, g.dv), (w.dq, w.dk, w.dv), "{source}");
}

#[test]
fn per_head_masks_broadcast_over_the_batch() {
    let windows = "param w: [int] = [1, 3, 4];\nmask = q - w[h] < k <= q;";
    assert_broadcasts(windows, (1, 3), (2, 3));
    // With a softcap, which the score reference reads from the plan (it refused the batch).
    assert_broadcasts(
        &format!("{windows}\nscore = softcap(score, 3.0);"),
        (1, 3),
        (3, 3),
    );
}

#[test]
fn per_batch_masks_broadcast_over_the_heads() {
    assert_broadcasts(
        "param w: [int] = [1, 4];\nmask = q - w[b] < k <= q;",
        (2, 1),
        (2, 3),
    );
}

/// `attention` on `shape` refuses `plan` with `PlanMismatch` naming `what`, planned and given.
fn assert_mismatch(
    plan: &compilemask::Plan,
    sh: AttentionShape,
    what: &str,
    planned: usize,
    given: usize,
) {
    let x = vec![0.0f64; sh.batch * sh.num_heads * N * 2];
    match attention(&sh, &x, &x, &x, plan, 1.0) {
        Err(AttentionError::PlanMismatch {
            what: w,
            planned: p,
            given: g,
        }) => {
            assert_eq!((w, p, g), (what, planned, given))
        }
        other => panic!(
            "{what}: expected PlanMismatch, got {:?}",
            other.map(|o| o.lse.len())
        ),
    }
}

#[test]
fn masks_that_read_the_index_do_not_broadcast() {
    // Planned for one batch index while the mask reads `b`: batch 2 is not that plan.
    let reads_b = plan("mask = k <= q - b & k >= q - 1 - h;", 1, 3);
    assert_mismatch(&reads_b, shape(2, 3), "batch", 1, 2);
    // Planned for one head while the mask reads `h`.
    let reads_h = plan("mask = k <= q - h & k >= q - 1 - b;", 2, 1);
    assert_mismatch(&reads_h, shape(2, 3), "num_heads", 1, 3);
}

/// `source` planned packed as samples of 2 and N - 2 tokens, with `num_heads` heads.
fn packed_plan(source: &str, num_heads: i64) -> compilemask::Plan {
    let mut options = PlanOptions::new(N as i64);
    options.num_heads = num_heads;
    let packed = PackedShape {
        cu_seqlens_q: vec![0, 2, N as i64],
        cu_seqlens_k: vec![0, 2, N as i64],
        num_heads,
    };
    compile(source)
        .unwrap()
        .plan_packed(&packed, &options)
        .unwrap()
}

#[test]
fn a_packed_plan_serves_batch_one_only() {
    let plan = packed_plan("param w: [int] = [1, 2];\nmask = q - w[h] < k <= q;", 2);
    assert_mismatch(&plan, shape(2, 2), "batch", 1, 2);
    let x = vec![0.0f64; 2 * N * 2];
    assert!(attention(&shape(1, 2), &x, &x, &x, &plan, 1.0).is_ok());
}

/// The class of the two above with a single distinct mask (which took a shortcut past the
/// checks): masks that depend on the batch or the heads through the lengths `batch` /
/// `num_heads` (bound at the plan's), or through an index whose masks happen to be one, and
/// a packed plan of one mask, hold only for the batch / heads they were planned for.
#[test]
fn one_mask_that_depends_on_the_batch_or_heads_does_not_broadcast() {
    let reads_num_heads = plan("mask = k <= q - num_heads;", 1, 1);
    assert_eq!(reads_num_heads.masks.len(), 1);
    assert_mismatch(&reads_num_heads, shape(1, 4), "num_heads", 1, 4);
    let reads_batch = plan("mask = k <= q - batch;", 1, 1);
    assert_mismatch(&reads_batch, shape(3, 1), "batch", 1, 3);
    // `b` read, one mask for batch 1: batch index 1 would read past `w`.
    let reads_b = plan("param w: [int] = [2];\nmask = q - w[b] < k <= q;", 1, 1);
    assert_eq!(reads_b.masks.len(), 1);
    assert_mismatch(&reads_b, shape(2, 1), "batch", 1, 2);
    // Masks that read none of them still broadcast.
    let x = vec![0.0f64; 2 * 3 * N * 2];
    assert!(attention(&shape(2, 3), &x, &x, &x, &plan("mask = k <= q;", 1, 1), 1.0).is_ok());
    // A packed plan of one mask.
    let one = packed_plan("mask = k <= q;", 1);
    assert_eq!(one.masks.len(), 1);
    assert_mismatch(&one, shape(2, 1), "batch", 1, 2);
}
