//! Vectorized f32 math of NdArray's host loops (`host_layer.rs`, `cross_entropy.rs`): `exp` and
//! `erf` as branch-free polynomials, and the row kernels built on them, compiled for AVX-512,
//! for AVX2 + FMA and for the build's baseline, the best one picked at run time.
//!
//! The scalar `f32::exp` and `libm::erff` are calls that the compiler cannot vectorize: with
//! them GELU forward and backward cost ~3 ns per element on this project's 2-core Xeon, several
//! times PyTorch's vectorized CPU kernels (docs/performance.md, CPU performance). The polynomials follow
//! PyTorch's CPU kernels, which vectorize the same way:
//! - `erf`: Abramowitz & Stegun 7.1.26 (absolute error ≤ 1.5e-7), the formula and coefficients
//!   of PyTorch's `Vectorized<float>::erf` (`aten/src/ATen/cpu/vec/vec256/vec256_float.h`),
//!   which its GELU (`aten/src/ATen/native/cpu/Activation.cpp`) uses.
//! - `exp`: Cephes' `expf` (range reduction by `ln 2` split in two constants, degree-5
//!   polynomial; relative error ~1e-7), as in `avx_mathfun.h`. PyTorch uses SLEEF's
//!   `expf_u10` (1 ulp) for the same purpose.
//!
//! Every variant runs the same IEEE operations in the same order (`mul_add` is a fused
//! multiply-add everywhere, the baseline computing it in software), and the row sums use 16
//! lane-wise partial sums on every variant, so results are bitwise identical whichever variant
//! a CPU gets (NaN's sign aside): a run stays deterministic across machines. The tests run
//! every variant the CPU has and compare their bits.

use std::f32::consts::{FRAC_1_SQRT_2, LOG2_E};

use crate::Gelu;

/// `√(2/π)` and the cubic coefficient of the tanh GELU, in f32.
const SQRT_2_OVER_PI: f32 = crate::gelu::SQRT_2_OVER_PI as f32;
const GELU_TANH_CUBIC: f32 = crate::gelu::GELU_TANH_CUBIC as f32;
const GELU_TANH_CLAMP: f32 = crate::gelu::GELU_TANH_CLAMP as f32;

/// 1/√(2π), as the reference's f64 constant rounded to f32.
pub(crate) const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// Lanes of the partial sums and maxima (one AVX-512 vector, two AVX2 vectors).
const LANES: usize = 16;

/// Test hook: which variant the kernels run (0: the best the CPU has; 1: the baseline; 2:
/// AVX2 + FMA where the CPU has them), so that one machine's tests compare every variant.
#[cfg(test)]
static FORCE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

#[inline(always)]
pub(crate) fn forced() -> u8 {
    #[cfg(test)]
    {
        FORCE.load(std::sync::atomic::Ordering::Relaxed)
    }
    #[cfg(not(test))]
    {
        0
    }
}

