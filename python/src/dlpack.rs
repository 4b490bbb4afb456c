//! DLPack import: any object with `__dlpack__` (and, optionally,
//! `__dlpack_device__`) as a byte buffer over the producer's memory.
//!
//! The protocol (DLPack's `dlpack.h` and the Python array API's
//! `__dlpack__`): the producer hands over a `PyCapsule` named `"dltensor"`
//! (a `DLManagedTensor`) or, when asked with `max_version=(1, 0)` and it
//! supports DLPack 1.x, `"dltensor_versioned"` (a `DLManagedTensorVersioned`,
//! which adds a version and read-only / copied flags). The consumer renames
//! the capsule `"used_dltensor"` / `"used_dltensor_versioned"` as it takes
//! ownership, so the capsule's own destructor no longer frees the tensor,
//! and then calls the tensor's `deleter` exactly once when done.
//!
//! Here ownership goes to a [`DlpackView`], a Python object with the buffer
//! protocol (a flat `'B'` buffer). The Python half wraps it in a
//! `memoryview`, and from there it is an ordinary buffer: the op's keep-alive
//! owner holds the export, the export holds the view, and the view's drop
//! (under the GIL, when Python frees it) calls the deleter. The deleter is
//! also what releases the producer's memory, so the memory lives exactly as
//! long as any op uses it.
//!
//! Accepted: device `kDLCPU`, one lane, the element types Chorus has
//! (float16/bfloat16/float32/float64, int8/int32/int64, uint8/uint32/uint64),
//! and C-contiguous layouts (null strides, or strides equal to the row-major
//! ones, ignoring dimensions of extent 1). Anything else is a `ValueError`
//! (device, layout) or `TypeError` (element type) that names what was found.

use std::ffi::{c_int, c_void, CStr};

use chorus::DType;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

// ------------------------------------------------------------------ ABI
// The structs of dlpack.h (DLPack 1.x), laid out as C lays them out.

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1 << 0;
const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 1 << 1;

const KDL_CPU: i32 = 1;
const KDL_INT: u8 = 0;
const KDL_UINT: u8 = 1;
const KDL_FLOAT: u8 = 2;
const KDL_BFLOAT: u8 = 4;
const KDL_BOOL: u8 = 6;

const LEGACY: &CStr = c"dltensor";
const LEGACY_USED: &CStr = c"used_dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const VERSIONED_USED: &CStr = c"used_dltensor_versioned";

/// DLPack's name for a device type, for error messages.
fn device_name(t: i32) -> String {
    let name = match t {
        1 => "kDLCPU",
        2 => "kDLCUDA",
        3 => "kDLCUDAHost",
        4 => "kDLOpenCL",
        7 => "kDLVulkan",
        8 => "kDLMetal",
        9 => "kDLVPI",
        10 => "kDLROCM",
        11 => "kDLROCMHost",
        12 => "kDLExtDev",
        13 => "kDLCUDAManaged",
        14 => "kDLOneAPI",
        15 => "kDLWebGPU",
        16 => "kDLHexagon",
        17 => "kDLMAIA",
        18 => "kDLTrn",
        _ => return format!("device type {t}"),
    };
    format!("{name} ({t})")
}

fn wrong_device(t: i32, id: i32) -> PyErr {
    PyValueError::new_err(format!(
        "the DLPack tensor is on {} device {id}; the chorus Python package moves host \
         memory only (kDLCPU); copy it to the CPU first",
        device_name(t)
    ))
}

/// The Chorus dtype of a DLPack element type.
fn dtype_of(t: DLDataType) -> PyResult<DType> {
    let d = match (t.code, t.bits, t.lanes) {
        (KDL_FLOAT, 16, 1) => Some(DType::F16),
        (KDL_BFLOAT, 16, 1) => Some(DType::BF16),
        (KDL_FLOAT, 32, 1) => Some(DType::F32),
        (KDL_FLOAT, 64, 1) => Some(DType::F64),
        (KDL_INT, 8, 1) => Some(DType::I8),
        (KDL_INT, 32, 1) => Some(DType::I32),
        (KDL_INT, 64, 1) => Some(DType::I64),
        (KDL_UINT, 8, 1) => Some(DType::U8),
        (KDL_UINT, 32, 1) => Some(DType::U32),
        (KDL_UINT, 64, 1) => Some(DType::U64),
        (KDL_BOOL, 8, 1) => Some(DType::Bool),
        _ => None,
    };
    d.ok_or_else(|| {
        let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        PyTypeError::new_err(format!(
            "unsupported DLPack element type (code {}, {} bits, {} lanes); Chorus supports {}",
            t.code,
            t.bits,
            t.lanes,
            names.join(", ")
        ))
    })
}

