//! A row-major batched product `C = A·B`, as Burn's tensors lay it out, in the terms of a
//! column-major BLAS (cuBLASLt, `model.gemm = "cublaslt"`): which operand is which, whether
//! each is transposed, its leading dimension and its batch stride.
//!
//! Note [Row-major GEMMs on a column-major BLAS]: a row-major `[m, n]` matrix is the
//! column-major `[n, m]` matrix of the same memory, so `C = A·B` is computed as
//! `Cᵀ = Bᵀ·Aᵀ`: the BLAS's first operand is `B`, its second `A`, and its `(m, n, k)` are
//! `(n, m, k)` (cuBLAS's documentation, "row-major"; what PyTorch's `at::cuda::blas::gemm`
//! calls do for its row-major tensors). Each operand is then either in the BLAS's column-major
//! order (unit stride down its columns: no transpose) or in row-major order (unit stride along
//! its rows: the BLAS reads it transposed), with the other stride as its leading dimension; a
//! view with neither unit stride (a strided slice) has no such layout and keeps CubeCL's
//! matmul. The batch dimensions (broadcast where an operand has 1) must flatten into one
//! count with one stride per operand, as cuBLASLt's strided batches are
//! (`CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT`, `..._STRIDED_BATCH_OFFSET`; a stride of 0 repeats
//! the operand, which is how a broadcast weight is read).

/// One column-major BLAS call, in elements (cuBLASLt's `cublasLtMatmul`: `cube/cublaslt_call.rs`): `C'[batch] = op(A')·op(B')`, `C'` `[m, n]` column-major with
/// leading dimension `ldc`, where `A'` is the row-major `B` and `B'` the row-major `A`
/// (Note [Row-major GEMMs on a column-major BLAS]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ColumnMajorGemm {
    /// Whether `A'` (the row-major right operand) is read transposed.
    pub transa: bool,
    /// Whether `B'` (the row-major left operand) is read transposed.
    pub transb: bool,
    /// Rows of `C'`: the row-major product's columns.
    pub m: usize,
    /// Columns of `C'`: the row-major product's rows.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// Leading dimension of `A'` as stored.
    pub lda: usize,
    /// Leading dimension of `B'` as stored.
    pub ldb: usize,
    /// Leading dimension of `C'` (the row-major product's row length: it is contiguous).
    pub ldc: usize,
    /// Products in the batch (1: no batch).
    pub batch: usize,
    /// Elements between consecutive products of `A'` (0: the same matrix for each).
    pub stride_a: usize,
    /// Elements between consecutive products of `B'`.
    pub stride_b: usize,
    /// Elements between consecutive products of `C'`.
    pub stride_c: usize,
}

/// A matrix as cuBLASLt's `cublasLtMatrixLayoutCreate` describes it: `rows × cols` stored
/// column-major with leading dimension `ld` (element `(r, c)` at `r + c·ld`), and its strided
/// batch `(count, stride)` where there is one (`CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT`,
/// `..._STRIDED_BATCH_OFFSET`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatrixLayout {
    /// Rows as stored.
    pub rows: usize,
    /// Columns as stored.
    pub cols: usize,
    /// Elements between consecutive columns.
    pub ld: usize,
    /// `(count, stride)` of the batch, in elements; `None` without a batch.
    pub batch: Option<(usize, usize)>,
}

