//! The losses' cross-entropy on CubeCL (`FusedOps::cross_entropy` and its backward): one row
//! kernel forward, one element-wise kernel backward, where the reference composition launched
//! about nine kernels forward and eight backward, each a pass over the `[N, 30522]` masked-LM
//! logits.
//!
//! Note [Cross-entropy in one pass]: the forward reads each logit once. A cube per row (the
//! row kernels' layout, Note [Row reductions] in `reductions.rs`) keeps, per unit, a running
//! maximum `m` and the sum `s` of `exp(x − m)` over its strided share of the row, rescaling
//! `s` by `exp(m_old − m_new)` when the maximum grows: the online normaliser of Milakov and
//! Gimelshein, "Online normalizer calculation for softmax" (2018), on which FlashAttention's
//! softmax builds. The cube then takes the row's maximum
//! `M` and the sum of `s · exp(m − M)`, and `lse = M + ln Σ`. The max-shifted two-pass form
//! (PyTorch's `log_softmax` kernel, the reference here) reads the row twice. Unit 0 writes
//! `lse` and the row's loss `lse − x[label]`. The mean over rows is one more launch, one cube
//! summing the rows' losses in a fixed order (`sum_rows_ordered_kernel`, Note [Ranks stay one
//! model]) times `1/N`. Not Burn's `mean`: on lavapipe (burn-cubecl 0.21) that gives 0.9999695
//! for the mean of 65,535 ones, and −0.00129 for a `[70000, 1]` column of normal values whose
//! mean is −0.00041.
//!
//! The backward, `(exp(x − lse) − [j = label]) · g / N`, is element-wise: one launch, one read
//! of the logits, one write, no one-hot materialised (PyTorch's `log_softmax_backward` +
//! `nll_loss_backward` make two passes and a one-hot scatter).
//!
//! Half logits are read as they are: arithmetic is in f32 whatever the logits' dtype, as
//! `torch.autocast` runs `cross_entropy` in f32, without an f32 copy of the logits (the model
//! used to cast the `[N, 30522]` logits to f32 for the losses: a launch and a pass each way).
//! The log-sum-exp and the loss are f32 (a bf16 `lse` of ~10 would be off by up to 0.03, and
//! every probability of the backward with it; an fp16 loss would overflow under loss
//! scaling); the gradient has the logits' dtype, rounded once from f32, as the cast's backward
//! rounded it.
//!
//! A label outside `0..C` (the data path rejects such ids: `ember-data`'s `IdOutOfRange`)
//! reads no logit: its row's loss is NaN, computed at run time (`0/0`), so the mean is NaN
//! and the step's non-finite check sees it; PyTorch stops with a device-side assert instead.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::row_index;
use super::reductions::{row_form, row_launch, row_max, row_sum};
use super::{check_rows, elemwise_launch, empty_like, storage};

/// Per row of `[N, C]` logits (a cube per row): `lse[row] = log Σ_j exp(x_j)` and
/// `row_loss[row] = lse − x[label]` (NaN for a label outside `0..C`), both f32. Note
/// [Cross-entropy in one pass].
#[cube(launch)]
pub fn cross_entropy_rows_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    labels: &Tensor<I>,
    lse: &mut Tensor<f32>,
    row_loss: &mut Tensor<f32>,
    rows: u32,
    #[comptime] block: u32,
    #[comptime] planes: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let n = logits.shape(1);
    let base = row * n;
    let mut shared = SharedMemory::<f32>::new(block as usize);

    let mut m = f32::new(-3.0e38);
    let mut s = f32::new(0.0);
    let mut j = UNIT_POS_X as usize;
    while j < n {
        let x = f32::cast_from(logits[base + j]);
        if x > m {
            s = s * (m - x).exp() + f32::new(1.0);
            m = x;
        } else {
            s += (x - m).exp();
        }
        j += CUBE_DIM_X as usize;
    }
    let max = row_max(&mut shared, m, planes);
    let total = row_sum(&mut shared, s * (m - max).exp(), planes);
    let log_sum_exp = total.ln() + max;

    if UNIT_POS_X == 0 {
        lse[row] = log_sum_exp;
        let label = labels[row];
        // NaN unless the label is a class: 0/0 computed at run time (WGSL takes no NaN
        // literal), from unit 0's x and y positions (both 0 in this one-dimensional cube).
        let mut loss = f32::cast_from(UNIT_POS_X) / f32::cast_from(UNIT_POS_Y);
        if label >= I::new(0) && label < I::cast_from(n) {
            loss = log_sum_exp - f32::cast_from(logits[base + usize::cast_from(label)]);
        }
        row_loss[row] = loss;
    }
}

