//! The analytical mask compiler: from a bound program (checked program + lengths +
//! parameters) to the exact visible key intervals of every query row ([`RowIntervals`])
//! and the tile descriptor ([`TileDescriptor`]) that kernels consume.
//!
//! Invariants owned here: the plan is a pure function of (bound program, tile shape);
//! row intervals are exact, sorted and maximal and agree with `cm_ir`'s pairwise semantics;
//! tile classes are exact; cost grows with rows x intervals and non-empty tiles, never
//! with `q_len x kv_len` (except inside `elementwise`, which is counted and reported).

pub mod order;
pub mod packed;
pub mod plan;
pub mod rows;
pub mod symbolic;
pub mod tiles;

pub use order::{TokenOrder, Traversal};
pub use packed::{plan_packed, plan_packed_with, Packing};
pub use plan::{
    elementwise_pairs_up_front, expand_error, first_piece, plan, plan_in_order,
    row_range_intervals, AffineRows, MaskPlan, OrderRequest, Plan, TreeOverhang,
};
pub use rows::{ExpandError, KeyInterval, RowIntervals, MAX_EXPANDED_INTERVALS};
pub use tiles::{PartialRows, TileCounts, TileDescriptor, TileShape};
