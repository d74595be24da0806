//! Which GELU the model's activations compute: BERT's `hidden_act` (Note [Two GELUs]).
//!
//! Note [Two GELUs]: GELU(z) = z·Φ(z) (Hendrycks & Gimpel 2016, arXiv 1606.08415). Two forms
//! train BERT:
//! - **erf**, `z · ½(1 + erf(z/√2))`: Hugging Face's `"gelu"` (`GELUActivation`,
//!   `torch.nn.functional.gelu`), the activation of the checkpoints ember loads and exports.
//! - **tanh**, `z · ½(1 + tanh(√(2/π)·(z + 0.044715·z³)))`: Google's BERT `modeling.py`,
//!   Hugging Face's `"gelu_new"` (also `"gelu_pytorch_tanh"`, `"gelu_fast"`: the same
//!   formula), and the fused `bias_gelu` of NVIDIA's MLPerf BERT
//!   (`training_results_v1.1/NVIDIA/.../model/layers/activations.py`), which Samsung's
//!   submission runs: the method's own code computes this form (`../shared/REFERENCES.md`),
//!   and so does cuBLASLt's GELU epilogue.
//!
//! The two differ by at most 4.7e-4 (near z = ±2.7) and their derivatives by at most 8.7e-4.
//! ember's default is erf, Hugging Face's `"gelu"`, so that its models match the checkpoints
//! it reads and writes; `hidden_act = "gelu_new"` (`model.hidden_act`) trains as the MLPerf
//! submissions did. Every path computes the chosen form: the reference composition of Burn
//! ops, NdArray's host loops and the CubeCL kernels, each with the exact derivative of its
//! form. The tanh form is evaluated as `z · σ(2u)`, `u = √(2/π)·(z + 0.044715·z³)`, since
//! `½(1 + tanh(u)) = σ(2u) = 1 / (1 + e^(−2u))`: one exponential, no cancellation near 0;
//! its derivative is `σ(2u) + z · σ(2u)·(1 − σ(2u)) · 2u'`, `u' = √(2/π)·(1 + 3·0.044715·z²)`,
//! the same value as NVIDIA's `bias_gelu_back` (written with `tanh`). The gate and its slope
//! take `z` clamped to ±15 ([`GELU_TANH_CLAMP`]), which changes no f32 value and keeps `z³`
//! and `u'` finite; the kernels and host loops take σ(t) as `1/(1 + e)` or `e/(1 + e)` with
//! `e = e^(−|t|)`, and the reference Burn's `sigmoid`. Google's BERT first released the erf form and later switched to tanh;
//! Hugging Face's `"gelu"` is the erf of the released checkpoints.

/// `√(2/π)`, the tanh form's scale.
pub const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// The tanh form's cubic coefficient.
pub const GELU_TANH_CUBIC: f64 = 0.044_715;

/// Where every implementation clamps `z` inside the tanh form's gate and slope: past ±15 the
/// gate `σ(2u)` is 0 or 1 in f32 (`2u` is ±265) and its slope 0, so the clamp changes no
/// value, while `z³` and `u'` stay finite (without it `z³` overflows a half type past 40 and
/// `u'` f32 past 1.8e19, giving 0·∞ = NaN gradients). The gate's exponential is `e^(−|2u|)`
/// in the kernels and host loops, which cannot overflow (`e^(−2u)` would past z < −10).
pub const GELU_TANH_CLAMP: f64 = 15.0;

/// Which GELU a model computes (Note [Two GELUs]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Gelu {
    /// `z · ½(1 + erf(z/√2))`: Hugging Face's `"gelu"`.
    #[default]
    Erf,
    /// `z · ½(1 + tanh(√(2/π)·(z + 0.044715·z³)))`: Hugging Face's `"gelu_new"`, Google's and
    /// NVIDIA's (MLPerf) BERT.
    Tanh,
}

