//! Note [A bucket's writes, awaited] (ember-backend-ext's `bucket_ops.rs`): the communication
//! thread reads a bucket only after the writes made into it in place on the compute thread's
//! stream, once it awaited them (`BucketOps::writes_marker` after the writes,
//! `BucketOps::await_marker` on the communication thread: what the reducer does for every
//! bucket). CubeCL aligns two threads' streams only for memory allocated
//! since they last met, so without the wait such writes race with the read. On CUDA the two
//! streams run side by side; wgpu's queue runs them in order, where the race cannot show, so
//! this runs in `kernels::cuda` (`scripts/gpu-check.sh run kernels`).

use burn::tensor::{Tensor, TensorData};
use ember_backend_ext::FusedOps;
use ember_trainer::parallel::{CommThread, Communicator, InProcess, ReduceOp};

/// `tries` times: a bucket of `n` ones is allocated; the communication thread then meets
/// this thread's stream (its own command on a tensor made here, after the bucket); the bucket
/// is then written in place ten times (`x ← 2x + 1`, 20 launches of `n` elements), marked, and
/// handed over; the communication thread awaits the marker and averages it over one rank (a kernel of
/// its own stream that reads it): every element must be 2¹¹ − 1.
pub fn check_writes_in_place_awaited<B: FusedOps>(device: &B::Device, n: usize, tries: usize) {
    let comm = InProcess::group(1, std::time::Duration::from_secs(60))
        .pop()
        .expect("a group of one");
    let thread = CommThread::<B>::spawn(Communicator::Device(Box::new(comm)));
    for attempt in 0..tries {
        let mut bucket = Tensor::<B, 1>::ones([n], device);
        let other = Tensor::<B, 1>::from_data(TensorData::from([0.0f32]), device);
        let met = thread
            .submit_device(move |c| c.allreduce_device(other, ReduceOp::Average))
            .recv()
            .expect("the communication thread")
            .expect("the meeting");
        drop(met);
        for _ in 0..10 {
            bucket = bucket.mul_scalar(2.0).add_scalar(1.0);
        }
        let marker = B::writes_marker(&bucket.clone().into_primitive().tensor());
        let reduced = thread
            .submit_device(move |c| {
                B::await_marker(marker.expect("CubeCL makes a marker")).expect("the wait");
                // With one rank the average is a division by 1: a kernel of this thread's
                // stream that reads the bucket (a sum of one hands it back unread).
                c.allreduce_device(bucket, ReduceOp::Average)
            })
            .recv()
            .expect("the communication thread")
            .expect("the allreduce");
        let values = reduced.into_data().to_vec::<f32>().unwrap();
        let wrong = values.iter().position(|&v| v != 2047.0);
        assert_eq!(
            wrong.map(|i| (i, values[i])),
            None,
            "attempt {attempt}: the communication thread read the bucket before its writes"
        );
    }
}
