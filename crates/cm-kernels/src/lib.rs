//! The CompileMask CUDA kernels: CUDA C++ sources for sm_90a, the table of compiled variants,
//! the NVRTC options they are built with, the cache key of each build, and the policy a build
//! must pass (no register spills in forward kernels).
//!
//! This crate holds no unsafe code and calls no compiler: `cm-cuda`'s build script runs NVRTC
//! over [`VARIANTS`] (the FFI lives there, the only crate allowed `unsafe`) and embeds the
//! CUBINs; this crate is what both sides agree on.

use sha2::{Digest, Sha256};
use std::fmt;

/// Element type of Q, K, V and the output. Accumulation is always fp32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    F16,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        2
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "fp16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which kernel a variant instantiates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// `kernels/fwd_simple.cu`: mma.sync forward, the reference GPU path and fallback.
    FwdSimple,
    /// `kernels/fwd_wgmma.cu`: Hopper forward on wgmma from swizzled shared memory, one
    /// warpgroup per 64-row query block.
    FwdWgmma,
    /// `kernels/fwd_ws.cu`: the warp-specialised Hopper forward (TMA producer warpgroup, a
    /// wgmma consumer warpgroup per 64 query rows: 128x128 tiles, and 192x128 at head_dim
    /// 64, [`FWD_WS_TILES`]); the default.
    FwdWs,
    /// `kernels/fwd_ws.cu` built with `CM_PAGED=1`: the same forward reading K and V from a
    /// paged KV cache through a block table (serving's prefill-chunk path, over
    /// `cm_serve::Prefill`'s virtual key blocks), 128x128 tiles, no score terms.
    FwdWsPaged,
    /// `kernels/bwd_pre.cu`: backward pre-processing (`delta = rowsum(dO * O)`, lse in the
    /// exp2 domain, zeroed fp32 dQ accumulator and dQ turn counters), per query block.
    BwdPre,
    /// `kernels/bwd_dkdv.cu`: dK and dV per 128-key block, warp-specialised (a TMA producer
    /// warpgroup, two wgmma consumer warpgroups of 64 keys, [`BWD_TILE`]); also dQ, added into
    /// an fp32 accumulator by bulk asynchronous reductions (in the deterministic mode in turns,
    /// ascending key block by key block per query tile).
    BwdDkDv,
    /// `kernels/bwd_dq.cu`: dQ per query block on wgmma, no atomics (the deterministic mode
    /// where `bwd_dkdv` cannot add dQ in turns: score terms, per-head masks under GQA, the
    /// wide shapes).
    BwdDq,
    /// `kernels/bwd_post.cu`: `bwd_dkdv`'s fp32 dQ accumulator scaled and rounded.
    BwdPost,
    /// `kernels/decode.cu`: serving attention of a step's new rows against a paged KV cache
    /// (the query heads of a kv head packed into one CTA, split-KV, mma.sync, 64x64 tiles).
    Decode,
    /// `kernels/decode.cu`: the merge of [`KernelKind::Decode`]'s split-KV partial outputs by
    /// their lse.
    DecodeMerge,
}

impl KernelKind {
    pub const fn name(self) -> &'static str {
        match self {
            KernelKind::FwdSimple => "fwd_simple",
            KernelKind::FwdWgmma => "fwd_wgmma",
            KernelKind::FwdWs => "fwd_ws",
            KernelKind::FwdWsPaged => "fwd_ws_paged",
            KernelKind::BwdPre => "bwd_pre",
            KernelKind::BwdDkDv => "bwd_dkdv",
            KernelKind::BwdDq => "bwd_dq",
            KernelKind::BwdPost => "bwd_post",
            KernelKind::Decode => "decode",
            KernelKind::DecodeMerge => "decode_merge",
        }
    }

    /// The `.cu` file compiled for this kernel (a key of [`SOURCES`]).
    pub const fn source_file(self) -> &'static str {
        match self {
            KernelKind::FwdSimple => "fwd_simple.cu",
            KernelKind::FwdWgmma => "fwd_wgmma.cu",
            KernelKind::FwdWs | KernelKind::FwdWsPaged => "fwd_ws.cu",
            KernelKind::BwdPre => "bwd_pre.cu",
            KernelKind::BwdDkDv => "bwd_dkdv.cu",
            KernelKind::BwdDq => "bwd_dq.cu",
            KernelKind::BwdPost => "bwd_post.cu",
            KernelKind::Decode | KernelKind::DecodeMerge => "decode.cu",
        }
    }

    /// The `extern "C"` entry point in the CUBIN.
    pub const fn entry_point(self) -> &'static str {
        match self {
            KernelKind::FwdSimple => "cm_fwd_simple",
            KernelKind::FwdWgmma => "cm_fwd_wgmma",
            KernelKind::FwdWs | KernelKind::FwdWsPaged => "cm_fwd_ws",
            KernelKind::BwdPre => "cm_bwd_pre",
            KernelKind::BwdDkDv => "cm_bwd_dkdv",
            KernelKind::BwdDq => "cm_bwd_dq",
            KernelKind::BwdPost => "cm_bwd_post",
            KernelKind::Decode => "cm_decode",
            KernelKind::DecodeMerge => "cm_decode_merge",
        }
    }

    /// The kernels [`KernelKind`]'s forward launches (`Runtime::forward`) may use.
    pub const fn is_forward(self) -> bool {
        matches!(
            self,
            KernelKind::FwdSimple | KernelKind::FwdWgmma | KernelKind::FwdWs
        )
    }

    /// Kernels that must compile with no register spills: every forward kernel (the
    /// training forward and serving's decode), whose speed a spill would cost most.
    pub const fn must_not_spill(self) -> bool {
        self.is_forward()
            || matches!(
                self,
                KernelKind::FwdWsPaged | KernelKind::Decode | KernelKind::DecodeMerge
            )
    }
}

