//! `model.gemm = "cublaslt"` on CUDA (`backend-ext/src/cube/cublaslt.rs`): the products of a
//! BERT step as ember lays them out (dense layers on rows, their gradients through transposed
//! views, attention's batched products, a broadcast weight; the dense layer with its bias in
//! cuBLASLt's epilogue), in f32 and bf16, against the products of the same rounded values in
//! f64 on the host; each product must have run on cuBLASLt (its counter), not on CubeCL's
//! matmul.

use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use ember_backend_ext::{CublasltSync, FusedOps, Gemm, GemmPrecision};

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
/// f32 accumulation over `k` terms (`(k + 2)·2⁻²⁴·Σ|a·b|`; a split-K algorithm adds its bf16
/// partial products in f32 too, `cublaslt_call.rs`'s reduction-scheme preference), and the
/// output's rounding to its dtype (`2⁻⁸|c|` in bf16); `(operands, output)`: their dtypes (a
/// weight gradient of bf16 operands is written in f32).
fn bound(
    c: f64,
    scale: f64,
    k: usize,
    (operands, output): (DType, DType),
    f32_gemm: GemmPrecision,
) -> f64 {
    let u32 = f64::powi(2.0, -24);
    let conversion = if operands == DType::F32 {
        4.0 * f32_gemm.unit_roundoff()
    } else {
        0.0
    };
    let rounding = if output == DType::BF16 {
        f64::powi(2.0, -8)
    } else {
        u32
    };
    (conversion + (k as f64 + 2.0) * u32) * scale + rounding * c.abs()
}

/// Asserts each element of `got` within [`bound`] of the host's `(product, Σ|a·b|)`, naming
/// the worst; operands and output in `dtype`.
fn assert_within(
    what: &str,
    got: &[f32],
    host: &(Vec<f64>, Vec<f64>),
    k: usize,
    dtype: DType,
    f32_gemm: GemmPrecision,
) {
    assert_within_as(what, got, host, k, (dtype, dtype), f32_gemm);
}

/// [`assert_within`] with the operands' and the output's dtypes apart.
fn assert_within_as(
    what: &str,
    got: &[f32],
    (expected, scale): &(Vec<f64>, Vec<f64>),
    k: usize,
    dtypes: (DType, DType),
    f32_gemm: GemmPrecision,
) {
    assert_eq!(got.len(), expected.len(), "{what}");
    let mut worst = (0usize, 0.0f64);
    for (i, ((&g, &e), &sc)) in got.iter().zip(expected).zip(scale).enumerate() {
        let excess = (f64::from(g) - e).abs() / bound(e, sc, k, dtypes, f32_gemm);
        if !(excess <= worst.1) {
            worst = (i, excess);
        }
    }
    let i = worst.0;
    assert!(
        worst.1 <= 1.0,
        "{what}: element {i} is {} where the host gives {} (bound {:.3e})",
        got[i],
        expected[i],
        bound(expected[i], scale[i], k, dtypes, f32_gemm)
    );
}

/// Restores the process's GEMM choice when dropped (also when a check fails).
struct GemmChoice(Gemm);

impl Drop for GemmChoice {
    fn drop(&mut self) {
        let _ = ember_backend_ext::set_gpu_gemm(self.0);
    }
}

/// Restores the process's `model.cublaslt_sync` when a test ends.
pub(super) struct SyncChoice(pub(super) CublasltSync);

impl Drop for SyncChoice {
    fn drop(&mut self) {
        ember_backend_ext::set_cublaslt_sync(self.0);
    }
}

/// What the counting runtime counts for a window of cuBLASLt products besides the products:
/// `(launches, host waits)`. With host waits: no launch, the wait for CubeCL's stream (a
/// `sync`; ember's own stream is not CubeCL's and is not counted). With device windows (Note
/// [Device-side GEMM windows]): the window kernel's launch, no sync (for a window of kinds
/// launched before: a kind's first window waits on the host; the first four device windows
/// read the `expired` flag after their products, a read, not a sync). Under Burn's plain CUDA backend
/// nothing is counted but the products.
fn window_counts(counting: bool) -> (u64, u64) {
    match (counting, ember_backend_ext::cublaslt_sync()) {
        (false, _) => (0, 0),
        (true, CublasltSync::Host) => (0, 1),
        (true, CublasltSync::Device) => (1, 0),
    }
}

