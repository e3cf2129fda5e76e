//! Python exceptions and the `Diagnostic` value they carry.
//!
//! `MaskSyntaxError` (syntax and checking errors) and `PlanError` (binding and planning
//! errors) both derive from `ValueError`. Their message is the rendered diagnostic; they
//! also carry `.diagnostics` (a list of [`Diagnostic`]), `.rendered`, and for plan errors
//! `.code`, `.hint`.

use compilemask::Code;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::IntoPyObjectExt;

create_exception!(
    compilemask,
    MaskSyntaxError,
    PyValueError,
    "A mask program failed to parse or check. The message is the rendered diagnostics; \
     `.diagnostics` lists them (code, message, line, column, severity, hint)."
);

create_exception!(
    compilemask,
    PlanError,
    PyValueError,
    "Planning failed: bad lengths or parameters, a failed `require`, an arithmetic error of \
     the mask, or an export over its limit. The message is the rendered diagnostic; \
     `.code`, `.hint` and `.diagnostics` give its parts."
);

/// One diagnostic: a stable code (`CM0104`, ...), a severity (`"error"` / `"warning"`),
/// the message, a short label for the span, an optional hint, and the span as 1-based
/// line / column (characters) plus 0-based byte offsets `start`, `end`.
#[pyclass(frozen, get_all, eq, module = "compilemask", name = "Diagnostic")]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub code: String,
    pub severity: String,
    pub message: String,
    pub label: String,
    pub hint: Option<String>,
    pub line: usize,
    pub column: usize,
    pub end_line: usize,
    pub end_column: usize,
    pub start: u32,
    pub end: u32,
}

impl Diagnostic {
    /// `lines`: the index of the diagnostic's source, built once for all its diagnostics
    /// (a position per diagnostic scanned from the start made thousands of them quadratic).
    pub fn new(d: &compilemask::Diagnostic, lines: &compilemask::LineIndex) -> Diagnostic {
        let (line, column) = lines.line_col(d.span.start);
        let (end_line, end_column) = lines.line_col(d.span.end);
        Diagnostic {
            code: d.code.to_string(),
            severity: match d.severity {
                compilemask::Severity::Error => "error",
                compilemask::Severity::Warning => "warning",
            }
            .to_string(),
            message: d.message.clone(),
            label: d.label.clone(),
            hint: d.hint.clone(),
            line,
            column,
            end_line,
            end_column,
            start: d.span.start,
            end: d.span.end,
        }
    }
}

#[pymethods]
impl Diagnostic {
    /// The fields as a dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("code", &self.code)?;
        d.set_item("severity", &self.severity)?;
        d.set_item("message", &self.message)?;
        d.set_item("label", &self.label)?;
        d.set_item("hint", &self.hint)?;
        d.set_item("line", self.line)?;
        d.set_item("column", self.column)?;
        d.set_item("end_line", self.end_line)?;
        d.set_item("end_column", self.end_column)?;
        d.set_item("start", self.start)?;
        d.set_item("end", self.end)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Diagnostic({} {} at {}:{}: {:?})",
            self.severity, self.code, self.line, self.column, self.message
        )
    }

    fn __str__(&self) -> String {
        let mut s = format!(
            "{}[{}] at {}:{}: {}",
            self.severity, self.code, self.line, self.column, self.message
        );
        if let Some(h) = &self.hint {
            s.push_str(&format!(" (hint: {h})"));
        }
        s
    }
}

/// Sets attributes on a freshly made exception; a failure to set one is not worth
/// masking the real error for, so it is ignored.
fn with_attrs(py: Python<'_>, err: PyErr, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    {
        let value = err.value(py);
        for (name, v) in attrs {
            let _ = value.setattr(*name, v.bind(py));
        }
    }
    err
}

/// `MaskSyntaxError` for a failed compile.
pub fn compile_error(py: Python<'_>, e: &compilemask::CompileError, source: &str) -> PyErr {
    let lines = compilemask::LineIndex::new(source);
    let diagnostics: Vec<Diagnostic> = e
        .diagnostics
        .iter()
        .map(|d| Diagnostic::new(d, &lines))
        .collect();
    let rendered = e.rendered.trim_end().to_string();
    let err = MaskSyntaxError::new_err(rendered.clone());
    let attrs = [
        ("diagnostics", into_py(py, diagnostics)),
        ("rendered", into_py(py, rendered)),
    ];
    with_attrs(py, err, &attrs)
}

/// `PlanError` for a failed plan, rendered by `compilemask::render_error` (against the
/// program's source when it has a span), as the CLI prints it.
pub fn plan_error(
    py: Python<'_>,
    program: Option<&compilemask::Program>,
    e: &compilemask::PlanError,
) -> PyErr {
    let (rendered, source) = match program {
        Some(p) => (p.render_error(e), p.source()),
        None => (compilemask::render_error("", "", e), ""),
    };
    let rendered = rendered.trim_end().to_string();
    let diagnostic = Diagnostic::new(&e.to_diagnostic(), &compilemask::LineIndex::new(source));
    let err = PlanError::new_err(rendered.clone());
    let attrs = [
        ("code", into_py(py, e.code.as_str())),
        ("hint", into_py(py, e.hint.clone())),
        ("diagnostics", into_py(py, vec![diagnostic])),
        ("rendered", into_py(py, rendered)),
    ];
    with_attrs(py, err, &attrs)
}

/// A `PlanError` with a code and no source span (argument checks done here).
pub fn plan_error_msg(py: Python<'_>, code: Code, message: String, hint: Option<String>) -> PyErr {
    let mut e = compilemask::PlanError::new(code, None, message);
    e.hint = hint;
    plan_error(py, None, &e)
}

/// `compilemask._native.plan_error(code, message, hint=None)`: the `PlanError` of the
/// package's own argument checks (in `python/compilemask`), made and rendered here so it
/// reads as every other. `ValueError` for a code that docs/language.md does not list.
#[pyfunction(name = "plan_error")]
#[pyo3(signature = (code, message, hint = None))]
pub fn py_plan_error(
    py: Python<'_>,
    code: &str,
    message: String,
    hint: Option<String>,
) -> PyResult<PyErr> {
    let code = Code::parse(code).ok_or_else(|| {
        PyValueError::new_err(format!(
            "`{code}` is not one of the diagnostic codes of docs/language.md"
        ))
    })?;
    Ok(plan_error_msg(py, code, message, hint))
}

fn into_py<'py, T: IntoPyObject<'py>>(py: Python<'py>, v: T) -> Py<PyAny> {
    v.into_py_any(py).unwrap_or_else(|_| py.None())
}