/// Defines `fn $name` that runs `$body` compiled for AVX-512 (`avx512f`), for AVX2 + FMA, or
/// for the baseline, whichever the CPU has (`is_x86_feature_detected!`, cached by std). The
/// body and everything it calls must be `#[inline(always)]` to be compiled for the feature set.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn avx512($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                let force = $crate::host_math::forced();
                if force == 0 && std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features `avx512` is compiled for (AVX-512F
                    // implies AVX2 and FMA on every CPU that has it).
                    return unsafe { avx512($($arg),*) };
                }
                if force != 1
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the features `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

/// `e^x`, Cephes' `expf`. Inputs are clamped to ±88 (`e^88` is finite in f32); results below
/// the smallest normal f32 (`x < −87.3`) may flush to 0. NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // `clamp` keeps NaN (`min`/`max` would turn it into a bound).
    let x = x.clamp(-88.0, 88.0);
    let n = (x * LOG2_E + 0.5).floor();
    // x − n·ln 2, with ln 2 = C1 + C2 split so that n·C1 is exact.
    let r = n.mul_add(-0.693_359_4, x);
    let r = n.mul_add(2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_2e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5); // Cephes' 5.0000001201e-1, which rounds to 0.5 in f32
    let y = p.mul_add(r * r, r) + 1.0;
    // 2^n from n + 127 written into the exponent bits: n + 127 + 2^23 holds n + 127 in its
    // low mantissa bits, which the shift moves into the exponent (discarding the rest).
    let scale = f32::from_bits((n + 8_388_735.0).to_bits() << 23);
    y * scale
}

/// `(erf(x), e^(−x²))`: Abramowitz & Stegun 7.1.26 as PyTorch's `Vectorized<float>::erf`,
/// `sign(x)·(1 − t·(a1 + t·(a2 + t·(a3 + t·(a4 + t·a5))))·e^(−x²))`, `t = 1/(1 + p·|x|)`;
/// absolute error ≤ 1.5e-7 plus f32 rounding (≤ 4e-7 in all, tested). The exponential is returned for GELU's
/// backward, whose density is the same `e^(−z²/2)`.
#[inline(always)]
pub(crate) fn erf_and_exp(x: f32) -> (f32, f32) {
    let a = x.abs();
    let t = 1.0 / 0.327_591_1f32.mul_add(a, 1.0);
    let mut r = 1.061_405_4f32;
    r = r.mul_add(t, -1.453_152);
    r = r.mul_add(t, 1.421_413_8);
    r = r.mul_add(t, -0.284_496_74);
    r = r.mul_add(t, 0.254_829_6);
    let e = exp(-(x * x));
    let y = (-(r * t)).mul_add(e, 1.0);
    (y.copysign(x), e)
}

/// Sums `LANES` partial sums pairwise.
#[inline(always)]
fn reduce_sum(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `Σ f(a_i, b_i)` over the shorter length as `LANES` lane-wise partial sums (element `i`
/// into lane `i mod LANES`), reduced pairwise. Fixed-size chunks, so that the loop vectorizes.
#[inline(always)]
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let len = a.len().min(b.len());
    let (a_chunks, a_rest) = a[..len].as_chunks::<LANES>();
    let (b_chunks, b_rest) = b[..len].as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for (a, b) in a_chunks.iter().zip(b_chunks) {
        for lane in 0..LANES {
            acc[lane] += f(a[lane], b[lane]);
        }
    }
    for ((acc, &a), &b) in acc.iter_mut().zip(a_rest).zip(b_rest) {
        *acc += f(a, b);
    }
    reduce_sum(acc)
}

/// The tanh GELU's gate `σ(2u)`, `u = √(2/π)(z + 0.044715 z³)` (Note [Two GELUs] in
/// `gelu.rs`), without an exponential that can overflow.
#[inline(always)]
fn tanh_gate(z: f32) -> f32 {
    let z = z.clamp(-GELU_TANH_CLAMP, GELU_TANH_CLAMP);
    let t = (z * z).mul_add(GELU_TANH_CUBIC * z, z) * (2.0 * SQRT_2_OVER_PI);
    // σ(t) from e = e^(−|t|) ≤ 1: `1 / (1 + e)` for t ≥ 0, `e / (1 + e)` below.
    let e = exp(-t.abs());
    let r = 1.0 / (1.0 + e);
    if t >= 0.0 { r } else { e * r }
}

multiversion! {
    /// `out = GELU(x + bias)` over rows of `bias.len()`: erf, `z · ½(1 + erf(z/√2))`; tanh,
    /// `z · σ(2u)`.
    pub(crate) fn bias_gelu_rows(x: &[f32], bias: &[f32], out: &mut [f32], gelu: Gelu) {
        let n = bias.len();
        for (out, x) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
            match gelu {
                Gelu::Erf => {
                    for ((o, &x), &b) in out.iter_mut().zip(x).zip(bias) {
                        let z = x + b;
                        *o = z * ((erf_and_exp(z * FRAC_1_SQRT_2).0 + 1.0) * 0.5);
                    }
                }
                Gelu::Tanh => {
                    for ((o, &x), &b) in out.iter_mut().zip(x).zip(bias) {
                        let z = x + b;
                        *o = z * tanh_gate(z);
                    }
                }
            }
        }
    }
}

multiversion! {
    /// `out = grad · GELU'(z)`, `z = x + bias`, over rows of `bias.len()`: erf,
    /// `Φ(z) + z·φ(z)`; tanh, `σ(2u) + z · σ(2u)(1 − σ(2u)) · 2u'`.
    pub(crate) fn bias_gelu_backward_rows(
        x: &[f32],
        bias: &[f32],
        grad: &[f32],
        out: &mut [f32],
        gelu: Gelu,
    ) {
        let n = bias.len();
        for ((out, x), grad) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)).zip(grad.chunks_exact(n)) {
            match gelu {
                Gelu::Erf => {
                    for (((o, &x), &b), &g) in out.iter_mut().zip(x).zip(bias).zip(grad) {
                        let z = x + b;
                        let (erf, density) = erf_and_exp(z * FRAC_1_SQRT_2);
                        let cdf = (erf + 1.0) * 0.5;
                        let pdf = density * FRAC_1_SQRT_2PI;
                        *o = g * z.mul_add(pdf, cdf);
                    }
                }
                Gelu::Tanh => {
                    for (((o, &x), &b), &g) in out.iter_mut().zip(x).zip(bias).zip(grad) {
                        let z = x + b;
                        let gate = tanh_gate(z);
                        let c = z.clamp(-GELU_TANH_CLAMP, GELU_TANH_CLAMP);
                        let du = (c * c).mul_add(3.0 * GELU_TANH_CUBIC, 1.0) * (2.0 * SQRT_2_OVER_PI);
                        *o = g * z.mul_add(gate * (1.0 - gate) * du, gate);
                    }
                }
            }
        }
    }
}

