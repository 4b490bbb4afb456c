//! Kernel tests: every dtype × operator against a scalar reference computed
//! in a wider type (`i128` for integers, `f64` for floats), on aligned and
//! deliberately misaligned byte slices ([RK-1], [RK-3]).
//!
//! [RK-1]: crate::kernels#invariants
//! [RK-3]: crate::kernels#invariants

use half::{bf16, f16};

use crate::tensor::Bool;
use proptest::prelude::*;

use super::*;

const COMBINING: [ReduceOp; 7] = [
    ReduceOp::Sum,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::BAnd,
    ReduceOp::BOr,
    ReduceOp::BXor,
];

/// A scalar reference, deliberately computed differently from the kernels.
trait Reference: Pod + std::fmt::Debug {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn scale(a: Self, s: f64) -> Self;
    fn divide(a: Self, n: usize) -> Self;
    /// Equality, with every NaN equal to every NaN.
    fn same(a: Self, b: Self) -> bool;
}

macro_rules! int_reference {
    ($($t:ty),*) => {$(
        impl Reference for $t {
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                let (x, y) = (a as i128, b as i128);
                let r = match op {
                    ReduceOp::Sum => x + y,
                    ReduceOp::Product => x.wrapping_mul(y),
                    ReduceOp::Min => if x <= y { x } else { y },
                    ReduceOp::Max => if x >= y { x } else { y },
                    ReduceOp::BAnd => x & y,
                    ReduceOp::BOr => x | y,
                    ReduceOp::BXor => x ^ y,
                    other => panic!("not a combining op: {other}"),
                };
                r as $t // truncation = two's complement wrap
            }
            fn scale(a: Self, s: f64) -> Self {
                ((a as i128).wrapping_mul((s as $t) as i128)) as $t
            }
            fn divide(a: Self, n: usize) -> Self {
                (a as i128 / n as i128) as $t
            }
            fn same(a: Self, b: Self) -> bool {
                a == b
            }
        }
    )*};
}
int_reference!(i8, u8, i32, i64, u32, u64);

/// Logical on truth values; results are exactly 0 or 1 (`same` compares
/// the raw byte, so a kernel writing another "true" byte fails).
impl Reference for Bool {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        let (x, y) = (a.get(), b.get());
        Bool::from(match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => x || y,
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => x && y,
            ReduceOp::BXor => x ^ y,
            other => panic!("not a combining op: {other}"),
        })
    }
    fn scale(a: Self, _s: f64) -> Self {
        a
    }
    fn divide(a: Self, _n: usize) -> Self {
        a
    }
    fn same(a: Self, b: Self) -> bool {
        a.0 == b.0
    }
}

fn f64_combine(op: ReduceOp, x: f64, y: f64) -> f64 {
    match op {
        ReduceOp::Sum => x + y,
        ReduceOp::Product => x * y,
        ReduceOp::Min => x.min(y),
        ReduceOp::Max => x.max(y),
        other => panic!("not a float combining op: {other}"),
    }
}

// f32: one operation in f64 then rounding to f32 equals the f32 operation
// (53 >= 2*24 + 2), so the reference is exact.
impl Reference for f32 {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        f64_combine(op, a as f64, b as f64) as f32
    }
    fn scale(a: Self, s: f64) -> Self {
        (a as f64 * (s as f32) as f64) as f32
    }
    fn divide(a: Self, n: usize) -> Self {
        (a as f64 / (n as f32) as f64) as f32
    }
    fn same(a: Self, b: Self) -> bool {
        a == b || (a.is_nan() && b.is_nan())
    }
}

impl Reference for f64 {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        f64_combine(op, a, b)
    }
    fn scale(a: Self, s: f64) -> Self {
        a * s
    }
    fn divide(a: Self, n: usize) -> Self {
        a / n as f64
    }
    fn same(a: Self, b: Self) -> bool {
        a == b || (a.is_nan() && b.is_nan())
    }
}

macro_rules! half_reference {
    ($($t:ty),*) => {$(
        impl Reference for $t {
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                <$t>::from_f64(f64_combine(op, a.to_f64(), b.to_f64()))
            }
            // scale/divide: the kernel rounds the f32 product, so does this.
            fn scale(a: Self, s: f64) -> Self {
                <$t>::from_f32(a.to_f32() * s as f32)
            }
            fn divide(a: Self, n: usize) -> Self {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
            fn same(a: Self, b: Self) -> bool {
                a == b || (a.is_nan() && b.is_nan())
            }
        }
    )*};
}
half_reference!(f16, bf16);

/// `len` bytes starting `offset` bytes into an 8-byte-aligned allocation.
fn buffer(bytes: &[u8], offset: usize) -> (Vec<u64>, std::ops::Range<usize>) {
    let storage = vec![0u64; (bytes.len() + offset).div_ceil(8) + 1];
    let mut storage = storage;
    let range = offset..offset + bytes.len();
    bytemuck::cast_slice_mut::<u64, u8>(&mut storage)[range.clone()].copy_from_slice(bytes);
    (storage, range)
}

