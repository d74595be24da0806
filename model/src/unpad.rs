//! The encoder with its padding removed (`model.unpad`): the batch's real tokens packed into
//! one `[1, T, H]` sequence of rows for everything that works row by row.
//!
//! Note [Padding removed]: a batch padded to S holds B·S rows of which only T = Σ input_mask
//! are real tokens. Every dense layer, LayerNorm, GELU and residual add of an encoder layer
//! treats rows independently, so their work on the B·S − T padded rows is thrown away. With
//! stratification (`ember-data`'s `stratify.rs` and sampler), which puts samples of every
//! length bin into each batch, that waste is large: a batch of 6 / 3 / 2 / 5 samples from the
//! four MLPerf bins is padded to its 512-token sample, about half of its rows padding.
//!
//! Samsung's MLPerf v1.1 BERT removes the padding ("padding is then removed", with apex's
//! unpadded fused multi-head attention and its `cu_seqlens`), as NVIDIA's MLPerf BERT does
//! with `--unpad` (`modeling.py`'s `unpad_input` / `pad_input`). ember does the same for the
//! rows:
//! - the embeddings run padded (their lookups cost no GEMM), then [`Unpadding::unpad`] gathers
//!   the T real rows, `[B, S, H]` → `[1, T, H]`, in the batch's row order (sample by sample,
//!   position by position);
//! - each layer's Q/K/V (packed or not), attention output, intermediate and output dense
//!   layers, its two bias + dropout + residual + LayerNorm ops and its bias + GELU run on the
//!   T rows;
//! - **difference from Samsung**: the attention core runs padded. [`Unpadding::pad`] scatters
//!   the projections back to `[B, S, ·]` (zeros in the padded rows, which the mask bias keeps
//!   out of every softmax), the attention op runs as it does without `unpad`, and its context
//!   is gathered again. ember's attention kernels have no variable-length (`cu_seqlens`) form
//!   yet; at S = 128 the core is about 2% of a layer's FLOPs, at 512 about 8%;
//! - after the last layer the rows are scattered back to `[B, S, H]`, zeros at the padded
//!   positions: the pooler reads `[CLS]` and the masked-LM head the masked positions, never a
//!   padded row.
//!
//! Dropout keeps its masks. The keyed masks of `ember-backend-ext`'s `dropout.rs` are a
//! function of (sample, position, column), so a packed row must be keyed as the padded row it
//! came from. On the fused path the two hidden-dropout sites of a packed layer (attention
//! output, feed-forward output) hand the row map to the fused bias + dropout + residual +
//! LayerNorm ([`Unpadding::layer_norm`]; `FusedOps::bias_dropout_add_layer_norm`'s
//! `dropout_rows`): its kernels key row r's mask as padded row `rows[r]`, forward and
//! backward, and the dense bias, the dropout and the bias gradient stay inside the op, as
//! without `unpad`. Where LayerNorm runs composed, the dropout op of packed rows,
//! `PackedRowOps::dropout_rows` ([`Unpadding::dropout`]), keys the rows the same way in one pass,
//! and the reference path pads, runs its composed dropout and unpads ([`Unpadding::around`]).
//! The masks are those of the padded model, bit for bit. The attention probabilities' dropout
//! runs inside the padded core, as before.
//!
//! What changes for a caller: [`crate::ForwardHook::layer_input`] receives the packed
//! `[1, T, H]` rows, and `sequence_output` is 0 (not the padded rows' values) at padded
//! positions. The row list comes from the batch (`ember_data::Batch::real_rows`, built on the
//! host: `forward_hooked_with_rows`, what the trainer calls); a plain `forward` reads
//! `input_mask` back to the host once instead (on a GPU, a wait for the device's queue).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use ember_backend_ext::{DropoutSpec, FusedOps};

/// Which rows of a padded batch are real tokens: the map between `[B, S, N]` and the packed
/// `[1, T, N]` of Note [Padding removed].
#[derive(Debug, Clone)]
pub struct Unpadding<B: Backend> {
    batch: usize,
    seq_len: usize,
    /// `[T]`, the flattened row `b·S + s` of each real token, ascending.
    rows: Tensor<B, 1, Int>,
    /// `[B·S]`, the packed row of each padded row, T at padding (the inverse map:
    /// `ember_backend_ext::PackedRowOps`'s `slots`).
    slots: Tensor<B, 1, Int>,
    tokens: usize,
}

impl<B: FusedOps> Unpadding<B> {
    /// The real tokens of `input_mask` (`[B, S]`, 1 for real tokens, 0 for padding): read
    /// back to the host once.
    pub fn of(input_mask: &Tensor<B, 2, Int>) -> Self {
        let [batch, seq_len] = input_mask.dims();
        let mask = input_mask.to_data().convert::<i64>();
        let mask = mask.as_slice::<i64>().expect("an i64 mask after convert");
        Self::from_mask(mask, batch, seq_len, &input_mask.device())
    }