multiversion! {
    /// The largest value of `x` (−∞ for an empty slice; NaN elements are skipped, as by
    /// `f32::max`).
    pub(crate) fn max(x: &[f32]) -> f32 {
        let (chunks, rest) = x.as_chunks::<LANES>();
        let mut acc = [f32::NEG_INFINITY; LANES];
        for chunk in chunks {
            for lane in 0..LANES {
                acc[lane] = acc[lane].max(chunk[lane]);
            }
        }
        rest.iter().chain(acc.iter()).copied().fold(f32::NEG_INFINITY, f32::max)
    }
}

multiversion! {
    /// `Σ e^(x − shift)`.
    pub(crate) fn sum_exp(x: &[f32], shift: f32) -> f32 {
        lane_sum(x, x, |v, _| exp(v - shift))
    }
}

multiversion! {
    /// `x ← e^(x − shift)` in place; returns the new `Σ x`.
    pub(crate) fn exp_in_place_sum(x: &mut [f32], shift: f32) -> f32 {
        for v in x.iter_mut() {
            *v = exp(*v - shift);
        }
        lane_sum(x, x, |v, _| v)
    }
}

multiversion! {
    /// `out = e^(x − shift) · scale`.
    pub(crate) fn exp_scaled(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = exp(v - shift) * scale;
        }
    }
}

multiversion! {
    /// `Σ a·b` over the shorter length.
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        lane_sum(a, b, |a, b| a * b)
    }
}

multiversion! {
    /// LayerNorm of one row: `out = (pre − μ)·rstd·γ + β`; returns `(μ, rstd)`, with
    /// `μ = Σ pre / n`, `var = Σ (pre − μ)² / n`, `rstd = 1/√(var + eps)` (biased variance, as
    /// PyTorch's `layer_norm`).
    pub(crate) fn layer_norm_row(pre: &[f32], gamma: &[f32], beta: &[f32], eps: f32, out: &mut [f32]) -> (f32, f32) {
        let inv_n = 1.0 / pre.len() as f32;
        let mu = lane_sum(pre, pre, |p, _| p) * inv_n;
        let var = lane_sum(pre, pre, |p, _| (p - mu) * (p - mu)) * inv_n;
        let rs = 1.0 / (var + eps).sqrt();
        for (((o, &p), &g), &b) in out.iter_mut().zip(pre).zip(gamma).zip(beta) {
            *o = (p - mu) * rs * g + b;
        }
        (mu, rs)
    }
}

