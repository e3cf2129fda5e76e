//! The standard library: built-in masks written in the mask language, embedded in the
//! binary. Names and parameters of the workload masks follow docs/design.md and
//! docs/workloads.md.

mod trace;

use cm_ir::NamedArray;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

/// The standard library's named arrays, built-in names of every program compiled with it
/// (`compilemask::compile` passes them): `trace_context` and `trace_generated`, the
/// `ContextTokens` and `GeneratedTokens` columns of the bundled Azure LLM inference trace
/// 2023 (conversation service, in file order; see data/README.md).
pub const ARRAYS: &[NamedArray] = &[
    NamedArray {
        name: "trace_context",
        values: trace::context_tokens,
    },
    NamedArray {
        name: "trace_generated",
        values: trace::generated_tokens,
    },
];

/// Parses and checks `source` with the standard library's [`ARRAYS`] as built-in names
/// (`cm_ir::compile` with them).
pub fn compile(source: &str) -> (Option<cm_ir::Program>, Vec<cm_ir::Diagnostic>) {
    cm_ir::compile(source, ARRAYS)
}

/// One built-in mask: its name and source text.
#[derive(Clone, Copy, Debug)]
pub struct Builtin {
    pub name: &'static str,
    pub source: &'static str,
}

impl Builtin {
    /// A one-line description: the leading comment lines of the source joined into one
    /// line, cut at the end of the first sentence.
    pub fn summary(&self) -> &'static str {
        // Summaries are computed once per source and kept for the life of the program (the
        // sources are static too), so the signature can stay `&'static str`.
        static CACHE: OnceLock<Mutex<HashMap<&'static str, &'static str>>> = OnceLock::new();
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        cache
            .entry(self.source)
            .or_insert_with(|| Box::leak(first_sentence(self.source).into_boxed_str()))
    }
}

/// The leading `#` comment lines of `source` joined with spaces, up to and including the
/// first sentence's full stop: a `.` at the end of the comment, or followed by a space and
/// then a capital letter or a backtick (so `et al. 2024`, `docs/workloads.md` and `2.1` do
/// not end a sentence).
fn first_sentence(source: &str) -> String {
    let text = source
        .lines()
        .map(str::trim)
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.trim_start_matches('#').trim())
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let bytes = text.as_bytes();
    for (i, _) in text.match_indices('.') {
        let ends = match (bytes.get(i + 1), bytes.get(i + 2)) {
            (None, _) => true,
            (Some(b' '), Some(&c)) => c.is_ascii_uppercase() || c == b'`',
            _ => false,
        };
        let word = text[..i].rsplit(' ').next().unwrap_or("");
        let abbreviation = matches!(word, "al" | "e.g" | "i.e" | "etc" | "vs" | "cf" | "Fig");
        if ends && !abbreviation {
            return text[..=i].to_string();
        }
    }
    text
}

/// Every built-in, workloads first.
pub const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "causal",
        source: include_str!("../masks/causal.cmask"),
    },
    Builtin {
        name: "causal_bottom_right",
        source: include_str!("../masks/causal_bottom_right.cmask"),
    },
    Builtin {
        name: "hstu",
        source: include_str!("../masks/hstu.cmask"),
    },
    Builtin {
        name: "shared_prefix",
        source: include_str!("../masks/shared_prefix.cmask"),
    },
    Builtin {
        name: "clear",
        source: include_str!("../masks/clear.cmask"),
    },
    Builtin {
        name: "sliding_window",
        source: include_str!("../masks/sliding_window.cmask"),
    },
    Builtin {
        name: "document_causal",
        source: include_str!("../masks/document_causal.cmask"),
    },
    Builtin {
        name: "trace_documents",
        source: include_str!("../masks/trace_documents.cmask"),
    },
    Builtin {
        name: "trace_prompt_groups",
        source: include_str!("../masks/trace_prompt_groups.cmask"),
    },
    Builtin {
        name: "prefix_lm",
        source: include_str!("../masks/prefix_lm.cmask"),
    },
    Builtin {
        name: "chunked_causal",
        source: include_str!("../masks/chunked_causal.cmask"),
    },
    Builtin {
        name: "block_causal",
        source: include_str!("../masks/block_causal.cmask"),
    },
    Builtin {
        name: "sink_local",
        source: include_str!("../masks/sink_local.cmask"),
    },
    Builtin {
        name: "global_local",
        source: include_str!("../masks/global_local.cmask"),
    },
    Builtin {
        name: "dilated_window",
        source: include_str!("../masks/dilated_window.cmask"),
    },
    Builtin {
        name: "neighborhood_2d",
        source: include_str!("../masks/neighborhood_2d.cmask"),
    },
    Builtin {
        name: "neighborhood_3d",
        source: include_str!("../masks/neighborhood_3d.cmask"),
    },
    Builtin {
        name: "tree",
        source: include_str!("../masks/tree.cmask"),
    },
    Builtin {
        name: "tree_decode",
        source: include_str!("../masks/tree_decode.cmask"),
    },
    Builtin {
        name: "flashmask",
        source: include_str!("../masks/flashmask.cmask"),
    },
    Builtin {
        name: "causal_alibi",
        source: include_str!("../masks/causal_alibi.cmask"),
    },
    Builtin {
        name: "causal_softcap",
        source: include_str!("../masks/causal_softcap.cmask"),
    },
    Builtin {
        name: "t5_relative_bias",
        source: include_str!("../masks/t5_relative_bias.cmask"),
    },
    Builtin {
        name: "sliding_window_sinks",
        source: include_str!("../masks/sliding_window_sinks.cmask"),
    },
];

/// The built-in named `name`.
pub fn get(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_are_whole_first_sentences() {
        let s = |name: &str| get(name).unwrap().summary();
        assert_eq!(
            s("causal"),
            "Causal attention, top-left aligned: row q sees keys [0, q + 1)."
        );
        assert_eq!(
            s("clear"),
            "CLEAR local 2D attention for diffusion transformers (Liu et al. 2024), \
             docs/workloads.md W4: `text` tokens first, then a grid x grid image in raster order."
        );
        assert_eq!(
            s("causal_bottom_right"),
            "Causal attention aligned at the bottom-right corner (FlashAttention >= 2.1, \
             FlashInfer): row q sees keys [0, q + kv_len - q_len + 1); with q_len > kv_len the \
             top rows are empty."
        );
        assert!(
            s("tree").ends_with("sees its ancestors and itself."),
            "{}",
            s("tree")
        );
        for b in BUILTINS {
            let sum = b.summary();
            assert!(sum.ends_with('.'), "{}: {sum}", b.name);
            assert!(
                !sum.contains('#') && !sum.contains('\n'),
                "{}: {sum}",
                b.name
            );
            assert!(std::ptr::eq(sum, b.summary()), "computed once");
        }
    }

    #[test]
    fn first_sentence_edge_cases() {
        assert_eq!(
            first_sentence("# One line, no stop\nmask = k <= q;"),
            "One line, no stop"
        );
        assert_eq!(first_sentence("mask = k <= q;"), "");
        assert_eq!(
            first_sentence("# See e.g. Foo et al. Bar. Second.\n"),
            "See e.g. Foo et al. Bar."
        );
        assert_eq!(
            first_sentence("#   Split\n#   over lines. Next one.\n#\nparam x: int = 1;"),
            "Split over lines."
        );
    }
}
