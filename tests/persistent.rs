//! Persistent all-gather (`all_gather_p_init` / `exec` / `free`): agreed
//! and allocated once, reused by every exec.

mod common;

use chorus::{DType, Error, ReduceOp, Tensor};
use common::run_ranks;

fn step_value(rank: usize, step: usize, i: usize) -> i32 {
    (rank * 1000 + step * 10 + i) as i32
}

#[test]
fn repeated_execs_reuse_the_buffers_and_gather_each_steps_values() {
    run_ranks(3, "agp-steps", |comm| {
        let r = comm.rank();
        let count = 5;
        let mut ag = comm.all_gather_p_init(DType::I32, count).unwrap();
        assert_eq!((ag.dtype(), ag.count()), (DType::I32, count));
        let out_ptr = ag.output().as_bytes().as_ptr();
        let in_ptr = ag.input_mut().as_bytes().as_ptr();
        for step in 0..8 {
            for (i, x) in ag.input_mut().as_mut_slice::<i32>().iter_mut().enumerate() {
                *x = step_value(r, step, i);
            }
            let out = ag.exec().unwrap().to_vec::<i32>();
            let want: Vec<i32> = (0..3)
                .flat_map(|p| (0..count).map(move |i| step_value(p, step, i)))
                .collect();
            assert_eq!(out, want, "step {step}");
            // The same memory every time: nothing allocated per exec.
            assert_eq!(ag.output().as_bytes().as_ptr(), out_ptr);
            assert_eq!(ag.input_mut().as_bytes().as_ptr(), in_ptr);
            // Ordered with the communicator's other ops.
            if step % 3 == 0 {
                let s = comm
                    .all_reduce(Tensor::full(1i64, 2), ReduceOp::Sum)
                    .unwrap();
                assert_eq!(s.to_vec::<i64>(), vec![3, 3]);
            }
        }
        ag.free();
        comm.finalize().unwrap();
    });
}

#[test]
fn the_async_exec_and_an_empty_count() {
    run_ranks(2, "agp-async", |comm| {
        let r = comm.rank();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut ag = comm.all_gather_p_init_async(DType::F64, 2).await.unwrap();
            for step in 0..4 {
                ag.input_mut()
                    .as_mut_slice::<f64>()
                    .fill((r * 10 + step) as f64);
                let out = ag.exec_async().await.unwrap().to_vec::<f64>();
                let (a, b) = (step as f64, (10 + step) as f64);
                assert_eq!(out, vec![a, a, b, b]);
            }
            let mut none = comm.all_gather_p_init_async(DType::U8, 0).await.unwrap();
            assert!(none.exec_async().await.unwrap().is_empty());
        });
        comm.finalize().unwrap();
    });
}

#[test]
fn ranks_that_set_up_different_shapes_get_a_mismatch_at_init() {
    run_ranks(3, "agp-mismatch", |comm| {
        let count = if comm.rank() == 1 { 4 } else { 3 };
        match comm.all_gather_p_init(DType::F32, count) {
            Err(Error::Mismatch { op, fatal, .. }) => {
                assert_eq!(op, "all_gather_p_init");
                assert!(!fatal);
            }
            other => panic!("{other:?}"),
        }
        match comm.all_gather_p_init(
            if comm.rank() == 0 {
                DType::I32
            } else {
                DType::F32
            },
            3,
        ) {
            Err(Error::Mismatch { .. }) => {}
            other => panic!("{other:?}"),
        }
        // Still usable, and a matching init works.
        let mut ag = comm.all_gather_p_init(DType::F32, 3).unwrap();
        ag.input_mut()
            .as_mut_slice::<f32>()
            .fill(comm.rank() as f32);
        let out = ag.exec().unwrap().to_vec::<f32>();
        assert_eq!(out, vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
        comm.finalize().unwrap();
        // After finalize an exec is a typed error, and the handle survives it.
        assert!(matches!(ag.exec(), Err(Error::Finalized { .. })));
        assert_eq!(ag.output().len(), 9);
    });
}
