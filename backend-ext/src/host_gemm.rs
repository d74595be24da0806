//! NdArray's dense-layer GEMMs split over rayon's threads: each product is cut into parts along
//! the larger side of its output, and each part is one BLAS call on the rayon thread that runs
//! it (OpenBLAS then set to one thread per call, `ember_trainer::blas::share_cores`).
//!
//! Why one pool: between two GEMMs a BERT step runs its fused ops (`host_layer.rs`) on rayon's
//! threads, and OpenBLAS's own worker threads spin (`sched_yield`) for about 0.1 s after each
//! GEMM before they sleep (OpenBLAS's `THREAD_TIMEOUT`, 2^28 cycles), so on 2 cores three or
//! four threads took turns on two cores all step long: 12–14% of tiny's and mini's samples
//! were the scheduler and `sched_yield` (perf, AMD EPYC, docs/performance.md, CPU performance).
//! With the GEMMs on rayon's pool one pool runs everything, as PyTorch's one intra-op pool
//! (OpenMP) runs both MKL's GEMMs and its own ops (`torch.set_num_threads`).
//!
//! How a product is cut: the parts split the larger of the output's rows and columns into
//! blocks of whole multiples of [`SPLIT_ALIGN`], so that each part's operand block is what
//! OpenBLAS would pack for it anyway (a row split packs the weight once per part, a column
//! split the activations; the larger side keeps the duplicated operand the smaller one).
//! Products of at most [`SPLIT_MIN_WORK`] multiply-adds stay whole, as OpenBLAS keeps them on
//! one thread. A split product agrees with the whole one to f32 rounding, not bit for bit
//! (OpenBLAS's kernels do not promise the same bits for a product cut into other calls); the
//! cut depends only on the shape and the number of parts, so a run is as deterministic as
//! before (tested below and in `tests/tests/integration/data_parallel/determinism.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};

use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis, Slice};
use rayon::prelude::*;

/// How many parts each GEMM is split into (1: one BLAS call, threaded as the BLAS library is).
static PARTS: AtomicUsize = AtomicUsize::new(1);

/// Products of at most this many multiply-adds (`m · n · k`) are not split: OpenBLAS's own
/// threshold for running a GEMM on one thread (`SMP_THRESHOLD_MIN` 65536 ×
/// `GEMM_MULTITHREAD_THRESHOLD` 4, `interface/gemm.c`).
const SPLIT_MIN_WORK: usize = 65_536 * 4;

/// Parts are whole multiples of this many rows or columns: 16 f32 are one 64-byte cache line,
/// and a multiple of OpenBLAS's x86 sgemm register tiles (16 × 4 on Haswell and Zen, 16 × 2 on
/// SkylakeX), so no part ends in a partial tile that the whole product would not have.
const SPLIT_ALIGN: usize = 16;

/// Sets how many parts NdArray's dense-layer GEMMs are split into on rayon's threads (`0` is
/// taken as 1). 1, the default, runs each GEMM as one BLAS call, threaded as the BLAS library
/// is; more parts need the BLAS library at one thread per call, or each part would start the
/// library's own threads too (`ember_trainer::blas::share_cores` sets both). Process-wide, as
/// OpenBLAS's thread count is.
pub fn set_gemm_parts(parts: usize) {
    PARTS.store(parts.max(1), Ordering::Relaxed);
}

/// The parts each GEMM is split into ([`set_gemm_parts`]).
pub fn gemm_parts() -> usize {
    PARTS.load(Ordering::Relaxed)
}

/// `c ← alpha · a · b + beta · c` (ndarray's `general_mat_mul`: BLAS `sgemm` with the
/// operands' strides), in [`gemm_parts`] parts on rayon's threads.
///
/// # Shapes
/// `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]` (any strides)
pub(crate) fn gemm(
    alpha: f32,
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
) {
    gemm_in(gemm_parts(), alpha, a, b, beta, c);
}

/// [`gemm`] in up to `parts` parts; returns the number of BLAS calls made.
fn gemm_in(
    parts: usize,
    alpha: f32,
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
) -> usize {
    let (m, n) = c.dim();
    let split_rows = m >= n;
    let side = if split_rows { m } else { n };
    let block = side.div_ceil(parts.max(1)).next_multiple_of(SPLIT_ALIGN);
    if parts <= 1 || m * n * a.ncols() <= SPLIT_MIN_WORK || block >= side {
        ndarray::linalg::general_mat_mul(alpha, a, b, beta, c);
        return 1;
    }
    // Part `i` is rows (or columns) `i · block ..` of `c` and of `a` (or `b`).
    let axis = Axis(if split_rows { 0 } else { 1 });
    let blocks: Vec<_> = c.axis_chunks_iter_mut(axis, block).enumerate().collect();
    let calls = blocks.len();
    blocks.into_par_iter().for_each(|(i, mut c)| {
        let range = Slice::from(i * block..i * block + c.len_of(axis));
        let (a, b) = if split_rows {
            (a.slice_axis(axis, range), b.view())
        } else {
            (a.view(), b.slice_axis(axis, range))
        };
        ndarray::linalg::general_mat_mul(alpha, &a, &b, beta, &mut c);
    });
    calls
}