/// `a` `[B, nh, m, k]` · `b` `[B, nh, k, n]` through `FusedOps::batched_matmul`, which must be
/// one cuBLASLt product, one launch and the window's counts ([`window_counts`]); the
/// product's values.
fn one_product<B: FusedOps>(
    a: Tensor<B, 4>,
    b: Tensor<B, 4>,
    what: &str,
    counting: bool,
) -> (Vec<usize>, Vec<f32>) {
    let device = a.device();
    // The kind's first product, uncounted: a window that launches a kind for the first time
    // waits on the host whatever `cublaslt_sync` says (CUDA's lazy loading: `cublaslt.rs`).
    drop(B::batched_matmul(
        a.clone().into_primitive().tensor(),
        b.clone().into_primitive().tensor(),
    ));
    // A sync completes the counts of the launches before it (`HostSyncs`).
    B::sync(&device).expect("the device's queue");
    let products = ember_backend_ext::cublaslt::products();
    let before = ember_backend_ext::HostSyncs::now();
    let product = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(B::batched_matmul(
        a.into_primitive().tensor(),
        b.into_primitive().tensor(),
    )));
    B::sync(&device).expect("the device's queue");
    let after = ember_backend_ext::HostSyncs::now();
    assert_eq!(
        ember_backend_ext::cublaslt::products(),
        products + 1,
        "{what}: the product did not run on cuBLASLt (refused so far: {})",
        ember_backend_ext::cublaslt::refusals()
    );
    let (window_launches, window_syncs) = window_counts(counting);
    assert_eq!(
        (after.launches - before.launches, after.syncs - before.syncs),
        (1 + window_launches, u64::from(counting) + window_syncs),
        "{what}: (launches, host syncs) of one cuBLASLt product (one launch) and its window \
         ({:?}), then one sync of the test's",
        ember_backend_ext::cublaslt_sync()
    );
    // Note [Device-side GEMM windows]: the window kernel reaches CUDA without CubeCL's flush,
    // which on CUDA waits for the device to reach the previous flush.
    assert_eq!(
        after.flushes - before.flushes,
        0,
        "{what}: flushes of CubeCL's queue in one cuBLASLt window ({:?})",
        ember_backend_ext::cublaslt_sync()
    );
    (product.dims().to_vec(), values(product))
}

