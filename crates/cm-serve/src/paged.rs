//! The CPU reference of a serving step over a paged KV cache: each sequence's pages gathered
//! into contiguous K/V, then `cm_reference`'s attention with the step's rows.

use crate::error::PagedError;
use crate::step::StepPlan;
use cm_plan::RowIntervals;
use cm_reference::{attention_forward, AttentionShape, Float, ForwardOutput, Masks};

/// The dimensions of a paged attention call (vLLM / FlashInfer layout). All tensors are
/// contiguous and row-major:
///
/// | tensor | shape |
/// |---|---|
/// | `q` | `[total_q, num_heads, head_dim]` (the step's rows, packed by `cu_q`) |
/// | `k_cache` | `[num_pages, page_size, num_kv_heads, head_dim]` |
/// | `v_cache` | `[num_pages, page_size, num_kv_heads, head_dim_v]` |
/// | `block_table` | `[num_seqs, max_pages_per_seq]`, `i32` page numbers |
/// | `out` | `[total_q, num_heads, head_dim_v]` |
/// | `lse` | `[total_q, num_heads]` |
///
/// Query head `h` reads kv head `h / (num_heads / num_kv_heads)` (GQA; MQA with one kv
/// head). A contiguous cache is the case `page_size = max kv_len`, one page per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub num_pages: usize,
    pub page_size: usize,
    pub max_pages_per_seq: usize,
}

fn product(tensor: &'static str, dims: &[usize]) -> Result<usize, PagedError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(PagedError::Overflow { tensor })
}

fn check_len(
    tensor: &'static str,
    dims: &'static str,
    actual: usize,
    expected: usize,
) -> Result<(), PagedError> {
    if actual == expected {
        Ok(())
    } else {
        Err(PagedError::Length {
            tensor,
            dims,
            expected,
            actual,
        })
    }
}

