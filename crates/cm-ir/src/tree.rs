//! Trees over positions (`tree t = parents at offset;`): validation of the parent array and
//! the table the planner reads, every node's path from its root (its ancestors and itself)
//! as sorted key intervals.
//!
//! Node `i` is position `at + i`; `parents[i]` is its parent node, `-1` for a root. The
//! paths are built parents first in one pass (each node's path is its parent's with the
//! node inserted), so the cost is O(nodes + intervals): in a depth-first preorder a path is
//! one interval per jump to a later sibling's subtree, one interval in all for a chain.

use crate::bind::{PResult, PlanError, MAX_LEN};
use cm_syntax::{Code, Span};
use std::sync::Arc;

/// Most path intervals one tree may hold (8 bytes each), summed over its nodes.
pub const MAX_TREE_INTERVALS: usize = 1 << 27;

/// A validated tree and every node's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeTable {
    /// Position of node 0.
    pub at: i64,
    /// `parents[i]`: the parent node of node `i`, `-1` for a root.
    pub parents: Arc<[i64]>,
    /// Node `i`'s path is `paths[ptr[i] .. ptr[i + 1]]`: half-open node ranges `[lo, hi)`,
    /// sorted, neither overlapping nor touching.
    pub ptr: Vec<u32>,
    pub paths: Vec<(u32, u32)>,
    /// `run[i]`: how many rows after node `i` continue its path affinely (same number of
    /// intervals, every endpoint moving by the same amount per node as from `i` to `i + 1`).
    pub run: Vec<u32>,
}

impl TreeTable {
    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.parents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }

    /// Node `i`'s path as node ranges.
    pub fn path(&self, i: usize) -> &[(u32, u32)] {
        &self.paths[self.ptr[i] as usize..self.ptr[i + 1] as usize]
    }

    /// Whether node `a` is an ancestor of node `u` or `u` itself, by walking up from `u`
    /// (the definition; the paths are the planner's form of it).
    pub fn on_path(&self, a: usize, u: usize) -> bool {
        let mut v = u as i64;
        while v >= 0 {
            if v as usize == a {
                return true;
            }
            v = self.parents[v as usize];
        }
        false
    }

    /// Validates `parents` (`CM0313`: a parent outside the tree, a cycle, too many nodes, a
    /// negative offset) and builds the paths (`CM0404` past [`MAX_TREE_INTERVALS`]).
    pub fn build(name: &str, parents: Arc<[i64]>, at: i64, span: Span) -> PResult<TreeTable> {
        let bad = |message: String| {
            Err(PlanError::new(Code::BadTree, Some(span), message).with_hint(
                "a tree is a parent array: parents[i] is node i's parent node (-1 for a root), \
                 every node reaching a root; in a depth-first order a node's parent comes before it",
            ))
        };
        let n = parents.len();
        if n as i64 > MAX_LEN {
            return bad(format!("tree `{name}` has {n} nodes; at most {MAX_LEN}"));
        }
        if at < 0 {
            return bad(format!(
                "tree `{name}` starts at {at}; expected a position >= 0"
            ));
        }
        if at.checked_add(n as i64).is_none() {
            return bad(format!(
                "tree `{name}` of {n} nodes starts at {at}, so its last position overflows a 64-bit integer; expected at + {n} <= {}",
                i64::MAX
            ));
        }
        if let Some((i, p)) = parents
            .iter()
            .enumerate()
            .find(|(_, &p)| p < -1 || p >= n as i64)
        {
            return bad(format!(
                "node {i} of tree `{name}` has parent {p}; a parent is -1 (a root) or a node 0 ..= {}",
                n as i64 - 1
            ));
        }
        // Parents first: walk up from each node not yet placed to a placed node or a root,
        // then place the walk top down. A walk that meets itself is a cycle.
        const NEW: u8 = 0;
        const ON_WALK: u8 = 1;
        const PLACED: u8 = 2;
        let mut state = vec![NEW; n];
        let mut order = Vec::with_capacity(n);
        let mut walk = Vec::new();
        for start in 0..n {
            let mut v = start as i64;
            while v >= 0 && state[v as usize] == NEW {
                state[v as usize] = ON_WALK;
                walk.push(v as usize);
                v = parents[v as usize];
            }
            if v >= 0 && state[v as usize] == ON_WALK {
                let at_cycle = walk.iter().position(|&w| w as i64 == v).unwrap_or(0);
                let len = walk.len() - at_cycle;
                let shown: Vec<String> = walk[at_cycle..]
                    .iter()
                    .take(8)
                    .map(usize::to_string)
                    .collect();
                // Every `a -> b` shown is a parent link; a long cycle skips to its end.
                let (size, cycle) = if len > 8 {
                    (
                        format!(" of {len} nodes"),
                        format!("{} -> ... -> {v}", shown.join(" -> ")),
                    )
                } else {
                    (String::new(), format!("{} -> {v}", shown.join(" -> ")))
                };
                return bad(format!(
                    "tree `{name}` has a cycle{size}: {cycle} (a node's parents must reach a root)"
                ));
            }
            for &w in walk.iter().rev() {
                state[w] = PLACED;
                order.push(w);
            }
            walk.clear();
        }
        // Every path's length first, so that the paths are written once, in place, into
        // one allocation of exactly their size (growing a buffer and copying it by node
        // cost a 128K-node tree most of its binding, in fresh pages). Node u's path is its
        // parent's with u inserted, one interval fewer for each of u - 1 and u + 1 on the
        // parent's path (the unit interval of u merges with theirs); "on the path" is an
        // ancestor test, O(1) from a preorder numbering and subtree sizes.
        let mut size = vec![1u32; n];
        for &u in order.iter().rev() {
            if parents[u] >= 0 {
                size[parents[u] as usize] += size[u];
            }
        }
        // `enter[u]`: u's preorder position (siblings in placing order); its subtree holds
        // positions `enter[u] .. enter[u] + size[u]`; `next[u]` is the next one unassigned.
        let mut enter = vec![0u32; n];
        let mut next = vec![0u32; n];
        let mut next_root = 0u32;
        for &u in &order {
            let slot = match parents[u] {
                -1 => &mut next_root,
                p => &mut next[p as usize],
            };
            enter[u] = *slot;
            *slot += size[u];
            next[u] = enter[u] + 1;
        }
        let on_path = |a: usize, u: usize| enter[a] <= enter[u] && enter[u] < enter[a] + size[a];
        let mut len = vec![0u32; n];
        for &u in &order {
            len[u] = match parents[u] {
                -1 => 1,
                p => {
                    let p = p as usize;
                    let merged = (u > 0 && on_path(u - 1, p)) as u32
                        + (u + 1 < n && on_path(u + 1, p)) as u32;
                    len[p] + 1 - merged
                }
            };
        }
        let total: u64 = len.iter().map(|&l| u64::from(l)).sum();
        if total > MAX_TREE_INTERVALS as u64 {
            return Err(PlanError::new(
                Code::TooLargeToPlan,
                Some(span),
                format!("the paths of tree `{name}` need more than {MAX_TREE_INTERVALS} intervals"),
            )
            .with_hint("a node's path costs one interval per jump in position between consecutive ancestors: number the nodes in depth-first order"));
        }
        let mut ptr = Vec::with_capacity(n + 1);
        ptr.push(0u32);
        for &l in &len {
            ptr.push(ptr.last().copied().unwrap_or(0) + l);
        }
        let mut paths = vec![(0u32, 0u32); total as usize];
        for &u in &order {
            let at_u = ptr[u] as usize..ptr[u + 1] as usize;
            match parents[u] {
                -1 => paths[at_u.start] = (u as u32, u as u32 + 1),
                p => {
                    let p = p as usize;
                    let at_p = ptr[p] as usize..ptr[p + 1] as usize;
                    // The parent's path and u's are disjoint ranges of `paths`.
                    let (parent, out) = if at_p.start < at_u.start {
                        let (lo, hi) = paths.split_at_mut(at_u.start);
                        (&lo[at_p], &mut hi[..at_u.len()])
                    } else {
                        let (lo, hi) = paths.split_at_mut(at_p.start);
                        (&hi[..at_p.len()], &mut lo[at_u])
                    };
                    insert(out, parent, u as u32);
                }
            }
        }
        let mut t = TreeTable {
            at,
            parents,
            ptr,
            paths,
            run: vec![0; n],
        };
        t.run = runs(&t);
        Ok(t)
    }
}