impl Gelu {
    /// The form named by a Hugging Face `hidden_act`: `"gelu"` → [`Gelu::Erf`];
    /// `"gelu_new"`, `"gelu_pytorch_tanh"`, `"gelu_fast"` → [`Gelu::Tanh`]; `None` for
    /// anything else (other activations ember does not implement).
    pub fn from_hidden_act(name: &str) -> Option<Self> {
        match name {
            "gelu" => Some(Gelu::Erf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Some(Gelu::Tanh),
            _ => None,
        }
    }

    /// The `hidden_act` name written for this form: `"gelu"` or `"gelu_new"`.
    pub fn hidden_act(self) -> &'static str {
        match self {
            Gelu::Erf => "gelu",
            Gelu::Tanh => "gelu_new",
        }
    }

    /// GELU(z) in f64, the formula of each form: the oracle of the tests.
    pub fn value_f64(self, z: f64) -> f64 {
        match self {
            Gelu::Erf => 0.5 * z * (1.0 + libm::erf(z * std::f64::consts::FRAC_1_SQRT_2)),
            Gelu::Tanh => {
                let u = SQRT_2_OVER_PI * (z + GELU_TANH_CUBIC * z * z * z);
                0.5 * z * (1.0 + u.tanh())
            }
        }
    }

    /// dGELU/dz in f64, written as the sources write it (for erf `Φ(z) + z·φ(z)`; for tanh
    /// NVIDIA's `bias_gelu_back`: `½(1 + t) + ½z(1 − t²)·√(2/π)(1 + 3·0.044715·z²)`,
    /// `t = tanh(u)`): the tests' oracle for the kernels' σ form.
    pub fn derivative_f64(self, z: f64) -> f64 {
        match self {
            Gelu::Erf => {
                let cdf = 0.5 * (1.0 + libm::erf(z * std::f64::consts::FRAC_1_SQRT_2));
                let pdf = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
                cdf + z * pdf
            }
            Gelu::Tanh => {
                let t = (SQRT_2_OVER_PI * (z + GELU_TANH_CUBIC * z * z * z)).tanh();
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * z * z);
                0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
            }
        }
    }
}

impl std::fmt::Display for Gelu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hidden_act())
    }
}

impl std::str::FromStr for Gelu {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Gelu::from_hidden_act(s).ok_or_else(|| {
            format!(
                "unknown hidden_act `{s}` (expected gelu (erf), or gelu_new, \
                 gelu_pytorch_tanh or gelu_fast (the tanh approximation))"
            )
        })
    }
}

impl serde::Serialize for Gelu {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.hidden_act())
    }
}

impl<'de> serde::Deserialize<'de> for Gelu {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_hugging_faces() {
        assert_eq!(Gelu::from_hidden_act("gelu"), Some(Gelu::Erf));
        for tanh in ["gelu_new", "gelu_pytorch_tanh", "gelu_fast"] {
            assert_eq!(tanh.parse::<Gelu>(), Ok(Gelu::Tanh));
        }
        assert_eq!(Gelu::Tanh.to_string(), "gelu_new");
        let err = "relu".parse::<Gelu>().unwrap_err();
        assert!(err.contains("`relu`") && err.contains("gelu_new"), "{err}");
        #[derive(serde::Deserialize, serde::Serialize, PartialEq, Debug)]
        struct S {
            hidden_act: Gelu,
        }
        let s: S = toml::from_str("hidden_act = \"gelu_pytorch_tanh\"").unwrap();
        assert_eq!(s.hidden_act, Gelu::Tanh);
        assert_eq!(
            toml::to_string(&s).unwrap().trim(),
            "hidden_act = \"gelu_new\""
        );
        assert!(toml::from_str::<S>("hidden_act = \"swish\"").is_err());
    }

