//! Token orders for grid masks. In raster order a local 2D/3D window makes almost every
//! tile partial; ordering the grid's tokens patch by patch packs each query tile's keys into
//! fewer, denser key tiles. Attention is permutation-equivariant, so a model can keep its
//! tokens in the better order; this module finds that order and plans masks in it.
//!
//! A [`TokenOrder`] maps new position `i` to original position `order[i]`. Planning in an
//! order is exact: row `i` of the permuted mask is the original row `order[i]` with every
//! key `k` moved to `inverse[k]`, merged into maximal intervals. Tokens before the grid
//! (a text prefix, say) and after it keep their places.

use crate::rows::RowIntervals;
use crate::tiles::{TileShape, Touched};
use cm_ir::bind::GridVals;
use cm_ir::tree::TreeTable;
use serde::Serialize;

/// How patches are visited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Traversal {
    /// Patch rows top to bottom, each left to right.
    RowMajor,
    /// Patch rows alternate direction, so consecutive patches always touch.
    Boustrophedon,
    /// A Hilbert curve over the patch grid (per frame for 3D grids).
    Hilbert,
}

/// A permutation of `[0, len)`: `order[new] = original`, `inverse[original] = new`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TokenOrder {
    pub order: Vec<u32>,
    #[serde(skip)]
    pub inverse: Vec<u32>,
    /// Patch extents (frames, rows, columns), or none for an explicit permutation. Raster
    /// order on a grid is the patch `[1, 1, width]` visited row-major.
    pub patch: Option<[u32; 3]>,
    pub traversal: Option<Traversal>,
    /// A tree's nodes in depth-first preorder ([`TokenOrder::tree_preorder`]).
    pub tree_preorder: bool,
}

impl TokenOrder {
    /// The identity order (raster).
    pub fn identity(len: u32) -> TokenOrder {
        let order: Vec<u32> = (0..len).collect();
        TokenOrder {
            inverse: order.clone(),
            order,
            patch: None,
            traversal: None,
            tree_preorder: false,
        }
    }

    /// An explicit permutation.
    ///
    /// # Errors
    /// A message naming the first repeated or out-of-range entry, or a wrong length.
    pub fn from_permutation(order: Vec<u32>, len: u32) -> Result<TokenOrder, String> {
        if order.len() != len as usize {
            return Err(format!(
                "the order has {} entries; expected one per token, {len}",
                order.len()
            ));
        }
        let mut inverse = vec![u32::MAX; order.len()];
        for (i, &o) in order.iter().enumerate() {
            if o >= len {
                return Err(format!("order[{i}] = {o} is out of range [0, {len})"));
            }
            if inverse[o as usize] != u32::MAX {
                return Err(format!(
                    "position {o} appears twice in the order (at {} and {i})",
                    inverse[o as usize]
                ));
            }
            inverse[o as usize] = i as u32;
        }
        Ok(TokenOrder {
            order,
            inverse,
            patch: None,
            traversal: None,
            tree_preorder: false,
        })
    }

    /// Grid tokens visited patch by patch; tokens outside the grid keep their positions.
    /// `patch` is (frames, rows, columns), each clipped to the grid.
    pub fn grid(len: u32, grid: &GridVals, patch: [u32; 3], traversal: Traversal) -> TokenOrder {
        let (t, h, w) = grid_extents(grid);
        let [pt, ph, pw] = clamp_patch(grid, patch);
        let (nt, nh, nw) = (t.div_ceil(pt), h.div_ceil(ph), w.div_ceil(pw));
        let at = grid.at as u32;
        let size = t * h * w;
        let mut order: Vec<u32> = (0..at.min(len)).collect();
        for bt in 0..nt {
            for (by, bx) in patch_walk(nh, nw, traversal) {
                for z in bt * pt..((bt + 1) * pt).min(t) {
                    for y in by * ph..((by + 1) * ph).min(h) {
                        for x in bx * pw..((bx + 1) * pw).min(w) {
                            let p = at + (z * h + y) * w + x;
                            if p < len {
                                order.push(p);
                            }
                        }
                    }
                }
            }
        }
        order.extend((at + size).min(len)..len);
        TokenOrder {
            inverse: inverse_of(&order),
            order,
            patch: Some([pt, ph, pw]),
            traversal: Some(traversal),
            tree_preorder: false,
        }
    }

