//! The kernels with half-precision storage against the f32 reference composition. The inputs
//! are cast to the half type on the f32 backend, as the trainer's mixed precision casts its
//! activations (Note [Autocast] in `ember_model`'s `precision.rs`): the kernels take their
//! element type from the tensors' dtype at launch (`#[define(F)]`, `src/cube/kernels.rs`), so
//! these are the kernels a mixed-precision run launches, and no second backend type (nor a
//! device whose default float type changed) is involved.

use burn::backend::NdArray;
use burn::tensor::{DType, Distribution, Tensor};
use ember_backend_ext::{DropoutSpec, FusedOps, Gelu, reference};

use super::common::{assert_close, mask_bias};

/// The kernels with half-precision storage (f16 on wgpu, where WGSL has no bf16; bf16 on CUDA
/// through `scripts/gpu-check.sh`): forward outputs against the f32 reference composition on
/// NdArray from the same rounded inputs. Tolerance: the half type's rounding of inputs and
/// output (f16: 2⁻¹¹, bf16: 2⁻⁸ relative), 1e-2 absolute + 1e-2 relative for f16 (3e-2
/// absolute for LayerNorm, whose outputs reach ±4), 8× that for bf16.
fn check_half_precision<H: FusedOps>(device: &H::Device, dtype: DType, scale: f32) {
    let tol = (1e-2 * scale, 1e-2 * scale);
    let cpu = Default::default();
    // A random tensor cast to `dtype` on H, and the same rounded values in f32 on NdArray.
    let pair = |shape: &[usize]| {
        let x = Tensor::<NdArray, 1>::random(
            [shape.iter().product::<usize>()],
            Distribution::Normal(0.0, 1.0),
            &cpu,
        );
        let half = Tensor::<H, 1>::from_data(x.into_data(), device).cast(dtype);
        assert_eq!(half.dtype(), dtype);
        let rounded = half.clone().cast(DType::F32).into_data();
        (Tensor::<NdArray, 1>::from_data(rounded, &cpu), half)
    };
    // The fused op's output, which must still be in `dtype`, in f32 on NdArray.
    let to_f32 = |t: Tensor<H, 1>| {
        assert_eq!(t.dtype(), dtype, "a fused op changed the dtype");
        Tensor::<NdArray, 1>::from_data(t.into_data().convert::<f32>(), &cpu)
    };

    let (x, xh) = pair(&[231, 300]);
    let (x, xh) = (x.reshape([231, 300]), xh.reshape([231, 300]));
    let (b, bh) = pair(&[300]);
    for gelu in [Gelu::Erf, Gelu::Tanh] {
        assert_close(
            &format!("bias_gelu {gelu}, half precision"),
            to_f32(ember_backend_ext::bias_gelu(xh.clone(), bh.clone(), gelu).reshape([231 * 300])),
            reference::bias_gelu(x.clone(), b.clone(), gelu).reshape([231 * 300]),
            tol,
        );
    }

    let dropout = DropoutSpec::new(0.1, 3);
    // Rows of 300 (in registers) and of 4,100 (past the registers' 4,096: the streaming form,
    // Note [Softmax rows in registers]).
    for (rows, width) in [(231, 300), (7, 4100)] {
        let (x, xh) = pair(&[rows, width]);
        let (x, xh) = (x.reshape([rows, width]), xh.reshape([rows, width]));
        let (b, bh) = pair(&[width]);
        let (r, rh) = pair(&[rows, width]);
        let (r, rh) = (r.reshape([rows, width]), rh.reshape([rows, width]));
        let (g, gh) = pair(&[width]);
        let fused = ember_backend_ext::bias_dropout_add_layer_norm(
            xh,
            bh.clone(),
            rh,
            gh,
            bh,
            dropout,
            1e-5,
        );
        let expected = reference::bias_dropout_add_layer_norm(x, b.clone(), r, g, b, dropout, 1e-5);
        assert_close(
            &format!("bias_dropout_add_layer_norm, half precision, rows of {width}"),
            to_f32(fused.reshape([rows * width])),
            expected.reshape([rows * width]),
            (3.0 * tol.0, tol.1),
        );
    }

    let n = 2 * 4 * 33 * 16;
    let (q, qh) = pair(&[n]);
    let (k, kh) = pair(&[n]);
    let (v, vh) = pair(&[n]);
    let shape = [2, 4, 33, 16];
    let mask = vec![
        vec![1.0; 33],
        (0..33).map(|j| (j < 20) as u8 as f32).collect(),
    ];
    let fused = ember_backend_ext::attention(
        qh.reshape(shape),
        kh.reshape(shape),
        vh.reshape(shape),
        mask_bias::<H>(&mask, device).cast(dtype),
        0.25,
        dropout,
    );
    let expected = reference::attention(
        q.reshape(shape),
        k.reshape(shape),
        v.reshape(shape),
        mask_bias::<NdArray>(&mask, &cpu),
        0.25,
        dropout,
    );
    assert_close(
        "attention, half precision",
        to_f32(fused.reshape([n])),
        expected.reshape([n]),
        tol,
    );
}