/// The products of a BERT step on cuBLASLt against the host; `counting`: whether `B` counts
/// its launches and host waits (`CountingCuda`), so that each window's are checked.
pub(super) fn check_cublaslt<B: FusedOps>(device: &B::Device, counting: bool) {
    let _restore = GemmChoice(ember_backend_ext::gpu_gemm());
    ember_backend_ext::set_gpu_gemm(Gemm::Cublaslt).expect("cuBLASLt opens on the GPU machine");
    let f32_gemm = B::f32_gemm_precision(device);
    // The first window on a runtime sets up (device windows: the flags' upload and a check of
    // the stream memory operations, one sync); the counted windows come after it.
    let warm_up = B::batched_matmul(
        random::<B, 4>([1, 1, 8, 8], device)
            .into_primitive()
            .tensor(),
        random::<B, 4>([1, 1, 8, 8], device)
            .into_primitive()
            .tensor(),
    );
    drop(warm_up);
    // (what, [samples, heads, m, k, n], a stored transposed, b stored transposed, b broadcast
    // over samples and heads): the dense layers' products (rows flattened: one sample, one
    // head) and attention's per sample and head, on operands laid out as the attention op
    // keeps them (contiguous [B, nh, S, hd]; transposes as views).
    let cases: [(&str, [usize; 5], bool, bool, bool); 7] = [
        (
            "dense forward x·W",
            [1, 1, 4 * 128, 768, 3072],
            false,
            false,
            false,
        ),
        ("dx = g·Wᵀ", [1, 1, 4 * 128, 3072, 768], false, true, false),
        ("dW = xᵀ·g", [1, 1, 768, 4 * 128, 3072], true, false, false),
        (
            "scores Q·Kᵀ per sample and head",
            [2, 12, 128, 64, 128],
            false,
            true,
            false,
        ),
        (
            "dK = dSᵀ·Q, odd sizes",
            [3, 5, 37, 29, 61],
            true,
            false,
            false,
        ),
        ("both transposed", [2, 3, 33, 40, 27], true, true, false),
        ("a broadcast weight", [2, 3, 33, 70, 50], false, false, true),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (what, [s, h, m, k, n], a_t, b_t, b_one) in cases {
            let (sb, hb) = if b_one { (1, 1) } else { (s, h) };
            // Each operand stored row-major, or stored transposed and viewed back.
            let a = if a_t {
                random::<B, 4>([s, h, k, m], device).swap_dims(2, 3)
            } else {
                random::<B, 4>([s, h, m, k], device)
            }
            .cast(dtype);
            let b = if b_t {
                random::<B, 4>([sb, hb, n, k], device).swap_dims(2, 3)
            } else {
                random::<B, 4>([sb, hb, k, n], device)
            }
            .cast(dtype);
            let (a_host, b_host) = (values(a.clone()), values(b.clone()));
            let what = format!("{what} ({dtype:?})");
            let (dims, got) = one_product(a, b, &what, counting);
            assert_eq!(dims, [s, h, m, n], "{what}");
            let host = host_product(&a_host, &b_host, [s * h, m, k, n], b_one);
            assert_within(&what, &got, &host, k, dtype, f32_gemm);
        }
        // Two products in one window of host waits (attention's dQ and dK; the dense layer's
        // dx and dW): two cuBLASLt products, two launches.
        let [s, h, m, k, n] = [2, 3, 33, 40, 27];
        let a1 = random::<B, 4>([s, h, m, k], device).cast(dtype);
        let b1 = random::<B, 4>([s, h, n, k], device)
            .cast(dtype)
            .swap_dims(2, 3);
        let a2 = random::<B, 4>([s, h, k, m], device)
            .cast(dtype)
            .swap_dims(2, 3);
        let b2 = random::<B, 4>([s, h, k, n], device).cast(dtype);
        let hosts = [(&a1, &b1), (&a2, &b2)].map(|(a, b)| {
            host_product(
                &values(a.clone()),
                &values(b.clone()),
                [s * h, m, k, n],
                false,
            )
        });
        // The kinds' first products, uncounted (as in `one_product`).
        drop(B::batched_matmul_pair(
            a1.clone().into_primitive().tensor(),
            b1.clone().into_primitive().tensor(),
            a2.clone().into_primitive().tensor(),
            b2.clone().into_primitive().tensor(),
        ));
        B::sync(device).expect("the device's queue");
        let (products, launches) = (
            ember_backend_ext::cublaslt::products(),
            ember_backend_ext::HostSyncs::now().launches,
        );
        let (c1, c2) = B::batched_matmul_pair(
            a1.into_primitive().tensor(),
            b1.into_primitive().tensor(),
            a2.into_primitive().tensor(),
            b2.into_primitive().tensor(),
        );
        B::sync(device).expect("the device's queue");
        assert_eq!(
            (
                ember_backend_ext::cublaslt::products() - products,
                ember_backend_ext::HostSyncs::now().launches - launches
            ),
            (2, 2 + window_counts(counting).0),
            "a pair ({dtype:?}): two cuBLASLt products in one window, a launch each (and the \
             window kernel's with device windows)"
        );
        for (i, (c, host)) in [c1, c2].into_iter().zip(&hosts).enumerate() {
            let got = values(Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(c)));
            assert_within(
                &format!("pair product {i} ({dtype:?})"),
                &got,
                host,
                k,
                dtype,
                f32_gemm,
            );
        }
    }
    // Head-strided views (what split_heads makes before the attention op copies them): the
    // heads' batch has no single stride, so CubeCL's matmul runs it (not a refusal).
    let q = random::<B, 4>([2, 8, 4, 16], device).swap_dims(1, 2);
    let k = random::<B, 4>([2, 8, 4, 16], device)
        .swap_dims(1, 2)
        .swap_dims(2, 3);
    let (products, refusals) = (
        ember_backend_ext::cublaslt::products(),
        ember_backend_ext::cublaslt::refusals(),
    );
    // In a pair beside a product that has a plan: that one alone runs on cuBLASLt.
    let (a, b) = (
        random::<B, 4>([2, 4, 8, 16], device),
        random::<B, 4>([2, 4, 16, 8], device),
    );
    let (scores, other) = B::batched_matmul_pair(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        a.into_primitive().tensor(),
        b.into_primitive().tensor(),
    );
    for product in [scores, other] {
        assert_eq!(
            Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(product)).dims(),
            [2, 4, 8, 8]
        );
    }
    assert_eq!(
        (
            ember_backend_ext::cublaslt::products(),
            ember_backend_ext::cublaslt::refusals()
        ),
        (products + 1, refusals),
        "a head-strided product has no cuBLASLt plan; the other of its pair runs there"
    );
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
            "dense ({dtype:?}): not one cuBLASLt product (the bias in its epilogue)"
        );
        let got = values(y);
        let (mut expected, mut scale) = host_product(&xh, &wh, [1, b * s, k, o], true);
        for (e, (c, sc)) in expected.iter_mut().zip(&mut scale).enumerate() {
            *c += f64::from(bh[e % o]);
            *sc += f64::from(bh[e % o]).abs();
        }
        assert_within(
            &format!("dense with bias ({dtype:?})"),
            &got,
            &(expected, scale),
            k,
            dtype,
            f32_gemm,
        );
    }
    check_dense_backward::<B>(device, counting, f32_gemm);
}

