//! The keys of a key-side atom `f(k) op v` ([`Region::KeyCmp`](cm_ir::ir::Region)): every
//! key's `f` computed once per (batch, head), and the set of keys with `f(k) <= threshold`
//! for the threshold a piece of rows asks for, moved key by key as the threshold moves.
//!
//! Keys whose values run affinely in `k` (`f(k) = f0 + s * (k - k0)` over at least
//! [`MIN_SLOPED_RUN`] consecutive keys, `s != 0`: FlashMask's causal bounds `ute[k] = k`, a
//! sliding window's `lts[k] = k + w`) are kept as one *sloped run*, not key by key: the run
//! is all in the set once the threshold reaches its largest value, out of it below its
//! smallest, and in between its keys in the set are one interval anchored at the run's low
//! (`s > 0`) or high (`s < 0`) end whose other end is affine in the threshold. A causal
//! column form then plans in a few pieces instead of one piece per row (the set changes at
//! every row, but affinely); keys outside such runs (constant runs of documents, random
//! values) are sorted by value as single keys.

use std::collections::{BTreeMap, BTreeSet};

use cm_ir::bind::PlanError;

/// The fewest consecutive keys with affine values kept as a sloped run: shorter ones cost
/// less as single keys (a partial run is evaluated on every piece while it is partial).
pub(super) const MIN_SLOPED_RUN: u32 = 16;

/// Keys `[k0, k1)` with `f(k) = f0 + slope * (k - k0)`, `slope != 0`.
#[derive(Clone, Copy, Debug)]
pub(super) struct SlopedRun {
    pub k0: u32,
    pub k1: u32,
    pub f0: i64,
    pub slope: i64,
}

impl SlopedRun {
    /// The smallest and the largest value of the run.
    pub fn range(&self) -> (i64, i64) {
        let last = self.f0 + self.slope * i64::from(self.k1 - self.k0 - 1);
        (self.f0.min(last), self.f0.max(last))
    }
}

/// See the module docs.
pub(super) struct KeySweep {
    /// `(f(k), k)` for every key whose `f` evaluates and that lies in no sloped run,
    /// ascending.
    pub sorted: Vec<(i64, u32)>,
    /// The sloped runs, by first key.
    pub sloped: Vec<SlopedRun>,
    /// `(smallest value, run)` / `(largest value, run)` of every sloped run, ascending.
    pub mins: Vec<(i64, u32)>,
    pub maxs: Vec<(i64, u32)>,
    /// The keys whose `f` fails, ascending.
    pub failing: Vec<u32>,
    /// How `f` fails at the first of them.
    pub error: Option<PlanError>,
    /// `sorted[..below]` are the single keys in `runs`; `mins[..entered]` the sloped runs
    /// at or below the threshold somewhere, `maxs[..full]` those entirely at or below it.
    below: usize,
    entered: usize,
    full: usize,
    /// Maximal runs of the keys in the set other than the partial sloped runs: start -> end.
    pub runs: BTreeMap<u32, u32>,
    /// The sloped runs partly in the set (`mins[..entered]` less `maxs[..full]`), by index.
    pub partial: BTreeSet<u32>,
}

impl KeySweep {
    /// The sweep over every key's value (`Err`: the key's `f` fails), with nothing in the set.
    pub fn new(values: Vec<Result<i64, PlanError>>) -> KeySweep {
        let (mut sorted, mut sloped, mut failing, mut error) =
            (Vec::new(), Vec::new(), Vec::new(), None);
        let n = values.len();
        let value = |k: usize| values[k].as_ref().ok().copied();
        let mut k = 0;
        while k < n {
            let Some(f0) = value(k) else {
                failing.push(k as u32);
                if let Err(e) = &values[k] {
                    error.get_or_insert_with(|| e.clone());
                }
                k += 1;
                continue;
            };
            // The longest run from k whose consecutive differences are all that of its
            // first step (checked subtraction: a difference past 64 bits ends the run).
            let step = (k + 1 < n)
                .then(|| value(k + 1))
                .flatten()
                .and_then(|f1| f1.checked_sub(f0));
            let mut end = k + 1;
            if let Some(s) = step {
                while end < n
                    && matches!((value(end - 1), value(end)),
                        (Some(a), Some(b)) if b.checked_sub(a) == Some(s))
                {
                    end += 1;
                }
            }
            match step {
                Some(s) if s != 0 && end - k >= MIN_SLOPED_RUN as usize => {
                    sloped.push(SlopedRun {
                        k0: k as u32,
                        k1: end as u32,
                        f0,
                        slope: s,
                    });
                    k = end;
                }
                // A constant run is single keys of one value; a short sloped one leaves its
                // last key to start the next run.
                Some(0) => {
                    sorted.extend((k..end).map(|x| (f0, x as u32)));
                    k = end;
                }
                _ => {
                    let stop = (end - 1).max(k + 1);
                    sorted.extend((k..stop).map(|x| (value(x).expect("evaluated"), x as u32)));
                    k = stop;
                }
            }
        }
        sorted.sort_unstable();
        let mut mins: Vec<(i64, u32)> = Vec::with_capacity(sloped.len());
        let mut maxs: Vec<(i64, u32)> = Vec::with_capacity(sloped.len());
        for (i, r) in sloped.iter().enumerate() {
            let (lo, hi) = r.range();
            mins.push((lo, i as u32));
            maxs.push((hi, i as u32));
        }
        mins.sort_unstable();
        maxs.sort_unstable();
        KeySweep {
            sorted,
            sloped,
            mins,
            maxs,
            failing,
            error,
            below: 0,
            entered: 0,
            full: 0,
            runs: BTreeMap::new(),
            partial: BTreeSet::new(),
        }
    }

