//! `model.gemm = "cublaslt"` on CUDA (`backend-ext/src/cube/cublaslt.rs`): the products of a
//! BERT step as ember lays them out (dense layers on rows, their gradients through transposed
//! views, attention's batched products, a broadcast weight; the dense layer with its bias in
//! cuBLASLt's epilogue), in f32 and bf16, against the products of the same rounded values in
//! f64 on the host; each product must have run on cuBLASLt (its counter), not on CubeCL's
//! matmul.

use burn::tensor::{DType, Tensor, TensorPrimitive};
use ember_backend_ext::{FusedOps, Gemm, GemmPrecision};

use super::common::{random, values};

/// The host's row-major batched product of `a` `[P, m, k]` and `b` `[P | 1, k, n]` in f64,
/// with `Σ|a·b|` per element (the error bounds' scale).
fn host_product(
    a: &[f32],
    b: &[f32],
    [p, m, k, n]: [usize; 4],
    b_broadcast: bool,
) -> (Vec<f64>, Vec<f64>) {
    let (mut c, mut scale) = (vec![0.0; p * m * n], vec![0.0; p * m * n]);
    for q in 0..p {
        let qb = if b_broadcast { 0 } else { q };
        for i in 0..m {
            for j in 0..n {
                let (mut sum, mut abs) = (0.0f64, 0.0f64);
                for l in 0..k {
                    let x = f64::from(a[(q * m + i) * k + l]) * f64::from(b[(qb * k + l) * n + j]);
                    sum += x;
                    abs += x.abs();
                }
                c[(q * m + i) * n + j] = sum;
                scale[(q * m + i) * n + j] = abs;
            }
        }
    }
    (c, scale)
}

/// Error bound of one element: the operands' conversion inside the GEMM (TF32 keeps 10
/// mantissa bits; whether the tensor cores round or truncate, each operand is within 2·u of
/// itself, u = 2⁻¹¹, so a product within 4u: 4u·`Σ|a·b|`; bf16 and f16 operands are exact),
/// f32 accumulation over `k` terms (`(k + 2)·2⁻²⁴·Σ|a·b|`), and the output's rounding to its
/// dtype (`2⁻⁸|c|` in bf16).
fn bound(c: f64, scale: f64, k: usize, dtype: DType, f32_gemm: GemmPrecision) -> f64 {
    let u32 = f64::powi(2.0, -24);
    let operands = if dtype == DType::F32 {
        4.0 * f32_gemm.unit_roundoff()
    } else {
        0.0
    };
    let output = if dtype == DType::BF16 {
        f64::powi(2.0, -8)
    } else {
        u32
    };
    (operands + (k as f64 + 2.0) * u32) * scale + output * c.abs()
}

pub(super) fn check_cublaslt<B: FusedOps>(device: &B::Device) {
    let previous = ember_backend_ext::gpu_gemm();
    ember_backend_ext::set_gpu_gemm(Gemm::Cublaslt).expect("cuBLASLt opens on the GPU machine");
    let f32_gemm = B::f32_gemm_precision(device);
    // (what, [P, m, k, n], a stored transposed, b stored transposed, b broadcast over P)
    let cases: [(&str, [usize; 4], bool, bool, bool); 6] = [
        (
            "dense forward x·W",
            [1, 4 * 128, 768, 3072],
            false,
            false,
            false,
        ),
        ("dx = g·Wᵀ", [1, 4 * 128, 3072, 768], false, true, false),
        ("dW = xᵀ·g", [1, 768, 4 * 128, 3072], true, false, false),
        (
            "scores Q·Kᵀ per sample and head",
            [2 * 12, 128, 64, 128],
            false,
            true,
            false,
        ),
        ("Pᵀ·g, odd sizes", [3 * 5, 37, 29, 61], true, false, false),
        ("a broadcast weight", [6, 33, 70, 50], false, false, true),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (what, [p, m, k, n], a_t, b_t, b_one) in cases {
            let pb = if b_one { 1 } else { p };
            // Each operand stored row-major, or stored transposed and viewed back.
            let a = if a_t {
                random::<B, 3>([p, k, m], device).swap_dims(1, 2)
            } else {
                random::<B, 3>([p, m, k], device)
            }
            .cast(dtype);
            let b = if b_t {
                random::<B, 3>([pb, n, k], device).swap_dims(1, 2)
            } else {
                random::<B, 3>([pb, k, n], device)
            }
            .cast(dtype);
            let (a_host, b_host) = (values(a.clone()), values(b.clone()));
            let before = ember_backend_ext::cublaslt::products();
            let product = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(
                B::batched_matmul(a.into_primitive().tensor(), b.into_primitive().tensor()),
            ));
            assert_eq!(product.dims(), [p, m, n], "{what}");
            assert_eq!(product.dtype(), dtype, "{what}");
            let got = values(product);
            assert_eq!(
                ember_backend_ext::cublaslt::products(),
                before + 1,
                "{what} ({dtype:?}): the product did not run on cuBLASLt (refused: {})",
                ember_backend_ext::cublaslt::refusals()
            );
            let (expected, scale) = host_product(&a_host, &b_host, [p, m, k, n], b_one);
            let mut worst = (0usize, 0.0f64);
            for (i, ((&g, &e), &s)) in got.iter().zip(&expected).zip(&scale).enumerate() {
                let excess = (f64::from(g) - e).abs() / bound(e, s, k, dtype, f32_gemm);
                if !(excess <= worst.1) {
                    worst = (i, excess);
                }
            }
            let i = worst.0;
            assert!(
                worst.1 <= 1.0,
                "{what} ({dtype:?}): element {i} is {} where the host gives {} (bound {:.3e})",
                got[i],
                expected[i],
                bound(expected[i], scale[i], k, dtype, f32_gemm)
            );
        }
    }
    // The dense layer: rows flattened to one product, the bias added in cuBLASLt's epilogue.
    for dtype in [DType::F32, DType::BF16] {
        let ([b, s, i, o], k) = ([3, 37, 70, 50], 70);
        let x = random::<B, 3>([b, s, i], device).cast(dtype);
        let w = random::<B, 2>([i, o], device).cast(dtype);
        let bias = random::<B, 1>([o], device).cast(dtype);
        let (xh, wh, bh) = (values(x.clone()), values(w.clone()), values(bias.clone()));
        let before = ember_backend_ext::cublaslt::products();
        let y = ember_backend_ext::dense(x, w, Some(bias));
        assert_eq!(y.dims(), [b, s, o]);
        assert_eq!(
            ember_backend_ext::cublaslt::products(),
            before + 1,
            "dense ({dtype:?}): not one cuBLASLt product"
        );
        let got = values(y);
        let (expected, scale) = host_product(&xh, &wh, [1, b * s, k, o], true);
        for (e, ((&g, &c), &sc)) in got.iter().zip(&expected).zip(&scale).enumerate() {
            let c = c + f64::from(bh[e % o]);
            let sc = sc + f64::from(bh[e % o]).abs();
            let err = (f64::from(g) - c).abs();
            assert!(
                err <= bound(c, sc, k, dtype, f32_gemm),
                "dense ({dtype:?}): element {e} is {g} where the host gives {c}"
            );
        }
    }
    ember_backend_ext::set_gpu_gemm(previous).expect("the previous choice resolves");
}
