//! Tensors: a flat, typed buffer in host memory (8-byte aligned) or in
//! device memory.
//!
//! A [`Tensor`] owns its memory. Collectives take tensors by value and hand
//! them back in their completion, so no buffer is ever shared between the user
//! and an operation in flight (dropping a [`Work`](crate::Work) cannot leave a
//! dangling buffer behind).
//!
//! Host tensors of 2 MiB and up live in an anonymous mapping of their own,
//! on transparent huge pages where the kernel allows (`mapped`: the first
//! touch of each 2 MiB costs one page fault, not 512); smaller ones come
//! from the global allocator.
//!
//! A tensor can also borrow memory that something else allocated — a NumPy
//! array, a pinned buffer, a memory-mapped file — through
//! [`Tensor::from_external`]. It then holds a keep-alive *owner* next to the
//! pointer, and drops the owner (only) when the tensor itself is dropped, so
//! the memory outlives every operation that uses it, even one that is still
//! running after its [`Work`](crate::Work) was dropped or timed out. An op that
//! works in place (e.g. `all_reduce`) writes straight into that memory: no copy
//! in, no copy out.
//!
//! A tensor can also live in *device* memory (a CUDA/ROCm GPU): allocated by
//! a communicator ([`Comm::device_zeros`](crate::Comm::device_zeros),
//! [`Comm::to_device`](crate::Comm::to_device)), or adopted from a raw device
//! pointer that another library allocated (a cudarc `CudaSlice`, a PyTorch
//! tensor) with [`Tensor::from_device_ptr`]. The `nccl` and `rccl` backends
//! run every op on such tensors without staging through the host. The host
//! never reads device memory through a tensor: on a device tensor the host
//! views ([`Tensor::as_slice`], [`Tensor::as_bytes`], ...) panic with a
//! message saying so, their `try_` forms return `None`, and
//! [`Comm::to_host`](crate::Comm::to_host) copies the data out.
//!
//! # Invariants
//! - T-1: storage is aligned to 8 bytes, so it can be viewed as a slice of any
//!   supported element type.
//! - T-2: `len_bytes() == len() * dtype().size()` always.
//! - T-3: every allocation whose size can come from a user or a peer
//!   ([`Tensor::try_zeros`], [`Tensor::split`], [`Tensor::concat`]) is
//!   fallible: it gives `None` when memory runs out, never an abort.
//! - T-4: an external tensor's owner is dropped exactly once, after the last
//!   access to its memory through the tensor (when the tensor is dropped);
//!   [`Clone`] of an external tensor is an owned copy, so the memory is never
//!   reachable through two tensors.
//! - T-5: no host access ever dereferences a device tensor's pointer; every
//!   host view of a device tensor panics (plain form) or is `None` (`try_`
//!   form). Its owner is dropped once, with the tensor, or later if a
//!   backend still had an op on that memory in flight when the tensor was
//!   dropped (the backend holds the owner until the op is finished or its
//!   communicator aborted).

use std::fmt;

use half::{bf16, f16};

mod mapped;

/// The sum of element counts, or `None` if it overflows `usize` (counts
/// from users and peers are never trusted to add up safely).
pub(crate) fn checked_sum(counts: &[usize]) -> Option<usize> {
    counts.iter().try_fold(0usize, |a, &c| a.checked_add(c))
}

/// `n` zeroed words, or `None` if the allocator refuses (T-3).
///
/// `alloc_zeroed` rather than `try_reserve` + fill: large buffers come
/// straight from zero pages (calloc), so they are not touched twice.
fn try_zeroed_words(n: usize) -> Option<Vec<u64>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u64>(n).ok()?;
    // SAFETY: `layout` has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u64>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of
    // `[u64; n]`, so capacity `n` matches; zeroed memory is `n` valid u64s.
    Some(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// Element types supported by Chorus.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DType {
    /// IEEE 754 half precision.
    F16 = 0,
    /// bfloat16.
    BF16 = 1,
    /// 32-bit float.
    F32 = 2,
    /// 64-bit float.
    F64 = 3,
    /// Signed 8-bit integer.
    I8 = 4,
    /// Unsigned 8-bit integer.
    U8 = 5,
    /// Signed 32-bit integer.
    I32 = 6,
    /// Signed 64-bit integer.
    I64 = 7,
    /// Unsigned 32-bit integer.
    U32 = 8,
    /// Unsigned 64-bit integer.
    U64 = 9,
    /// Boolean, one byte per element ([`Bool`]): zero is false, anything
    /// else true. Reductions are logical (see [`ReduceOp`](crate::ReduceOp)).
    Bool = 10,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 11] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// The wire code of this dtype.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// Decode a wire code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// Lower-case name, as used by PyTorch (`float32`, `bfloat16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can be stored in a [`Tensor`].