multiversion! {
    /// LayerNorm's backward of one row from the saved `pre`, `μ`, `rstd`:
    /// `grad_x_hat = grad · x̂` and
    /// `grad_pre = rstd · (g − mean(g) − x̂ · mean(g · x̂))`, `g = grad · γ`, `x̂ = (pre − μ)·rstd`.
    pub(crate) fn layer_norm_backward_row(
        grad: &[f32],
        pre: &[f32],
        gamma: &[f32],
        mu: f32,
        rs: f32,
        grad_pre: &mut [f32],
        grad_x_hat: &mut [f32],
    ) {
        let inv_n = 1.0 / pre.len() as f32;
        for (((dxh, &g), &p), dp) in grad_x_hat.iter_mut().zip(grad).zip(pre).zip(grad_pre.iter_mut()) {
            *dxh = g * ((p - mu) * rs);
            *dp = g;
        }
        // Σ g = Σ grad·γ and Σ g·x̂ = Σ grad_x_hat·γ, lane-wise.
        let mean_g = lane_sum(grad, gamma, |g, w| g * w) * inv_n;
        let mean_gx = lane_sum(grad_x_hat, gamma, |d, w| d * w) * inv_n;
        for ((dp, &p), &w) in grad_pre.iter_mut().zip(pre).zip(gamma) {
            let x_hat = (p - mu) * rs;
            *dp = (*dp * w - mean_g - x_hat * mean_gx) * rs;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Points over [−lo, hi] plus the edges that matter: 0, ±tiny, the clamps, large values.
    fn points(lo: f32, hi: f32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..=20_000)
            .map(|i| lo + (hi - lo) * i as f32 / 20_000.0)
            .collect();
        v.extend([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 87.9, 88.0, -87.0]);
        v
    }

    /// Every variant this CPU can run (AVX-512, AVX2 + FMA, baseline) gives the same bits for
    /// every kernel: a run does not depend on the machine's vector width.
    #[test]
    fn every_variant_gives_the_same_bits() {
        use std::sync::atomic::Ordering;
        let n = 771; // 48 lanes of 16 and a tail
        let x: Vec<f32> = (0..2 * n)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 0.0123)
            .chain([0.0, -0.0, 88.5, -90.0, 1e-30, f32::NAN])
            .collect();
        let g: Vec<f32> = x.iter().map(|v| (v * 1.7).sin()).collect();
        let bias: Vec<f32> = (0..x.len() / 2).map(|i| (i as f32 * 0.37).cos()).collect();
        let rows = 2 * (x.len() / 2);
        let (x2, g2) = (&x[..rows], &g[..rows]);
        let gamma: Vec<f32> = bias.iter().map(|b| 1.0 + b * 0.5).collect();
        let run = || {
            let mut gelu = vec![0.0; 2 * rows];
            let mut gelu_grad = vec![0.0; 2 * rows];
            for (k, form) in [Gelu::Erf, Gelu::Tanh].into_iter().enumerate() {
                let part = k * rows..(k + 1) * rows;
                bias_gelu_rows(x2, &bias, &mut gelu[part.clone()], form);
                bias_gelu_backward_rows(x2, &bias, g2, &mut gelu_grad[part], form);
            }
            let finite = &x[..x.len() - 1];
            let m = max(finite);
            let mut exps = finite.to_vec();
            let s = exp_in_place_sum(&mut exps, m);
            let mut scaled = vec![0.0; finite.len()];
            exp_scaled(finite, m, 0.25, &mut scaled);
            let row = &x2[..bias.len()];
            let mut normed = vec![0.0; row.len()];
            let (mu, rs) = layer_norm_row(row, &gamma, &bias, 1e-12, &mut normed);
            let (mut dp, mut dxh) = (vec![0.0; row.len()], vec![0.0; row.len()]);
            layer_norm_backward_row(&g2[..row.len()], row, &gamma, mu, rs, &mut dp, &mut dxh);
            let scalars = vec![m, s, sum_exp(finite, m), dot(&x, &g), max(&x), mu, rs];
            // Bits, with every NaN as one value (a NaN's sign differs between x86's vector
            // and scalar instructions, and means nothing).
            [gelu, gelu_grad, exps, scaled, normed, dp, dxh, scalars].map(|v| {
                v.iter()
                    .map(|f| if f.is_nan() { u32::MAX } else { f.to_bits() })
                    .collect::<Vec<u32>>()
            })
        };
        let best = run();
        for force in [2, 1] {
            FORCE.store(force, Ordering::Relaxed);
            let other = run();
            FORCE.store(0, Ordering::Relaxed);
            for (k, (a, b)) in best.iter().zip(&other).enumerate() {
                let first = a.iter().zip(b).position(|(a, b)| a != b);
                assert!(
                    first.is_none(),
                    "output {k} differs between the best variant and variant {force} at {first:?}"
                );
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_std() {
        for x in points(-87.0, 88.0) {
            let (ours, exact) = (exp(x), (x as f64).exp());
            let rel = ((ours as f64 - exact) / exact).abs();
            assert!(
                rel < 2.5e-7,
                "exp({x}) = {ours}, exact {exact}, relative error {rel:e}"
            );
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e4), 0.0);
        assert!(exp(-88.0) < 1e-37, "below the normal range: 0 or denormal");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(1e4).is_finite(), "clamped, not infinite");
    }

    #[test]
    fn erf_is_within_its_bound_of_f64() {
        for x in points(-6.0, 6.0) {
            let (ours, e) = erf_and_exp(x);
            let exact = libm::erf(x as f64);
            // The formula's 1.5e-7 plus f32 rounding of `1 − r·t·e` (3.1e-7 at most here).
            assert!(
                (ours as f64 - exact).abs() < 4e-7,
                "erf({x}) = {ours}, exact {exact}"
            );
            // Against e^(−x²) of the f32-rounded square, which is what is exponentiated.
            let exact_e = (-(x * x) as f64).exp();
            assert!(
                (e as f64 - exact_e).abs() <= 2.5e-7 * exact_e + 1e-37,
                "e^-x² at {x}"
            );
            assert_eq!(ours.is_sign_negative(), x.is_sign_negative(), "sign at {x}");
        }
        assert_eq!(erf_and_exp(30.0).0, 1.0);
        assert_eq!(erf_and_exp(-30.0).0, -1.0);
        assert!(erf_and_exp(f32::NAN).0.is_nan());
    }

    /// The dispatched kernels (whatever this CPU runs) against the same formulas evaluated one
    /// element at a time: bitwise for the elementwise ones, to f32 rounding for the sums.
    #[test]
    fn kernels_equal_their_scalar_formulas() {
        let n = 37; // not a multiple of the lanes: the tails are exercised
        let rows = 3;
        let x: Vec<f32> = (0..n * rows)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.11)
            .collect();
        let g: Vec<f32> = (0..n * rows)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.3)
            .collect();
        let bias: Vec<f32> = (0..n).map(|i| (i as f32 - 18.0) * 0.05).collect();
        let mut out = vec![0.0; n * rows];
        bias_gelu_rows(&x, &bias, &mut out, Gelu::Erf);
        for i in 0..n * rows {
            let z = x[i] + bias[i % n];
            let want = z * ((erf_and_exp(z * FRAC_1_SQRT_2).0 + 1.0) * 0.5);
            assert_eq!(out[i].to_bits(), want.to_bits(), "gelu at {i}");
        }
        bias_gelu_rows(&x, &bias, &mut out, Gelu::Tanh);
        for i in 0..n * rows {
            let z = x[i] + bias[i % n];
            assert_eq!(
                out[i].to_bits(),
                (z * tanh_gate(z)).to_bits(),
                "tanh gelu at {i}"
            );
        }
        // Each form against its f64 formula (Note [Two GELUs]; the tanh form's derivative as
        // NVIDIA's `bias_gelu_back` writes it).
        for form in [Gelu::Erf, Gelu::Tanh] {
            bias_gelu_rows(&x, &bias, &mut out, form);
            for i in 0..n * rows {
                let exact = form.value_f64((x[i] + bias[i % n]) as f64);
                assert!(
                    (out[i] as f64 - exact).abs() < 1e-6 * (1.0 + exact.abs()),
                    "{form} {i}: {} vs {exact}",
                    out[i]
                );
            }
            bias_gelu_backward_rows(&x, &bias, &g, &mut out, form);
            for i in 0..n * rows {
                let z = (x[i] + bias[i % n]) as f64;
                let exact = g[i] as f64 * form.derivative_f64(z);
                assert!(
                    (out[i] as f64 - exact).abs() < 2e-6 * (1.0 + exact.abs()),
                    "{form}' {i}: {} vs {exact}",
                    out[i]
                );
            }
        }
        let row = &x[..n];
        let m = max(row);
        assert_eq!(m, row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let exact: f64 = row.iter().map(|&v| ((v - m) as f64).exp()).sum();
        let s = sum_exp(row, m);
        assert!(
            ((s as f64 - exact) / exact).abs() < 1e-6,
            "sum_exp {s} vs {exact}"
        );
        let mut copy = row.to_vec();
        let s2 = exp_in_place_sum(&mut copy, m);
        assert_eq!(s.to_bits(), s2.to_bits(), "the same sum either way");
        for (c, &v) in copy.iter().zip(row) {
            assert_eq!(c.to_bits(), exp(v - m).to_bits());
        }
        let mut scaled = vec![0.0; n];
        exp_scaled(row, m, 0.5, &mut scaled);
        for (s, &v) in scaled.iter().zip(row) {
            assert_eq!(s.to_bits(), (exp(v - m) * 0.5).to_bits());
        }
        let d = dot(&x, &g);
        let exact: f64 = x.iter().zip(&g).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert!(
            (d as f64 - exact).abs() < 1e-5 * (1.0 + exact.abs()),
            "dot {d} vs {exact}"
        );
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(sum_exp(&[], 0.0), 0.0);
    }
}
