//! External-storage tensors ([`Tensor::from_external`]) through real
//! collectives: in-place ops write into the caller's memory, and the owner
//! outlives the op.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use chorus::{DType, ReduceOp, Tensor};

/// Memory allocated outside Chorus, and a count of owner drops.
struct Outside {
    words: Box<[u64]>,
    drops: Arc<AtomicUsize>,
}

struct Owner(Arc<AtomicUsize>);
impl Drop for Owner {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl Outside {
    fn new(words: usize) -> Outside {
        Outside {
            words: vec![0u64; words].into_boxed_slice(),
            drops: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn tensor(&mut self, dtype: DType, len: usize) -> Tensor {
        assert!(len * dtype.size() <= self.words.len() * 8);
        // SAFETY: `self.words` outlives the tensor (each test drops the
        // tensor before reading the words) and nothing else touches it.
        unsafe {
            Tensor::from_external(
                dtype,
                self.words.as_mut_ptr().cast(),
                len,
                Box::new(Owner(self.drops.clone())),
            )
        }
        .expect("aligned buffer")
    }

    fn f32s(&self, len: usize) -> Vec<f32> {
        bytemuck::cast_slice::<u64, f32>(&self.words)[..len].to_vec()
    }
}

#[test]
fn all_reduce_on_external_memory_writes_in_place_world_3_f32() {
    let out = common::run_ranks(3, "ext-allreduce", |comm| {
        let n = 1000;
        let mut mem = Outside::new(n / 2);
        let mut t = mem.tensor(DType::F32, n);
        t.as_mut_slice::<f32>().fill(comm.rank() as f32 + 1.0);
        let back = comm.all_reduce(t, ReduceOp::Sum).unwrap();
        assert!(back.is_external(), "all_reduce handed back another buffer");
        assert_eq!(back.as_ptr(), mem.words.as_ptr().cast::<u8>());
        drop(back);
        assert_eq!(mem.drops.load(Ordering::SeqCst), 1);
        mem.f32s(n)
    });
    for v in out {
        assert!(v.iter().all(|&x| x == 6.0), "got {:?}", &v[..4]);
    }
}

#[test]
fn all_gather_into_and_broadcast_fill_external_outputs_world_2() {
    let out = common::run_ranks(2, "ext-gather", |comm| {
        let r = comm.rank();
        let mut out_mem = Outside::new(4);
        let output = out_mem.tensor(DType::F32, 8);
        let input = Tensor::full(r as f32 + 10.0, 4);
        let (output, input) = comm.all_gather_into(input, output).unwrap();
        assert_eq!(input.to_vec::<f32>(), vec![r as f32 + 10.0; 4]);
        assert!(output.is_external());
        drop(output);
        let gathered = out_mem.f32s(8);

        let mut b_mem = Outside::new(2);
        let mut b = b_mem.tensor(DType::F32, 4);
        if r == 1 {
            b.as_mut_slice::<f32>()
                .copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        }
        drop(comm.broadcast(b, 1).unwrap());
        (gathered, b_mem.f32s(4), b_mem.drops.load(Ordering::SeqCst))
    });
    for (gathered, b, drops) in out {
        assert_eq!(
            gathered,
            vec![10.0, 10.0, 10.0, 10.0, 11.0, 11.0, 11.0, 11.0]
        );
        assert_eq!(b, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(drops, 1);
    }
}