    /// The first key of `keys` (ascending, disjoint ranges) whose `f` fails.
    pub fn first_failing(&self, keys: &[(i64, i64)]) -> Option<i64> {
        keys.iter().find_map(|&(a, z)| {
            let i = self.failing.partition_point(|&k| i64::from(k) < a);
            let k = i64::from(*self.failing.get(i)?);
            (k < z).then_some(k)
        })
    }

    /// The sorted value lists whose crossing by the threshold changes the set: the single
    /// keys' values and the sloped runs' smallest and largest values.
    pub fn thresholds(&self) -> [&[(i64, u32)]; 3] {
        [&self.sorted, &self.mins, &self.maxs]
    }

    /// Moves the set to the keys with `f(k) <= threshold`.
    pub fn move_to(&mut self, threshold: i64) {
        let at = |list: &[(i64, u32)]| list.partition_point(|&(v, _)| v <= threshold);
        let (below, entered, full) = (at(&self.sorted), at(&self.mins), at(&self.maxs));
        while self.below < below {
            let k = self.sorted[self.below].1;
            self.add(k, k + 1);
            self.below += 1;
        }
        while self.below > below {
            self.below -= 1;
            let k = self.sorted[self.below].1;
            self.remove(k, k + 1);
        }
        // Rising, a run enters the partial set before it can be full; falling, it leaves
        // the full set before it leaves the partial one.
        while self.entered < entered {
            self.partial.insert(self.mins[self.entered].1);
            self.entered += 1;
        }
        while self.full < full {
            let i = self.maxs[self.full].1;
            self.partial.remove(&i);
            let r = self.sloped[i as usize];
            self.add(r.k0, r.k1);
            self.full += 1;
        }
        while self.full > full {
            self.full -= 1;
            let i = self.maxs[self.full].1;
            let r = self.sloped[i as usize];
            self.remove(r.k0, r.k1);
            self.partial.insert(i);
        }
        while self.entered > entered {
            self.entered -= 1;
            self.partial.remove(&self.mins[self.entered].1);
        }
    }

    /// Adds the keys `[a, b)`, none of them in the set.
    fn add(&mut self, a: u32, b: u32) {
        let (mut start, mut end) = (a, b);
        if let Some((&s, &e)) = self.runs.range(..=a).next_back() {
            if e == a {
                start = s;
            }
        }
        if let Some(e) = self.runs.remove(&b) {
            end = e;
        }
        self.runs.insert(start, end);
    }

    /// Removes the keys `[a, b)`, all of them in the set (so in one run).
    fn remove(&mut self, a: u32, b: u32) {
        let (&s, &e) = self
            .runs
            .range(..=a)
            .next_back()
            .expect("keys in the set lie in a run");
        self.runs.remove(&s);
        if s < a {
            self.runs.insert(s, a);
        }
        if b < e {
            self.runs.insert(b, e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The set the sweep holds at `t`, key by key, from its runs and partial sloped runs.
    fn keys_in(s: &KeySweep, t: i64) -> Vec<u32> {
        let mut out: Vec<u32> = s.runs.iter().flat_map(|(&a, &b)| a..b).collect();
        for &i in &s.partial {
            let r = s.sloped[i as usize];
            out.extend((r.k0..r.k1).filter(|&k| r.f0 + r.slope * i64::from(k - r.k0) <= t));
        }
        out.sort_unstable();
        out
    }

    #[test]
    fn the_set_is_every_key_at_or_below_the_threshold_as_it_moves_both_ways() {
        // Runs up, down, constant, short and failing keys, in one array.
        let mut values: Vec<Result<i64, PlanError>> = Vec::new();
        values.extend((0..40).map(Ok));
        values.extend((0..5).map(|_| Ok(17)));
        values.extend((0..30).map(|k| Ok(100 - 3 * k)));
        values.extend([Ok(5), Ok(9), Ok(2)]);
        values.push(Err(PlanError::new(
            cm_syntax::Code::IndexOutOfRange,
            None,
            "x",
        )));
        values.extend((0..20).map(|k| Ok(2 * k - 7)));
        let expect = |t: i64| -> Vec<u32> {
            (0..values.len() as u32)
                .filter(|&k| matches!(values[k as usize], Ok(v) if v <= t))
                .collect()
        };
        let mut s = KeySweep::new(values.clone());
        assert_eq!(s.sloped.len(), 3, "{:?}", s.sloped);
        assert_eq!(s.failing, vec![78]);
        for t in [-10, 3, 17, 50, 40, 101, 200, 60, 16, -8, 0, 12, 33] {
            s.move_to(t);
            assert_eq!(keys_in(&s, t), expect(t), "threshold {t}");
        }
    }
}