impl ColumnMajorGemm {
    /// The layouts of `A'`, `B'` and `C'` as stored: an operand read transposed is stored as
    /// the transpose of its `op` (`A'` is `k × m` when `transa`, else `m × k`; `B'` is `n × k`
    /// when `transb`, else `k × n`; `C'` is `m × n`), as cuBLAS's `op(X)` is defined.
    pub fn layouts(&self) -> [MatrixLayout; 3] {
        let batch = |stride: usize| (self.batch > 1).then_some((self.batch, stride));
        let (a_rows, a_cols) = if self.transa {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (b_rows, b_cols) = if self.transb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [
            MatrixLayout {
                rows: a_rows,
                cols: a_cols,
                ld: self.lda,
                batch: batch(self.stride_a),
            },
            MatrixLayout {
                rows: b_rows,
                cols: b_cols,
                ld: self.ldb,
                batch: batch(self.stride_b),
            },
            MatrixLayout {
                rows: self.m,
                cols: self.n,
                ld: self.ldc,
                batch: batch(self.stride_c),
            },
        ]
    }
}

/// A matrix operand as the BLAS sees it: `rows × cols` with element `(r, c)` at
/// `r·row_stride + c·col_stride`. Returns `(transposed, ld)`, or `None` when neither stride is
/// a unit one (or a stride is too small to be a leading dimension).
fn operand(
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
) -> Option<(bool, usize)> {
    // Column-major (no transpose): unit stride down a column, `ld` between columns.
    if rows == 1 || row_stride == 1 {
        let ld = if cols == 1 { rows.max(1) } else { col_stride };
        if ld >= rows.max(1) {
            return Some((false, ld));
        }
    }
    // Stored as the column-major `cols × rows` matrix, read transposed.
    if cols == 1 || col_stride == 1 {
        let ld = if rows == 1 { cols.max(1) } else { row_stride };
        if ld >= cols.max(1) {
            return Some((true, ld));
        }
    }
    None
}

/// The one stride that walks an operand's batch dimensions in the output's row-major batch
/// order, or `None` when they do not flatten to one. `dims`/`strides` are the operand's batch
/// dimensions, `out` the output's (the broadcast of both operands'); a dimension of 1 where
/// the output has more is read with stride 0 (broadcast).
fn batch_stride(dims: &[usize], strides: &[usize], out: &[usize]) -> Option<usize> {
    let mut stride: Option<usize> = None;
    let mut inner = 1usize;
    for ((&dim, &s), &o) in dims.iter().zip(strides).zip(out).rev() {
        if o == 1 {
            continue;
        }
        let effective = if dim == 1 { 0 } else { s };
        match stride {
            None => stride = Some(effective),
            Some(t) if effective == t * inner => {}
            Some(_) => return None,
        }
        inner *= o;
    }
    Some(stride.unwrap_or(0))
}

/// The column-major call for the row-major product of `a` `[.., m, k]` and `b` `[.., k, n]`
/// (shapes and strides in elements, the same rank ≥ 2, batch dimensions equal or 1), writing
/// a contiguous `[.., m, n]`. `None` when a layout has no such call (a strided slice, batch
/// dimensions that do not flatten, an empty product, counts past `i32`): the caller keeps its
/// other GEMM.
pub fn column_major_gemm(
    a_shape: &[usize],
    a_strides: &[usize],
    b_shape: &[usize],
    b_strides: &[usize],
) -> Option<ColumnMajorGemm> {
    let rank = a_shape.len();
    if rank < 2 || b_shape.len() != rank || a_strides.len() != rank || b_strides.len() != rank {
        return None;
    }
    let (m, k) = (a_shape[rank - 2], a_shape[rank - 1]);
    let (k_b, n) = (b_shape[rank - 2], b_shape[rank - 1]);
    if k != k_b || m == 0 || n == 0 || k == 0 {
        return None;
    }
    let mut out = Vec::with_capacity(rank - 2);
    for (&da, &db) in a_shape[..rank - 2].iter().zip(&b_shape[..rank - 2]) {
        if da != db && da != 1 && db != 1 {
            return None;
        }
        out.push(da.max(db));
    }
    let batch: usize = out.iter().product();
    // A' = B seen as [n, k]: element (nn, kk) at nn·sb_n + kk·sb_k.
    let (transa, lda) = operand(n, k, b_strides[rank - 1], b_strides[rank - 2])?;
    // B' = A seen as [k, m]: element (kk, mm) at kk·sa_k + mm·sa_m.
    let (transb, ldb) = operand(k, m, a_strides[rank - 1], a_strides[rank - 2])?;
    let stride_a = batch_stride(&b_shape[..rank - 2], &b_strides[..rank - 2], &out)?;
    let stride_b = batch_stride(&a_shape[..rank - 2], &a_strides[..rank - 2], &out)?;
    let fits = |x: usize| i32::try_from(x).is_ok();
    let plan = ColumnMajorGemm {
        transa,
        transb,
        m: n,
        n: m,
        k,
        lda,
        ldb,
        ldc: n,
        batch,
        stride_a,
        stride_b,
        stride_c: m * n,
    };
    (fits(batch) && fits(m) && fits(n) && fits(k)).then_some(plan)
}

/// How cuBLASLt accumulates a product ([`product_compute`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProductCompute {
    /// f32 operands read as TF32 on the tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`), as
    /// cubek's tensor-core kernels read them.
    Tf32,
    /// Half operands multiplied exactly, accumulated in f32 (`CUBLAS_COMPUTE_32F`).
    F32,
}