// ------------------------------------------------------------------ ownership

/// A managed tensor this module owns: its deleter runs once, on drop.
enum Managed {
    Legacy(*mut DLManagedTensor),
    Versioned(*mut DLManagedTensorVersioned),
}

// SAFETY: the pointer is only dereferenced at import (with the GIL held)
// and in `drop`, which Python runs under the GIL when it frees the
// `DlpackView`; no two threads use it at once.
unsafe impl Send for Managed {}
// SAFETY: as above; `&Managed` exposes nothing.
unsafe impl Sync for Managed {}

impl Managed {
    fn tensor(&self) -> &DLTensor {
        // SAFETY: the producer keeps the managed tensor valid until its
        // deleter runs, which only `drop` does.
        unsafe {
            match *self {
                Managed::Legacy(p) => &(*p).dl_tensor,
                Managed::Versioned(p) => &(*p).dl_tensor,
            }
        }
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        // SAFETY: DLPack's contract: the consumer calls the deleter (when
        // there is one) exactly once, with the pointer it was given.
        unsafe {
            match *self {
                Managed::Legacy(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
                Managed::Versioned(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
            }
        }
    }
}

/// The memory of an imported DLPack tensor, as a flat writable (unless
/// the producer marked it read-only or copied) byte buffer. Dropping it
/// calls the producer's deleter.
#[pyclass(frozen, module = "chorus._chorus")]
pub struct DlpackView {
    addr: usize,
    len_bytes: usize,
    readonly: bool,
    _managed: Managed,
}

#[pymethods]
impl DlpackView {
    /// # Safety
    /// Called by Python's buffer protocol with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        // SAFETY: `addr` is valid for `len_bytes` bytes while `slf` lives,
        // and FillInfo makes the view hold a reference to `slf`.
        let r = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                me.addr as *mut c_void,
                me.len_bytes as ffi::Py_ssize_t,
                c_int::from(me.readonly),
                flags,
            )
        };
        if r != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.len_bytes
    }
}