/// One compiled instantiation: a kernel at a dtype and head dimensions, with or without the
/// score terms that change logits (softcap, biases: `CmScoreParams` in `kernels/common.cuh`;
/// every forward applies sinks, which change only the normalisation), at the tile
/// and pipeline depth it declares. The build passes the declared shape to the source
/// (`CM_BLOCK_M`, `CM_BLOCK_N`, `CM_STAGES`, `CM_THREADS`), which uses it or refuses to
/// compile with another; the runtime builds the descriptor lists each variant reads at its
/// tile ([`kernel_tiles`]) and sizes shared memory and the launch from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    pub kernel: KernelKind,
    pub dtype: DType,
    /// Columns of Q and K (the dimension `q . k` sums over).
    pub head_dim: u32,
    /// Columns of V and of the output; equal to `head_dim` but in [`WIDE_SHAPES`]' MLA shape.
    pub head_dim_v: u32,
    /// Compiled with `CM_SCORE=1`: the kernel forms every logit with the launch's softcap
    /// and biases. Only [`KernelKind::has_score_variant`] kernels have one.
    pub score: bool,
    /// Query rows of a tile of the descriptor lists the kernel reads.
    pub block_m: u32,
    /// Keys of such a tile.
    pub block_n: u32,
    /// Depth of the kernel's shared-memory load ring (stages of K and V in the forwards, of Q
    /// and dO in `bwd_dkdv`); 1 for kernels without a ring.
    pub stages: u32,
}

/// The shape a kernel is built at for a head dim, with or without score terms, as
/// `(block_m, block_n, stages)`: FlashAttention-3's shapes where our kernels follow it. The
/// `deep` forward is the 192-row `fwd_ws` (three consumer warpgroups), built beside the
/// 128-row one at head_dim 64 without score terms (with them its consumers, at 160 registers
/// each, spill); [`VARIANTS`] holds both and the launch picks by the plan's tiles.
const fn declared_shape(kernel: KernelKind, head_dim: u32, deep: bool) -> (u32, u32, u32) {
    match kernel {
        KernelKind::FwdWs if deep => (192, 128, 2),
        KernelKind::FwdWs | KernelKind::FwdWsPaged => (128, 128, 2),
        // 64-row query tiles against 128-key blocks (two consumer warpgroups of 64 keys);
        // a third ring stage at head_dim 64.
        KernelKind::BwdDkDv => (64, 128, if head_dim == 64 { 3 } else { 2 }),
        KernelKind::BwdDq => (64, 64, 2),
        KernelKind::Decode | KernelKind::DecodeMerge => (64, 64, 3),
        KernelKind::FwdSimple | KernelKind::FwdWgmma | KernelKind::BwdPre | KernelKind::BwdPost => {
            (64, 64, 1)
        }
    }
}

impl KernelKind {
    /// Whether the kernel has a score-terms variant: the default forward and both backward
    /// modes' kernels (the reference forwards and the pre/post passes have none; the pre
    /// pass's delta and lse conversion do not depend on the scores).
    pub const fn has_score_variant(self) -> bool {
        matches!(
            self,
            KernelKind::FwdWs | KernelKind::BwdDkDv | KernelKind::BwdDq
        )
    }
}

/// The shapes `(head_dim, head_dim_v)` beyond 64 and 128: Gemma's head_dim 256 and
/// DeepSeek's MLA (192 for Q and K, 128 for V). Built for [`KernelKind::FwdWs`] (with score
/// terms at [`WIDE_SCORE_SHAPES`] only) and for the backward's four kernels without score
/// terms; their `bwd_dkdv` is `kernels/bwd_dkdv_wide.cu` (64-key CTAs with the head dim split
/// between the consumers: 64 keys x 256 columns of dK and dV do not fit one warpgroup's
/// registers).
pub const WIDE_SHAPES: [(u32, u32); 2] = [(256, 256), (192, 128)];

/// The [`WIDE_SHAPES`] with a score-terms variant of `fwd_ws`: at head_dim 256 the terms'
/// registers beside the 64 x 256 fp32 output spill (8-40 bytes per thread, also with a
/// 240-register consumer budget), which the build refuses for forward kernels.
pub const WIDE_SCORE_SHAPES: [(u32, u32); 1] = [(192, 128)];

impl Variant {
    /// A stable, file-name-safe name, e.g. `fwd_simple_bf16_d128`, `fwd_ws_score_bf16_d64`,
    /// `fwd_ws_bf16_d192v128` (head_dim_v named only where it differs) or `fwd_ws_bf16_d64_m192`
    /// (`block_m` named where the kernel's first variant in [`VARIANTS`] has another).
    pub fn name(&self) -> String {
        let v = if self.head_dim_v == self.head_dim {
            String::new()
        } else {
            format!("v{}", self.head_dim_v)
        };
        let first = VARIANTS.iter().find(|o| o.kernel == self.kernel);
        let m = match first {
            Some(o) if o.block_m != self.block_m => format!("_m{}", self.block_m),
            _ => String::new(),
        };
        format!(
            "{}{}_{}_d{}{v}{m}",
            self.kernel.name(),
            if self.score { "_score" } else { "" },
            self.dtype.name(),
            self.head_dim
        )
    }