/// `d_logits[i, j] = (exp(x[i, j] − lse[i]) − [j = label[i]]) · grad[0] · inv_rows`, element-wise
/// over `[N, C]`.
#[cube(launch)]
pub fn cross_entropy_backward_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    labels: &Tensor<I>,
    lse: &Tensor<f32>,
    grad: &Tensor<f32>,
    d_logits: &mut Tensor<F>,
    inv_rows: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= d_logits.len() {
        terminate!();
    }
    let n = logits.shape(1);
    let row = i / n;
    let j = i % n;
    let mut d = (f32::cast_from(logits[i]) - lse[row]).exp();
    let label = labels[row];
    if label >= I::new(0) && label == I::cast_from(j) {
        d -= f32::new(1.0);
    }
    d_logits[i] = F::cast_from(d * grad[0] * inv_rows);
}

/// The forward's per-row outputs for `[N, C]` logits and `[N]` labels: the rows' losses and
/// their log-sum-exp (`[N]` each, f32). `N` and `C` at least 1.
pub(super) fn rows<R: CubeRuntime>(
    logits: CubeTensor<R>,
    labels: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let logits = into_contiguous(logits);
    let labels = into_contiguous(labels);
    let int_dtype = storage(labels.dtype);
    let [n_rows, classes] = logits.shape().dims::<2>();
    check_rows(n_rows * classes);
    assert_eq!(
        labels.shape().num_elements(),
        n_rows,
        "cross_entropy: a label per row"
    );
    let f32_rows = || {
        empty_device_contiguous_dtype(
            logits.client.clone(),
            logits.device.clone(),
            Shape::new([n_rows]),
            DType::F32,
        )
    };
    let (row_loss, lse) = (f32_rows(), f32_rows());
    let (planes, min_units) = row_form(&logits.client);
    let (count, dim, block) = row_launch(n_rows, classes, min_units);
    cross_entropy_rows_kernel::launch::<R>(
        &logits.client,
        count,
        dim,
        logits.clone().into_tensor_arg(),
        labels.into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        row_loss.clone().into_tensor_arg(),
        n_rows as u32,
        block as u32,
        planes,
        [storage(logits.dtype), int_dtype],
    );
    (row_loss, lse)
}

/// `d logits` `[N, C]`, in the logits' dtype, from the logits, labels, the forward's
/// log-sum-exp and the loss's gradient `[1]` (both f32; read on the device: no host
/// synchronisation).
pub(super) fn backward<R: CubeRuntime>(
    logits: CubeTensor<R>,
    labels: CubeTensor<R>,
    log_sum_exp: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> CubeTensor<R> {
    let logits = into_contiguous(logits);
    let [n_rows, classes] = logits.shape().dims::<2>();
    let elements = n_rows * classes;
    check_rows(elements);
    assert_eq!(
        labels.shape().num_elements(),
        n_rows,
        "cross_entropy: a label per row"
    );
    let d_logits = empty_like(&logits, logits.shape());
    let (count, dim) = elemwise_launch(&logits, elements);
    let int_dtype = storage(labels.dtype);
    cross_entropy_backward_kernel::launch::<R>(
        &logits.client,
        count,
        dim,
        logits.clone().into_tensor_arg(),
        into_contiguous(labels).into_tensor_arg(),
        into_contiguous(log_sum_exp).into_tensor_arg(),
        into_contiguous(grad).into_tensor_arg(),
        d_logits.clone().into_tensor_arg(),
        1.0 / n_rows as f32,
        [storage(logits.dtype), int_dtype],
    );
    d_logits
}
