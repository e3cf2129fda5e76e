//! The bundled Azure LLM inference trace 2023 (conversation service), CC-BY-4.0, from
//! Patel et al., "Splitwise", ISCA 2024 (see data/README.md). It gives the built-in arrays
//! `trace_context` (`ContextTokens`, file order) and `trace_generated` (`GeneratedTokens`).

use std::sync::{Arc, OnceLock};

const CONV_CSV: &str = include_str!("../../../data/azure-llm-trace-2023-conv.csv");

type Columns = (Arc<[i64]>, Arc<[i64]>);

/// `(ContextTokens, GeneratedTokens)` of every row of the conversation trace, parsed once.
pub fn conv_trace() -> (Arc<[i64]>, Arc<[i64]>) {
    static CELL: OnceLock<Columns> = OnceLock::new();
    let (c, g) = CELL.get_or_init(|| {
        let mut context = Vec::new();
        let mut generated = Vec::new();
        // The header row (after a UTF-8 byte-order mark) is the only non-numeric line.
        for line in CONV_CSV.lines() {
            let mut cols = line.trim().split(',');
            let (_, c, g) = (cols.next(), cols.next(), cols.next());
            if let (Some(Ok(c)), Some(Ok(g))) = (c.map(str::parse::<i64>), g.map(str::parse::<i64>))
            {
                context.push(c);
                generated.push(g);
            }
        }
        (context.into(), generated.into())
    });
    (c.clone(), g.clone())
}
