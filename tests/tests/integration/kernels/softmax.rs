//! The masked softmax + dropout op alone (`FusedOps::masked_softmax_dropout` and its
//! backward) against the reference composition, on rows that take each of the kernels' layouts
//! (Note [Softmax rows in registers] in backend-ext's `cube/reductions.rs`): a plane per row
//! with the row in registers (CUDA's warps: up to 512 keys; lavapipe's planes of 8 with
//! `RowReductions::Planes`: up to 128), a cube per row with the row in registers (up to
//! 256 · 16 keys), and the streaming form beyond; more rows than one grid dimension holds; odd
//! lengths, one key, padded keys.

use burn::tensor::{Tensor, TensorPrimitive};
use ember_backend_ext::{DropoutSpec, FusedOps, reference};

use super::common::{assert_close, mask_bias, random};
use super::{BWD, FWD};

/// `[B, nh, Sq, Sk]` scores and the number of real keys of each sample.
const CASES: [([usize; 4], [usize; 2]); 8] = [
    // BERT's rows of 128 keys: a warp per row on CUDA, a plane per row on lavapipe.
    ([2, 3, 5, 128], [128, 77]),
    // 512 keys: a warp per row on CUDA (16 each); a cube per row (2 each) elsewhere.
    ([2, 2, 3, 512], [512, 300]),
    // A cube per row, 4 keys each.
    ([1, 1, 3, 1000], [999, 0]),
    // The cube form's largest share: 256 units holding 16 keys each.
    ([1, 1, 2, 4096], [4000, 0]),
    // Past 256 · 16 keys: the streaming form.
    ([1, 1, 2, 4500], [4321, 0]),
    // More rows than one grid dimension holds (65,535 cubes): the grid's second dimension, in
    // every layout (a plane per row: 65,550 cubes of four rows).
    ([2, 1, 131_100, 1], [1, 1]),
    // One key; odd lengths.
    ([2, 1, 3, 1], [1, 1]),
    ([2, 2, 6, 33], [33, 0]),
];

fn float<B: FusedOps>(t: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Forward (probabilities and dropped probabilities) and backward of the fused op against the
/// reference composition on `B`, dropout off and on.
pub fn check_softmax_rows<B: FusedOps>(device: &B::Device) {
    for (shape, real) in CASES {
        let [batch, _, _, keys] = shape;
        let mask: Vec<Vec<f32>> = real[..batch]
            .iter()
            .map(|&r| (0..keys).map(|j| (j < r) as u8 as f32).collect())
            .collect();
        let bias = mask_bias::<B>(&mask, device);
        let scores = random::<B, 4>(shape, device);
        let grad = random::<B, 4>(shape, device);
        for p in [0.0, 0.1] {
            let spec = DropoutSpec::new(p, 77);
            let what = format!("softmax {shape:?}, dropout {p}");
            let fused = B::masked_softmax_dropout(
                scores.clone().into_primitive().tensor(),
                bias.clone().into_primitive().tensor(),
                0.125,
                spec,
            );
            let expected = reference::masked_softmax_dropout_forward(
                scores.clone(),
                bias.clone(),
                0.125,
                spec,
            );
            let (probs, expected_probs) = (float::<B>(fused.probs), float::<B>(expected.probs));
            assert_close(
                &format!("{what}: probs"),
                probs.clone(),
                expected_probs.clone(),
                FWD,
            );
            assert_close(
                &format!("{what}: dropped"),
                float::<B>(fused.dropped),
                float::<B>(expected.dropped),
                FWD,
            );
            let grad_scores = B::masked_softmax_dropout_backward(
                grad.clone().into_primitive().tensor(),
                probs.into_primitive().tensor(),
                0.125,
                spec,
            );
            let expected_grad = reference::masked_softmax_dropout_backward(
                grad.clone(),
                expected_probs,
                0.125,
                spec,
            );
            assert_close(
                &format!("{what}: grad"),
                float::<B>(grad_scores),
                expected_grad,
                BWD,
            );
        }
    }
}