/// `FusedOps::cast_multi_tensor` (Note [Weights cast together]): 41 tensors (more than a
/// launch takes; one element, odd sizes, a strided one, one already in `dtype`) equal Burn's
/// cast of each, bit for bit; the one in `dtype` comes back as it is.
fn check_multi_cast<H: FusedOps>(device: &H::Device, dtype: DType) {
    let mut xs: Vec<Tensor<H, 2>> = vec![
        Tensor::random([1, 1], Distribution::Normal(0.0, 1.0), device),
        Tensor::random([3, 100_001], Distribution::Normal(0.0, 3.0), device),
        Tensor::random([7, 13], Distribution::Normal(0.0, 1e-3), device).transpose(),
        Tensor::<H, 2>::random([4, 5], Distribution::Normal(0.0, 1.0), device).cast(dtype),
    ];
    xs.extend((0..37).map(|i| {
        Tensor::random(
            [1 + i * 37 % 301, 2],
            Distribution::Normal(0.0, 1.0),
            device,
        )
    }));
    let cast = H::cast_multi_tensor(
        xs.iter()
            .map(|x| x.clone().into_primitive().tensor())
            .collect(),
        dtype.into(),
    );
    assert_eq!(cast.len(), xs.len());
    for (i, (x, c)) in xs.iter().zip(cast).enumerate() {
        let c: Tensor<H, 2> = Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(c));
        assert_eq!(c.dtype(), dtype, "tensor {i}");
        assert_eq!(c.dims(), x.dims(), "tensor {i}");
        let bits = |t: Tensor<H, 2>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        assert_eq!(bits(c), bits(x.clone().cast(dtype)), "tensor {i}");
    }
}

/// Note [LayerNorm statistics in f32]: the fused LayerNorm of half-precision rows keeps each
/// row's mean and `1/√(var + eps)` in f32, equal within f32 rounding (1e-5 relative) to the
/// f64 statistics: the mean of `x + bias + residual` (the kernel adds them in f32 and averages
/// the sums before storing them), `rstd` from the variance of the stored sums (`pre_norm`, in
/// the half type) about that mean. Statistics stored in the half type would be off by its
/// rounding (f16: up to 2.4e-4 relative; bf16: 2e-3). Rows with a mean far from zero
/// (about 4.5), 300 wide (in registers) and 4,100 (streaming).
fn check_layer_norm_statistics<H: FusedOps>(device: &H::Device, dtype: DType) {
    use burn::tensor::TensorPrimitive;
    let values = |t: Tensor<H, 2>| -> Vec<f64> { t.into_data().convert::<f64>().to_vec().unwrap() };
    let read = |t| values(Tensor::<H, 1>::from_primitive(TensorPrimitive::Float(t)).unsqueeze());
    for (rows, width) in [(31, 300), (5, 4100)] {
        let random = |mean: f64| {
            Tensor::<H, 2>::random([rows, width], Distribution::Normal(mean, 1.0), device)
                .cast(dtype)
        };
        let vector = |value: f64| {
            Tensor::<H, 1>::full([width], value, device)
                .cast(dtype)
                .into_primitive()
                .tensor()
        };
        let (x, residual) = (random(4.0), random(0.0));
        let forward = H::bias_dropout_add_layer_norm(
            x.clone().into_primitive().tensor(),
            vector(0.5),
            residual.clone().into_primitive().tensor(),
            vector(1.0),
            vector(0.0),
            DropoutSpec::NONE,
            None,
            1e-5,
        );
        let stat_dtype =
            |t: &burn::tensor::ops::FloatTensor<H>| burn::tensor::TensorMetadata::dtype(t);
        assert_eq!(stat_dtype(&forward.mean), DType::F32, "the mean's dtype");
        assert_eq!(stat_dtype(&forward.rstd), DType::F32, "rstd's dtype");
        let pre_norm = Tensor::<H, 2>::from_primitive(TensorPrimitive::Float(forward.pre_norm));
        assert_eq!(pre_norm.dtype(), dtype);
        let (x, residual, pre_norm) = (values(x), values(residual), values(pre_norm));
        let (mean, rstd) = (read(forward.mean), read(forward.rstd));
        for row in 0..rows {
            let at = row * width..(row + 1) * width;
            let m = x[at.clone()]
                .iter()
                .zip(&residual[at.clone()])
                .map(|(x, r)| x + 0.5 + r)
                .sum::<f64>()
                / width as f64;
            let var = pre_norm[at].iter().map(|y| (y - m).powi(2)).sum::<f64>() / width as f64;
            let r = 1.0 / (var + 1e-5).sqrt();
            assert!(
                (mean[row] - m).abs() <= 1e-5 * m.abs(),
                "rows of {width}, row {row}: mean {} against {m}",
                mean[row]
            );
            assert!(
                (rstd[row] - r).abs() <= 1e-5 * r,
                "rows of {width}, row {row}: rstd {} against {r}",
                rstd[row]
            );
        }
    }
}

