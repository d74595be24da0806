//! The kernels with half-precision storage against the f32 reference composition, in a test
//! binary of their own: Burn keeps per-device settings (the default float type among them), so
//! an f16 backend must not share a device with the f32 tests running in parallel threads.

use burn::tensor::{Distribution, Tensor};
use ember_backend_ext::{DropoutSpec, FusedOps, reference};

mod common;
use common::{assert_close, mask_bias};

/// The kernels with half-precision storage (f16 on wgpu, where WGSL has no bf16; bf16 on CUDA
/// through `scripts/gpu-check.sh`): forward outputs against the f32 reference composition on
/// NdArray from the same rounded inputs. Tolerance: the half type's rounding of inputs and
/// output (f16: 2⁻¹¹, bf16: 2⁻⁸ relative), 1e-2 absolute + 1e-2 relative for f16 (3e-2
/// absolute for LayerNorm, whose outputs reach ±4), 8× that for bf16.
fn check_half_precision<H: FusedOps, E: burn::tensor::Element>(device: &H::Device, scale: f32) {
    use burn::backend::NdArray;
    let tol = (1e-2 * scale, 1e-2 * scale);
    let cpu = Default::default();
    // A random f32 tensor rounded through E: on NdArray as f32, and on H.
    let pair = |shape: &[usize]| {
        let x = Tensor::<NdArray, 1>::random(
            [shape.iter().product::<usize>()],
            Distribution::Normal(0.0, 1.0),
            &cpu,
        );
        let data = x.into_data().convert::<E>();
        let half = Tensor::<H, 1>::from_data(data.clone(), device);
        (
            Tensor::<NdArray, 1>::from_data(data.convert::<f32>(), &cpu),
            half,
        )
    };
    let to_f32 =
        |t: Tensor<H, 1>| Tensor::<NdArray, 1>::from_data(t.into_data().convert::<f32>(), &cpu);

    let (x, xh) = pair(&[231, 300]);
    let (x, xh) = (x.reshape([231, 300]), xh.reshape([231, 300]));
    let (b, bh) = pair(&[300]);
    assert_close(
        "bias_gelu, half precision",
        to_f32(ember_backend_ext::bias_gelu(xh.clone(), bh.clone()).reshape([231 * 300])),
        reference::bias_gelu(x.clone(), b.clone()).reshape([231 * 300]),
        tol,
    );

    let (r, rh) = pair(&[231, 300]);
    let (r, rh) = (r.reshape([231, 300]), rh.reshape([231, 300]));
    let (g, gh) = pair(&[300]);
    let dropout = DropoutSpec::new(0.1, 3);
    let fused =
        ember_backend_ext::bias_dropout_add_layer_norm(xh, bh.clone(), rh, gh, bh, dropout, 1e-5);
    let expected = reference::bias_dropout_add_layer_norm(x, b.clone(), r, g, b, dropout, 1e-5);
    assert_close(
        "bias_dropout_add_layer_norm, half precision",
        to_f32(fused.reshape([231 * 300])),
        expected.reshape([231 * 300]),
        (3.0 * tol.0, tol.1),
    );

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
        mask_bias::<H>(&mask, device),
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

#[test]
fn f16_kernels_on_wgpu_match_the_f32_reference() {
    type H = burn::backend::wgpu::CubeBackend<
        burn::backend::wgpu::WgpuRuntime,
        burn::tensor::f16,
        i32,
        u32,
    >;
    check_half_precision::<H, burn::tensor::f16>(
        &burn::backend::wgpu::WgpuDevice::DefaultDevice,
        1.0,
    );
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    #[test]
    fn bf16_kernels_match_the_f32_reference() {
        type H = burn::backend::Cuda<burn::tensor::bf16, i32>;
        check_half_precision::<H, burn::tensor::bf16>(
            &burn::backend::cuda::CudaDevice::new(0),
            8.0,
        );
    }
}