fn elems<T: Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

fn check_reduce<T: Reference>(
    dtype: DType,
    op: ReduceOp,
    a: &[u8],
    b: &[u8],
    offs: (usize, usize),
) -> Result<(), TestCaseError> {
    let (mut da, ra) = buffer(a, offs.0);
    let (db, rb) = buffer(b, offs.1);
    let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut da)[ra];
    let src = &bytemuck::cast_slice::<u64, u8>(&db)[rb];
    let res = reduce_into(dtype, op, dst, src);
    if op.is_bitwise() && dtype.is_float() {
        prop_assert!(matches!(res, Err(Error::UnsupportedOp { .. })), "{res:?}");
        prop_assert_eq!(&*dst, a, "dst must be untouched on error");
        return Ok(());
    }
    prop_assert!(res.is_ok(), "{res:?}");
    let (xa, xb, got) = (elems::<T>(a), elems::<T>(b), elems::<T>(dst));
    for i in 0..xa.len() {
        let want = T::combine(op, xa[i], xb[i]);
        prop_assert!(
            T::same(got[i], want),
            "{dtype} {op} at {i}: {:?} (op) {:?} = {:?}, want {:?}",
            xa[i],
            xb[i],
            got[i],
            want
        );
    }
    Ok(())
}

fn check_scale_divide<T: Reference>(
    dtype: DType,
    a: &[u8],
    off: usize,
    s: f64,
    n: usize,
) -> Result<(), TestCaseError> {
    let xa = elems::<T>(a);
    let (mut da, ra) = buffer(a, off);
    let data = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut da)[ra.clone()];
    scale(dtype, data, s);
    let got = elems::<T>(data);
    for i in 0..xa.len() {
        let want = T::scale(xa[i], s);
        prop_assert!(
            T::same(got[i], want),
            "{dtype} scale {s} at {i}: {:?} -> {:?}, want {want:?}",
            xa[i],
            got[i]
        );
    }
    let (mut da, ra) = buffer(a, off);
    let data = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut da)[ra];
    divide(dtype, data, n);
    let got = elems::<T>(data);
    for i in 0..xa.len() {
        let want = T::divide(xa[i], n);
        prop_assert!(
            T::same(got[i], want),
            "{dtype} divide {n} at {i}: {:?} -> {:?}, want {want:?}",
            xa[i],
            got[i]
        );
    }
    Ok(())
}

macro_rules! with_type {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DType::F16 => $f::<f16>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::I8 => $f::<i8>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::U32 => $f::<u32>($($arg),*),
            DType::U64 => $f::<u64>($($arg),*),
            DType::Bool => $f::<Bool>($($arg),*),
        }
    };
}

