//! Conversions between Python values and the facade's types.

use std::collections::BTreeMap;
use std::sync::Arc;

use compilemask::Value;
use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyTuple};

/// Mask parameters from a dict of `name -> int | list[int] | tuple[int, ...]`.
pub fn params(dict: Option<&Bound<'_, PyDict>>) -> PyResult<BTreeMap<String, Value>> {
    let mut out = BTreeMap::new();
    let Some(dict) = dict else {
        return Ok(out);
    };
    for (key, value) in dict.iter() {
        let name: String = key
            .extract()
            .map_err(|_| PyTypeError::new_err("parameter names must be strings"))?;
        let v = param_value(&name, &value)?;
        out.insert(name, v);
    }
    Ok(out)
}

fn int(name: &str, v: &Bound<'_, PyAny>) -> PyResult<i64> {
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "parameter `{name}`: expected an int or a list of ints, got {}",
            type_name(v)
        )));
    }
    v.extract::<i64>().map_err(|_| {
        PyValueError::new_err(format!(
            "parameter `{name}`: {v} does not fit in a 64-bit signed integer"
        ))
    })
}

fn param_value(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Value> {
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let items: Vec<i64> = v
            .try_iter()?
            .map(|item| int(name, &item?))
            .collect::<PyResult<_>>()?;
        return Ok(Value::Array(Arc::from(items)));
    }
    Ok(Value::Int(int(name, v)?))
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// A flat vector from an object with the buffer protocol (a numpy array, `array.array`,
/// `memoryview`) of element type `T`, or from a list of numbers.
pub fn read_vec<T>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>>
where
    T: Element + Copy + for<'a, 'py> FromPyObject<'a, 'py>,
{
    if let Ok(buf) = PyBuffer::<T>::get(obj) {
        return buf.to_vec(obj.py());
    }
    obj.extract::<Vec<T>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a contiguous buffer of {} or a list of numbers, got {}",
            std::any::type_name::<T>(),
            type_name(obj)
        ))
    })
}

/// Three flat buffers of one element type (`q`, `k`, `v` of an attention call), each
/// named in its error.
pub fn read_three<T>(bufs: [(&Bound<'_, PyAny>, &str); 3]) -> PyResult<[Vec<T>; 3]>
where
    T: Element + Copy + for<'a, 'py> FromPyObject<'a, 'py>,
{
    let [(a, na), (b, nb), (c, nc)] = bufs;
    Ok([read_vec(a, na)?, read_vec(b, nb)?, read_vec(c, nc)?])
}

/// Plain numbers whose native-endian bytes cross to Python (`bytemuck::Pod`: reinterpreted
/// in place, no per-element work).
pub trait NeBytes: bytemuck::Pod {}

impl NeBytes for u32 {}
impl NeBytes for i32 {}
impl NeBytes for f32 {}
impl NeBytes for f64 {}

pub fn to_bytes<T: NeBytes>(values: &[T]) -> &[u8] {
    bytemuck::cast_slice(values)
}

pub fn py_bytes<'py, T: NeBytes>(py: Python<'py>, values: &[T]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, to_bytes(values))
}
