//! Whether a program's meaning is the same at every square length: bound at `q_len = kv_len =
//! L`, does it give the same parameters, structures and pairwise visibility for every `L`,
//! the length only bounding the keys? True for a program that reads no length, and for one
//! that reads `q_len` and `kv_len` only in affine combinations where they cancel once they are
//! equal: `causal_bottom_right`'s `k <= q + kv_len - q_len` is `k <= q` in every square
//! binding. `cm-serve` binds each sequence square at its own length, so such programs can be
//! served from one binding at a larger capacity (its piece cache).
//!
//! The test is an abstract interpretation of every integer expression as an affine function of
//! the one length `L` (`q_len` and `kv_len` each count `1 * L`): a sum, difference, negation or
//! product with a constant stays affine; any other operation, and every place an expression is
//! used (a comparison's side, an atom's offset, an array entry, a structure's extent), must see
//! coefficient 0. `batch` and `num_heads` are not lengths of the square and always fail it.

use crate::ir::{
    Arr, Bool, Int, IntKind, IntOp, ParamDefault, Program, RangeE, RangeKind, Region, SegKind,
};

/// Bounds on the affine terms that read `L`: coefficients at most [`MAX_COEF`] and constants
/// added to them at most [`MAX_OFFSET`] in magnitude. With `L` below 2^31 such a term stays far
/// inside i64 at every `L`, so it cannot overflow at one length and not another (an error the
/// general path would report where a binding at a larger capacity would not).
const MAX_COEF: i128 = 1 << 20;
const MAX_OFFSET: i128 = 1 << 40;

/// The coefficient of `L` in `i`, or `None` when `i` reads `L` other than affinely, beyond the
/// bounds above, or reads `batch` / `num_heads`.
fn coef(i: &Int) -> Option<i128> {
    let c = affine(i)?;
    (c.abs() <= MAX_COEF).then_some(c)
}

/// A constant too large to sit beside a term that reads `L` (see [`MAX_OFFSET`]).
fn large_constant(i: &Int) -> bool {
    matches!(i.kind, IntKind::Const(c) if i128::from(c).abs() > MAX_OFFSET)
}

fn affine(i: &Int) -> Option<i128> {
    let zero = |x: &Int| coef(x) == Some(0);
    // A sum's constant operand beside an operand that reads L.
    let sum = |a: &Int, b: &Int, ca: i128, cb: i128| {
        let mixed = (ca != 0 && large_constant(b)) || (cb != 0 && large_constant(a));
        (!mixed).then_some(())
    };
    match &i.kind {
        IntKind::QLen | IntKind::KvLen => Some(1),
        IntKind::Batch | IntKind::NumHeads => None,
        IntKind::Const(_)
        | IntKind::Q
        | IntKind::K
        | IntKind::B
        | IntKind::H
        | IntKind::SegLen
        | IntKind::Param(_)
        | IntKind::SegCount(_)
        | IntKind::Var(_) => Some(0),
        IntKind::Neg(a) => coef(a).map(|c| -c),
        IntKind::Bin(IntOp::Add, a, b) => {
            let (ca, cb) = (coef(a)?, coef(b)?);
            sum(a, b, ca, cb)?;
            Some(ca + cb)
        }
        IntKind::Bin(IntOp::Sub, a, b) => {
            let (ca, cb) = (coef(a)?, coef(b)?);
            sum(a, b, ca, cb)?;
            Some(ca - cb)
        }
        IntKind::Bin(IntOp::Mul, a, b) => match (&a.kind, &b.kind) {
            (IntKind::Const(c), _) => coef(b).map(|x| x * i128::from(*c)),
            (_, IntKind::Const(c)) => coef(a).map(|x| x * i128::from(*c)),
            _ => (zero(a) && zero(b)).then_some(0),
        },
        IntKind::Bin(IntOp::Div | IntOp::Mod | IntOp::Min | IntOp::Max, a, b) => {
            (zero(a) && zero(b)).then_some(0)
        }
        IntKind::Abs(a) | IntKind::Isqrt(a) => zero(a).then_some(0),
        IntKind::ArrIndex(a, x) => (arr(a) && zero(x)).then_some(0),
        IntKind::ArrLen(a) | IntKind::ArrSum(a) => arr(a).then_some(0),
        IntKind::If(c, a, b) => (boolean(c) && zero(a) && zero(b)).then_some(0),
        IntKind::RangeLo(r) | IntKind::RangeHi(r) => range(r).then_some(0),
        IntKind::SegIndex(_, p) | IntKind::GridCoord(_, _, p) => zero(p).then_some(0),
    }
}

/// An expression used as a value: the same at every `L`.
fn int(i: &Int) -> bool {
    coef(i) == Some(0)
}

fn boolean(b: &Bool) -> bool {
    match b {
        Bool::Const(_) => true,
        // A comparison is the same at every L when its sides differ by the same amount.
        Bool::Cmp(_, a, b) => matches!((coef(a), coef(b)), (Some(x), Some(y)) if x == y),
        Bool::And(a, b) | Bool::Or(a, b) => boolean(a) && boolean(b),
        Bool::Not(a) => boolean(a),
        Bool::InGrid(_, p) => int(p),
    }
}

