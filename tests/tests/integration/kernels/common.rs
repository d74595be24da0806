//! Helpers shared by the kernel tests.

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, TensorData};

pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// Asserts `|a − b| ≤ atol + rtol·|b|` elementwise, naming the worst element.
pub fn assert_close<B: Backend, const D: usize>(
    what: &str,
    actual: Tensor<B, D>,
    expected: Tensor<B, D>,
    (atol, rtol): (f32, f32),
) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shapes differ");
    let (a, e) = (values(actual), values(expected));
    let mut worst = (0usize, 0f32);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        assert!(x.is_finite(), "{what}: element {i} is {x}");
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    let i = worst.0;
    assert!(
        worst.1 <= 0.0,
        "{what}: element {i} is {} but the reference gives {} (atol {atol}, rtol {rtol})",
        a[i],
        e[i]
    );
}

pub fn random<B: Backend, const D: usize>(shape: [usize; D], device: &B::Device) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// `mask` `[B, S]`: 1 for real keys, 0 for padding → additive bias (0 / −10000).
pub fn mask_bias<B: Backend>(mask: &[Vec<f32>], device: &B::Device) -> Tensor<B, 2> {
    let (b, s) = (mask.len(), mask[0].len());
    let flat: Vec<f32> = mask
        .iter()
        .flatten()
        .map(|m| (1.0 - m) * -10000.0)
        .collect();
    Tensor::from_data(TensorData::new(flat, [b, s]), device)
}