    /// The reference composition and its explicit backward (the default bodies of
    /// `FusedOps::bias_gelu` and `bias_gelu_backward`) on NdArray, and the host loops, against
    /// each form's f64 formula from z = −1e30 to 1e30: finite everywhere, the clamp changing
    /// no value beyond rounding.
    #[test]
    fn the_reference_is_each_form_and_stays_finite() {
        use burn::backend::NdArray;
        use burn::tensor::{Tensor, TensorData};
        let mut z: Vec<f32> = (-400..=400).map(|i| i as f32 * 0.05).collect();
        z.extend([
            -1e30, -1e4, -60.0, -15.5, -10.5, 10.5, 15.5, 60.0, 1e4, 1e30,
        ]);
        let n = z.len();
        let device = Default::default();
        let x = Tensor::<NdArray, 2>::from_data(TensorData::new(z.clone(), [1, n]), &device);
        let bias = Tensor::<NdArray, 1>::zeros([n], &device);
        let grad = Tensor::<NdArray, 2>::ones([1, n], &device);
        let zeros = vec![0.0f32; n];
        let mut runs = Vec::new();
        for gelu in [Gelu::Erf, Gelu::Tanh] {
            let value = crate::reference::bias_gelu(x.clone(), bias.clone(), gelu);
            let slope =
                crate::reference::bias_gelu_backward(x.clone(), bias.clone(), grad.clone(), gelu);
            let value = value.into_data().to_vec::<f32>().unwrap();
            let slope = slope.into_data().to_vec::<f32>().unwrap();
            runs.push(("reference", gelu, value, slope));
            // NdArray's host loops (`host_math.rs`; their exponential's floor of e^−88 leaves
            // the tanh gate at 6e-39 instead of 0 past z < −10, within the tolerance below).
            let (mut value, mut slope) = (vec![0.0; n], vec![0.0; n]);
            crate::host_math::bias_gelu_rows(&z, &zeros, &mut value, gelu);
            crate::host_math::bias_gelu_backward_rows(&z, &zeros, &vec![1.0; n], &mut slope, gelu);
            runs.push(("host loops", gelu, value, slope));
        }
        for (path, gelu, value, slope) in runs {
            for i in 0..n {
                let (v, d) = (
                    gelu.value_f64(z[i] as f64),
                    gelu.derivative_f64(z[i] as f64),
                );
                assert!(
                    value[i].is_finite() && slope[i].is_finite(),
                    "{gelu} at {}",
                    z[i]
                );
                assert!(
                    (value[i] as f64 - v).abs() <= 5e-6 * (1.0 + v.abs()),
                    "{path}: {gelu}({}) = {}, formula {v}",
                    z[i],
                    value[i]
                );
                assert!(
                    (slope[i] as f64 - d).abs() <= 1e-5 * (1.0 + d.abs()),
                    "{path}: {gelu}'({}) = {}, formula {d}",
                    z[i],
                    slope[i]
                );
            }
        }
    }

    /// The two forms: close (at most 4.7e-4 apart) but not equal, and each derivative equal to
    /// a central difference of its own value.
    #[test]
    fn the_forms_and_their_derivatives() {
        let mut widest: f64 = 0.0;
        for i in -800..=800 {
            let z = i as f64 * 0.01;
            widest = widest.max((Gelu::Erf.value_f64(z) - Gelu::Tanh.value_f64(z)).abs());
            for gelu in [Gelu::Erf, Gelu::Tanh] {
                let h = 1e-5;
                let numeric = (gelu.value_f64(z + h) - gelu.value_f64(z - h)) / (2.0 * h);
                let d = gelu.derivative_f64(z);
                assert!(
                    (numeric - d).abs() < 1e-8,
                    "{gelu}' at {z}: {d} vs {numeric}"
                );
            }
        }
        assert!(widest > 4e-4 && widest < 5e-4, "{widest}");
        // GELU(1) of each form (tanh: Google's BERT; erf: 0.5·(1 + erf(1/√2))).
        assert!((Gelu::Erf.value_f64(1.0) - 0.841_344_746_068_542_9).abs() < 1e-15);
        assert!((Gelu::Tanh.value_f64(1.0) - 0.841_191_990_608_276_8).abs() < 1e-12);
    }
}