/// The compute type of a product of `operands` written in `output`, or `None` for a pair
/// ember does not offer cuBLASLt: an output in the operands' dtype (f32, bf16, f16), or f32
/// from half operands, their accumulator's precision (Note [cuBLASLt's f32 output] in
/// `cube/cublaslt_call.rs`: the weight gradients under autocast). Never a half output of f32
/// operands, mixed half operands, or other dtypes.
pub fn product_compute(
    operands: burn::tensor::DType,
    output: burn::tensor::DType,
) -> Option<ProductCompute> {
    use burn::tensor::DType::{BF16, F16, F32};
    match (operands, output) {
        (F32, F32) => Some(ProductCompute::Tf32),
        (BF16, BF16 | F32) | (F16, F16 | F32) => Some(ProductCompute::F32),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_operands_may_write_f32_and_nothing_writes_a_narrower_type() {
        use burn::tensor::DType::{BF16, F16, F32, F64};
        for (operands, output, compute) in [
            (F32, F32, Some(ProductCompute::Tf32)),
            (BF16, BF16, Some(ProductCompute::F32)),
            (F16, F16, Some(ProductCompute::F32)),
            (BF16, F32, Some(ProductCompute::F32)),
            (F16, F32, Some(ProductCompute::F32)),
            (F32, BF16, None),
            (F32, F16, None),
            (BF16, F16, None),
            (F16, BF16, None),
            (F64, F64, None),
            (BF16, F64, None),
        ] {
            assert_eq!(
                product_compute(operands, output),
                compute,
                "{operands:?} operands written in {output:?}"
            );
        }
    }

    /// Element `(r, c)` of a stored matrix of batch `p`, through its layout: every read
    /// inside the layout's `rows × cols` (the plan's layouts describe what is read).
    fn stored(layout: &MatrixLayout, data: &[f64], p: usize, r: usize, c: usize) -> f64 {
        assert!(
            r < layout.rows && c < layout.cols,
            "({r}, {c}) outside {layout:?}"
        );
        assert!(layout.ld >= layout.rows, "{layout:?}");
        let offset = layout.batch.map_or(0, |(count, stride)| {
            assert!(p < count, "batch {p} outside {layout:?}");
            p * stride
        });
        data[offset + r + c * layout.ld]
    }

    /// `op(X)(i, l)` of a stored matrix: `X(i, l)`, or `X(l, i)` when read transposed.
    fn op(
        layout: &MatrixLayout,
        transposed: bool,
        data: &[f64],
        p: usize,
        i: usize,
        l: usize,
    ) -> f64 {
        if transposed {
            stored(layout, data, p, l, i)
        } else {
            stored(layout, data, p, i, l)
        }
    }

    /// What a column-major BLAS computes for `plan` (cuBLAS's definition of `op`, `ld` and the
    /// strided batch), on flat buffers read through the plan's [`ColumnMajorGemm::layouts`]:
    /// the reference the plans are checked against.
    fn column_major_blas(plan: &ColumnMajorGemm, a: &[f64], b: &[f64], c: &mut [f64]) {
        let [la, lb, lc] = plan.layouts();
        assert_eq!((lc.rows, lc.cols), (plan.m, plan.n), "{plan:?}");
        for p in 0..plan.batch {
            for i in 0..plan.m {
                for j in 0..plan.n {
                    let mut sum = 0.0;
                    for l in 0..plan.k {
                        sum += op(&la, plan.transa, a, p, i, l) * op(&lb, plan.transb, b, p, l, j);
                    }
                    let offset = lc.batch.map_or(0, |(_, stride)| p * stride);
                    c[offset + i + j * lc.ld] = sum;
                }
            }
        }
    }

    /// cuBLASLt's `CUBLASLT_EPILOGUE_BGRADA`: `op(A')` summed over the GEMM's `k` dimension, a
    /// vector of `C'`'s `m` rows ("the reduction happens over the GEMM's k dimension; the bias
    /// size corresponds to the number of rows of the matrix D", cuBLAS's documentation of
    /// `cublasLtEpilogue_t`); one product.
    fn bias_gradient_a(plan: &ColumnMajorGemm, a: &[f64]) -> Vec<f64> {
        let [la, _, _] = plan.layouts();
        (0..plan.m)
            .map(|i| (0..plan.k).map(|l| op(&la, plan.transa, a, 0, i, l)).sum())
            .collect()
    }

    /// Row-major strides of `shape`.
    fn contiguous(shape: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        strides
    }

    /// A view: the buffer, its shape and strides (a permutation of a contiguous tensor's).
    struct View {
        data: Vec<f64>,
        shape: Vec<usize>,
        strides: Vec<usize>,
    }

    impl View {
        /// A contiguous tensor of `stored` shape viewed through the axis permutation `perm`.
        fn permuted(stored: &[usize], perm: &[usize], seed: u64) -> Self {
            let n: usize = stored.iter().product();
            let mut state = seed;
            let data = (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 17) as f64 - 8.0
                })
                .collect();
            let strides = contiguous(stored);
            View {
                data,
                shape: perm.iter().map(|&p| stored[p]).collect(),
                strides: perm.iter().map(|&p| strides[p]).collect(),
            }
        }

        fn at(&self, index: &[usize]) -> f64 {
            let offset: usize = index
                .iter()
                .zip(&self.shape)
                .zip(&self.strides)
                .map(|((&i, &d), &s)| if d == 1 { 0 } else { i * s })
                .sum();
            self.data[offset]
        }
    }

    /// The row-major batched product, element by element (batch dimensions broadcast).
    fn row_major(a: &View, b: &View) -> (Vec<usize>, Vec<f64>) {
        let rank = a.shape.len();
        let (m, k, n) = (a.shape[rank - 2], a.shape[rank - 1], b.shape[rank - 1]);
        let batch_dims: Vec<usize> = (0..rank - 2).map(|d| a.shape[d].max(b.shape[d])).collect();
        let batch: usize = batch_dims.iter().product();
        let mut out = Vec::with_capacity(batch * m * n);
        for p in 0..batch {
            let mut index = vec![0; rank];
            let mut rest = p;
            for d in (0..rank - 2).rev() {
                index[d] = rest % batch_dims[d];
                rest /= batch_dims[d];
            }
            for i in 0..m {
                for j in 0..n {
                    let mut sum = 0.0;
                    for l in 0..k {
                        let (mut ia, mut ib) = (index.clone(), index.clone());
                        (ia[rank - 2], ia[rank - 1]) = (i, l);
                        (ib[rank - 2], ib[rank - 1]) = (l, j);
                        sum += a.at(&ia) * b.at(&ib);
                    }
                    out.push(sum);
                }
            }
        }
        let mut shape = batch_dims;
        shape.extend([m, n]);
        (shape, out)
    }

    fn check(a: View, b: View, what: &str) -> ColumnMajorGemm {
        let plan = column_major_gemm(&a.shape, &a.strides, &b.shape, &b.strides)
            .unwrap_or_else(|| panic!("{what}: no plan"));
        let (shape, expected) = row_major(&a, &b);
        let mut c = vec![f64::NAN; shape.iter().product()];
        // A' is the row-major B, B' the row-major A.
        column_major_blas(&plan, &b.data, &a.data, &mut c);
        assert_eq!(c, expected, "{what}: {plan:?}");
        plan
    }

    #[test]
    fn dense_layers_forward_and_both_gradients_as_bert_lays_them_out() {
        // x·W: x [R, I] contiguous, W [I, O] contiguous: no transposes, ld = row lengths.
        let plan = check(
            View::permuted(&[6, 4], &[0, 1], 1),
            View::permuted(&[4, 5], &[0, 1], 2),
            "forward",
        );
        assert_eq!(
            (plan.transa, plan.transb, plan.m, plan.n, plan.k),
            (false, false, 5, 6, 4)
        );
        assert_eq!((plan.lda, plan.ldb, plan.ldc, plan.batch), (5, 4, 5, 1));
        // dx = g·Wᵀ: W's transposed view [O, I] of the stored [I, O].
        let plan = check(
            View::permuted(&[6, 5], &[0, 1], 3),
            View::permuted(&[4, 5], &[1, 0], 4),
            "dx",
        );
        assert!(plan.transa && !plan.transb, "{plan:?}");
        // dW = xᵀ·g: x's transposed view [I, R].
        let plan = check(
            View::permuted(&[6, 4], &[1, 0], 5),
            View::permuted(&[6, 5], &[0, 1], 6),
            "dW",
        );
        assert!(!plan.transa && plan.transb, "{plan:?}");
    }

    /// The dense layer's bias gradient in the weight gradient's GEMM (`dW = xᵀ·g` with
    /// cuBLASLt's BGRADA epilogue, `cublaslt.rs`): `A'` is the row-major `g`, so the epilogue's
    /// sum over `k` is `db = Σ_rows g`, a vector of `dW`'s columns.
    #[test]
    fn the_weight_gradients_bias_epilogue_sums_the_output_gradient_over_rows() {
        let (rows, i, o) = (6, 4, 5);
        let x = View::permuted(&[rows, i], &[1, 0], 21);
        let g = View::permuted(&[rows, o], &[0, 1], 22);
        let expected: Vec<f64> = (0..o)
            .map(|col| (0..rows).map(|r| g.at(&[r, col])).sum())
            .collect();
        let plan = column_major_gemm(&x.shape, &x.strides, &g.shape, &g.strides)
            .expect("dW = xᵀ·g has a plan");
        assert_eq!(plan.m, o, "C' has dW's columns as its rows");
        assert_eq!(bias_gradient_a(&plan, &g.data), expected, "{plan:?}");
        // The same epilogue on the forward product would sum W over its rows: not db.
        let w = View::permuted(&[i, o], &[0, 1], 23);
        let forward =
            column_major_gemm(&[rows, i], &[i, 1], &w.shape, &w.strides).expect("x·W has a plan");
        assert_ne!(bias_gradient_a(&forward, &w.data), expected);
    }

    #[test]
    fn layouts_store_a_transposed_operand_as_the_transpose_of_its_op() {
        // Q·Kᵀ per sample and head (A' = Kᵀ's view read transposed, a batch of 6).
        let k = View::permuted(&[2, 3, 5, 4], &[0, 1, 3, 2], 24);
        let q = View::permuted(&[2, 3, 5, 4], &[0, 1, 2, 3], 25);
        let plan = column_major_gemm(&q.shape, &q.strides, &k.shape, &k.strides)
            .expect("scores have a plan");
        let [la, lb, lc] = plan.layouts();
        assert!(plan.transa && !plan.transb, "{plan:?}");
        assert_eq!(
            (la.rows, la.cols, la.ld, la.batch),
            (4, 5, 4, Some((6, 20)))
        );
        assert_eq!(
            (lb.rows, lb.cols, lb.ld, lb.batch),
            (4, 5, 4, Some((6, 20)))
        );
        assert_eq!(
            (lc.rows, lc.cols, lc.ld, lc.batch),
            (5, 5, 5, Some((6, 25)))
        );
        // Without a batch, no batch attributes.
        let plan = column_major_gemm(&[6, 4], &[4, 1], &[4, 5], &[5, 1]).expect("a plan");
        assert!(plan.layouts().iter().all(|l| l.batch.is_none()));
    }

    #[test]
    fn attention_products_batch_over_samples_and_heads() {
        // Q·Kᵀ per sample and head: Q [B, nh, S, hd], K's transposed view [B, nh, hd, S].
        let plan = check(
            View::permuted(&[2, 3, 5, 4], &[0, 1, 2, 3], 7),
            View::permuted(&[2, 3, 5, 4], &[0, 1, 3, 2], 8),
            "scores",
        );
        assert_eq!(plan.batch, 6);
        assert_eq!((plan.stride_a, plan.stride_b, plan.stride_c), (20, 20, 25));
        // P·V and the gradients' transposed operands.
        check(
            View::permuted(&[2, 3, 5, 5], &[0, 1, 3, 2], 9),
            View::permuted(&[2, 3, 5, 4], &[0, 1, 2, 3], 10),
            "Pᵀ·g",
        );
        // Head-strided views: [B, S, nh, hd] stored, viewed as [B, nh, S, hd]: the heads'
        // batch does not flatten to one stride (samples S·nh·hd apart, heads hd apart).
        let q = View::permuted(&[2, 5, 3, 4], &[0, 2, 1, 3], 11);
        let k = View::permuted(&[2, 5, 3, 4], &[0, 2, 3, 1], 12);
        assert_eq!(
            column_major_gemm(&q.shape, &q.strides, &k.shape, &k.strides),
            None
        );
    }

    #[test]
    fn broadcast_batches_read_one_matrix_with_stride_zero() {
        let plan = check(
            View::permuted(&[1, 3, 5, 4], &[0, 1, 2, 3], 13),
            View::permuted(&[1, 1, 4, 2], &[0, 1, 2, 3], 14),
            "weight broadcast",
        );
        assert_eq!((plan.batch, plan.stride_a, plan.stride_b), (3, 0, 20));
        check(
            View::permuted(&[1, 1, 5, 4], &[0, 1, 2, 3], 15),
            View::permuted(&[2, 3, 4, 2], &[0, 1, 2, 3], 16),
            "left broadcast",
        );
        // Broadcast on the inner batch dimension only: no single stride.
        let a = View::permuted(&[2, 1, 5, 4], &[0, 1, 2, 3], 17);
        let b = View::permuted(&[2, 3, 4, 2], &[0, 1, 2, 3], 18);
        assert_eq!(
            column_major_gemm(&a.shape, &a.strides, &b.shape, &b.strides),
            None
        );
    }

    #[test]
    fn vectors_and_single_rows_take_a_valid_leading_dimension() {
        for (m, k, n) in [(1, 4, 5), (6, 1, 5), (6, 4, 1), (1, 1, 1), (1, 7, 1)] {
            for (pa, pb) in [
                ([0, 1], [0, 1]),
                ([1, 0], [0, 1]),
                ([0, 1], [1, 0]),
                ([1, 0], [1, 0]),
            ] {
                let sa = if pa == [0, 1] { [m, k] } else { [k, m] };
                let sb = if pb == [0, 1] { [k, n] } else { [n, k] };
                let plan = check(
                    View::permuted(&sa, &pa, 19),
                    View::permuted(&sb, &pb, 20),
                    &format!("m {m} k {k} n {n}"),
                );
                let (rows_a, rows_b) = (
                    if plan.transa { plan.k } else { plan.m },
                    if plan.transb { plan.n } else { plan.k },
                );
                assert!(
                    plan.lda >= rows_a.max(1) && plan.ldb >= rows_b.max(1),
                    "{plan:?}"
                );
            }
        }
    }

    #[test]
    fn strided_slices_and_mismatched_shapes_have_no_plan() {
        // Every other column of a [6, 8] matrix: strides (8, 2), neither a unit stride.
        assert_eq!(column_major_gemm(&[6, 4], &[8, 2], &[4, 5], &[5, 1]), None);
        assert_eq!(column_major_gemm(&[6, 4], &[4, 1], &[3, 5], &[5, 1]), None);
        assert_eq!(
            column_major_gemm(&[2, 6, 4], &[24, 4, 1], &[3, 4, 5], &[20, 5, 1]),
            None
        );
        assert_eq!(column_major_gemm(&[0, 4], &[4, 1], &[4, 5], &[5, 1]), None);
        assert_eq!(column_major_gemm(&[4], &[1], &[4], &[1]), None);
    }
}