    /// The real tokens as their rows `b·S + s` (`[T]`, ascending; `ember_data::Batch::
    /// real_rows`), of a batch of `batch` samples padded to `seq_len`: no read-back.
    /// The inverse map is made on the device (`ember_backend_ext::slots_of_rows`: one launch on
    /// CubeCL backends, once per forward).
    pub fn from_rows(rows: Tensor<B, 1, Int>, batch: usize, seq_len: usize) -> Self {
        let [tokens] = rows.dims();
        let slots = ember_backend_ext::slots_of_rows(&rows, batch * seq_len);
        Self {
            batch,
            seq_len,
            rows,
            slots,
            tokens,
        }
    }

    /// The real tokens of a `[B, S]` mask given row-major on the host (no read-back).
    ///
    /// # Panics
    /// If `mask` does not hold B·S values.
    pub fn from_mask(mask: &[i64], batch: usize, seq_len: usize, device: &B::Device) -> Self {
        assert_eq!(mask.len(), batch * seq_len, "a [B, S] input_mask");
        let rows: Vec<i64> = (0..mask.len())
            .filter(|&i| mask[i] != 0)
            .map(|i| i as i64)
            .collect();
        let tokens = rows.len();
        let rows = Tensor::from_data(TensorData::new(rows, [tokens]), device);
        Self::from_rows(rows, batch, seq_len)
    }

    /// T, the real tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// `(B, S)`, the padded batch's shape.
    pub fn padded_shape(&self) -> (usize, usize) {
        (self.batch, self.seq_len)
    }

    /// Gathers the real rows: `[B, S, N]` → `[1, T, N]` (`ember_backend_ext::gather_rows`).
    /// Backward: the scatter of [`Unpadding::pad`].
    pub fn unpad(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq_len, n] = x.dims();
        debug_assert_eq!((batch, seq_len), (self.batch, self.seq_len));
        ember_backend_ext::gather_rows(
            ember_backend_ext::reshape(x, [batch * seq_len, n]),
            self.rows.clone(),
            self.slots.clone(),
        )
        .unsqueeze::<3>()
    }

    /// Scatters packed rows back: `[1, T, N]` → `[B, S, N]`, zeros at the padded positions
    /// (`ember_backend_ext::scatter_rows`: one pass writing each padded row once). Backward:
    /// the gather of [`Unpadding::unpad`].
    pub fn pad(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [_, tokens, n] = x.dims();
        debug_assert_eq!(tokens, self.tokens);
        let padded = ember_backend_ext::scatter_rows(
            ember_backend_ext::reshape(x, [tokens, n]),
            self.rows.clone(),
            self.slots.clone(),
        );
        ember_backend_ext::reshape(padded, [self.batch, self.seq_len, n])
    }

    /// `f` of the padded layout, for packed rows: `unpad(f(pad(x)))`, `[1, T, N]` →
    /// `[1, T, N]`.
    pub fn around(
        &self,
        x: Tensor<B, 3>,
        f: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        self.unpad(f(self.pad(x)))
    }

    /// `LayerNorm(residual + dropout(x + bias))` of packed rows `[1, T, N]`, fused, with each
    /// row's dropout mask that of its padded position (Note [Padding removed]):
    /// [`ember_backend_ext::bias_dropout_add_layer_norm_of_packed_rows`] through the row map.
    /// `bias` and `(gamma, beta)` are (master, copy) pairs.
    pub(crate) fn layer_norm(
        &self,
        x: Tensor<B, 3>,
        bias: (Tensor<B, 1>, Tensor<B, 1>),
        residual: Tensor<B, 3>,
        gamma_beta: ((Tensor<B, 1>, Tensor<B, 1>), (Tensor<B, 1>, Tensor<B, 1>)),
        spec: DropoutSpec,
        eps: f64,
    ) -> Tensor<B, 3> {
        ember_backend_ext::bias_dropout_add_layer_norm_of_packed_rows(
            x,
            bias,
            residual,
            gamma_beta,
            spec.with_seq_len(self.seq_len),
            self.rows.clone(),
            eps,
        )
    }

    /// `spec`'s dropout of packed rows `[1, T, N]` with the masks of their padded positions
    /// (Note [Padding removed]): [`ember_backend_ext::dropout_rows`] through the row map, the
    /// values `unpad(dropout(pad(x)))` has; `x` itself when `spec` drops nothing.
    pub fn dropout(&self, x: Tensor<B, 3>, spec: DropoutSpec) -> Tensor<B, 3> {
        ember_backend_ext::dropout_rows(x, spec.with_seq_len(self.seq_len), self.rows.clone())
    }
}