fn range(r: &RangeE) -> bool {
    match &r.kind {
        RangeKind::Lit(a, b) => int(a) && int(b),
        RangeKind::Seg(_, p)
        | RangeKind::SegAt(_, p)
        | RangeKind::Part(_, _, p)
        | RangeKind::Piece(_, _, p) => int(p),
    }
}

fn arr(a: &Arr) -> bool {
    match a {
        Arr::Param(_) | Arr::Const(_) => true,
        Arr::Lit(xs) => xs.iter().all(int),
        Arr::Add(a, b, _) => arr(a) && arr(b),
        Arr::Concat(xs, _) => xs.iter().all(arr),
        Arr::Slice(a, r, _) => arr(a) && range(r),
    }
}

fn region(r: &Region) -> bool {
    match r {
        Region::Rows(b) | Region::Elementwise(b, _) => boolean(b),
        Region::KCmp { rest, .. } => int(rest),
        Region::KDiv { rest, div, rhs, .. } | Region::KMod { rest, div, rhs, .. } => {
            int(rest) && int(div) && int(rhs)
        }
        Region::KeyCmp { f, v, .. } => int(f) && int(v),
        Region::Ball { radius, .. } => int(radius),
        Region::Box { ranges, .. } => ranges.iter().all(range),
        Region::Path { pos, .. } => int(pos),
        Region::Union(a, b) | Region::Inter(a, b) | Region::Diff(a, b) => region(a) && region(b),
        Region::Not(a) => region(a),
        Region::Cond(c, a, b) => boolean(c) && region(a) && region(b),
        Region::Quant { lo, hi, body, .. } => int(lo) && int(hi) && region(body),
    }
}

impl Program {
    /// Whether binding at `q_len = kv_len = L` gives the same parameters, structures and
    /// pairwise visibility at every `L` (see the module docs): always when
    /// [`Program::reads_lengths`] is false. Programs with tensors or score terms are not
    /// examined (false when they read a length).
    pub fn square_invariant(&self) -> bool {
        if !self.reads_lengths {
            return true;
        }
        if !self.tensors.is_empty() || self.score.is_some() || self.sink.is_some() {
            return false;
        }
        let params = self.params.iter().all(|p| match &p.default {
            None => true,
            Some(ParamDefault::Int(i)) => int(i),
            Some(ParamDefault::Array(a)) => arr(a),
        });
        let segs = self.segs.iter().all(|s| {
            let kind = match &s.kind {
                SegKind::Plain(a) => arr(a),
                SegKind::Composite(pieces) => {
                    pieces.iter().all(|p| arr(&p.lengths) && int(&p.count))
                }
            };
            kind && int(&s.fill) && s.parts.iter().all(|p| int(&p.lo) && int(&p.hi))
        });
        let grids = self
            .grids
            .iter()
            .all(|g| g.dims.iter().all(int) && int(&g.at));
        let trees = self.trees.iter().all(|t| arr(&t.parents) && int(&t.at));
        let requires = self.requires.iter().all(|r| {
            boolean(&r.cond)
                && r.message.iter().all(|m| match m {
                    crate::ir::MsgPart::Text(_) => true,
                    crate::ir::MsgPart::Value(v) => int(v),
                })
        });
        params && segs && grids && trees && requires && region(&self.mask)
    }
}

#[cfg(test)]
mod tests {
    fn invariant(src: &str) -> bool {
        let (ast, diags) = cm_syntax::parse(src);
        assert!(diags.is_empty(), "{src}: {diags:?}");
        let (p, diags) = crate::check::check(&ast, &[]);
        p.unwrap_or_else(|| panic!("{src}: {diags:?}"))
            .square_invariant()
    }

    /// Lengths that cancel once they are equal keep a program square-invariant, wherever they
    /// are read; any other read of a length, `batch` or `num_heads`, or an affine term that
    /// could overflow at one length and not another does not.
    #[test]
    fn lengths_that_cancel_in_a_square_binding() {
        for src in [
            "mask = k <= q;",
            "mask = k <= q + kv_len - q_len;",
            "mask = q + kv_len - q_len - 50 < k <= q + kv_len - q_len;",
            "param d: int = kv_len - q_len;\nmask = k <= q + 2 * d;",
            "mask = k <= q + 3 * kv_len - 3 * q_len & k >= (kv_len - q_len) / 2;",
            "mask = k <= q & q_len > q_len - 1;",
            "require kv_len >= q_len else \"short\";\nmask = k <= q + kv_len - q_len;",
        ] {
            assert!(invariant(src), "{src}");
        }
        for src in [
            "mask = k < 4 | k >= kv_len - 8;",
            "mask = k <= q & q < q_len / 2;",
            "mask = k <= q + kv_len / 2 - q_len / 2;",
            "segments d = [2, 3];\nmask = k <= q & d.index(k) == d.index(q);",
            "mask = k <= q & k % num_heads == 0;",
            "mask = k <= q + batch - 1;",
            "mask = k <= q + kv_len * 2097152 - q_len * 2097152;",
            "mask = k <= q + (kv_len + 9223372036854775000) - q_len - 9223372036854775000;",
        ] {
            assert!(!invariant(src), "{src}");
        }
    }
}