/// Note [Unscaled per bucket]: half-precision tensors flattened and multiplied by a scale in
/// one launch (`flatten_multi_tensor`) equal Burn's `mul_scalar` of their `cat`, bit for bit:
/// the product in the half type (the scale rounded to it), not in f32 rounded once. At 1/3
/// the two differ on some elements, so a kernel multiplying in f32 fails.
fn check_flatten_scaled<H: FusedOps>(device: &H::Device, dtype: DType) {
    use burn::tensor::TensorPrimitive;
    let xs: Vec<Tensor<H, 1>> = [1, 4_099, 300_001]
        .into_iter()
        .map(|n| Tensor::<H, 1>::random([n], Distribution::Normal(0.0, 3.0), device).cast(dtype))
        .collect();
    let bits = |t: Tensor<H, 1>| -> Vec<u32> {
        assert_eq!(t.dtype(), dtype);
        let values: Vec<f32> = t.into_data().convert::<f32>().to_vec().unwrap();
        values.iter().map(|v| v.to_bits()).collect()
    };
    for scale in [1.0f32 / 3.0, 1.0 / 65_536.0] {
        let flat = H::flatten_multi_tensor(
            xs.iter()
                .map(|x| x.clone().into_primitive().tensor())
                .collect(),
            scale,
        );
        let got = bits(Tensor::from_primitive(TensorPrimitive::Float(flat)));
        let expected = bits(Tensor::cat(xs.clone(), 0).mul_scalar(scale));
        let first_difference = got.iter().zip(&expected).position(|(a, b)| a != b);
        assert_eq!(
            first_difference, None,
            "{dtype:?} flattened at scale {scale}"
        );
    }
}

#[test]
fn f16_flattening_scales_as_burn_multiplies() {
    check_flatten_scaled::<crate::Wgpu>(&super::wgpu::device(), DType::F16);
}

#[test]
fn f16_layer_norm_keeps_its_statistics_in_f32() {
    check_layer_norm_statistics::<crate::Wgpu>(&super::wgpu::device(), DType::F16);
}

#[test]
fn f16_kernels_on_wgpu_match_the_f32_reference() {
    check_half_precision::<crate::Wgpu>(&super::wgpu::device(), DType::F16, 1.0);
}

#[test]
fn f16_casts_of_many_tensors_are_burns_casts() {
    check_multi_cast::<crate::Wgpu>(&super::wgpu::device(), DType::F16);
}

/// In `kernels::cuda` with the other CUDA tests (`scripts/gpu-check.sh run kernels` runs that
/// module).
#[cfg(feature = "cuda")]
pub(super) fn check_bf16<H: FusedOps>(device: &H::Device) {
    check_half_precision::<H>(device, DType::BF16, 8.0);
    check_layer_norm_statistics::<H>(device, DType::BF16);
    check_flatten_scaled::<H>(device, DType::BF16);
    check_multi_cast::<H>(device, DType::BF16);
}