/// Take ownership of the tensor in `capsule` (renaming it), or say why not.
fn take(capsule: &Bound<'_, PyCapsule>) -> PyResult<Managed> {
    let p = capsule.as_ptr();
    // SAFETY: `p` is a live capsule; IsValid/GetPointer/SetName only read
    // and write its name and pointer; the names are 'static.
    unsafe {
        if ffi::PyCapsule_IsValid(p, VERSIONED.as_ptr()) == 1 {
            let m =
                ffi::PyCapsule_GetPointer(p, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            if m.is_null() || ffi::PyCapsule_SetName(p, VERSIONED_USED.as_ptr()) != 0 {
                return Err(PyErr::fetch(capsule.py()));
            }
            return Ok(Managed::Versioned(m));
        }
        if ffi::PyCapsule_IsValid(p, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(p, LEGACY.as_ptr()) as *mut DLManagedTensor;
            if m.is_null() || ffi::PyCapsule_SetName(p, LEGACY_USED.as_ptr()) != 0 {
                return Err(PyErr::fetch(capsule.py()));
            }
            return Ok(Managed::Legacy(m));
        }
    }
    Err(PyValueError::new_err(
        "__dlpack__ returned a capsule that is not an unused \"dltensor\" or \
         \"dltensor_versioned\" (was it consumed already?)",
    ))
}

/// The element count of a C-contiguous tensor, or why it is not one.
fn contiguous_count(t: &DLTensor) -> PyResult<usize> {
    let ndim = usize::try_from(t.ndim)
        .map_err(|_| PyValueError::new_err(format!("DLPack tensor with ndim {}", t.ndim)))?;
    if ndim > 0 && t.shape.is_null() {
        return Err(PyValueError::new_err("DLPack tensor with a null shape"));
    }
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: the producer gives `ndim` extents at `shape` (non-null,
        // checked), valid while the managed tensor lives.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let mut count: usize = 1;
    for &e in shape {
        let e = usize::try_from(e)
            .map_err(|_| PyValueError::new_err(format!("DLPack tensor with extent {e}")))?;
        count = count
            .checked_mul(e)
            .ok_or_else(|| PyValueError::new_err("DLPack tensor too large"))?;
    }
    if t.strides.is_null() || count == 0 {
        return Ok(count);
    }
    // SAFETY: as for `shape`.
    let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
    let mut want: i64 = 1;
    for (&e, &s) in shape.iter().zip(strides).rev() {
        if e != 1 && s != want {
            return Err(PyValueError::new_err(format!(
                "the DLPack tensor is not C-contiguous (shape {shape:?}, strides {strides:?} \
                 in elements); pass a contiguous copy (numpy.ascontiguousarray) and copy the \
                 result back for an in-place op"
            )));
        }
        want = want.saturating_mul(e);
    }
    Ok(count)
}

/// `_dlpack_view(obj)`: import `obj` through `__dlpack__`, as
/// `(DlpackView, dtype code)`; see the module docs.
#[pyfunction]
pub fn _dlpack_view(obj: &Bound<'_, PyAny>) -> PyResult<(DlpackView, u8)> {
    let py = obj.py();
    // Ask where the tensor lives before asking for it, so that a GPU
    // tensor is refused without the producer exporting anything.
    if obj.hasattr("__dlpack_device__")? {
        let (t, id): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        if t != KDL_CPU {
            return Err(wrong_device(t, id));
        }
    }
    // DLPack 1.x first; a producer from before `max_version` rejects the
    // keyword with a TypeError, and is asked again the old way.
    let kw = PyDict::new(py);
    kw.set_item("max_version", PyTuple::new(py, [1u32, 0u32])?)?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kw)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(e),
    };
    let capsule = capsule.cast_into::<PyCapsule>().map_err(|e| {
        PyTypeError::new_err(format!(
            "__dlpack__ returned {}, not a PyCapsule",
            e.into_inner().get_type()
        ))
    })?;
    // From here on the tensor is ours: every early return drops `managed`,
    // which calls the deleter.
    let managed = take(&capsule)?;
    let readonly = match &managed {
        Managed::Legacy(_) => false,
        Managed::Versioned(p) => {
            // SAFETY: a live DLManagedTensorVersioned; version and flags
            // sit before any field a new major version may move.
            let (major, minor, flags) =
                unsafe { ((**p).version.major, (**p).version.minor, (**p).flags) };
            if major != 1 {
                return Err(PyValueError::new_err(format!(
                    "the DLPack tensor has version {major}.{minor}; Chorus reads DLPack 1.x"
                )));
            }
            flags & (DLPACK_FLAG_BITMASK_READ_ONLY | DLPACK_FLAG_BITMASK_IS_COPIED) != 0
        }
    };
    let t = managed.tensor();
    if t.device.device_type != KDL_CPU {
        return Err(wrong_device(t.device.device_type, t.device.device_id));
    }
    let dtype = dtype_of(t.dtype)?;
    let count = contiguous_count(t)?;
    let len_bytes = count
        .checked_mul(dtype.size())
        .ok_or_else(|| PyValueError::new_err("DLPack tensor too large"))?;
    let addr = if len_bytes == 0 {
        // An empty tensor may have a null data pointer; any non-null
        // address serves, as no byte is read.
        std::ptr::NonNull::<u64>::dangling().as_ptr() as usize
    } else {
        if t.data.is_null() {
            return Err(PyValueError::new_err(
                "DLPack tensor with a null data pointer",
            ));
        }
        (t.data as usize)
            .checked_add(t.byte_offset as usize)
            .ok_or_else(|| PyValueError::new_err("DLPack tensor with an invalid byte_offset"))?
    };
    Ok((
        DlpackView {
            addr,
            len_bytes,
            readonly,
            _managed: managed,
        },
        dtype.code(),
    ))
}