    /// The tile shape (`block_m` query rows x `block_n` keys) of this variant's descriptor
    /// lists.
    pub const fn tile(&self) -> (u32, u32) {
        (self.block_m, self.block_n)
    }

    /// Threads per CTA: for [`KernelKind::FwdWs`] a producer warpgroup and one consumer
    /// warpgroup per 64 query rows; for [`KernelKind::BwdDkDv`] a producer and two consumers
    /// (64 keys each); one warpgroup for the others.
    pub const fn threads(&self) -> u32 {
        match self.kernel {
            KernelKind::FwdWs | KernelKind::FwdWsPaged => 128 * (1 + self.block_m / 64),
            KernelKind::BwdDkDv => 384,
            _ => 128,
        }
    }

    /// Query tiles of the descriptor lists (`block_m` rows each) one step of
    /// [`KernelKind::BwdDkDv`]'s ring takes: two at head_dim 64 without score terms, so that
    /// each consumer's products are 64 keys x 128 queries (FlashAttention-3's 128 x 128 tile
    /// at that head dim: a 64-row step's products are too short to hide its barriers and
    /// statistics), one elsewhere (at head_dim 128 a 128-query step's scores beside dK and dV
    /// do not fit the consumers' registers; the score terms index their tiles by first
    /// query). The two tiles of a step need not be adjacent: any two of the key block's list,
    /// across the GQA group's heads; a block with an odd count ends with a step of one. 1 for
    /// every other kernel.
    pub const fn q_tiles_per_step(&self) -> u32 {
        match self.kernel {
            KernelKind::BwdDkDv if self.head_dim == 64 && !self.score => 2,
            _ => 1,
        }
    }

    /// Buffers of [`KernelKind::BwdDkDv`]'s shared dS^T tile: two at one query tile a step
    /// without score terms, so that a consumer writes a step's dS^T without waiting for the
    /// other consumer's dQ product of the step before (FlashAttention-3's and -4's
    /// double-buffered dS) and waits for the dQ hand-off behind the step's dQ and dK products
    /// instead; one at two tiles a step (two 128 x 128 dS^T tiles do not fit beside the
    /// three-stage ring, and two stages with two buffers measured no faster there) and in the
    /// score variants (unmeasured). 1 for every other kernel.
    pub const fn ds_stages(&self) -> u32 {
        match self.kernel {
            KernelKind::BwdDkDv
                if self.head_dim <= 128 && self.q_tiles_per_step() == 1 && !self.score =>
            {
                2
            }
            _ => 1,
        }
    }

    /// Keys per pipeline stage of [`KernelKind::FwdWs`]: the descriptor's 128-key tile, or at
    /// head_dim above 192 half of it (two stages of 128 keys x 256 columns of K and V beside a
    /// 128 x 256 Q tile exceed the SM's 227 KB of shared memory; the 64-key halves of one tile
    /// share its visibility bits). Keys per CTA of [`KernelKind::BwdDkDv`]: its 128-key block,
    /// or half of it at the wide shapes (one CTA per half). Other kernels: their tile's
    /// `block_n`.
    pub const fn key_step(&self) -> u32 {
        match self.kernel {
            KernelKind::FwdWs if self.head_dim > 192 => 64,
            KernelKind::BwdDkDv if self.head_dim > 128 => 64,
            _ => self.block_n,
        }
    }