/// `a · b` into a new row-major array: ndarray's `dot` when GEMMs are not split; else zeros
/// written by rayon's threads and [`gemm`] with `beta = 1` (OpenBLAS's `beta = 0` is the same
/// zeroing pass, `sgemm_beta`, before its kernels add the product).
///
/// # Shapes
/// `a` `[m, k]`, `b` `[k, n]` → `[m, n]`
pub(crate) fn product(a: &ArrayView2<'_, f32>, b: &ArrayView2<'_, f32>) -> Array2<f32> {
    product_in(gemm_parts(), a, b)
}

fn product_in(parts: usize, a: &ArrayView2<'_, f32>, b: &ArrayView2<'_, f32>) -> Array2<f32> {
    if parts <= 1 {
        return a.dot(b);
    }
    let (m, n) = (a.nrows(), b.ncols());
    let mut c =
        Array2::from_shape_vec((m, n), crate::host_layer::par_zeros(m * n)).expect("m · n zeros");
    gemm_in(parts, 1.0, a, b, 1.0, &mut c.view_mut());
    c
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, ArrayView2, ShapeBuilder};

    fn matrix(rows: usize, cols: usize, seed: u32) -> Array2<f32> {
        Array2::from_shape_fn((rows, cols), |(i, j)| {
            let x = (i as u32 * 131 + j as u32 * 71 + seed * 29) % 97;
            x as f32 / 13.0 - 3.5
        })
    }

    /// `c` against `alpha · a · b + beta · start` computed in f64, element by element, within
    /// the f32 rounding bound of a length-`k` dot product, `(k + 2) · 2⁻²³ · (|alpha| ·
    /// Σ|a·b| + |beta · start|)` (Higham, "Accuracy and Stability of Numerical Algorithms",
    /// §3.1, with twice the unit roundoff).
    fn assert_accurate(
        what: &str,
        c: &Array2<f32>,
        (alpha, a, b): (f64, &ArrayView2<'_, f32>, &ArrayView2<'_, f32>),
        (beta, start): (f64, &Array2<f32>),
    ) {
        let k = a.ncols();
        for ((i, j), &got) in c.indexed_iter() {
            let (mut exact, mut size) = (0.0f64, 0.0f64);
            for l in 0..k {
                let term = f64::from(a[[i, l]]) * f64::from(b[[l, j]]);
                exact += term;
                size += term.abs();
            }
            let start = beta * f64::from(start[[i, j]]);
            let expected = alpha * exact + start;
            let bound = (k as f64 + 2.0) * f64::powi(2.0, -23) * (alpha.abs() * size + start.abs());
            assert!(
                (f64::from(got) - expected).abs() <= bound,
                "{what}[{i}, {j}]: {got} against {expected} (bound {bound:e})"
            );
        }
    }

    /// A product split into 2 and 3 parts is as accurate as the whole one, against f64: a row
    /// split (m ≥ n) with a ragged last block, a column split (n > m), operands transposed as
    /// the dense layers' backward passes them (`g · wᵀ`, `xᵀ · g`), `alpha` 0.5 and `beta` 1
    /// onto a column-major output (the parts are strided views), and a product too small to
    /// split; the number of BLAS calls is the parts'. Not bit for bit: OpenBLAS's kernels do
    /// not promise the same bits for a product cut into other calls (with OpenBLAS, elements
    /// of the split and the whole product differed by up to 2e-6 relative here).
    #[test]
    fn split_gemm_is_as_accurate_as_the_whole_product() {
        let cases = [
            // (what, m, n, k, a transposed, b transposed, BLAS calls for 2 and 3 parts)
            ("rows", 200, 72, 48, false, false, [2, 3]),
            ("columns", 40, 300, 64, false, false, [2, 3]),
            ("g·wᵀ", 160, 96, 80, false, true, [2, 3]),
            ("xᵀ·g", 96, 112, 150, true, false, [2, 3]),
            ("small", 16, 16, 16, false, false, [1, 1]),
        ];
        for (what, m, n, k, ta, tb, calls) in cases {
            let a = if ta {
                matrix(k, m, 1).reversed_axes()
            } else {
                matrix(m, k, 1)
            };
            let b = if tb {
                matrix(n, k, 2).reversed_axes()
            } else {
                matrix(k, n, 2)
            };
            let (a, b) = (a.view(), b.view());
            let zeros = Array2::<f32>::zeros((m, n));
            let whole = super::product_in(1, &a, &b);
            assert_accurate(
                &format!("{what}, whole"),
                &whole,
                (1.0, &a, &b),
                (0.0, &zeros),
            );
            for (parts, calls) in [2, 3].into_iter().zip(calls) {
                let split = super::product_in(parts, &a, &b);
                let label = format!("{what}, {parts} parts");
                assert_accurate(&label, &split, (1.0, &a, &b), (0.0, &zeros));
                let start = matrix(m, n, 3);
                let mut c = Array2::<f32>::zeros((m, n).f());
                c.assign(&start);
                let made = super::gemm_in(parts, 0.5, &a, &b, 1.0, &mut c.view_mut());
                assert_eq!(made, calls, "{label}: BLAS calls");
                let c = c.as_standard_layout().into_owned();
                assert_accurate(
                    &format!("{label}, beta 1"),
                    &c,
                    (0.5, &a, &b),
                    (1.0, &start),
                );
            }
        }
    }

    /// The setting is process-wide, 0 is taken as 1.
    #[test]
    fn gemm_parts_is_set_and_read() {
        let before = super::gemm_parts();
        super::set_gemm_parts(0);
        assert_eq!(super::gemm_parts(), 1);
        super::set_gemm_parts(3);
        assert_eq!(super::gemm_parts(), 3);
        super::set_gemm_parts(before);
    }
}
