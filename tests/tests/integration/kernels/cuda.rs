//! The kernel tests on CUDA (`scripts/gpu-check.sh run kernels` runs this module,
//! `kernels::cuda::`): the shared ones (`kernel_tests!`) and those only a GPU can run.

pub type Backend = burn::backend::Cuda<f32, i32>;

kernel_tests!(Backend, device());

#[test]
fn out_of_range_labels_make_the_loss_nan() {
    super::cross_entropy::check_out_of_range_labels::<Backend>(&device());
}

#[test]
fn cross_entropy_reads_half_logits_as_their_f32_cast() {
    super::cross_entropy::check_cross_entropy_of_half_logits::<Autodiff<Backend>>(
        &device(),
        burn::tensor::FloatDType::BF16,
    );
}

#[test]
fn bf16_kernels_match_the_f32_reference() {
    super::half_precision::check_bf16::<Backend>(&device());
}

/// Note [A bucket's writes, awaited]: 20 tries with a bucket of 16M elements (64 MB,
/// written in place 20 times after the streams met).
#[test]
fn a_bucket_written_in_place_is_awaited_before_the_communication_thread_reads_it() {
    super::streams::check_writes_in_place_awaited::<Backend>(&device(), 1 << 24, 20);
}

/// Note [Weight gradients in f32]: in bf16, the default `model.gemm` (CubeCL's kernels;
/// cuBLASLt's f32 weight gradients are `cublaslt.rs`'s), launches counted by the counting
/// runtime.
#[test]
fn dense_of_masters_writes_f32_weight_gradients() {
    super::dense::check_dense_of_masters::<burn::backend::Autodiff<ember_backend_ext::CountingCuda>>(
        &device(),
        burn::tensor::DType::BF16,
    );
}

/// Note [Parameter gradients in f32]: in bf16 (launches counted by the counting runtime).
#[test]
fn layer_ops_of_masters_write_f32_parameter_gradients() {
    super::layer_masters::check_layer_ops_of_masters::<
        burn::backend::Autodiff<ember_backend_ext::CountingCuda>,
    >(&device(), burn::tensor::DType::BF16);
}

/// Note [Unflattened by views], at CUDA's 512-byte alignment.
#[test]
fn unflattening_views_aligned_parts_and_copies_adjacent_others_together() {
    super::flatten::check_unflatten_launches::<ember_backend_ext::CountingCuda>(&device());
}

#[test]
fn cublaslt_products_match_the_host_in_f32_and_bf16() {
    super::cublaslt::check_cublaslt::<Backend>(&device(), false);
}

/// The trainer's backend (Burn's CUDA with its launches and waits counted) takes cuBLASLt
/// too, each product one launch.
#[test]
fn cublaslt_runs_under_the_counting_runtime() {
    super::cublaslt::check_cublaslt::<ember_backend_ext::CountingCuda>(&device(), true);
}

#[test]
fn cublaslt_products_match_the_host_with_device_windows() {
    let _restore = super::cublaslt::SyncChoice(ember_backend_ext::cublaslt_sync());
    ember_backend_ext::set_cublaslt_sync(ember_backend_ext::CublasltSync::Device);
    super::cublaslt::check_cublaslt::<ember_backend_ext::CountingCuda>(&device(), true);
}

#[test]
fn gemm_window_kernel_waits_for_its_release_or_expires() {
    super::gemm_window::check_window_kernel::<
        ember_backend_ext::CountingRuntime<ember_backend_ext::CudaRuntime>,
    >(&device());
}

/// CUDA's `auto` reduces through planes (warps): the tree, which ran before, must match
/// too.
#[test]
fn row_kernels_with_tree_reductions_match_reference() {
    super::with_row_reductions::<burn::backend::Autodiff<Backend>>(
        ember_backend_ext::RowReductions::Tree,
        &device(),
    );
}

pub fn device() -> burn::backend::cuda::CudaDevice {
    burn::backend::cuda::CudaDevice::new(0)
}