///
/// Implemented for `f32`, `f64`, [`half::f16`], [`half::bf16`], `i8`, `u8`,
/// `i32`, `i64`, `u32`, `u64` and [`Bool`]. Sealed: the set matches [`DType`].
pub trait Element: bytemuck::Pod + PartialEq + fmt::Debug + Send + Sync + sealed::Sealed {
    /// The dtype tag of this type.
    const DTYPE: DType;
    /// Convert from `f64` (saturating/rounding as `as` does). Used by tests and
    /// by `PremulSum` scalars.
    fn from_f64(v: f64) -> Self;
    /// Convert to `f64`.
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(i8, DType::I8);
element!(u8, DType::U8);
element!(i32, DType::I32);
element!(i64, DType::I64);
element!(u32, DType::U32);
element!(u64, DType::U64);

/// A boolean element of a [`DType::Bool`] tensor: one byte, zero is false
/// and any other value true (what PyTorch and NumPy store for `bool`).
/// `Rust`'s `bool` cannot be viewed from arbitrary bytes, so tensors hold
/// this instead; [`Tensor::from_bools`] and [`Tensor::to_bools`] convert.
/// Equality and hashing compare truth values, so `Bool(2) == Bool::TRUE`.
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct Bool(pub u8);

impl PartialEq for Bool {
    fn eq(&self, other: &Bool) -> bool {
        self.get() == other.get()
    }
}

impl Eq for Bool {}

impl std::hash::Hash for Bool {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.get().hash(h);
    }
}

impl Bool {
    /// `true`.
    pub const TRUE: Bool = Bool(1);
    /// `false`.
    pub const FALSE: Bool = Bool(0);

    /// Whether this element is true (non-zero).
    pub const fn get(self) -> bool {
        self.0 != 0
    }
}

impl From<bool> for Bool {
    fn from(b: bool) -> Bool {
        Bool(u8::from(b))
    }
}

impl From<Bool> for bool {
    fn from(b: Bool) -> bool {
        b.get()
    }
}

impl fmt::Debug for Bool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.get(), f)
    }
}

impl sealed::Sealed for Bool {}
impl Element for Bool {
    const DTYPE: DType = DType::Bool;
    fn from_f64(v: f64) -> Self {
        Bool::from(v != 0.0)
    }
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self.get()))
    }
}

impl sealed::Sealed for f16 {}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}
impl sealed::Sealed for bf16 {}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

/// A flat host buffer of `len()` elements of one [`DType`].
///
/// ```
/// use chorus::{DType, Tensor};
/// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0]);
/// assert_eq!(t.dtype(), DType::F32);
/// assert_eq!(t.len(), 3);
/// assert_eq!(t.as_slice::<f32>(), &[1.0, 2.0, 3.0]);
/// ```
pub struct Tensor {
    dtype: DType,
    len: usize,
    storage: Storage,
}

/// Where a tensor's bytes live.
enum Storage {
    /// T-1: u64 words keep every view aligned.
    Owned(Vec<u64>),
    /// A large buffer in a mapping of its own, on huge pages where the
    /// kernel allows (`mapped`); page-aligned (T-1).
    Mapped(mapped::Mapped),
    /// Memory owned by someone else, kept alive by `owner` (T-4).
    External(External),
    /// Device memory, never dereferenced on the host (T-5).
    Device(DeviceMem),
}

/// What keeps a device tensor's memory alive: dropped after the last use
/// of the memory (T-5). Shared (`Arc`) so that a backend can hold it while
/// an op on the memory is still running on the device.
pub(crate) type KeepAlive = std::sync::Arc<dyn std::any::Any + Send + Sync>;

/// A device allocation (or a part of one) plus its keep-alive.
struct DeviceMem {
    /// Device address; an integer because the host never dereferences it.
    addr: usize,
    device: crate::Device,
    owner: KeepAlive,
}

/// Borrowed memory plus the object that keeps it alive.
struct External {
    /// 8-byte aligned (T-1), valid for reads and writes of `len_bytes` bytes
    /// while `owner` lives (the contract of [`Tensor::from_external`]).
    ptr: std::ptr::NonNull<u8>,
    len_bytes: usize,
    /// Dropped with the tensor, after the last access through `ptr` (T-4).
    _owner: Box<dyn std::any::Any + Send + Sync>,
}

// SAFETY: `from_external`'s contract gives the tensor exclusive access to
// the memory for as long as the owner lives, and the owner is `Send + Sync`;
// so moving the tensor to another thread moves that exclusive access with it,
// and `&Tensor` hands out only shared `&[u8]` views, as for `Vec<u64>`.
unsafe impl Send for External {}
// SAFETY: see `Send` above: shared access gives only `&[u8]`.
unsafe impl Sync for External {}

/// Why [`Tensor::from_external`] refused a buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExternalError {
    /// The pointer is null.
    #[error("the buffer pointer is null")]
    Null,
    /// The pointer is not 8-byte aligned (every tensor is, T-1); copy the data
    /// into a [`Tensor::from_bytes`] tensor instead.
    #[error("the buffer at {addr:#x} is not 8-byte aligned")]
    Misaligned {
        /// The address.
        addr: usize,
    },
    /// A device tensor was asked for on [`Device::Cpu`](crate::Device::Cpu)
    /// ([`Tensor::from_device_ptr`] is for GPU memory only).
    #[error("{device} is not a GPU device")]
    NotADevice {
        /// The device given.
        device: crate::Device,
    },
    /// `len * dtype.size()` overflows or exceeds `isize::MAX`.
    #[error("{len} elements of {dtype} do not fit in the address space")]
    TooLarge {
        /// Element count.
        len: usize,
        /// Element type.
        dtype: DType,
    },
}

