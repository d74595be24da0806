//! The tied word embedding's gradient, reduced in two shares.
//!
//! Note [Tied embedding split]: the word-embedding table is used twice, by the input lookup
//! (the first op of forward, so the last of backward) and by the MLM decoder (among the last
//! ops of forward). Its gradient is final only when backward returns, which left it (89 MiB of
//! BERT-base's 420) to be reduced after backward, where nothing hides it. Its two shares are
//! reduced separately instead:
//! - the decoder's share, dense `[V, H]`, is complete right after the decoder's backward; the
//!   decoder op ([`super::GradHookBackend::decoder_hook`]) hands it over there as the gradient
//!   of a parameter of its own, `cls.predictions.decoder.weight` (Hugging Face's name of the
//!   tied decoder), in the heads' bucket, and passes nothing on to the table;
//! - the lookup's share (the table's autodiff gradient, now that share alone) is nonzero only
//!   in the rows of the tokens in the batch: the reducer reduces those rows only, the union
//!   over the ranks of their batches' token ids (exchanged at the start of the step,
//!   [`super::Reducer::begin_step`]), after backward, as the last reduction.
//!
//! The averaged gradient is the averaged decoder share plus the averaged rows scattered into
//! it: the same sum as the whole table's, in another order. A norm of the whole gradient adds
//! the shares' cross term, `‖d + l‖² = ‖d‖² + ‖l‖² + 2⟨d, l⟩`, over the rows. With few ranks and
//! small batches the rows are a small part of the table (2 ranks × 256 tokens: at most 512 of
//! 30522 rows); at MLPerf's scale (1024 ranks × 8k tokens) their union is nearly the whole
//! vocabulary and the saving is the decoder share's overlap alone. One rank has nothing to
//! reduce: `parallel.tied_embedding = "auto"` splits with more than one.

use std::collections::BTreeSet;
use std::sync::mpsc::Receiver;

use burn::module::ParamId;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};
use ember_backend_ext::FusedOps;

use super::buckets::{Buffer, Scalar};
use super::collective::CommError;
use super::comm_thread::{CommThread, receive};
use super::plan::TiedSplit;

/// Hugging Face's name of the tied decoder weight: the decoder's share of the gradient.
pub const DECODER_WEIGHT: &str = "cls.predictions.decoder.weight";

/// The module path of the tied word-embedding table.
pub const WORD_EMBEDDINGS: &str = "bert.embeddings.word_embeddings.weight";

/// The table's rows in one step: which, and their gradient.
pub(crate) struct TiedRows<B: FusedOps> {
    /// The table's id and shape `[V, H]`.
    pub table: ParamId,
    shape: [usize; 2],
    /// The ranks' token ids, being exchanged.
    exchange: Option<Receiver<Result<Vec<Vec<u8>>, CommError>>>,
    /// Their union, sorted: on the host, and as row indices on the device.
    rows: Option<(Vec<i64>, Tensor<B, 1, Int>)>,
    /// The rows' gradient summed over the step's micro-batches so far, `[n · H]`.
    pub buffer: Option<Buffer<B>>,
    /// Whether the table's gradient arrived in the current micro-batch.
    pub arrived: bool,
    /// The rows' allreduce, in flight.
    pub in_flight: Option<Receiver<Result<Buffer<B>, CommError>>>,
}

impl<B: FusedOps> TiedRows<B> {
    pub(crate) fn new(tied: &TiedSplit) -> Self {
        let shape = [tied.table.shape[0], tied.table.shape[1]];
        Self {
            table: tied.table.id,
            shape,
            exchange: None,
            rows: None,
            buffer: None,
            arrived: false,
            in_flight: None,
        }
    }

    /// Starts the exchange of this rank's token ids (every token of the step's batches).
    pub(crate) fn begin_step(
        &mut self,
        comm: &CommThread<B>,
        token_ids: impl IntoIterator<Item = i64>,
    ) {
        let mine: BTreeSet<i64> = token_ids.into_iter().collect();
        let bytes: Vec<u8> = mine
            .into_iter()
            .flat_map(|id| (id as u32).to_le_bytes())
            .collect();
        self.exchange = Some(comm.submit(move |c| c.allgather(&bytes)));
        self.rows = None;
    }