    /// The source file that defines this variant's entry point: the kernel's, but
    /// `bwd_dkdv_wide.cu` for [`KernelKind::BwdDkDv`] at the [`WIDE_SHAPES`].
    pub const fn source_file(&self) -> &'static str {
        match self.kernel {
            KernelKind::BwdDkDv if self.head_dim > 128 => "bwd_dkdv_wide.cu",
            kind => kind.source_file(),
        }
    }

    /// The preprocessor definitions that select this variant in the kernel source.
    pub fn defines(&self) -> Vec<String> {
        let bf16 = u8::from(self.dtype == DType::Bf16);
        let mut defines = vec![
            format!("-DCM_DTYPE_BF16={bf16}"),
            format!("-DCM_HEAD_DIM={}", self.head_dim),
            format!("-DCM_HEAD_DIM_V={}", self.head_dim_v),
            format!("-DCM_SCORE={}", u8::from(self.score)),
            format!("-DCM_BLOCK_M={}", self.block_m),
            format!("-DCM_BLOCK_N={}", self.block_n),
            format!("-DCM_STAGES={}", self.stages),
            format!("-DCM_THREADS={}", self.threads()),
        ];
        if self.kernel == KernelKind::BwdDkDv {
            defines.push(format!("-DCM_Q_TILES={}", self.q_tiles_per_step()));
            defines.push(format!("-DCM_DS_STAGES={}", self.ds_stages()));
        }
        if matches!(self.kernel, KernelKind::FwdWs | KernelKind::FwdWsPaged) {
            defines.push(format!("-DCM_WS_KEY_STEP={}", self.key_step()));
        }
        if self.kernel == KernelKind::FwdWsPaged {
            defines.push("-DCM_PAGED=1".into());
        }
        if self.dynamic_shared_bytes() > 0 {
            // The kernel checks its layout against this with a static_assert.
            defines.push(format!(
                "-DCM_DYNAMIC_SMEM_BYTES={}",
                self.dynamic_shared_bytes()
            ));
        }
        defines
    }

    /// Dynamic shared memory per CTA in bytes the variant is launched with (0: static only).
    /// The backward kernels' tiles (64 rows x `head_dim`, 128B-swizzled) with their double
    /// buffers exceed the 48 KB static limit.
    pub const fn dynamic_shared_bytes(&self) -> u32 {
        let tile = 64 * self.head_dim * 2;
        let tile_v = 64 * self.head_dim_v * 2;
        match self.kernel {
            // bwd_dkdv_wide.cu: K and V of 64 keys, two stages of Q and dO, P^T and dS^T (64 x
            // 64 elements each), two stages of lse and delta (64 f32 each) and of the half's
            // key visibility (64 u64), 64 bytes of mbarriers, and 1 KB of alignment.
            KernelKind::BwdDkDv if self.head_dim > 128 => {
                3 * tile + 3 * tile_v + 2 * 64 * 64 * 2 + 2 * 2 * 64 * 4 + 2 * 64 * 8 + 64 + 1024
            }
            // K and V (128 x head_dim each), `stages` stages of Q and dO, of lse and delta (64
            // f32 each) and of the key visibility (128 u64), each per query tile of a step
            // (`q_tiles_per_step`); `ds_stages` dS^T tiles (128 keys x the step's queries), the
            // fp32 dQ tiles (64 x head_dim each), 64 bytes of mbarriers, and 1 KB to align the
            // start to a swizzle atom.
            KernelKind::BwdDkDv => {
                let stages = self.stages;
                let q_tiles = self.q_tiles_per_step();
                2 * 2 * tile
                    + stages * q_tiles * (2 * tile + 2 * 64 * 4 + 128 * 8)
                    + self.ds_stages() * 128 * 64 * 2 * q_tiles
                    + q_tiles * 64 * self.head_dim * 4
                    + 64
                    + 1024
            }
            // Q, dO, two stages of K and V; two stages of row visibility; alignment.
            KernelKind::BwdDq => 3 * tile + 3 * tile_v + 2 * 64 * 8 + 1024,
            // Three stages of a 64-key K and V tile, rows padded by 16 bytes (decode.cu's PITCH).
            KernelKind::Decode => 3 * 2 * 64 * (self.head_dim + 8) * 2,
            // Q (block_m x head_dim) and `stages` stages of K (key_step x head_dim) and V
            // (key_step x head_dim_v), unpadded: 128B-swizzled; 256 bytes of mbarriers and
            // work-item slots, `stages` stages of a partial tile's row bits (block_m rows x 16
            // bytes), and 1 KB to align the start to a swizzle atom.
            KernelKind::FwdWs | KernelKind::FwdWsPaged => {
                self.block_m * self.head_dim * 2
                    + self.stages * self.key_step() * (self.head_dim + self.head_dim_v) * 2
                    + 256
                    + self.stages * self.block_m * 16
                    + 1024
            }
            _ => 0,
        }
    }
}

/// Every variant the project ships; the build compiles all of them and the runtime finds a
/// launch's kernel here by index: every kernel at both dtypes and head dims 64 and 128, the
/// score variant of each kernel that has one, then at both dtypes and each of
/// [`WIDE_SHAPES`] `fwd_ws` and the backward's four kernels, then `fwd_ws` with score terms at
/// each of [`WIDE_SCORE_SHAPES`], then the deep (192-row) `fwd_ws` at head_dim 64, then the
/// paged `fwd_ws` at both dtypes and head dims 64 and 128. Each at the shape `declared_shape`
/// gives it.
pub const VARIANTS: [Variant; 76] = {
    use DType::{Bf16, F16};
    use KernelKind::{
        BwdDkDv, BwdDq, BwdPost, BwdPre, Decode, DecodeMerge, FwdSimple, FwdWgmma, FwdWs,
        FwdWsPaged,
    };
    // Every kernel plain, then the score variant of each kernel that has one.
    const KINDS: [(KernelKind, bool); 12] = [
        (FwdSimple, false),
        (FwdWgmma, false),
        (FwdWs, false),
        (BwdPre, false),
        (BwdDkDv, false),
        (BwdDq, false),
        (BwdPost, false),
        (FwdWs, true),
        (BwdDkDv, true),
        (BwdDq, true),
        (Decode, false),
        (DecodeMerge, false),
    ];
    // The kernels built at the wide shapes.
    const WIDE_KINDS: [KernelKind; 5] = [FwdWs, BwdPre, BwdDkDv, BwdDq, BwdPost];
    const SHAPES: [(DType, u32); 4] = [(Bf16, 64), (Bf16, 128), (F16, 64), (F16, 128)];
    const SQUARE: usize = KINDS.len() * SHAPES.len();
    const WIDE: usize = 2 * WIDE_SHAPES.len() * WIDE_KINDS.len();
    const WIDE_SCORE: usize = 2 * WIDE_SCORE_SHAPES.len();
    const N: usize = SQUARE + WIDE + WIDE_SCORE + 2 + SHAPES.len();
    assert!(N == 76);
    const fn variant(
        kernel: KernelKind,
        dtype: DType,
        dims: (u32, u32),
        score: bool,
        deep: bool,
    ) -> Variant {
        let (block_m, block_n, stages) = declared_shape(kernel, dims.0, deep);
        Variant {
            kernel,
            dtype,
            head_dim: dims.0,
            head_dim_v: dims.1,
            score,
            block_m,
            block_n,
            stages,
        }
    }
    let mut out = [variant(FwdSimple, Bf16, (64, 64), false, false); N];
    let mut n = 0;
    while n < SQUARE {
        let (kernel, score) = KINDS[n / SHAPES.len()];
        let (dtype, head_dim) = SHAPES[n % SHAPES.len()];
        out[n] = variant(kernel, dtype, (head_dim, head_dim), score, false);
        n += 1;
    }
    while n < SQUARE + WIDE + WIDE_SCORE {
        let i = n - SQUARE;
        let score = i >= WIDE;
        let (kernel, dims) = if score {
            (FwdWs, WIDE_SCORE_SHAPES[(i - WIDE) / 2])
        } else {
            (
                WIDE_KINDS[i / 2 / WIDE_SHAPES.len()],
                WIDE_SHAPES[i / 2 % WIDE_SHAPES.len()],
            )
        };
        let dtype = if i % 2 == 0 { Bf16 } else { F16 };
        out[n] = variant(kernel, dtype, dims, score, false);
        n += 1;
    }
    out[n] = variant(FwdWs, Bf16, (64, 64), false, true);
    out[n + 1] = variant(FwdWs, F16, (64, 64), false, true);
    n += 2;
    let mut i = 0;
    while i < SHAPES.len() {
        let (dtype, head_dim) = SHAPES[i];
        out[n + i] = variant(FwdWsPaged, dtype, (head_dim, head_dim), false, false);
        i += 1;
    }
    out
};