impl Clone for Tensor {
    /// An owned copy (also of an external tensor, T-4).
    ///
    /// # Panics
    /// On a device tensor (copying device memory needs the device's
    /// runtime); use [`Tensor::try_clone`], or copy through a communicator
    /// ([`Comm::to_host`](crate::Comm::to_host)).
    fn clone(&self) -> Tensor {
        match self.try_clone() {
            Some(t) => t,
            None => panic!("{}", self.device_misuse("cloned")),
        }
    }
}

impl Tensor {
    /// An owned host copy, or `None` for a device tensor (T-5).
    pub fn try_clone(&self) -> Option<Tensor> {
        Some(match &self.storage {
            Storage::Owned(words) => Tensor {
                dtype: self.dtype,
                len: self.len,
                storage: Storage::Owned(words.clone()),
            },
            Storage::External(_) | Storage::Mapped(_) => {
                let mut t = Tensor::try_zeros(self.dtype, self.len)?;
                t.as_bytes_mut().copy_from_slice(self.as_bytes());
                t
            }
            Storage::Device(_) => return None,
        })
    }

    /// The panic message of a host access to a device tensor (T-5).
    fn device_misuse(&self, what: &str) -> String {
        format!(
            "a tensor of {} x {} on {} cannot be {what} on the host; copy it with \
             Comm::to_host first",
            self.len,
            self.dtype,
            self.device()
        )
    }
}

impl PartialEq for Tensor {
    /// Same dtype, length and bytes, wherever they are stored. A device
    /// tensor is never read on the host (T-5): it equals only a tensor
    /// over the same device memory (same device, address, dtype, length).
    fn eq(&self, other: &Tensor) -> bool {
        if self.dtype != other.dtype || self.len != other.len {
            return false;
        }
        match (&self.storage, &other.storage) {
            (Storage::Device(a), Storage::Device(b)) => a.addr == b.addr && a.device == b.device,
            (Storage::Device(_), _) | (_, Storage::Device(_)) => false,
            _ => self.as_bytes() == other.as_bytes(),
        }
    }
}

impl Tensor {
    /// A tensor of `len` zeroed elements.
    ///
    /// # Panics
    /// If `len` elements of `dtype` do not fit in memory's address range; use
    /// [`Tensor::try_zeros`] for sizes that come from untrusted input.
    pub fn zeros(dtype: DType, len: usize) -> Tensor {
        match Tensor::try_zeros(dtype, len) {
            Some(t) => t,
            None => panic!("a tensor of {len} x {dtype} does not fit in memory"),
        }
    }

    /// A tensor of `len` zeroed elements, or `None` if its size in bytes
    /// overflows `isize::MAX` or the allocator cannot provide it (T-3: the
    /// process is never aborted for a size that came from a user or a peer).
    pub fn try_zeros(dtype: DType, len: usize) -> Option<Tensor> {
        let bytes = len
            .checked_mul(dtype.size())
            .filter(|&b| b <= isize::MAX as usize)?;
        // Large buffers in a mapping of their own (huge pages), else, or
        // where that fails, from the global allocator.
        let storage = (bytes >= mapped::HUGE_MIN && mapped::enabled())
            .then(|| mapped::Mapped::zeroed(bytes))
            .flatten()
            .map(Storage::Mapped);
        let storage = match storage {
            Some(s) => s,
            None => Storage::Owned(try_zeroed_words(bytes.div_ceil(8))?),
        };
        Some(Tensor {
            dtype,
            len,
            storage,
        })
    }