    /// Starts a micro-batch (`first`: of its step).
    pub(crate) fn prepare_backward(&mut self, first: bool) {
        self.arrived = false;
        if first {
            self.buffer = None;
            self.in_flight = None;
        }
    }

    /// The union of the ranks' token ids, once exchanged, as row indices on `grad`'s device.
    fn rows(&mut self, device: &B::Device) -> Result<(Vec<i64>, Tensor<B, 1, Int>), String> {
        if let Some(rows) = &self.rows {
            return Ok(rows.clone());
        }
        let exchange = self.exchange.take().ok_or_else(|| {
            "the tied embedding's rows were not exchanged: Reducer::begin_step was not called"
                .to_string()
        })?;
        let all = receive(&exchange).map_err(|e| e.to_string())?;
        let union: BTreeSet<i64> = all
            .iter()
            .flat_map(|bytes| bytes.chunks_exact(4))
            .map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        if let Some(&last) = union.last() {
            if last as usize >= self.shape[0] {
                return Err(format!(
                    "token id {last} is outside the {}-row embedding table",
                    self.shape[0]
                ));
            }
        }
        let ids: Vec<i64> = union.into_iter().collect();
        let n = ids.len();
        let rows = Tensor::from_data(TensorData::new(ids.clone(), [n]), device);
        self.rows = Some((ids, rows));
        Ok(self.rows.clone().expect("just set"))
    }

    /// Adds the table's gradient (the lookup's share, `[V, H]`) of a micro-batch: its rows,
    /// gathered on the device.
    pub(crate) fn add(
        &mut self,
        grad: FloatTensor<B>,
        on_device: bool,
        first: bool,
        inv_loss_scale: f32,
    ) -> Result<(), String> {
        if self.arrived {
            return Err(format!(
                "the gradient of the tied table ({WORD_EMBEDDINGS}) arrived twice"
            ));
        }
        let grad = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grad));
        let (_, rows) = self.rows(&grad.device())?;
        let gathered = grad.select(0, rows); // [n, H]
        let flat = Buffer::flatten(
            on_device,
            vec![gathered.into_primitive().tensor()],
            inv_loss_scale,
        );
        self.buffer = Some(match self.buffer.take() {
            Some(earlier) if !first => earlier.add(flat),
            _ => flat,
        });
        self.arrived = true;
        Ok(())
    }

    /// `2⟨d, l⟩` over the rows: the cross term of the squared norm of the table's gradient, with
    /// `decoder_bucket` the bucket holding the decoder's share `d` at `offset` and the rows' `l`
    /// in [`TiedRows::buffer`].
    pub(crate) fn cross_term(&self, decoder_bucket: &Buffer<B>, offset: usize) -> Scalar<B> {
        let (ids, rows) = self
            .rows
            .as_ref()
            .expect("rows are known once the table's gradient arrived");
        let lookup = self.buffer.as_ref().expect("the rows' gradient arrived");
        let [v, h] = self.shape;
        let dot = decoder_bucket.rows_dot(offset, [v, h], ids, rows, lookup);
        match dot {
            Scalar::Host(x) => Scalar::Host(2.0 * x),
            Scalar::Device(t) => Scalar::Device(t.mul_scalar(2.0)),
        }
    }

    /// The table's averaged gradient: the decoder's share (`decoder`, `[V, H]`) with the
    /// averaged rows added.
    pub(crate) fn gradient<const D: usize>(
        &self,
        decoder: Tensor<B, D>,
        device: &B::Device,
    ) -> Tensor<B, D> {
        let (ids, rows) = self.rows.as_ref().expect("rows are known after the step");
        let lookup = self.buffer.as_ref().expect("the rows were averaged");
        let mut shape = decoder.dims();
        shape[0] = ids.len();
        decoder.select_assign(
            0,
            rows.clone(),
            lookup.part(0, shape, device),
            burn::tensor::IndexingUpdateOp::Add,
        )
    }
}
