//! The layer boundaries a trainer can step into during the forward pass.
//!
//! Data-parallel training wants each encoder layer's parameter gradients the moment they are
//! final, while backward still runs on the layers below (PyTorch DDP's gradient hooks). Burn
//! has no per-parameter hook, but an identity op placed on a layer's *input* activation has its
//! backward run right after that layer's own backward ops. The model only offers the places;
//! what goes there (an identity, an autodiff op with a callback) is the trainer's business.

use burn::tensor::Tensor;
use ember_backend_ext::FusedOps;

/// Called at the layer boundaries of [`BertForPreTraining::forward_hooked`]
/// (and [`BertModel::forward_hooked`]). Every method defaults to what the plain forward does.
///
/// In backward, whatever a hook inserts at `layer_input(i, ..)` runs after every op of encoder
/// layer `i`, and at `heads_input` after every op of the pooler and both heads (deepest first:
/// heads, layer N−1, …, layer 0). `decoder_weight` gives the MLM decoder its matrix.
///
/// [`BertForPreTraining::forward_hooked`]: crate::BertForPreTraining::forward_hooked
/// [`BertModel::forward_hooked`]: crate::BertModel::forward_hooked
pub trait ForwardHook<B: FusedOps> {
    /// The input of encoder layer `layer` (0-based), `[B, S, H]`; returns what the layer
    /// consumes.
    fn layer_input(&self, layer: usize, hidden_states: Tensor<B, 3>) -> Tensor<B, 3> {
        let _ = layer;
        hidden_states
    }

    /// The encoder's output before the pooler and the pre-training heads, `[B, S, H]`;
    /// returns what they consume.
    fn heads_input(&self, sequence_output: Tensor<B, 3>) -> Tensor<B, 3> {
        sequence_output
    }

    /// The MLM decoder's matrix, `[H, V]`: the word-embedding table `[V, H]` (tied)
    /// transposed. `transformed` (`[N, H]`) is the MLM transform's output, which the decoder
    /// multiplies; a trainer's op can take it as a parent so that its backward runs right
    /// after the decoder's (Burn orders backward by graph depth), which is when the decoder's
    /// share of the tied gradient is complete. The default,
    /// [`ember_backend_ext::tied_decoder_weight`], does that: it hands that share to the
    /// table there, and the lookup's share is added into it at the end of backward.
    fn decoder_weight(
        &self,
        word_embeddings: Tensor<B, 2>,
        transformed: &Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        ember_backend_ext::tied_decoder_weight(word_embeddings, transformed)
    }
}

/// The hook that does nothing: what [`crate::BertForPreTraining::forward`] uses.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHook;

impl<B: FusedOps> ForwardHook<B> for NoHook {}
