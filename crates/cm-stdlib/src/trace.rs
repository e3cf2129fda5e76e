//! The bundled Azure LLM inference trace 2023 (conversation service), CC-BY-4.0, from
//! Patel et al., "Splitwise", ISCA 2024 (see data/README.md): the data behind the built-in
//! arrays `trace_context` (`ContextTokens`, file order) and `trace_generated`
//! (`GeneratedTokens`), which the workload masks W7 and W8 (`trace_documents`,
//! `trace_prompt_groups`) read.

use std::sync::{Arc, OnceLock};

const CONV_CSV: &str = include_str!("../../../data/azure-llm-trace-2023-conv.csv");

type Columns = (Arc<[i64]>, Arc<[i64]>);

/// `(ContextTokens, GeneratedTokens)` of every row of the conversation trace, parsed once.
fn conv_trace() -> &'static Columns {
    static CELL: OnceLock<Columns> = OnceLock::new();
    CELL.get_or_init(|| {
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
    })
}

/// The `ContextTokens` column, in file order.
pub fn context_tokens() -> Arc<[i64]> {
    conv_trace().0.clone()
}

/// The `GeneratedTokens` column, in file order.
pub fn generated_tokens() -> Arc<[i64]> {
    conv_trace().1.clone()
}

#[cfg(test)]
mod tests {
    /// Every data row is read: the file's lines less the header, both columns of equal
    /// length, and the first and last rows as the file writes them.
    #[test]
    fn every_row_is_read() {
        let rows: Vec<&str> = super::CONV_CSV.lines().skip(1).collect();
        let (c, g) = (super::context_tokens(), super::generated_tokens());
        assert_eq!((c.len(), g.len()), (rows.len(), rows.len()));
        for (i, row) in [(0, rows[0]), (rows.len() - 1, rows[rows.len() - 1])] {
            let cols: Vec<i64> = row
                .trim()
                .split(',')
                .skip(1)
                .map(|x| x.parse().unwrap())
                .collect();
            assert_eq!((c[i], g[i]), (cols[0], cols[1]), "row {i}: {row}");
        }
    }
}
