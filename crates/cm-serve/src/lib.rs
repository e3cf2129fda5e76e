//! Serving steps over a paged KV cache: the new query rows of every sequence of a decode,
//! speculative-tree or chunked-prefill step as plain key intervals, planned for the new
//! rows alone ([`StepPlanner`], [`Step::append`]), and the float64 reference of attention
//! over paged caches ([`paged_attention`]).
//!
//! ```
//! use std::collections::BTreeMap;
//! use std::sync::Arc;
//! let (program, _) = cm_stdlib::compile("param window: int = 4;\nmask = q - window < k <= q;");
//! let planner = cm_serve::StepPlanner::new(Arc::new(program.unwrap()), BTreeMap::new()).unwrap();
//! // Two sequences decoding one token each, with 10 and 3 keys (the new token included).
//! let mut step = cm_serve::Step::new(planner, &[1, 1], &[10, 3], None).unwrap();
//! assert_eq!(step.plan().cu_q(), &[0, 1, 2]);
//! assert_eq!(step.plan().row(0).collect::<Vec<_>>(), [(6, 10)]); // position 9 sees 6..10
//! assert_eq!(step.plan().row(1).collect::<Vec<_>>(), [(0, 3)]);
//! step.append(&[1, 2]).unwrap(); // one more token for the first, two for the second
//! assert_eq!(step.plan().kv_len(), &[11, 5]);
//! assert_eq!(step.plan().row(2).collect::<Vec<_>>(), [(1, 5)]); // position 4
//! ```
//!
//! Conventions: every index is 0-based, every interval half-open `[start, end)`; row `i` of
//! sequence `s` is the logical position `kv_len[s] - q_len[s] + i` (bottom-right aligned);
//! `lse` is a natural logarithm. The arrays' contract is [`StepPlan`]'s.

mod error;
mod paged;
mod planner;
mod prefill;
mod step;

pub use error::{PagedError, StepError};
pub use paged::{paged_attention, PagedShape};
pub use planner::{Step, StepPlanner, MIN_CAPACITY};
pub use prefill::{
    Prefill, PrefillShape, MAX_PREFILL_KEYS, MAX_PREFILL_KEY_BLOCKS, MAX_PREFILL_TILES,
};
pub use step::{StepPlan, MAX_STEP_INTERVALS};