/// The distinct tiles `(block_m, block_n)` of `kind`'s variants, in [`VARIANTS`] order; the
/// build fails when they are not exactly `M`.
pub const fn kernel_tiles<const M: usize>(kind: KernelKind) -> [(u32, u32); M] {
    let mut out = [(0u32, 0u32); M];
    let mut count = 0;
    let mut i = 0;
    while i < VARIANTS.len() {
        let v = &VARIANTS[i];
        if v.kernel as u8 == kind as u8 {
            let mut seen = false;
            let mut j = 0;
            while j < count {
                seen |= out[j].0 == v.block_m && out[j].1 == v.block_n;
                j += 1;
            }
            if !seen {
                assert!(count < M, "a kernel has more tiles than declared");
                out[count] = (v.block_m, v.block_n);
                count += 1;
            }
        }
        i += 1;
    }
    assert!(count == M, "a kernel has fewer tiles than declared");
    out
}

/// The tile of the plan's own lists: what the reference forwards ([`KernelKind::FwdSimple`],
/// [`KernelKind::FwdWgmma`]) and `bwd_dq` read, and the 64-row blocks of `bwd_pre` /
/// `bwd_post` and of the backward workspace (the build checks that they all declare it).
pub const TILE: (u32, u32) = kernel_tiles::<1>(KernelKind::FwdSimple)[0];

/// The tiles of [`KernelKind::FwdWs`]'s variants, each with its own forward lists in the
/// device plan: 128 x 128 (two consumer warpgroups of 64 rows, FlashAttention-3's shape at
/// head_dim 128) and 192 x 128 (three, its shape at head_dim 64).
pub const FWD_WS_TILES: [(u32, u32); 2] = kernel_tiles::<2>(KernelKind::FwdWs);

/// The tile of [`KernelKind::BwdDkDv`]'s variants: 64-row query tiles against 128-key blocks
/// (two consumer warpgroups of 64 keys), FlashAttention-3's backward shape for head_dim 128.
pub const BWD_TILE: (u32, u32) = kernel_tiles::<1>(KernelKind::BwdDkDv)[0];

const _: () = {
    let kinds = [
        KernelKind::FwdWgmma,
        KernelKind::BwdPre,
        KernelKind::BwdDq,
        KernelKind::BwdPost,
    ];
    let mut i = 0;
    while i < kinds.len() {
        let t = kernel_tiles::<1>(kinds[i])[0];
        assert!(
            t.0 == TILE.0 && t.1 == TILE.1,
            "the plan's own lists serve one tile"
        );
        i += 1;
    }
};

/// Index into [`VARIANTS`] of the first variant matching the arguments, if one is built (for
/// [`KernelKind::FwdWs`] at head_dim 64 there are two tiles: [`find_variants`]).
pub fn find_variant(
    kernel: KernelKind,
    dtype: DType,
    head_dim: u32,
    head_dim_v: u32,
    score: bool,
) -> Option<usize> {
    find_variants(kernel, dtype, head_dim, head_dim_v, score).next()
}

/// Indices into [`VARIANTS`] of every variant matching the arguments (one per tile shape).
pub fn find_variants(
    kernel: KernelKind,
    dtype: DType,
    head_dim: u32,
    head_dim_v: u32,
    score: bool,
) -> impl Iterator<Item = usize> {
    VARIANTS.iter().enumerate().filter_map(move |(i, v)| {
        (v.kernel == kernel
            && v.dtype == dtype
            && v.head_dim == head_dim
            && v.head_dim_v == head_dim_v
            && v.score == score)
            .then_some(i)
    })
}

/// The `(head_dim, head_dim_v)` shapes `kernel` is built for at `dtype` (with or without score
/// terms), ascending: what an error for an unbuilt shape lists.
pub fn built_head_dims(kernel: KernelKind, dtype: DType, score: bool) -> Vec<(u32, u32)> {
    let mut dims: Vec<(u32, u32)> = VARIANTS
        .iter()
        .filter(|v| v.kernel == kernel && v.dtype == dtype && v.score == score)
        .map(|v| (v.head_dim, v.head_dim_v))
        .collect();
    dims.sort_unstable();
    dims.dedup();
    dims
}

