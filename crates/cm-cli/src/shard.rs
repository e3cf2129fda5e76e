//! `compilemask shard`: context parallelism's deal of one mask (`cm_shard`): each rank's
//! tokens, visible and computed pairs against the mean and against a split by positions, and
//! the keys it fetches against ring attention's.

use anyhow::{anyhow, Result};
use compilemask::{Plan, Sharding};
use serde_json::{json, Value};

/// Visible pairs of each rank when rank `r` takes positions `r * len / ranks ..` (the plain
/// split by positions that context parallelism starts from).
fn position_split_work(plan: &Plan, ranks: u32) -> Vec<u64> {
    let rows = &plan.masks[0].rows;
    let len = u64::from(plan.q_len);
    (0..u64::from(ranks))
        .map(|r| {
            let (a, b) = (r * len / u64::from(ranks), (r + 1) * len / u64::from(ranks));
            (a as u32..b as u32)
                .map(|q| rows.row_expanded(q).iter().map(|iv| iv.len()).sum::<u64>())
                .sum()
        })
        .collect()
}

/// The largest entry over the mean (1 when all are equal or all zero).
fn max_over_mean(xs: &[u64]) -> f64 {
    let mean = xs.iter().sum::<u64>() as f64 / xs.len().max(1) as f64;
    if mean == 0.0 {
        1.0
    } else {
        xs.iter().copied().max().unwrap_or(0) as f64 / mean
    }
}

/// The report of `sharding` over `plan` at the plan's tile, with `ms` the sharding's time.
pub fn report(plan: &Plan, s: &Sharding, ms: f64) -> Value {
    let computed = s.computed_pairs(plan.tile);
    let positions = position_split_work(plan, s.ranks);
    let ranks: Vec<Value> = (0..s.ranks as usize)
        .map(|r| {
            json!({
                "rank": r,
                "tokens": s.shard_len(r),
                "chunks": s.chunks[r].len(),
                "visible_pairs": s.work[r],
                "computed_pairs": computed[r],
                "fetched_keys": s.fetched(r),
                "ring_fetched_keys": s.ring_fetched(r),
                "position_split_visible_pairs": positions[r],
            })
        })
        .collect();
    json!({
        "q_len": plan.q_len,
        "ranks": s.ranks,
        "chunk": s.chunk,
        "tile": [plan.tile.block_m, plan.tile.block_n],
        "max_over_mean_visible": max_over_mean(&s.work),
        "max_over_mean_computed": max_over_mean(&computed),
        "position_split_max_over_mean_visible": max_over_mean(&positions),
        "fetched_over_ring": (0..s.ranks as usize).map(|r| s.fetched(r)).sum::<u64>() as f64
            / (0..s.ranks as usize).map(|r| s.ring_fetched(r)).sum::<u64>().max(1) as f64,
        "shard_ms": ms,
        "per_rank": ranks,
    })
}

/// Lines of the human-readable report.
pub fn lines(name: &str, r: &Value) -> Vec<String> {
    let ranks = r["ranks"].as_u64().unwrap_or(0);
    let mut out = vec![
        format!(
            "{name}: {} over {} in chunks of {} (sharded in {:.3} ms)",
            crate::count(r["q_len"].as_u64().unwrap_or(0), "token"),
            crate::count(ranks, "rank"),
            r["chunk"],
            r["shard_ms"].as_f64().unwrap_or(0.0)
        ),
        format!(
            "  max / mean     visible pairs {:.4}, computed pairs at {}x{} {:.4}; split by positions {:.4}",
            r["max_over_mean_visible"].as_f64().unwrap_or(0.0),
            r["tile"][0],
            r["tile"][1],
            r["max_over_mean_computed"].as_f64().unwrap_or(0.0),
            r["position_split_max_over_mean_visible"].as_f64().unwrap_or(0.0),
        ),
        format!(
            "  keys fetched   {:.3} of ring attention's",
            r["fetched_over_ring"].as_f64().unwrap_or(0.0)
        ),
        "  rank  tokens  visible pairs  computed pairs  fetched keys  ring keys".to_string(),
    ];
    for x in r["per_rank"].as_array().into_iter().flatten() {
        let n = |k: &str| x[k].as_u64().unwrap_or(0);
        out.push(format!(
            "  {:>4}  {:>6}  {:>13}  {:>14}  {:>12}  {:>9}",
            n("rank"),
            n("tokens"),
            n("visible_pairs"),
            n("computed_pairs"),
            n("fetched_keys"),
            n("ring_fetched_keys")
        ));
    }
    out
}

/// Shards `plan` (one square mask of batch 1).
pub fn shard(plan: &Plan, ranks: u32, chunk: u32) -> Result<(Sharding, f64)> {
    let t0 = std::time::Instant::now();
    let s = compilemask::shard_plan(plan, ranks, chunk).map_err(|e| anyhow!("{e}"))?;
    Ok((s, t0.elapsed().as_secs_f64() * 1e3))
}
