//! [`PackedRowOps`] for `CubeBackend` (`model.unpad`, Note [Padding removed] in `ember-model`'s
//! `unpad.rs`): the dropout of packed rows keyed through the row map (`dropout_rows_kernel`),
//! the gather by Burn's `select` (one launch), the scatter as one pass over the padded rows by
//! their slots ([`scatter_rows_kernel`]), where Burn's `select_assign` into zeros takes a fill
//! and a scatter, and the slots themselves in one launch ([`slots_of_rows_kernel`]; Burn's
//! 1-D `select_assign` runs its indices on a single unit).

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::kernels::{self, row_index};
use super::reductions::row_launch;
use super::{check_rows, dropout_args, elemwise_launch, empty_like, storage};
use crate::{DropoutSpec, PackedRowOps};

/// Row `row` of the padded `output` (`[R, N]`): row `slots[row]` of the packed `x` (`[T, N]`)
/// where it is below `tokens` (T), else zeros; the cube's units stride over the row.
#[cube(launch)]
pub fn scatter_rows_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    slots: &Tensor<I>,
    output: &mut Tensor<F>,
    rows: u32,
    tokens: u32,
    #[comptime] block: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let n = output.shape(output.rank() - 1);
    let base = row * n;
    let slot = u32::cast_from(slots[row]);
    let mut j = UNIT_POS_X as usize;
    if slot < tokens {
        let source = slot as usize * n;
        while j < n {
            output[base + j] = x[source + j];
            j += block as usize;
        }
    } else {
        while j < n {
            output[base + j] = F::cast_from(f32::new(0.0));
            j += block as usize;
        }
    }
}

/// `slots[p]`: the index t of padded row p in the ascending `rows` (`[T]`), or T where p is not
/// among them (padding); a binary search per padded row, one unit each.
#[cube(launch)]
pub fn slots_of_rows_kernel<I: Int>(
    rows: &Tensor<I>,
    slots: &mut Tensor<I>,
    tokens: u32,
    #[define(I)] _dtype: StorageType,
) {
    let p = ABSOLUTE_POS;
    if p >= slots.len() {
        terminate!();
    }
    let target = p as u32;
    let mut lo = 0u32;
    let mut hi = tokens;
    while lo < hi {
        let mid = lo + (hi - lo) / 2u32;
        if u32::cast_from(rows[mid as usize]) < target {
            lo = mid + 1u32;
        } else {
            hi = mid;
        }
    }
    let mut slot = tokens;
    if lo < tokens {
        if u32::cast_from(rows[lo as usize]) == target {
            slot = lo;
        }
    }
    slots[p] = I::cast_from(slot);
}

impl<R, F, I, BT> PackedRowOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn dropout_rows(x: CubeTensor<R>, dropout: DropoutSpec, rows: CubeTensor<R>) -> CubeTensor<R> {
        if !dropout.enabled() {
            return x;
        }
        assert!(
            dropout.seq_len > 0,
            "dropout of packed rows needs the padded length (DropoutSpec::with_seq_len)"
        );
        let x = into_contiguous(x);
        let padded_rows = into_contiguous(rows);
        let n = x.shape().to_vec().last().copied().unwrap_or(1).max(1);
        let n_rows = x.shape().num_elements() / n;
        check_rows(n_rows * n);
        assert_eq!(
            padded_rows.shape().num_elements(),
            n_rows,
            "dropout_rows: a padded row per row"
        );
        let output = empty_like(&x, x.shape());
        let (count, dim, block) = row_launch(n_rows, n, 1);
        // The layout of `[B·S, N]` rows, S per sample: that of the padded rows.
        let mask = dropout_args(dropout, &[dropout.seq_len as usize, n]);
        let dtypes = [storage(x.dtype), storage(padded_rows.dtype)];
        kernels::dropout_rows_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            padded_rows.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            n_rows as u32,
            mask.key_lo,
            mask.key_hi,
            mask.sample_offset,
            mask.seq,
            mask.threshold,
            mask.keep_scale,
            block as u32,
            dtypes,
        );
        output
    }

    fn slots_of_rows(rows: CubeTensor<R>, padded_rows: usize) -> CubeTensor<R> {
        let rows = into_contiguous(rows);
        let tokens = rows.shape().num_elements();
        // T itself must fit the integer type (i32 on CubeCL backends).
        assert!(
            padded_rows.max(tokens) <= i32::MAX as usize,
            "slots_of_rows: {padded_rows} padded rows, {tokens} rows: more than 32-bit indices"
        );
        if padded_rows == 0 || tokens == 0 {
            // Nothing to search (no empty buffer bound to a kernel): every slot is T = 0.
            return <Self as burn::tensor::ops::IntTensorOps<Self>>::int_zeros(
                Shape::new([padded_rows]),
                &rows.device,
                rows.dtype.into(),
            );
        }
        let slots = empty_like(&rows, Shape::new([padded_rows]));
        let (count, dim) = elemwise_launch(&rows, padded_rows.max(1));
        let dtype = storage(rows.dtype);
        slots_of_rows_kernel::launch::<R>(
            &rows.client,
            count,
            dim,
            rows.clone().into_tensor_arg(),
            slots.clone().into_tensor_arg(),
            tokens as u32,
            dtype,
        );
        slots
    }

    fn scatter_rows(x: CubeTensor<R>, rows: CubeTensor<R>, slots: CubeTensor<R>) -> CubeTensor<R> {
        let x = into_contiguous(x);
        let slots = into_contiguous(slots);
        let [tokens, n] = x.shape().dims::<2>();
        assert_eq!(
            rows.shape().num_elements(),
            tokens,
            "scatter_rows: a padded row per packed row"
        );
        let padded = slots.shape().num_elements();
        check_rows(padded * n);
        let output = empty_like(&x, Shape::new([padded, n]));
        let (count, dim, block) = row_launch(padded, n, 1);
        let dtypes = [storage(x.dtype), storage(slots.dtype)];
        scatter_rows_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            slots.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            padded as u32,
            tokens as u32,
            block as u32,
            dtypes,
        );
        output
    }
}