    /// A tree's nodes in depth-first preorder (roots, and each node's children, by ascending
    /// node index); tokens outside the tree keep their positions. In preorder every subtree
    /// is one run of positions, so a node's ancestors are at most one interval per depth
    /// where the path jumps past earlier siblings' subtrees, and the rows of `k in t.path(q)`
    /// are as dense as the tree allows (docs/language.md, "Token orders"). O(nodes).
    ///
    /// `tree.parents` is validated ([`cm_ir::tree::TreeTable::build`]: every parent a node of
    /// the tree, no cycle); nodes at positions `>= len` are left out of the order's tree part.
    pub fn tree_preorder(len: u32, tree: &TreeTable) -> TokenOrder {
        let n = tree.len();
        let at = tree.at.clamp(0, i64::from(len)) as u32;
        // Children lists by counting sort (each list ascending, as the nodes are visited in
        // ascending order); roots are the list of the virtual node n.
        let mut start = vec![0u32; n + 2];
        for &p in tree.parents.iter() {
            let slot = if p < 0 { n } else { p as usize };
            start[slot + 1] += 1;
        }
        for i in 0..=n {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut children = vec![0u32; n];
        for (i, &p) in tree.parents.iter().enumerate() {
            let slot = if p < 0 { n } else { p as usize };
            children[fill[slot] as usize] = i as u32;
            fill[slot] += 1;
        }
        let mut order: Vec<u32> = (0..at).collect();
        // Nodes to visit, children pushed in reverse so that the smallest is visited first.
        let mut stack: Vec<u32> = children[start[n] as usize..start[n + 1] as usize]
            .iter()
            .rev()
            .copied()
            .collect();
        while let Some(v) = stack.pop() {
            let pos = at + v;
            if pos < len {
                order.push(pos);
            }
            let (c0, c1) = (start[v as usize] as usize, start[v as usize + 1] as usize);
            stack.extend(children[c0..c1].iter().rev());
        }
        let end = (u64::from(at) + n as u64).min(u64::from(len)) as u32;
        order.extend(end..len);
        TokenOrder {
            inverse: inverse_of(&order),
            order,
            patch: None,
            traversal: None,
            tree_preorder: true,
        }
    }

    /// Raster order described as a grid order: the identity, with patch `[1, 1, width]`
    /// visited row-major (what [`TokenOrder::grid`] gives for that patch).
    pub fn raster(len: u32, grid: &GridVals) -> TokenOrder {
        TokenOrder {
            patch: Some(raster_patch(grid)),
            traversal: Some(Traversal::RowMajor),
            ..TokenOrder::identity(len)
        }
    }

    pub fn len(&self) -> u32 {
        self.order.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// `inverse[order[i]] = i` of a permutation built here (every position once).
fn inverse_of(order: &[u32]) -> Vec<u32> {
    let mut inverse = vec![0u32; order.len()];
    for (i, &o) in order.iter().enumerate() {
        inverse[o as usize] = i as u32;
    }
    inverse
}

/// A grid's (frames, rows, columns); a 2D grid has one frame.
fn grid_extents(grid: &GridVals) -> (u32, u32, u32) {
    let d = |i: usize| grid.dims.get(i).map_or(1, |&x| x.max(0) as u32);
    if grid.dims.len() == 3 {
        (d(0), d(1), d(2))
    } else {
        (1, d(0), d(1))
    }
}

/// `patch` clipped to the grid: each extent in `[1, grid extent]` (`u32::MAX` means the
/// whole extent).
pub fn clamp_patch(grid: &GridVals, patch: [u32; 3]) -> [u32; 3] {
    let (t, h, w) = grid_extents(grid);
    [
        patch[0].min(t).max(1),
        patch[1].min(h).max(1),
        patch[2].min(w).max(1),
    ]
}

/// The patch that describes raster order: one row of the grid, `[1, 1, width]`.
pub fn raster_patch(grid: &GridVals) -> [u32; 3] {
    clamp_patch(grid, [1, 1, u32::MAX])
}

/// The (row, column) patch coordinates of an `nh x nw` patch grid in visiting order.
fn patch_walk(nh: u32, nw: u32, traversal: Traversal) -> Vec<(u32, u32)> {
    match traversal {
        Traversal::RowMajor => (0..nh).flat_map(|y| (0..nw).map(move |x| (y, x))).collect(),
        Traversal::Boustrophedon => (0..nh)
            .flat_map(|y| (0..nw).map(move |x| (y, if y % 2 == 0 { x } else { nw - 1 - x })))
            .collect(),
        Traversal::Hilbert => {
            let side = nh.max(nw).next_power_of_two();
            (0..u64::from(side) * u64::from(side))
                .map(|d| hilbert_d2xy(side, d))
                .filter(|&(y, x)| y < nh && x < nw)
                .collect()
        }
    }
}

/// Point `d` of the Hilbert curve filling a `side x side` square (side a power of two),
/// as (row, column). The classic iterative construction (Wikipedia, "Hilbert curve").
fn hilbert_d2xy(side: u32, d: u64) -> (u32, u32) {
    let (mut x, mut y) = (0u64, 0u64);
    let mut t = d;
    let mut s = 1u64;
    while s < u64::from(side) {
        let rx = 1 & (t / 2);
        let ry = 1 & (t ^ rx);
        if ry == 0 {
            if rx == 1 {
                x = s - 1 - x;
                y = s - 1 - y;
            }
            std::mem::swap(&mut x, &mut y);
        }
        x += s * rx;
        y += s * ry;
        t /= 4;
        s *= 2;
    }
    (y as u32, x as u32)
}

/// The mask in a new token order (queries and keys both permuted).
///
/// # Panics
/// If the order's length differs from `q_len` or `kv_len` (callers check).
pub fn permute_rows(rows: &RowIntervals, order: &TokenOrder) -> RowIntervals {
    let n = order.len();
    assert!(
        rows.q_len() == n && rows.kv_len() == n,
        "callers check the order length"
    );
    // Each key's new position and run side by side: the keys of scattered rows are read
    // at random, one cache line per key instead of two.
    let moved: Vec<(u32, Run)> = order
        .inverse
        .iter()
        .copied()
        .zip(contiguous_runs(order))
        .collect();
    let mut out = RowIntervals::with_capacity(n, n, rows.intervals().len() * 2);
    let mut pieces: Vec<(u32, u32)> = Vec::new();
    for i in 0..n {
        pieces.clear();
        for iv in rows.row(order.order[i as usize]) {
            let mut k = iv.start;
            while k < iv.end {
                let (start, run) = moved[k as usize];
                let len = run.len.min(iv.end - k);
                pieces.push(run.image(start, len));
                k += len;
            }
        }
        // Pieces never overlap (the keys are distinct), so their starts order them.
        pieces.sort_unstable_by_key(|p| p.0);
        let mut cur: Option<(u32, u32)> = None;
        for &(s, e) in &pieces {
            match &mut cur {
                Some(c) if s <= c.1 => c.1 = c.1.max(e),
                _ => {
                    if let Some(c) = cur {
                        out.push_row_interval(c.0, c.1);
                    }
                    cur = Some((s, e));
                }
            }
        }
        if let Some(c) = cur {
            out.push_row_interval(c.0, c.1);
        }
        out.finish_row();
    }
    out
}

/// In-range pairs inside non-empty tiles: the work a tile kernel does (the same count as
/// `TileDescriptor::computed_pairs`, without building the descriptor).
pub fn computed_pairs(rows: &RowIntervals, tile: TileShape) -> u64 {
    let (q_len, kv_len) = (rows.q_len(), rows.kv_len());
    let (bm, bn) = tile.clamped(q_len, kv_len);
    let num_n = kv_len.div_ceil(bn);
    let mut total = 0u64;
    // A block's key tiles gathered as the tile builder does, so that rows whose keys
    // scatter (a tree in its program's order touches hundreds of tiles a block) cost a sort
    // or a bitmap per block, not a merge per row.
    let mut touched = Touched::default();
    let div_n = crate::tiles::DivU32::new(bn);
    for m in 0..q_len.div_ceil(bm) {
        let (r0, r1) = (m * bm, ((m + 1) * bm).min(q_len));
        touched.list.clear();
        for q in r0..r1 {
            touched.add(
                rows.row(q)
                    .iter()
                    .map(|iv| (div_n.div(iv.start), div_n.div(iv.end - 1))),
            );
        }
        touched.settle(num_n);
        let tiles: u64 = touched
            .list
            .iter()
            .map(|&(a, b)| u64::from(((b + 1) * bn).min(kv_len) - a * bn))
            .sum();
        total += u64::from(r1 - r0) * tiles;
    }
    total
}

/// The computed pairs of `rows` planned in `order`, without building the permuted rows:
/// each query block stamps the key tiles its rows' runs land on. O(runs after permutation).
pub fn computed_pairs_in_order(
    rows: &RowIntervals,
    order: &TokenOrder,
    run: &[Run],
    tile: TileShape,
) -> u64 {
    let n = order.len();
    let (bm, bn) = tile.clamped(n, n);
    let num_n = n.div_ceil(bn) as usize;
    let mut stamp = vec![u32::MAX; num_n];
    let mut total = 0u64;
    // Two divisions per run, over a million runs for a scattered tree: by multiply.
    let div_n = crate::tiles::DivU32::new(bn);
    for m in 0..n.div_ceil(bm) {
        let (r0, r1) = (m * bm, ((m + 1) * bm).min(n));
        let mut cols = 0u64;
        for i in r0..r1 {
            for iv in rows.row(order.order[i as usize]) {
                let mut k = iv.start;
                while k < iv.end {
                    let r = run[k as usize];
                    let len = r.len.min(iv.end - k);
                    let (start, end) = r.image(order.inverse[k as usize], len);
                    for t in div_n.div(start)..=div_n.div(end - 1) {
                        if stamp[t as usize] != m {
                            stamp[t as usize] = m;
                            cols += u64::from(((t + 1) * bn).min(n) - t * bn);
                        }
                    }
                    k += len;
                }
            }
        }
        total += u64::from(r1 - r0) * cols;
    }
    total
}

/// A key's run in a token order: `len` keys from it on land on consecutive new positions,
/// ascending or (`descending`) one below the other, as a reversed stretch of the order puts
/// them; a run of one key is ascending.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub len: u32,
    pub descending: bool,
}

impl Run {
    /// The new positions of the run's first `len` keys (`len <= self.len`) when its first
    /// key lands on `start`, as a half-open range.
    pub fn image(self, start: u32, len: u32) -> (u32, u32) {
        if self.descending {
            (start + 1 - len, start + 1)
        } else {
            (start, start + len)
        }
    }
}

/// `run[k]`: the run of keys from `k` on (see [`Run`]). Both directions count, so that an
/// order that reverses a stretch of keys (a tree numbered children first, put in preorder)
/// moves a row's interval in O(1) pieces rather than one per key.
pub fn contiguous_runs(order: &TokenOrder) -> Vec<Run> {
    let n = order.len() as usize;
    let mut run = vec![
        Run {
            len: 1,
            descending: false
        };
        n
    ];
    for k in (0..n.saturating_sub(1)).rev() {
        let (a, b) = (order.inverse[k], order.inverse[k + 1]);
        // A key's two neighbouring positions differ, so a run of two or more keys from
        // `k + 1` already goes the way the step from `k` goes, if it is a step of one.
        if b == a + 1 || a == b + 1 {
            run[k] = Run {
                len: run[k + 1].len + 1,
                descending: a == b + 1,
            };
        }
    }
    run
}

/// One candidate order and its exact cost. `patch` is clipped to the grid; raster order is
/// `[1, 1, width]` row-major.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub patch: [u32; 3],
    pub traversal: Traversal,
    pub computed_pairs: u64,
}

/// Patch shapes tried by [`choose_grid_order`] (frames, rows, columns), each clipped to the
/// grid (`u32::MAX` would mean the whole extent); `[1, 16, 1]` walks 16-row strips column
/// by column. Raster order (`[1, 1, width]` row-major) is always a candidate too.
pub const PATCHES_2D: &[[u32; 3]] = &[
    [1, 4, 32],
    [1, 8, 8],
    [1, 8, 16],
    [1, 16, 8],
    [1, 16, 16],
    [1, 32, 8],
    [1, 8, 32],
    [1, 16, 1],
    [1, 32, 1],
];
pub const PATCHES_3D: &[[u32; 3]] = &[
    [1, 8, 16],
    [1, 16, 8],
    [2, 8, 8],
    [4, 8, 8],
    [2, 4, 16],
    [4, 4, 8],
    [1, 16, 16],
    [2, 16, 4],
    [5, 8, 4],
];

/// Finds the candidate grid order with the fewest computed pairs at `tile` (raster order
/// included, so the result is never worse than raster). Returns the order and every
/// candidate's score, best first (raster first among equals). Candidates are distinct: a
/// patch shape that clips to one already tried with the same traversal (on a small grid,
/// say) is scored once. When raster wins, the order is the identity described as
/// [`TokenOrder::raster`] (patch `[1, 1, width]`, row-major).
pub fn choose_grid_order(
    rows: &RowIntervals,
    grid: &GridVals,
    tile: TileShape,
) -> (TokenOrder, Vec<Candidate>) {
    let n = rows.q_len();
    let patches = if grid.dims.len() == 3 {
        PATCHES_3D
    } else {
        PATCHES_2D
    };
    let raster = computed_pairs(rows, tile);
    let raster_patch = raster_patch(grid);
    let mut scored = vec![Candidate {
        patch: raster_patch,
        traversal: Traversal::RowMajor,
        computed_pairs: raster,
    }];
    let mut tried = std::collections::HashSet::from([(raster_patch, Traversal::RowMajor)]);
    let mut best: Option<(u64, TokenOrder)> = None;
    for &patch in patches {
        for traversal in [
            Traversal::RowMajor,
            Traversal::Boustrophedon,
            Traversal::Hilbert,
        ] {
            let clamped = clamp_patch(grid, patch);
            if !tried.insert((clamped, traversal)) {
                continue;
            }
            let order = TokenOrder::grid(n, grid, clamped, traversal);
            let cost = computed_pairs_in_order(rows, &order, &contiguous_runs(&order), tile);
            scored.push(Candidate {
                patch: clamped,
                traversal,
                computed_pairs: cost,
            });
            if cost < raster && best.as_ref().is_none_or(|(c, _)| cost < *c) {
                best = Some((cost, order));
            }
        }
    }
    scored.sort_by_key(|c| c.computed_pairs);
    (
        best.map_or_else(|| TokenOrder::raster(n, grid), |(_, o)| o),
        scored,
    )
}