    /// A tensor over `len` elements of `dtype` at `ptr`, memory that someone
    /// else allocated (T-4). `owner` is whatever keeps that memory alive (an
    /// `Arc` of the allocation, a handle on a NumPy array's buffer, ...); it
    /// is dropped when the tensor is, and never earlier, so the memory stays
    /// valid while any op that holds the tensor runs, even one whose
    /// [`Work`](crate::Work) was dropped or timed out.
    ///
    /// Ops that work in place (`all_reduce`, `broadcast`, `recv`, the outputs
    /// of `all_gather_into` and `reduce_scatter_into`, ...) write straight into
    /// this memory, and the tensor they hand back still points at it
    /// ([`Tensor::as_ptr`] tells). [`Clone`] gives an owned copy.
    ///
    /// A zero-length tensor never touches `ptr` (any non-null, aligned value
    /// works, e.g. `NonNull::<u64>::dangling()`).
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use chorus::{DType, Tensor};
    ///
    /// // Memory owned elsewhere: u64 words (8-byte aligned) behind an Arc.
    /// let words = Arc::new(Mutex::new(vec![0u64; 2].into_boxed_slice()));
    /// let ptr = words.lock().unwrap().as_mut_ptr().cast::<u8>();
    /// // SAFETY: 16 initialized bytes at `ptr`, kept alive by the Arc clone
    /// // handed over as the owner; nothing else touches them until `t` drops.
    /// let mut t = unsafe { Tensor::from_external(DType::U64, ptr, 2, Box::new(words.clone())) }?;
    /// assert!(t.is_external());
    /// t.as_mut_slice::<u64>().copy_from_slice(&[7, 9]);
    /// drop(t);
    /// assert_eq!(&words.lock().unwrap()[..], &[7, 9]);
    /// # Ok::<(), chorus::tensor::ExternalError>(())
    /// ```
    ///
    /// # Errors
    /// [`ExternalError`] for a null or not 8-byte aligned `ptr`, or a size
    /// that overflows; nothing is dereferenced before these checks.
    ///
    /// # Safety
    /// Until `owner` is dropped (which happens when the returned tensor, and
    /// everything it is moved into, is dropped):
    /// - `ptr` must be valid for reads and writes of `len * dtype.size()`
    ///   bytes, and those bytes must be initialized;
    /// - nothing else may read or write that memory (the tensor has exclusive
    ///   access, like a `&mut [u8]`), and it must not be freed or moved;
    /// - `owner` may be dropped on any thread.
    pub unsafe fn from_external(
        dtype: DType,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Tensor, ExternalError> {
        let ptr = std::ptr::NonNull::new(ptr).ok_or(ExternalError::Null)?;
        if ptr.as_ptr() as usize % 8 != 0 {
            return Err(ExternalError::Misaligned {
                addr: ptr.as_ptr() as usize,
            });
        }
        let len_bytes = len
            .checked_mul(dtype.size())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(ExternalError::TooLarge { len, dtype })?;
        Ok(Tensor {
            dtype,
            len,
            storage: Storage::External(External {
                ptr,
                len_bytes,
                _owner: owner,
            }),
        })
    }

    /// Whether this tensor borrows external memory ([`Tensor::from_external`]).
    pub fn is_external(&self) -> bool {
        matches!(self.storage, Storage::External(_))
    }

    /// A tensor over `len` elements of `dtype` at device address `ptr` on
    /// `device` (a GPU), memory that someone else allocated: a cudarc
    /// `CudaSlice`, a PyTorch tensor's `data_ptr()`, a `cudaMalloc`. Like
    /// [`Tensor::from_external`], `keep_alive` is whatever keeps that
    /// memory allocated; it is dropped when the tensor is, or, if the
    /// tensor is dropped while an op still uses the memory on the device,
    /// when that op finished or its communicator was aborted (T-5).
    ///
    /// The host never reads or writes the memory through the tensor: its
    /// host views panic (or are `None` in their `try_` forms). Ops of the
    /// `nccl` and `rccl` backends use it in place, with no host staging.
    ///
    /// ```no_run
    /// use chorus::{DType, Device, Tensor};
    /// # fn device_alloc() -> (*mut u8, Box<dyn std::any::Any + Send + Sync>) { unimplemented!() }
    /// // E.g. from cudarc: `let p = *slice.device_ptr() as *mut u8;` and the
    /// // slice itself as the keep-alive.
    /// let (ptr, owner) = device_alloc();
    /// // SAFETY: `ptr` is 1024 f32s on GPU 0, kept allocated by `owner`.
    /// let t = unsafe { Tensor::from_device_ptr(ptr, DType::F32, 1024, Device::Cuda(0), owner) }?;
    /// assert!(t.is_device());
    /// # Ok::<(), chorus::tensor::ExternalError>(())
    /// ```
    ///
    /// # Errors
    /// [`ExternalError`] for a null pointer, one not aligned to the element
    /// size, a size that overflows, or [`Device::Cpu`](crate::Device::Cpu).
    ///
    /// # Safety
    /// Until `keep_alive` is dropped:
    /// - `ptr` must be a device address on `device`, valid for
    ///   `len * dtype.size()` bytes (for reads and writes);
    /// - nothing else may access that memory while an op that holds the
    ///   tensor runs (work the caller queued on its own streams must have
    ///   finished before the op is issued, or be ordered before it through
    ///   the op's stream);
    /// - `keep_alive` may be dropped on any thread.
    pub unsafe fn from_device_ptr(
        ptr: *mut u8,
        dtype: DType,
        len: usize,
        device: crate::Device,
        keep_alive: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Tensor, ExternalError> {
        Tensor::device_from_parts(
            ptr as usize,
            dtype,
            len,
            device,
            std::sync::Arc::from(keep_alive),
        )
    }

    /// A device tensor from its parts (the checks of [`Tensor::from_device_ptr`]).
    pub(crate) fn device_from_parts(
        addr: usize,
        dtype: DType,
        len: usize,
        device: crate::Device,
        owner: KeepAlive,
    ) -> Result<Tensor, ExternalError> {
        if addr == 0 {
            return Err(ExternalError::Null);
        }
        if addr % dtype.size() != 0 {
            return Err(ExternalError::Misaligned { addr });
        }
        if device == crate::Device::Cpu {
            return Err(ExternalError::NotADevice { device });
        }
        len.checked_mul(dtype.size())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(ExternalError::TooLarge { len, dtype })?;
        Ok(Tensor {
            dtype,
            len,
            storage: Storage::Device(DeviceMem {
                addr,
                device,
                owner,
            }),
        })
    }

    /// Whether this tensor lives in device memory (T-5).
    pub fn is_device(&self) -> bool {
        matches!(self.storage, Storage::Device(_))
    }

    /// Where the tensor's memory is: [`Device::Cpu`](crate::Device::Cpu)
    /// for host memory (owned or external), the GPU for a device tensor.
    pub fn device(&self) -> crate::Device {
        match &self.storage {
            Storage::Device(d) => d.device,
            _ => crate::Device::Cpu,
        }
    }

    /// The device address of a device tensor (never to be dereferenced on
    /// the host), `None` for a host tensor.
    pub fn device_ptr(&self) -> Option<*mut u8> {
        match &self.storage {
            Storage::Device(d) => Some(d.addr as *mut u8),
            _ => None,
        }
    }

    /// A device tensor's keep-alive, for a backend that must keep the
    /// memory allocated while an op on it runs (T-5).
    #[cfg_attr(not(any(feature = "nccl", feature = "rccl")), allow(dead_code))]
    pub(crate) fn device_keep_alive(&self) -> Option<KeepAlive> {
        match &self.storage {
            Storage::Device(d) => Some(d.owner.clone()),
            _ => None,
        }
    }

    /// A second tensor over the same device memory, sharing its keep-alive,
    /// for a copy out that runs on another thread; `None` for host tensors.
    /// Crate-internal: the alias is only read, and dropped after the copy.
    pub(crate) fn device_alias(&self) -> Option<Tensor> {
        match &self.storage {
            Storage::Device(d) => Some(Tensor {
                dtype: self.dtype,
                len: self.len,
                storage: Storage::Device(DeviceMem {
                    addr: d.addr,
                    device: d.device,
                    owner: d.owner.clone(),
                }),
            }),
            _ => None,
        }
    }

    /// Address of the first byte: for an external tensor, the pointer it
    /// was created with, so a caller can tell whether an op handed back the
    /// same memory (wrote in place) or a new buffer; for a device tensor,
    /// its device address (which the host must not dereference).
    pub fn as_ptr(&self) -> *const u8 {
        match &self.storage {
            Storage::Device(d) => d.addr as *const u8,
            _ => self.as_bytes().as_ptr(),
        }
    }

    /// A tensor filled with `value`.
    pub fn full<T: Element>(value: T, len: usize) -> Tensor {
        let mut t = Tensor::zeros(T::DTYPE, len);
        t.as_mut_slice::<T>().fill(value);
        t
    }

    /// A tensor copying the given elements.
    pub fn from_slice<T: Element>(data: &[T]) -> Tensor {
        let mut t = Tensor::zeros(T::DTYPE, data.len());
        t.as_mut_slice::<T>().copy_from_slice(data);
        t
    }

    /// A tensor from a vector (copied once into aligned storage).
    pub fn from_vec<T: Element>(data: Vec<T>) -> Tensor {
        Tensor::from_slice(&data)
    }

    /// A tensor of `dtype` from raw little-endian bytes.
    ///
    /// Returns `None` when `bytes.len()` is not a multiple of the element size.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Option<Tensor> {
        if bytes.len() % dtype.size() != 0 {
            return None;
        }
        let mut t = Tensor::zeros(dtype, bytes.len() / dtype.size());
        t.as_bytes_mut().copy_from_slice(bytes);
        Some(t)
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes (T-2).
    pub fn len_bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The raw bytes.
    ///
    /// # Panics
    /// On a device tensor (T-5); [`Tensor::try_as_bytes`] gives `None`.
    pub fn as_bytes(&self) -> &[u8] {
        match self.try_as_bytes() {
            Some(b) => b,
            None => panic!("{}", self.device_misuse("read")),
        }
    }

    /// The raw bytes, or `None` for a device tensor (T-5).
    pub fn try_as_bytes(&self) -> Option<&[u8]> {
        let n = self.len_bytes();
        Some(match &self.storage {
            Storage::Owned(words) => &bytemuck::cast_slice::<u64, u8>(words)[..n],
            Storage::Mapped(m) => &m.bytes()[..n],
            // SAFETY: `from_external`'s contract: `ptr` is valid for
            // `len_bytes` (== n, T-2) initialized bytes while the owner, a
            // field of this tensor, lives; `&self` rules out a `&mut` view.
            Storage::External(e) => unsafe {
                std::slice::from_raw_parts(e.ptr.as_ptr(), e.len_bytes)
            },
            Storage::Device(_) => return None,
        })
    }

    /// The raw bytes, mutably.
    ///
    /// # Panics
    /// On a device tensor (T-5); [`Tensor::try_as_bytes_mut`] gives `None`.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        if self.is_device() {
            panic!("{}", self.device_misuse("written"));
        }
        self.try_as_bytes_mut().unwrap_or_default()
    }