/// `built_head_dims` as text: `64, 128, 192 (head_dim_v 128), 256`.
pub fn head_dims_text(dims: &[(u32, u32)]) -> String {
    let items: Vec<String> = dims
        .iter()
        .map(|&(d, dv)| {
            if d == dv {
                d.to_string()
            } else {
                format!("{d} (head_dim_v {dv})")
            }
        })
        .collect();
    items.join(", ")
}

/// Every kernel source file by the name it is included as (`#include "common.cuh"`). The
/// build hands these to NVRTC as in-memory headers, so what is hashed is exactly what is
/// compiled.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("fwd_common.cuh", include_str!("../kernels/fwd_common.cuh")),
    ("score.cuh", include_str!("../kernels/score.cuh")),
    ("wgmma.cuh", include_str!("../kernels/wgmma.cuh")),
    ("tma.cuh", include_str!("../kernels/tma.cuh")),
    ("fwd_simple.cu", include_str!("../kernels/fwd_simple.cu")),
    ("fwd_wgmma.cu", include_str!("../kernels/fwd_wgmma.cu")),
    ("fwd_ws.cu", include_str!("../kernels/fwd_ws.cu")),
    ("bwd_common.cuh", include_str!("../kernels/bwd_common.cuh")),
    ("bwd_pre.cu", include_str!("../kernels/bwd_pre.cu")),
    ("bwd_dkdv.cu", include_str!("../kernels/bwd_dkdv.cu")),
    (
        "bwd_dkdv_wide.cu",
        include_str!("../kernels/bwd_dkdv_wide.cu"),
    ),
    ("bwd_dq.cu", include_str!("../kernels/bwd_dq.cu")),
    ("bwd_post.cu", include_str!("../kernels/bwd_post.cu")),
    ("decode.cu", include_str!("../kernels/decode.cu")),
];

/// The target every CUBIN is built for: a real architecture, so NVRTC runs ptxas (which
/// catches inline-PTX errors and reports registers and spills), with the `a` features that
/// wgmma and TMA need.
pub const GPU_ARCH: &str = "sm_90a";

/// Source text of a file in [`SOURCES`].
pub fn source(name: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// The headers of [`SOURCES`] (every file but the `.cu` ones), as `(include name, text)`.
pub fn headers() -> impl Iterator<Item = (&'static str, &'static str)> {
    SOURCES.iter().copied().filter(|(n, _)| n.ends_with(".cuh"))
}

/// NVRTC options for `variant`.
pub fn nvrtc_options(variant: &Variant) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={GPU_ARCH}"),
        "--ptxas-options=-v".to_string(),
        "-std=c++17".to_string(),
        // The sources hold no host code; this makes generic lambdas (the backward's walks
        // hand one body two step types) device code too.
        "-default-device".to_string(),
        "-lineinfo".to_string(),
    ];
    opts.extend(variant.defines());
    opts
}

/// Cache key of one variant's CUBIN, lowercase hex SHA-256 over every source, the options and
/// the compiler's identity (`compiler_id`: its version and anything else that changes its
/// output). Equal keys mean byte-identical inputs to the same compiler.
pub fn cache_key(variant: &Variant, compiler_id: &str) -> String {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(compiler_id.as_bytes());
    for (name, text) in SOURCES {
        field(name.as_bytes());
        field(text.as_bytes());
    }
    for opt in nvrtc_options(variant) {
        field(opt.as_bytes());
    }
    field(variant.kernel.entry_point().as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// What ptxas reported for one entry point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PtxasReport {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of register spills stored to local memory, per thread.
    pub spill_store_bytes: u32,
    /// Bytes of register spills loaded from local memory, per thread.
    pub spill_load_bytes: u32,
    /// Bytes of the stack frame (local memory), per thread.
    pub stack_frame_bytes: u32,
    /// Bytes of static shared memory per CTA.
    pub shared_bytes: u32,
    /// ptxas serialised the function's wgmma instructions (its C7520 "Potential Performance
    /// Loss" note): each product then waits for the previous one, several times slower.
    pub wgmma_serialized: bool,
}

/// Extracts the report of `entry` from an NVRTC log compiled with `--ptxas-options=-v`.
///
/// ptxas prints, per function, `Compiling entry function 'NAME'`, then
/// `N bytes stack frame, N bytes spill stores, N bytes spill loads` and
/// `Used N registers, ... N bytes smem, ...`. Notes about a function that ptxas prints before
/// those sections (`... wgmma.mma_async instructions are serialized ... in the function
/// 'NAME'`) are read from the whole log.
///
/// # Errors
/// A message when the log has no report for `entry` (e.g. `-v` was dropped).
pub fn parse_ptxas_log(log: &str, entry: &str) -> Result<PtxasReport, String> {
    let marker = format!("Compiling entry function '{entry}'");
    let start = log
        .find(&marker)
        .ok_or_else(|| format!("the ptxas log has no report for entry function '{entry}'"))?;
    let section = &log[start + marker.len()..];
    let section = section
        .find("Compiling entry function")
        .map_or(section, |end| &section[..end]);
    let number_before = |text: &str, unit: &str| -> Option<u32> {
        let at = text.find(unit)?;
        text[..at].split_whitespace().last()?.parse().ok()
    };
    let used = section
        .find("Used ")
        .ok_or_else(|| format!("the ptxas log for '{entry}' has no 'Used N registers' line"))?;
    let registers = section[used + 5..]
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("the ptxas log for '{entry}' has an unreadable register count"))?;
    let used_line = section[used..].lines().next().unwrap_or("");
    Ok(PtxasReport {
        registers,
        spill_store_bytes: number_before(section, "bytes spill stores").unwrap_or(0),
        spill_load_bytes: number_before(section, "bytes spill loads").unwrap_or(0),
        stack_frame_bytes: number_before(section, "bytes stack frame").unwrap_or(0),
        shared_bytes: number_before(used_line, "bytes smem").unwrap_or(0),
        wgmma_serialized: log.lines().any(|line| {
            line.contains("wgmma.mma_async instructions are serialized")
                && line.contains(&format!("function '{entry}'"))
        }),
    })
}