/// Attention of a step's rows over a paged cache, in float64 whatever `T` (the reference's
/// arithmetic). Logical key `p` of sequence `s` is slot `p % page_size` of page
/// `block_table[s][p / page_size]`; only the first `ceil(kv_len[s] / page_size)` entries of a
/// sequence's block-table row are read (so pages may be shared between sequences, and the
/// rest of a row may hold anything), and only its first `kv_len[s]` slots. Returns `out`
/// `[total_q, num_heads, head_dim_v]` and `lse` `[total_q, num_heads]`, the natural-log
/// log-sum-exp of the row's scaled logits `softmax_scale * q . k` over its visible keys;
/// a row with no visible key gives 0 and `-inf`.
///
/// # Errors
/// [`PagedError`]: a zero dimension, `num_heads` not a multiple of `num_kv_heads`, a tensor
/// of the wrong length, a block table too narrow for a sequence or naming a page outside
/// `[0, num_pages)` where a sequence reads it, a non-finite scale, or a non-finite input the
/// reference refuses (naming the sequence).
pub fn paged_attention<T: Float>(
    shape: &PagedShape,
    step: &StepPlan,
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    block_table: &[i32],
    softmax_scale: T,
) -> Result<ForwardOutput<T>, PagedError> {
    let s = shape;
    for (what, v) in [
        ("num_heads", s.num_heads),
        ("num_kv_heads", s.num_kv_heads),
        ("head_dim", s.head_dim),
        ("head_dim_v", s.head_dim_v),
        ("page_size", s.page_size),
    ] {
        if v == 0 {
            return Err(PagedError::Zero { what });
        }
    }
    if s.num_heads % s.num_kv_heads != 0 {
        return Err(PagedError::HeadsNotDivisible {
            num_heads: s.num_heads,
            num_kv_heads: s.num_kv_heads,
        });
    }
    let (num_seqs, total_q) = (step.num_seqs(), step.total_q());
    let (hq, hk, d, dv, ps) = (
        s.num_heads,
        s.num_kv_heads,
        s.head_dim,
        s.head_dim_v,
        s.page_size,
    );
    check_len(
        "q",
        "[total_q, num_heads, head_dim]",
        q.len(),
        product("q", &[total_q, hq, d])?,
    )?;
    check_len(
        "k_cache",
        "[num_pages, page_size, num_kv_heads, head_dim]",
        k_cache.len(),
        product("k_cache", &[s.num_pages, ps, hk, d])?,
    )?;
    check_len(
        "v_cache",
        "[num_pages, page_size, num_kv_heads, head_dim_v]",
        v_cache.len(),
        product("v_cache", &[s.num_pages, ps, hk, dv])?,
    )?;
    check_len(
        "block_table",
        "[num_seqs, max_pages_per_seq]",
        block_table.len(),
        product("block_table", &[num_seqs, s.max_pages_per_seq])?,
    )?;
    let scale = softmax_scale.to_f64();
    if !scale.is_finite() {
        return Err(PagedError::Scale(scale));
    }
    let pages_of = |seq: usize| -> Result<&[i32], PagedError> {
        let kv = step.kv_len()[seq] as usize;
        let needed = kv.div_ceil(ps);
        if needed > s.max_pages_per_seq {
            return Err(PagedError::TooFewPages {
                seq,
                kv_len: kv,
                needed,
                page_size: ps,
                max_pages_per_seq: s.max_pages_per_seq,
            });
        }
        let row = &block_table[seq * s.max_pages_per_seq..][..needed];
        for (index, &page) in row.iter().enumerate() {
            if page < 0 || page as usize >= s.num_pages {
                return Err(PagedError::PageOutOfRange {
                    seq,
                    index,
                    page: i64::from(page),
                    num_pages: s.num_pages,
                });
            }
        }
        Ok(row)
    };
    // Every sequence's block table is checked before any work.
    let tables: Vec<&[i32]> = (0..num_seqs).map(pages_of).collect::<Result<_, _>>()?;
    let zero = T::from_f64(0.0);
    let mut out = vec![zero; total_q * hq * dv];
    let mut lse = vec![zero; total_q * hq];
    for (seq, pages) in tables.iter().enumerate() {
        let (kv, lq, r0) = (
            step.kv_len()[seq] as usize,
            step.q_len(seq),
            step.cu_q()[seq] as usize,
        );
        // Contiguous K / V of the sequence in the reference's layout [1, hk, kv, d].
        let gather = |cache: &[T], width: usize| {
            let mut dense = vec![zero; hk * kv * width];
            for p in 0..kv {
                let slot = (pages[p / ps] as usize * ps + p % ps) * hk;
                for h in 0..hk {
                    let from = (slot + h) * width;
                    dense[(h * kv + p) * width..][..width]
                        .copy_from_slice(&cache[from..from + width]);
                }
            }
            dense
        };
        let (k, v) = (gather(k_cache, d), gather(v_cache, dv));
        let mut qs = vec![zero; hq * lq * d];
        for i in 0..lq {
            for h in 0..hq {
                qs[(h * lq + i) * d..][..d].copy_from_slice(&q[((r0 + i) * hq + h) * d..][..d]);
            }
        }
        let rows: Vec<Vec<(u32, u32)>> = (0..lq).map(|i| step.row(r0 + i).collect()).collect();
        let mask = RowIntervals::from_rows(kv as u32, &rows)
            .expect("a StepPlan's rows are canonical (validated when it was built)");
        let attn = AttentionShape {
            batch: 1,
            num_heads: hq,
            num_kv_heads: hk,
            q_len: lq,
            kv_len: kv,
            head_dim: d,
            head_dim_v: dv,
        };
        let o = attention_forward(&attn, &qs, &k, &v, &Masks::shared(&mask), softmax_scale)
            .map_err(|error| match error {
                // The gathered layouts' flat indices, named in the caller's tensors.
                cm_reference::ReferenceError::NonFiniteInput {
                    tensor,
                    index,
                    value,
                    ..
                } => {
                    let (name, index, what) = match tensor.as_str() {
                        "q" => {
                            let (h, i, e) = (index / (lq * d), index / d % lq, index % d);
                            let r = r0 + i;
                            ("q", format!("{r}, {h}, {e}"), format!("its row {i}"))
                        }
                        _ => {
                            let width = if tensor == "k" { d } else { dv };
                            let (h, p, e) =
                                (index / (kv * width), index / width % kv, index % width);
                            let (page, slot) = (pages[p / ps], p % ps);
                            let name = if tensor == "k" { "k_cache" } else { "v_cache" };
                            (
                                name,
                                format!("{page}, {slot}, {h}, {e}"),
                                format!("position {p}"),
                            )
                        }
                    };
                    PagedError::NonFiniteInput {
                        seq,
                        tensor: name,
                        index,
                        what,
                        value,
                    }
                }
                error => PagedError::Reference { seq, error },
            })?;
        for i in 0..lq {
            for h in 0..hq {
                out[((r0 + i) * hq + h) * dv..][..dv]
                    .copy_from_slice(&o.out[(h * lq + i) * dv..][..dv]);
                lse[(r0 + i) * hq + h] = o.lse[h * lq + i];
            }
        }
    }
    Ok(ForwardOutput { out, lse })
}