    /// The raw bytes mutably, or `None` for a device tensor (T-5).
    pub fn try_as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let n = self.len_bytes();
        Some(match &mut self.storage {
            Storage::Owned(words) => &mut bytemuck::cast_slice_mut::<u64, u8>(words)[..n],
            Storage::Mapped(m) => &mut m.bytes_mut()[..n],
            // SAFETY: as in `try_as_bytes`, plus exclusive access: the
            // contract forbids any other access to the memory, and
            // `&mut self` rules out another view through this tensor.
            Storage::External(e) => unsafe {
                std::slice::from_raw_parts_mut(e.ptr.as_ptr(), e.len_bytes)
            },
            Storage::Device(_) => return None,
        })
    }

    /// Typed view.
    ///
    /// # Panics
    /// If `T` is not this tensor's element type, or on a device tensor
    /// (T-5); use [`Tensor::try_as_slice`] to get an `Option` instead.
    pub fn as_slice<T: Element>(&self) -> &[T] {
        if self.is_device() {
            panic!("{}", self.device_misuse("read"));
        }
        match self.try_as_slice() {
            Some(s) => s,
            None => panic!("tensor holds {}, not {}", self.dtype, T::DTYPE),
        }
    }

    /// Typed view, or `None` on a dtype mismatch or a device tensor (T-5).
    pub fn try_as_slice<T: Element>(&self) -> Option<&[T]> {
        if T::DTYPE != self.dtype {
            return None;
        }
        self.try_as_bytes().map(bytemuck::cast_slice)
    }

    /// Typed mutable view.
    ///
    /// # Panics
    /// If `T` is not this tensor's element type, or on a device tensor (T-5).
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "tensor holds {}, not {}",
            self.dtype,
            T::DTYPE
        );
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }

    /// Copy the elements out into a `Vec`.
    ///
    /// # Panics
    /// If `T` is not this tensor's element type, or on a device tensor.
    pub fn to_vec<T: Element>(&self) -> Vec<T> {
        self.as_slice::<T>().to_vec()
    }

    /// A [`DType::Bool`] tensor holding `values`.
    ///
    /// ```
    /// let t = chorus::Tensor::from_bools(&[true, false]);
    /// assert_eq!(t.dtype(), chorus::DType::Bool);
    /// assert_eq!(t.to_bools(), vec![true, false]);
    /// ```
    pub fn from_bools(values: &[bool]) -> Tensor {
        Tensor::from_vec(values.iter().map(|&b| Bool::from(b)).collect())
    }

    /// The elements of a [`DType::Bool`] tensor as `bool`s.
    ///
    /// # Panics
    /// If this tensor's dtype is not [`DType::Bool`].
    pub fn to_bools(&self) -> Vec<bool> {
        self.as_slice::<Bool>().iter().map(|b| b.get()).collect()
    }

    /// Elements converted to `f64` (for checks and printing, any dtype).
    ///
    /// # Panics
    /// On a device tensor (T-5).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        fn conv<T: Element>(t: &Tensor) -> Vec<f64> {
            t.as_slice::<T>().iter().map(|v| v.to_f64()).collect()
        }
        match self.dtype {
            DType::F16 => conv::<f16>(self),
            DType::BF16 => conv::<bf16>(self),
            DType::F32 => conv::<f32>(self),
            DType::F64 => conv::<f64>(self),
            DType::I8 => conv::<i8>(self),
            DType::U8 => conv::<u8>(self),
            DType::I32 => conv::<i32>(self),
            DType::I64 => conv::<i64>(self),
            DType::U32 => conv::<u32>(self),
            DType::U64 => conv::<u64>(self),
            DType::Bool => conv::<Bool>(self),
        }
    }

    /// A tensor of `dtype` from `f64` values (converted as `as` does).
    pub fn from_f64s(dtype: DType, values: &[f64]) -> Tensor {
        fn conv<T: Element>(values: &[f64]) -> Tensor {
            Tensor::from_vec(values.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>())
        }
        match dtype {
            DType::F16 => conv::<f16>(values),
            DType::BF16 => conv::<bf16>(values),
            DType::F32 => conv::<f32>(values),
            DType::F64 => conv::<f64>(values),
            DType::I8 => conv::<i8>(values),
            DType::U8 => conv::<u8>(values),
            DType::I32 => conv::<i32>(values),
            DType::I64 => conv::<i64>(values),
            DType::U32 => conv::<u32>(values),
            DType::U64 => conv::<u64>(values),
            DType::Bool => conv::<Bool>(values),
        }
    }

    /// Split into consecutive tensors of the given element counts.
    ///
    /// Returns `None` if the counts do not add up to `len()`, or if memory
    /// for the parts runs out (T-3), or for a device tensor (T-5).
    pub fn split(&self, counts: &[usize]) -> Option<Vec<Tensor>> {
        if checked_sum(counts) != Some(self.len) || self.is_device() {
            return None;
        }
        let es = self.dtype.size();
        let bytes = self.as_bytes();
        let mut off = 0;
        let mut out = Vec::new();
        out.try_reserve_exact(counts.len()).ok()?;
        for &c in counts {
            let mut t = Tensor::try_zeros(self.dtype, c)?;
            t.as_bytes_mut()
                .copy_from_slice(&bytes[off * es..(off + c) * es]);
            out.push(t);
            off += c;
        }
        Some(out)
    }

    /// Concatenate host tensors of one dtype. Returns `None` on mixed
    /// dtypes, if memory for the result runs out (T-3), or if a part is a
    /// device tensor (T-5). An empty list gives an empty tensor of `dtype`.
    pub fn concat(dtype: DType, parts: &[Tensor]) -> Option<Tensor> {
        if parts.iter().any(|p| p.dtype != dtype || p.is_device()) {
            return None;
        }
        let lens: Vec<usize> = parts.iter().map(|p| p.len).collect();
        let mut out = Tensor::try_zeros(dtype, checked_sum(&lens)?)?;
        let mut off = 0;
        let bytes = out.as_bytes_mut();
        for p in parts {
            let b = p.as_bytes();
            bytes[off..off + b.len()].copy_from_slice(b);
            off += b.len();
        }
        Some(out)
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Storage::Device(d) = &self.storage {
            // T-5: never read on the host.
            return f
                .debug_struct("Tensor")
                .field("dtype", &self.dtype)
                .field("len", &self.len)
                .field("device", &d.device)
                .field("addr", &format_args!("{:#x}", d.addr))
                .finish();
        }
        let vals = self.to_f64_vec();
        let shown: Vec<f64> = vals.iter().take(8).copied().collect();
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .field(
                "head",
                &format_args!("{:?}{}", shown, if vals.len() > 8 { "…" } else { "" }),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor of 2 MiB or more lives in a mapping of its own (huge pages
    /// where allowed): zeroed, aligned, and read, written, cloned and
    /// compared like any other.
    #[test]
    fn large_tensors_are_mapped_and_behave_like_small_ones() {
        let n = (mapped::HUGE_MIN / 4) + 3;
        let mut t = Tensor::zeros(DType::F32, n);
        if mapped::enabled() {
            assert!(matches!(t.storage, Storage::Mapped(_)));
        }
        assert_eq!(t.len_bytes(), 4 * n);
        assert!(t.as_slice::<f32>().iter().all(|x| *x == 0.0));
        assert_eq!(t.as_bytes().as_ptr() as usize % 8, 0);
        for (i, x) in t.as_mut_slice::<f32>().iter_mut().enumerate() {
            *x = i as f32;
        }
        let c = t.clone();
        assert!(c == t);
        assert_eq!(c.as_slice::<f32>()[n - 1], (n - 1) as f32);
        let small = Tensor::zeros(DType::F32, 16);
        assert!(matches!(small.storage, Storage::Owned(_)));
    }

    #[test]
    fn bools_compare_by_truth_and_convert() {
        assert_eq!(Bool(2), Bool::TRUE);
        assert_ne!(Bool(0), Bool::TRUE);
        let t = Tensor::from_vec(vec![Bool(7), Bool(0)]);
        assert_eq!(t.to_bools(), vec![true, false]);
        assert_eq!(Tensor::from_bools(&[false, true]).as_bytes(), &[0, 1]);
    }

    #[test]
    fn every_dtype_round_trips_through_f64() {
        for d in DType::ALL {
            let t = Tensor::from_f64s(d, &[1.0, 2.0, 3.0, 0.0]);
            assert_eq!(t.dtype(), d);
            assert_eq!(t.len_bytes(), 4 * d.size());
            // Booleans keep truth values only.
            let want = if d == DType::Bool {
                vec![1.0, 1.0, 1.0, 0.0]
            } else {
                vec![1.0, 2.0, 3.0, 0.0]
            };
            assert_eq!(t.to_f64_vec(), want);
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_code(200), None);
    }

    #[test]
    fn split_and_concat_are_inverse() {
        let t = Tensor::from_vec((0..10).collect::<Vec<i32>>());
        let parts = t.split(&[3, 0, 7]).unwrap();
        assert_eq!(parts[1].len(), 0);
        assert_eq!(Tensor::concat(DType::I32, &parts).unwrap(), t);
        assert!(t.split(&[3, 3]).is_none());
    }

    #[test]
    fn t3_a_tensor_larger_than_memory_is_none_not_an_abort() {
        // Fits isize::MAX, so only the allocator can refuse it.
        assert!(Tensor::try_zeros(DType::U8, isize::MAX as usize).is_none());
        assert!(Tensor::try_zeros(DType::F64, usize::MAX / 4).is_none());
        assert_eq!(Tensor::try_zeros(DType::U8, 0).map(|t| t.len()), Some(0));
    }

    /// Counts drops of the owner it is part of.
    struct DropCount(std::sync::Arc<std::sync::atomic::AtomicUsize>);
    impl Drop for DropCount {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// An external tensor over `words`, whose owner bumps `drops`.
    fn external_over(
        words: &mut [u64],
        dtype: DType,
        len: usize,
        drops: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) -> Tensor {
        assert!(len * dtype.size() <= words.len() * 8);
        // SAFETY: the test keeps `words` alive and untouched until the
        // tensor is dropped.
        unsafe {
            Tensor::from_external(
                dtype,
                words.as_mut_ptr().cast(),
                len,
                Box::new(DropCount(drops.clone())),
            )
        }
        .unwrap()
    }

    #[test]
    fn t4_external_tensor_writes_into_the_callers_memory_and_drops_its_owner_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let drops = std::sync::Arc::new(AtomicUsize::new(0));
        let mut words = vec![0u64; 2];
        let mut t = external_over(&mut words, DType::I32, 3, &drops);
        assert!(t.is_external());
        assert_eq!(t.len_bytes(), 12);
        t.as_mut_slice::<i32>().copy_from_slice(&[1, -2, 3]);
        assert_eq!(t.as_ptr(), words.as_ptr().cast());
        let moved = std::thread::spawn(move || t).join().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 0, "owner dropped early");
        drop(moved);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        let ints: &[i32] = bytemuck::cast_slice(&words);
        assert_eq!(&ints[..3], &[1, -2, 3]);
        assert_eq!(ints[3], 0, "bytes past the tensor are untouched");
    }

    #[test]
    fn t4_clone_of_an_external_tensor_is_an_owned_copy() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let drops = std::sync::Arc::new(AtomicUsize::new(0));
        let mut words = vec![5u64; 1];
        let t = external_over(&mut words, DType::U64, 1, &drops);
        let mut c = t.clone();
        assert!(!c.is_external());
        assert_eq!(c, t);
        c.as_mut_slice::<u64>()[0] = 6;
        assert_ne!(c, t);
        drop(t);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(words, vec![5]);
        assert_eq!(c.to_vec::<u64>(), vec![6]);
    }

    #[test]
    fn external_tensor_refuses_null_misaligned_and_oversized_buffers() {
        let mut words = [0u64; 2];
        let base = words.as_mut_ptr().cast::<u8>();
        let owner = || -> Box<dyn std::any::Any + Send + Sync> { Box::new(()) };
        // SAFETY (all three): each call fails its checks before any access.
        let null = unsafe { Tensor::from_external(DType::U8, std::ptr::null_mut(), 1, owner()) };
        assert_eq!(null.unwrap_err(), ExternalError::Null);
        let odd = unsafe { Tensor::from_external(DType::U8, base.wrapping_add(1), 1, owner()) };
        assert!(matches!(odd, Err(ExternalError::Misaligned { .. })));
        let huge = unsafe { Tensor::from_external(DType::F64, base, usize::MAX / 4, owner()) };
        assert!(matches!(huge, Err(ExternalError::TooLarge { .. })));
        // A zero-length tensor over a dangling pointer is fine and empty.
        // SAFETY: zero bytes are never accessed.
        let empty = unsafe {
            Tensor::from_external(
                DType::F32,
                std::ptr::NonNull::<u64>::dangling().as_ptr().cast(),
                0,
                owner(),
            )
        };
        assert!(empty.unwrap().as_bytes().is_empty());
    }

    /// T-5: a device tensor (here over an address no one dereferences) has
    /// no host view: the plain accessors panic, the `try_` forms are
    /// `None`, split/concat refuse it, and its owner drops once.
    #[test]
    fn t5_device_tensors_are_never_read_on_the_host() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let drops = std::sync::Arc::new(AtomicUsize::new(0));
        let owner: KeepAlive = std::sync::Arc::new(DropCount(drops.clone()));
        let mut t = Tensor::device_from_parts(0x1000, DType::F32, 4, crate::Device::Cuda(1), owner)
            .unwrap();
        assert!(t.is_device() && !t.is_external());
        assert_eq!(t.device(), crate::Device::Cuda(1));
        assert_eq!(t.device_ptr(), Some(0x1000 as *mut u8));
        assert_eq!(t.as_ptr() as usize, 0x1000);
        assert_eq!(t.len_bytes(), 16);
        assert!(t.try_as_bytes().is_none() && t.try_as_bytes_mut().is_none());
        assert!(t.try_as_slice::<f32>().is_none() && t.try_clone().is_none());
        assert!(t.split(&[4]).is_none());
        assert!(Tensor::concat(DType::F32, std::slice::from_ref(&t)).is_none());
        for f in [
            &(|t: &Tensor| assert!(!t.as_bytes().is_empty())) as &dyn Fn(&Tensor),
            &|t: &Tensor| assert!(!t.as_slice::<f32>().is_empty()),
            &|t: &Tensor| drop(t.clone()),
            &|t: &Tensor| drop(t.to_f64_vec()),
        ] {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&t)));
            let msg = r.expect_err("a host view of device memory must panic");
            let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(msg.contains("cuda:1") && msg.contains("to_host"), "{msg}");
        }
        assert!(format!("{t:?}").contains("0x1000"));
        // Equal only to a tensor over the same memory; never to host data.
        let alias = t.device_alias().unwrap();
        assert_eq!(alias, t);
        assert_ne!(Tensor::zeros(DType::F32, 4), t);
        drop(alias);
        drop(t);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // Checks before anything else.
        let own = || -> KeepAlive { std::sync::Arc::new(()) };
        let bad = [
            Tensor::device_from_parts(0, DType::U8, 1, crate::Device::Cuda(0), own()),
            Tensor::device_from_parts(0x1002, DType::F32, 1, crate::Device::Cuda(0), own()),
            Tensor::device_from_parts(0x1000, DType::F32, 1, crate::Device::Cpu, own()),
            Tensor::device_from_parts(
                0x1000,
                DType::F64,
                usize::MAX / 4,
                crate::Device::Cuda(0),
                own(),
            ),
        ];
        assert_eq!(bad[0].as_ref().unwrap_err(), &ExternalError::Null);
        assert!(matches!(bad[1], Err(ExternalError::Misaligned { .. })));
        assert!(matches!(bad[2], Err(ExternalError::NotADevice { .. })));
        assert!(matches!(bad[3], Err(ExternalError::TooLarge { .. })));
    }

    #[test]
    fn odd_sized_tensors_have_exact_byte_length() {
        let t = Tensor::zeros(DType::I8, 5);
        assert_eq!(t.as_bytes().len(), 5);
        assert!(Tensor::from_bytes(DType::F32, &[0u8; 7]).is_none());
    }
}