/// `m` `[rows, cols]` row-major, transposed.
fn transposed(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows)
        .map(|e| m[(e % rows) * cols + e / rows])
        .collect()
}

/// The dense layer's backward on cuBLASLt: `dx = g·Wᵀ` and `dW = xᵀ·g` in one window, and the
/// bias gradient `db = Σ_rows g` written by `dW`'s epilogue (`CUBLASLT_EPILOGUE_BGRADA`),
/// against the host in f32 and bf16, and with bf16 operands `dW` and `db` written in f32
/// (`MasterOps::dense_backward_as`, autocast's weight gradients: Note [cuBLASLt's f32 output]).
/// At BERT-like sizes (multiples of 64) the epilogue must have run: two products, one bias
/// gradient, two launches and no reduction or cast of its own (the launches are counted under
/// the counting runtime only); with bf16 operands written in f32, for which cuBLASLt lists no
/// BGRADA kernel, it may have been refused (then said), and where it ran the same counts hold.
/// At odd sizes (rows of 100 bytes in bf16) cuBLASLt may have no
/// BGRADA kernel; the values must hold either way (the fallback sums `g`'s columns: `sum_dim`,
/// or in f32 the column sums of Note [Parameter gradients in f32]).
fn check_dense_backward<B: FusedOps>(device: &B::Device, counting: bool, f32_gemm: GemmPrecision) {
    // (the operands' dtype, the weight and bias gradients' dtype)
    for (dtype, grads_dtype) in [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::BF16, DType::F32),
    ] {
        for ([b, s, i, o], aligned) in [([4, 32, 128, 192], true), ([3, 37, 70, 50], false)] {
            let rows = b * s;
            let x = random::<B, 3>([b, s, i], device).cast(dtype);
            let w = random::<B, 2>([i, o], device).cast(dtype);
            let g = random::<B, 3>([b, s, o], device).cast(dtype);
            let (xh, wh, gh) = (values(x.clone()), values(w.clone()), values(g.clone()));
            let backward = |x: Tensor<B, 3>, w: Tensor<B, 2>, g: Tensor<B, 3>| {
                let (x, w, g) = (
                    x.into_primitive().tensor(),
                    w.into_primitive().tensor(),
                    g.into_primitive().tensor(),
                );
                if grads_dtype == dtype {
                    B::dense_backward(x, w, g, true)
                } else {
                    let as_float = FloatDType::from(grads_dtype);
                    B::dense_backward_as(x, w, g, true, as_float)
                }
            };
            // The kinds' first products, uncounted (as in `one_product`).
            drop(backward(x.clone(), w.clone(), g.clone()));
            B::sync(device).expect("the device's queue");
            let (products, gradients, launches) = (
                ember_backend_ext::cublaslt::products(),
                ember_backend_ext::cublaslt::bias_gradients(),
                ember_backend_ext::HostSyncs::now().launches,
            );
            let (dx, dw, db) = backward(x, w, g);
            B::sync(device).expect("the device's queue");
            let what = format!(
                "dense backward [{rows}, {i}]·[{i}, {o}] ({dtype:?}, dW and db in {grads_dtype:?})"
            );
            // cuBLASLt documents BGRADA's vector as the output's type but lists no kernel for
            // bf16 operands with an f32 output and vector: there a refusal is allowed (the
            // kind then runs without the epilogue, its bias gradient a column sum), and said.
            let epilogue_documented = !(dtype == DType::BF16 && grads_dtype == DType::F32);
            if aligned && !epilogue_documented {
                let ran = ember_backend_ext::cublaslt::bias_gradients() - gradients;
                assert_eq!(
                    ember_backend_ext::cublaslt::products() - products,
                    2,
                    "{what}: cuBLASLt products (refused so far: {})",
                    ember_backend_ext::cublaslt::refusals()
                );
                assert!(
                    ran <= 1,
                    "{what}: {ran} bias gradients in an epilogue, for one dW"
                );
                if ran == 1 {
                    assert_eq!(
                        ember_backend_ext::HostSyncs::now().launches - launches,
                        2 + window_counts(counting).0,
                        "{what}: launches with db in dW's epilogue: no reduction or cast"
                    );
                }
                println!(
                    "{what}: the bias gradient {} (refused so far: {})",
                    if ran == 1 {
                        "in dW's epilogue"
                    } else {
                        "by a column sum: cuBLASLt refused BGRADA for bf16 operands written in f32"
                    },
                    ember_backend_ext::cublaslt::refusals()
                );
            } else if aligned {
                assert_eq!(
                    (
                        ember_backend_ext::cublaslt::products() - products,
                        ember_backend_ext::cublaslt::bias_gradients() - gradients,
                        ember_backend_ext::HostSyncs::now().launches - launches,
                    ),
                    (2, 1, 2 + window_counts(counting).0),
                    "{what}: (cuBLASLt products, bias gradients in an epilogue, launches) should \
                     be two products in one window, db in dW's epilogue and no reduction or \
                     cast of its own (refused so far: {})",
                    ember_backend_ext::cublaslt::refusals()
                );
            }
            let dx = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(dx));
            let dw = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(dw));
            let db = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(
                db.expect("a bias gradient"),
            ));
            assert_eq!(
                (dx.dtype(), dw.dtype(), db.dtype()),
                (dtype, grads_dtype, grads_dtype),
                "{what}: the gradients' dtypes"
            );
            assert_eq!(db.dims(), [o], "{what}: db's shape");
            let (got_dx, got_dw, got_db) = (values(dx), values(dw), values(db));
            let host_dx = host_product(&gh, &transposed(&wh, i, o), [1, rows, o, i], false);
            assert_within(
                &format!("{what}: dx"),
                &got_dx,
                &host_dx,
                o,
                dtype,
                f32_gemm,
            );
            let host_dw = host_product(&transposed(&xh, rows, i), &gh, [1, i, rows, o], false);
            assert_within_as(
                &format!("{what}: dW"),
                &got_dw,
                &host_dw,
                rows,
                (dtype, grads_dtype),
                f32_gemm,
            );
            let host_db: (Vec<f64>, Vec<f64>) = (0..o)
                .map(|j| {
                    (0..rows)
                        .map(|r| f64::from(gh[r * o + j]))
                        .fold((0.0, 0.0), |(sum, abs), v| (sum + v, abs + v.abs()))
                })
                .unzip();
            assert_within_as(
                &format!("{what}: db"),
                &got_db,
                &host_db,
                rows,
                (dtype, grads_dtype),
                f32_gemm,
            );
        }
    }
}