/// Writes into `out` the path `parent` with `node` added (sorted, merged where it touches);
/// `out` is exactly as long as the result.
fn insert(out: &mut [(u32, u32)], parent: &[(u32, u32)], node: u32) {
    let mut w = 0usize;
    let mut push = |iv: (u32, u32)| match w.checked_sub(1).map(|i| &mut out[i]) {
        Some(last) if last.1 >= iv.0 => last.1 = last.1.max(iv.1),
        _ => {
            out[w] = iv;
            w += 1;
        }
    };
    let mut placed = false;
    for &(lo, hi) in parent {
        if !placed && node < lo {
            push((node, node + 1));
            placed = true;
        }
        push((lo, hi));
    }
    if !placed {
        push((node, node + 1));
    }
    debug_assert_eq!(w, out.len(), "the path's length was counted exactly");
}

/// `run[i]` of every node (see [`TreeTable::run`]), from the last node back, comparing the
/// paths in place (a list per node made this a tenth of binding a 128K-node tree).
fn runs(t: &TreeTable) -> Vec<u32> {
    let n = t.len();
    let mut run = vec![0u32; n];
    // Whether node i's path and node i + 1's have equally many intervals (a step exists).
    let steps = |i: usize| t.path(i).len() == t.path(i + 1).len();
    // Whether the step from i + 1 to i + 2 is the one from i to i + 1.
    let same = |i: usize| {
        let (a, b, c) = (t.path(i), t.path(i + 1), t.path(i + 2));
        a.iter().zip(b).zip(c).all(|((x, y), z)| {
            i64::from(y.0) - i64::from(x.0) == i64::from(z.0) - i64::from(y.0)
                && i64::from(y.1) - i64::from(x.1) == i64::from(z.1) - i64::from(y.1)
        })
    };
    for i in (0..n.saturating_sub(1)).rev() {
        run[i] = if !steps(i) {
            0
        } else if i + 2 < n && steps(i + 1) && same(i) {
            run[i + 1] + 1
        } else {
            1
        };
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(parents: &[i64]) -> PResult<TreeTable> {
        TreeTable::build("t", parents.to_vec().into(), 0, Span::new(0, 0))
    }

    /// Every node's path against walking up its parents, on trees numbered in any order.
    #[test]
    fn paths_are_the_ancestors_and_the_node() {
        for parents in [
            vec![-1],
            vec![-1, 0, 1, 2, 3],
            vec![-1, 0, 0, 1, 1, 2, 2],
            vec![-1, 0, 1, 1, 0, 4, 4, -1, 7],
            vec![3, 3, -1, 2, 0, 4, 2],
            vec![-1, -1, -1],
            vec![1, 2, 3, 4, -1],
        ] {
            let t = table(&parents).unwrap();
            for u in 0..parents.len() {
                let want: Vec<usize> = (0..parents.len()).filter(|&a| t.on_path(a, u)).collect();
                let got: Vec<usize> = t
                    .path(u)
                    .iter()
                    .flat_map(|&(lo, hi)| lo as usize..hi as usize)
                    .collect();
                assert_eq!(got, want, "{parents:?}, node {u}");
                let p = t.path(u);
                assert!(
                    p.windows(2).all(|w| w[0].1 < w[1].0),
                    "{parents:?}, node {u}: {p:?}"
                );
            }
            // Each run's rows follow the first by its step.
            for i in 0..parents.len() {
                for j in 1..=t.run[i] as usize {
                    let (a, b, c) = (t.path(i), t.path(i + 1), t.path(i + j));
                    assert_eq!(a.len(), c.len());
                    for x in 0..a.len() {
                        let d = (
                            i64::from(b[x].0) - i64::from(a[x].0),
                            i64::from(b[x].1) - i64::from(a[x].1),
                        );
                        assert_eq!(i64::from(c[x].0), i64::from(a[x].0) + j as i64 * d.0);
                        assert_eq!(i64::from(c[x].1), i64::from(a[x].1) + j as i64 * d.1);
                    }
                }
            }
        }
        // A chain is one run: every path is [0, i + 1).
        let chain: Vec<i64> = (-1..999).collect();
        let t = table(&chain).unwrap();
        assert_eq!(t.run[0], 999);
        assert_eq!(t.path(500), &[(0, 501)]);
    }

    #[test]
    fn bad_parent_arrays_are_named() {
        for (parents, want) in [
            (
                vec![-1, 5, 0],
                "node 1 of tree `t` has parent 5; a parent is -1 (a root) or a node 0 ..= 2",
            ),
            (
                vec![-1, -2],
                "node 1 of tree `t` has parent -2; a parent is -1 (a root) or a node 0 ..= 1",
            ),
            (
                vec![0],
                "tree `t` has a cycle: 0 -> 0 (a node's parents must reach a root)",
            ),
            (
                vec![-1, 2, 3, 1],
                "tree `t` has a cycle: 1 -> 2 -> 3 -> 1 (a node's parents must reach a root)",
            ),
        ] {
            let e = table(&parents).unwrap_err();
            assert_eq!(
                (e.code, e.message.as_str()),
                (Code::BadTree, want),
                "{parents:?}"
            );
        }
        // A start so late that the last node's position overflows names that, not the sign.
        let e =
            TreeTable::build("t", vec![-1, 0].into(), i64::MAX - 1, Span::new(0, 0)).unwrap_err();
        assert_eq!(
            e.message,
            format!(
                "tree `t` of 2 nodes starts at {}, so its last position overflows a 64-bit \
                 integer; expected at + 2 <= {}",
                i64::MAX - 1,
                i64::MAX
            )
        );
        // A long cycle shows its first links and its end: every `a -> b` is a parent link.
        let long: Vec<i64> = (1..=20).chain([0]).collect();
        let e = table(&long).unwrap_err();
        assert_eq!(
            e.message,
            "tree `t` has a cycle of 21 nodes: 0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 6 -> 7 -> ... -> 0 \
             (a node's parents must reach a root)"
        );
        for parents in [
            vec![0],
            vec![-1, 2, 3, 1],
            long,
            (1..=9).chain([0]).collect(),
        ] {
            let e = table(&parents).unwrap_err();
            let chain = e.message.split(": ").nth(1).unwrap();
            let chain = chain.split(" (").next().unwrap();
            let nodes: Vec<&str> = chain.split(" -> ").collect();
            for pair in nodes.windows(2) {
                if let [a, b] = pair {
                    if *a != "..." && *b != "..." {
                        let (a, b): (usize, i64) = (a.parse().unwrap(), b.parse().unwrap());
                        assert_eq!(parents[a], b, "{}", e.message);
                    }
                }
            }
        }
    }
}