/// Random raw bytes: every bit pattern, including NaN, infinities,
/// subnormals and signed zeros for the float types.
fn case() -> impl Strategy<Value = (DType, Vec<u8>, Vec<u8>, usize, usize)> {
    (
        0..DType::ALL.len(),
        prop_oneof![0usize..40, 500usize..1100],
        0usize..8,
        0usize..8,
    )
        .prop_flat_map(|(d, len, o1, o2)| {
            let dtype = DType::ALL[d];
            let n = len * dtype.size();
            (
                Just(dtype),
                proptest::collection::vec(any::<u8>(), n),
                proptest::collection::vec(any::<u8>(), n),
                Just(o1),
                Just(o2),
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn reduce_into_matches_scalar_reference_every_dtype_and_op_any_alignment(
        (dtype, a, b, o1, o2) in case()
    ) {
        for op in COMBINING {
            with_type!(dtype, check_reduce, dtype, op, &a, &b, (o1, o2))?;
        }
    }

    #[test]
    fn scale_and_divide_match_scalar_reference_every_dtype_any_alignment(
        (dtype, a, _b, o1, _o2) in case(),
        s in prop_oneof![-4.0f64..4.0, Just(0.0), Just(2.75), Just(-1.0)],
        n in prop_oneof![1usize..10, Just(200), Just(300), Just(1 << 40)],
    ) {
        with_type!(dtype, check_scale_divide, dtype, &a, o1, s, n)?;
    }
}

fn bytes_of<T: Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

#[test]
fn integer_sum_and_product_wrap_like_nccl() {
    let mut d = bytes_of(&[i8::MAX, 100, -128]);
    reduce_into(DType::I8, ReduceOp::Sum, &mut d, &bytes_of(&[1i8, 100, -1])).unwrap();
    assert_eq!(elems::<i8>(&d), vec![i8::MIN, -56, 127]);
    let mut d = bytes_of(&[u32::MAX, 1 << 31]);
    reduce_into(DType::U32, ReduceOp::Product, &mut d, &bytes_of(&[2u32, 2])).unwrap();
    assert_eq!(elems::<u32>(&d), vec![u32::MAX - 1, 0]);
}

#[test]
fn float_min_max_return_the_number_when_one_operand_is_nan() {
    let mut d = bytes_of(&[f32::NAN, 1.0, f32::NAN]);
    reduce_into(
        DType::F32,
        ReduceOp::Max,
        &mut d,
        &bytes_of(&[2.0f32, f32::NAN, f32::NAN]),
    )
    .unwrap();
    let got = elems::<f32>(&d);
    assert_eq!(&got[..2], &[2.0, 1.0]);
    assert!(got[2].is_nan());
    let mut d = bytes_of(&[f16::NAN, f16::from_f32(3.0)]);
    reduce_into(
        DType::F16,
        ReduceOp::Min,
        &mut d,
        &bytes_of(&[f16::from_f32(-1.0), f16::NAN]),
    )
    .unwrap();
    assert_eq!(
        elems::<f16>(&d),
        vec![f16::from_f32(-1.0), f16::from_f32(3.0)]
    );
}

#[test]
fn bf16_sum_rounds_to_nearest_even() {
    // 1 + 2^-8 is exactly half-way between two bf16 values: ties to even (1.0).
    let mut d = bytes_of(&[bf16::from_f32(1.0), bf16::from_f32(1.0)]);
    let s = bytes_of(&[bf16::from_f32(1.0 / 256.0), bf16::from_f32(3.0 / 256.0)]);
    reduce_into(DType::BF16, ReduceOp::Sum, &mut d, &s).unwrap();
    assert_eq!(
        elems::<bf16>(&d),
        vec![bf16::from_f32(1.0), bf16::from_f32(1.015625)]
    );
}

#[test]
fn reduce_into_on_unaligned_subrange_is_correct() {
    // f64 at byte offset 4 of an aligned buffer: not 8-aligned.
    let mut storage = vec![0u64; 40];
    let bytes = bytemuck::cast_slice_mut::<u64, u8>(&mut storage);
    let vals: Vec<f64> = (0..30).map(|i| i as f64).collect();
    bytes[4..4 + 240].copy_from_slice(&bytes_of(&vals));
    let src = bytes_of(&vals);
    reduce_into(DType::F64, ReduceOp::Sum, &mut bytes[4..244], &src).unwrap();
    let got = elems::<f64>(&bytes[4..244]);
    assert_eq!(got, (0..30).map(|i| 2.0 * i as f64).collect::<Vec<_>>());
    assert_eq!(
        &bytes[..4],
        &[0; 4],
        "bytes outside the range are untouched"
    );
}

#[test]
fn reduce_into_rejects_bad_arguments_with_typed_errors() {
    let mut d = vec![0u8; 8];
    let err = reduce_into(DType::F32, ReduceOp::BXor, &mut d, &[0u8; 8]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnsupportedOp {
                dtype: DType::F32,
                ..
            }
        ),
        "{err}"
    );
    for op in [ReduceOp::Avg, ReduceOp::PremulSum(2.0)] {
        let err = reduce_into(DType::F32, op, &mut d, &[0u8; 8]).unwrap_err();
        assert!(matches!(err, Error::Internal(_)), "{err}");
    }
    let err = reduce_into(DType::I32, ReduceOp::Sum, &mut d, &[0u8; 4]).unwrap_err();
    assert!(matches!(err, Error::Internal(_)), "{err}");
    let err = reduce_into(DType::I32, ReduceOp::Sum, &mut d[..6], &[0u8; 6]).unwrap_err();
    assert!(matches!(err, Error::Internal(_)), "{err}");
    // Empty slices are fine.
    reduce_into(DType::U64, ReduceOp::Max, &mut [], &[]).unwrap();
}

#[test]
fn integer_divide_truncates_even_when_n_exceeds_the_type() {
    let mut d = bytes_of(&[-7i8, 7, i8::MIN, 100]);
    divide(DType::I8, &mut d, 2);
    assert_eq!(elems::<i8>(&d), vec![-3, 3, -64, 50]);
    let mut d = bytes_of(&[i8::MIN, i8::MAX]);
    divide(DType::I8, &mut d, 128);
    assert_eq!(elems::<i8>(&d), vec![-1, 0]);
    let mut d = bytes_of(&[255u8]);
    divide(DType::U8, &mut d, 300);
    assert_eq!(elems::<u8>(&d), vec![0]);
    let mut d = bytes_of(&[5u32]);
    divide(DType::U32, &mut d, 0);
    assert_eq!(elems::<u32>(&d), vec![5], "n = 0 leaves data unchanged");
}

#[test]
fn integer_scale_truncates_the_scalar_and_wraps() {
    let mut d = bytes_of(&[3i32, -3, i32::MAX]);
    scale(DType::I32, &mut d, 2.75);
    assert_eq!(elems::<i32>(&d), vec![6, -6, -2]);
    let mut d = bytes_of(&[1.5f32]);
    scale(DType::F32, &mut d, 2.0);
    assert_eq!(elems::<f32>(&d), vec![3.0]);
    // A trailing partial element is ignored, never a panic.
    let mut d = vec![1u8, 0, 0, 0, 9, 9];
    scale(DType::I32, &mut d, 3.0);
    assert_eq!(d, vec![3, 0, 0, 0, 9, 9]);
}