/// The build policy: forward kernels must not spill registers, and no kernel may have its
/// wgmma products serialised.
///
/// # Errors
/// A message naming the variant and the spill sizes or the serialisation.
pub fn check_report(variant: &Variant, report: &PtxasReport) -> Result<(), String> {
    if report.wgmma_serialized {
        return Err(format!(
            "kernel {} has its wgmma products serialised by ptxas (C7520: a warpgroup.arrive \
             the compiler had to insert, e.g. on a divergent path); keep every wgmma batch in \
             warpgroup-uniform straight-line code with explicit cm_wgmma_fence",
            variant.name()
        ));
    }
    let spills = report.spill_store_bytes + report.spill_load_bytes;
    if variant.kernel.must_not_spill() && spills > 0 {
        return Err(format!(
            "kernel {} spills registers ({} bytes stores, {} bytes loads at {} registers); \
             forward and decode kernels must compile with no spills",
            variant.name(),
            report.spill_store_bytes,
            report.spill_load_bytes,
            report.registers
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'cm_other' for 'sm_90a'\n\
        ptxas info    : Function properties for cm_other\n\
        \x20   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
        ptxas info    : Used 255 registers, used 0 barriers, 8 bytes cumulative stack size\n\
        ptxas info    : Compiling entry function 'cm_fwd_simple' for 'sm_90a'\n\
        ptxas info    : Function properties for cm_fwd_simple\n\
        \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
        ptxas info    : Used 168 registers, used 1 barriers, 34816 bytes smem, 544 bytes cmem[0]\n";

    #[test]
    fn parses_the_named_entry_only() {
        let r = parse_ptxas_log(LOG, "cm_fwd_simple").unwrap();
        assert_eq!(
            r,
            PtxasReport {
                registers: 168,
                spill_store_bytes: 0,
                spill_load_bytes: 0,
                stack_frame_bytes: 0,
                shared_bytes: 34816,
                wgmma_serialized: false,
            }
        );
        let other = parse_ptxas_log(LOG, "cm_other").unwrap();
        assert_eq!(
            (
                other.registers,
                other.spill_store_bytes,
                other.spill_load_bytes
            ),
            (255, 4, 4)
        );
        assert!(parse_ptxas_log(LOG, "missing")
            .unwrap_err()
            .contains("'missing'"));
    }

    #[test]
    fn serialized_wgmma_fails_the_build() {
        let log = format!(
            "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are \
             serialized due to program dependence on compiler-inserted WG.AR in divergent path in \
             the function 'cm_fwd_simple'\n{LOG}"
        );
        let r = parse_ptxas_log(&log, "cm_fwd_simple").unwrap();
        assert!(r.wgmma_serialized);
        assert!(!parse_ptxas_log(&log, "cm_other").unwrap().wgmma_serialized);
        assert!(
            !parse_ptxas_log(LOG, "cm_fwd_simple")
                .unwrap()
                .wgmma_serialized
        );
        let bwd = VARIANTS
            .iter()
            .find(|v| v.kernel == KernelKind::BwdDkDv)
            .unwrap();
        let err = check_report(bwd, &r).unwrap_err();
        assert!(
            err.contains(&bwd.name()) && err.contains("serialised"),
            "{err}"
        );
    }

    #[test]
    fn forward_spills_fail_the_build() {
        let v = VARIANTS[0];
        let spilled = PtxasReport {
            registers: 255,
            spill_store_bytes: 4,
            ..Default::default()
        };
        let err = check_report(&v, &spilled).unwrap_err();
        assert!(
            err.contains(&v.name()) && err.contains("4 bytes stores"),
            "{err}"
        );
        assert!(check_report(
            &v,
            &PtxasReport {
                registers: 128,
                ..Default::default()
            }
        )
        .is_ok());
    }

    /// Every kernel's dynamic shared memory reaches the kernel (which checks its layout
    /// against it) and leaves room for the CTAs per SM it is meant to run with (227 KB per SM
    /// on sm_90): one for the warp-specialised fwd_ws and bwd_dkdv, two for bwd_dq and for
    /// decode (whose bandwidth comes from several CTAs' loads in flight).
    #[test]
    fn dynamic_shared_memory_fits_the_intended_ctas_per_sm() {
        for v in VARIANTS.iter().filter(|v| v.dynamic_shared_bytes() > 0) {
            let ctas = match v.kernel {
                KernelKind::BwdDkDv | KernelKind::FwdWs | KernelKind::FwdWsPaged => 1,
                // Q, dO and two stages of K and V at 256 columns are 192 KB.
                KernelKind::BwdDq if v.head_dim > 128 => 1,
                _ => 2,
            };
            assert!(
                ctas * (v.dynamic_shared_bytes() + 1024) <= 227 * 1024,
                "{}",
                v.name()
            );
            let define = format!("-DCM_DYNAMIC_SMEM_BYTES={}", v.dynamic_shared_bytes());
            assert!(v.defines().contains(&define), "{}", v.name());
        }
    }

    #[test]
    fn variants_are_distinct_and_sources_resolve() {
        for (i, v) in VARIANTS.iter().enumerate() {
            let same: Vec<usize> =
                find_variants(v.kernel, v.dtype, v.head_dim, v.head_dim_v, v.score).collect();
            assert!(same.contains(&i), "{}", v.name());
            // Variants of the same kernel, dtype, dims and terms differ in their tile.
            let tiles: std::collections::HashSet<_> =
                same.iter().map(|&j| VARIANTS[j].tile()).collect();
            assert_eq!(tiles.len(), same.len(), "{}", v.name());
            assert!(
                v.defines().contains(&format!("-DCM_BLOCK_M={}", v.block_m))
                    && v.defines().contains(&format!("-DCM_STAGES={}", v.stages)),
                "{}",
                v.name()
            );
            assert!(!v.score || v.kernel.has_score_variant(), "{}", v.name());
            assert!(source(v.source_file()).is_some(), "{}", v.name());
        }
        let keys: std::collections::HashSet<_> = VARIANTS
            .iter()
            .map(|v| cache_key(v, "nvrtc 13.0"))
            .collect();
        assert_eq!(keys.len(), VARIANTS.len());
        let names: std::collections::HashSet<_> = VARIANTS.iter().map(Variant::name).collect();
        assert_eq!(names.len(), VARIANTS.len());
        assert_eq!(FWD_WS_TILES, [(128, 128), (192, 128)]);
        let deep: Vec<String> = VARIANTS
            .iter()
            .filter(|v| v.tile() == FWD_WS_TILES[1])
            .map(Variant::name)
            .collect();
        assert_eq!(deep, ["fwd_ws_bf16_d64_m192", "fwd_ws_fp16_d64_m192"]);
        assert_ne!(
            cache_key(&VARIANTS[0], "nvrtc 13.0"),
            cache_key(&VARIANTS[0], "nvrtc 13.1")
        );
    }

    /// The wide shapes are built for fwd_ws and the backward's kernels, the backward without
    /// score terms; fwd_ws's key step keeps two stages of K and V beside Q inside one SM's
    /// shared memory, bwd_dkdv runs a CTA per 64-key half, and the kernels learn both through
    /// their defines.
    #[test]
    fn wide_shapes_are_built_forward_and_backward_and_fit() {
        const WIDE_KINDS: [KernelKind; 5] = [
            KernelKind::FwdWs,
            KernelKind::BwdPre,
            KernelKind::BwdDkDv,
            KernelKind::BwdDq,
            KernelKind::BwdPost,
        ];
        let wide: Vec<&Variant> = VARIANTS
            .iter()
            .filter(|v| v.head_dim > 128 || v.head_dim_v != v.head_dim)
            .collect();
        assert_eq!(
            wide.len(),
            2 * (WIDE_KINDS.len() * WIDE_SHAPES.len() + WIDE_SCORE_SHAPES.len())
        );
        for v in &wide {
            assert!(WIDE_KINDS.contains(&v.kernel), "{}", v.name());
            assert!(!v.score || v.kernel == KernelKind::FwdWs, "{}", v.name());
            assert!(WIDE_SHAPES.contains(&(v.head_dim, v.head_dim_v)));
            if v.kernel == KernelKind::FwdWs {
                let step = if v.head_dim > 192 { 64 } else { 128 };
                assert_eq!(v.key_step(), step, "{}", v.name());
                assert!(v.defines().contains(&format!("-DCM_WS_KEY_STEP={step}")));
            }
            if v.kernel == KernelKind::BwdDkDv {
                assert_eq!(v.key_step(), 64, "{}", v.name());
                assert_eq!(v.source_file(), "bwd_dkdv_wide.cu");
            }
            assert!(
                v.dynamic_shared_bytes() + 1024 <= 227 * 1024,
                "{}",
                v.name()
            );
        }
        assert_eq!(
            built_head_dims(KernelKind::FwdWs, DType::Bf16, false),
            vec![(64, 64), (128, 128), (192, 128), (256, 256)]
        );
        assert_eq!(
            head_dims_text(&built_head_dims(KernelKind::FwdWs, DType::F16, false)),
            "64, 128, 192 (head_dim_v 128), 256"
        );
        assert_eq!(
            built_head_dims(KernelKind::FwdWs, DType::F16, true),
            vec![(64, 64), (128, 128), (192, 128)]
        );
        for kind in [KernelKind::BwdPre, KernelKind::BwdDkDv, KernelKind::BwdDq] {
            assert_eq!(
                built_head_dims(kind, DType::Bf16, false),
                vec![(64, 64), (128, 128), (192, 128), (256, 256)]
            );
        }
        assert_eq!(
            built_head_dims(KernelKind::BwdDkDv, DType::F16, true),
            vec![(64, 64), (128, 128)]
        );
        let square_dkdv = VARIANTS
            .iter()
            .find(|v| v.kernel == KernelKind::BwdDkDv && v.head_dim == 128)
            .unwrap();
        assert_eq!(square_dkdv.key_step(), 128);
        assert_eq!(square_dkdv.source_file(), "bwd_dkdv.cu");
        let mla = VARIANTS
            .iter()
            .find(|v| v.head_dim_v == 128 && v.head_dim == 192);
        assert_eq!(mla.unwrap().name(), "fwd_ws_bf16_d192v128");
    }
}
