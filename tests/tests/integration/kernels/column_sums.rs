//! Column sums of several matrices at once (`FusedOps::sum_rows_many`, what LayerNorm's
//! backward takes for β, γ and the preceding bias): each equals its matrix's column sums
//! computed in f64 on the host, to f32 rounding of a sum of R terms; the same bits on a second
//! run; matrices of different shapes still summed (each alone); and on CubeCL two launches for
//! a LayerNorm's three sums (partial sums per chunk of rows, then their sum).

use burn::tensor::{Tensor, TensorPrimitive};
use ember_backend_ext::FusedOps;

use super::common::{random, values};

/// Groups of one shape each: one element; rows longer than a cube's 32 columns and more rows
/// than a chunk of 256 (1030 × 300, odd both ways: five chunks, the last short); a transposed
/// (strided) matrix beside a contiguous one; BERT-base's LayerNorm rows at batch 4 × 128.
fn groups<B: FusedOps>(device: &B::Device) -> Vec<Vec<Tensor<B, 2>>> {
    vec![
        vec![random([1, 1], device), random([1, 1], device)],
        (0..3).map(|_| random([1030, 300], device)).collect(),
        vec![
            random([33, 37], device).transpose(),
            random([37, 33], device),
        ],
        (0..3).map(|_| random([512, 768], device)).collect(),
    ]
}

pub fn sum_rows_many<B: FusedOps>(xs: &[Tensor<B, 2>]) -> Vec<Tensor<B, 1>> {
    B::sum_rows_many(
        xs.iter()
            .map(|x| x.clone().into_primitive().tensor())
            .collect(),
    )
    .into_iter()
    .map(|s| Tensor::from_primitive(TensorPrimitive::Float(s)))
    .collect()
}

/// Asserts `sum` is `x`'s column sums: within `R·2⁻²⁴·Σ|x|` of the f64 sum (the bound of a
/// sum of R f32 terms in any order), per column.
fn assert_column_sums<B: FusedOps>(what: &str, x: &Tensor<B, 2>, sum: Tensor<B, 1>) {
    let [rows, cols] = x.dims();
    let (x, sum) = (values(x.clone()), values(sum));
    assert_eq!(sum.len(), cols, "{what}");
    for c in 0..cols {
        let exact: f64 = (0..rows).map(|r| x[r * cols + c] as f64).sum();
        let magnitude: f64 = (0..rows).map(|r| (x[r * cols + c] as f64).abs()).sum();
        let bound = rows as f64 * 2f64.powi(-24) * magnitude + 1e-30;
        assert!(
            (sum[c] as f64 - exact).abs() <= bound,
            "{what}: column {c} sums to {} where f64 gives {exact} (bound {bound:e})",
            sum[c]
        );
    }
}

pub fn check_column_sums<B: FusedOps>(device: &B::Device) {
    for xs in groups::<B>(device) {
        let what = format!("{} × {:?}", xs.len(), xs[0].dims());
        let sums = sum_rows_many(&xs);
        assert_eq!(sums.len(), xs.len(), "{what}");
        let again = sum_rows_many(&xs);
        for (i, ((x, sum), repeat)) in xs.iter().zip(sums).zip(again).enumerate() {
            assert_eq!(
                values(sum.clone()),
                values(repeat),
                "{what}: matrix {i} changed between runs"
            );
            assert_column_sums(&format!("{what}, matrix {i}"), x, sum);
        }
    }
    // Different shapes: each summed on its own.
    let xs = vec![
        random::<B, 2>([5, 3], device),
        random::<B, 2>([4, 7], device),
    ];
    let sums = sum_rows_many(&xs);
    for (i, (x, sum)) in xs.iter().zip(sums).enumerate() {
        assert_column_sums(&format!("mixed shapes, matrix {i}"), x, sum);
    }
}

/// On the counting wgpu runtime: a LayerNorm's three sums of `[512, 768]` rows take two
/// launches (Burn's reductions: at least three).
pub fn check_column_sums_launch() {
    use ember_backend_ext::HostSyncs;
    type B = crate::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let xs: Vec<Tensor<B, 2>> = (0..3).map(|_| random([512, 768], &device)).collect();
    let _ = sum_rows_many(&xs).into_iter().map(values).count(); // compiled
    let before = HostSyncs::now();
    // Read back inside the count: the runtime counts a launch when it runs it.
    let sums: Vec<Vec<f32>> = sum_rows_many(&xs).into_iter().map(values).collect();
    let launches = HostSyncs::now().since(before).launches;
    assert_eq!(launches, 2, "three column sums took {launches} launches");
    assert_eq!(sums.len(), 3);
}
