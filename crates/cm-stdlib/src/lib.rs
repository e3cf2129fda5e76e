//! The standard library: built-in masks written in the mask language, embedded in the
//! binary. Names and parameters of the workload masks follow design.md and workloads.md.

/// One built-in mask: its name and source text.
#[derive(Clone, Copy, Debug)]
pub struct Builtin {
    pub name: &'static str,
    pub source: &'static str,
}

impl Builtin {
    /// The first comment line of the source, as a one-line description.
    pub fn summary(&self) -> &'static str {
        self.source
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches('#')
            .trim()
    }
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
];

/// The built-in named `name`.
pub fn get(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}
