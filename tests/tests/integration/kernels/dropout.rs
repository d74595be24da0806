//! Dropout on the kernels: the mask is the host's counter-based mask (keyed by sample and
//! position, so a micro-batch offset into the step keeps its samples' masks), the backward
//! pass reuses the forward's mask, the dropout op equals the host mask, and the dropout op and
//! the fused LayerNorm of packed rows give each row its padded row's mask.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor};
use ember_backend_ext::{DropoutSpec, FusedOps, keep_mask};

use super::common::{assert_close, random, values};
use super::packed_rows::{PACKED_LENGTHS, packed_rows};
use super::{BWD, FWD, weighted_sum};

/// The kernel's dropout mask is the host's [`keep_mask`], the same seed gives the same mask,
/// another seed another one, and the keep rate is within 6σ of 1 − p.
pub fn check_dropout_mask<B: FusedOps>(device: &B::Device) {
    let (batch, heads, seq) = (4, 4, 256); // 1,048,576 elements
    let shape = [batch, heads, seq, seq];
    let scores = random::<B, 4>(shape, device);
    let bias = Tensor::<B, 2>::zeros([batch, seq], device);
    let run = |seed: u64| {
        // Samples 5.. of the step: the offset enters the kernel's row keys.
        let spec = DropoutSpec {
            sample_offset: 5,
            ..DropoutSpec::new(0.1, seed)
        };
        let out = B::masked_softmax_dropout(
            scores.clone().into_primitive().tensor(),
            bias.clone().into_primitive().tensor(),
            1.0,
            spec,
        );
        let probs = Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(out.probs));
        let dropped =
            Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(out.dropped));
        (probs, dropped)
    };
    let (probs, dropped) = run(1234);
    let host = keep_mask::<B, 4>(
        DropoutSpec {
            sample_offset: 5,
            ..DropoutSpec::new(0.1, 1234)
        },
        shape,
        device,
    );
    assert_close(
        "dropout mask = host mask",
        dropped.clone(),
        probs.clone() * host,
        FWD,
    );

    let (_, again) = run(1234);
    assert_eq!(
        values(again),
        values(dropped.clone()),
        "same seed, different mask"
    );
    let (_, other) = run(1235);
    let kept = |t: Tensor<B, 4>| values(t).iter().filter(|v| **v != 0.0).count();
    let (k1, k2) = (kept(dropped.clone()), kept(other.clone()));
    let n = (batch * heads * seq * seq) as f64;
    let sigma = (n * 0.1 * 0.9).sqrt();
    for k in [k1, k2] {
        assert!(
            (k as f64 - 0.9 * n).abs() < 6.0 * sigma,
            "kept {k} of {n}: keep rate {} is not within 6σ of 0.9",
            k as f64 / n
        );
    }
    let same = values(dropped)
        .iter()
        .zip(values(other))
        .filter(|(a, b)| (**a == 0.0) == (*b == 0.0))
        .count() as f64;
    // Independent masks agree on 0.9² + 0.1² = 82% of elements.
    assert!(
        (same / n - 0.82).abs() < 0.01,
        "masks of two seeds agree on {}",
        same / n
    );
}

/// The backward pass uses the forward's mask: the gradient of x is exactly 0 where x was
/// dropped, and nowhere else.
pub fn check_dropout_backward_mask<B: AutodiffBackend + FusedOps>(device: &B::Device)
where
    B::InnerBackend: FusedOps,
{
    let (rows, n) = (64, 96);
    let spec = DropoutSpec::new(0.25, 99);
    let x = random::<B, 2>([rows, n], device).require_grad();
    let out = ember_backend_ext::bias_dropout_add_layer_norm(
        x.clone(),
        Tensor::zeros([n], device),
        random::<B, 2>([rows, n], device),
        Tensor::ones([n], device),
        Tensor::zeros([n], device),
        spec,
        1e-12,
    );
    let weight = random::<B, 2>([rows, n], device);
    let mut grads = weighted_sum(out, &weight).backward();
    let grad = values(x.grad_remove(&mut grads).unwrap());
    let mask = values(keep_mask::<B, 2>(spec, [rows, n], device));
    for (i, (g, m)) in grad.iter().zip(&mask).enumerate() {
        assert_eq!(*g == 0.0, *m == 0.0, "element {i}: grad {g}, mask {m}");
    }
}

/// The dropout op on `[B, S, N]` (the embeddings' dropout), forward and backward, against the
/// host mask, for a micro-batch whose samples start at 3 of the step; and its LayerNorm
/// counterpart on the same rows keeps the same mask (both key by sample and position).
pub fn check_dropout_op<B: AutodiffBackend + FusedOps>(device: &B::Device)
where
    B::InnerBackend: FusedOps,
{
    let shape = [3, 37, 40];
    let spec = DropoutSpec {
        sample_offset: 3,
        ..DropoutSpec::new(0.2, 0xfeed_beef_0123)
    };
    let x = random::<B, 3>(shape, device).require_grad();
    let out = ember_backend_ext::dropout(x.clone(), spec);
    let mask = keep_mask::<B, 3>(spec, shape, device);
    assert_close(
        "dropout = x · host mask",
        out.clone(),
        x.clone().detach() * mask.clone(),
        FWD,
    );
    let weight = random::<B, 3>(shape, device);
    let mut grads = weighted_sum(out, &weight).backward();
    assert_close(
        "dropout backward = grad · host mask",
        x.grad_remove(&mut grads).unwrap(),
        (weight * mask).inner(),
        FWD,
    );
}

/// The dropout op of packed rows (`PackedRowOps::dropout_rows`, Note [Padding removed]): each row
/// of a packed `[T, N]` gets the host mask of the padded row it came from (a micro-batch whose
/// samples start at 2 of the step, three samples of 4, 11 and 7 real tokens padded to 11),
/// forward and backward; keyed through the identity map instead, the output moves; the same
/// spec without the padded length is refused.
pub fn check_dropout_rows<B: AutodiffBackend + FusedOps>(device: &B::Device)
where
    B::InnerBackend: FusedOps,
{
    let (seq_len, n, lengths) = (11usize, 40usize, PACKED_LENGTHS);
    let (rows, tokens) = packed_rows::<B>(&lengths, seq_len, device);
    let spec = DropoutSpec {
        sample_offset: 2,
        ..DropoutSpec::new(0.3, 0x0dd_5eed_cafe)
    };
    let x = random::<B, 2>([tokens, n], device).require_grad();
    let out = ember_backend_ext::dropout_rows(x.clone(), spec.with_seq_len(seq_len), rows.clone());
    // The padded batch's mask, its real rows gathered.
    let mask = keep_mask::<B, 3>(spec, [lengths.len(), seq_len, n], device)
        .reshape([lengths.len() * seq_len, n])
        .select(0, rows);
    assert_close(
        "packed dropout = x · the padded rows' host mask",
        out.clone(),
        x.clone().detach() * mask.clone(),
        (0.0, 0.0),
    );
    let identity = Tensor::<B, 1, Int>::arange(0..tokens as i64, device);
    let unmapped = ember_backend_ext::dropout_rows(x.clone(), spec.with_seq_len(seq_len), identity);
    let moved: f64 = (unmapped - out.clone().detach())
        .abs()
        .max()
        .into_scalar()
        .elem();
    assert!(moved > 0.1, "the row map moves the mask (by {moved})");
    let weight = random::<B, 2>([tokens, n], device);
    let mut grads = weighted_sum(out, &weight).backward();
    assert_close(
        "packed dropout backward = grad · the same mask",
        x.grad_remove(&mut grads).unwrap(),
        (weight * mask).inner(),
        (0.0, 0.0),
    );
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        B::dropout_rows(
            x.clone().detach().into_primitive().tensor(),
            spec,
            Tensor::<B, 1, Int>::zeros([tokens], device).into_primitive(),
        )
    }));
    assert!(refused.is_err(), "packed rows without their padded length");
}

/// The fused bias + dropout + residual + LayerNorm of packed rows (its `dropout_rows`, Note
/// [Padding removed]) equals the padded op at the real rows, forward and backward: three
/// samples of 4, 11 and 7 real tokens padded to 11, a micro-batch whose samples start at 2 of
/// the step, random bias, γ and β; the padded rows get a zero cotangent, so the parameters'
/// gradients are the real rows' sums in both. The same op keying the packed rows as
/// themselves (the identity map) and the mapped op under another key both move the output.
pub fn check_layer_norm_of_packed_rows<B: AutodiffBackend + FusedOps>(device: &B::Device)
where
    B::InnerBackend: FusedOps,
{
    let (seq_len, n, lengths) = (11usize, 40usize, PACKED_LENGTHS);
    let batch = lengths.len();
    let (rows, tokens) = packed_rows::<B>(&lengths, seq_len, device);
    let spec = DropoutSpec {
        sample_offset: 2,
        ..DropoutSpec::new(0.3, 0x1a7e_0b0d_5eed)
    };
    let padded = |t: Tensor<B, 2>| {
        Tensor::<B, 2>::zeros([batch * seq_len, n], device).select_assign(
            0,
            rows.clone(),
            t,
            burn::tensor::IndexingUpdateOp::Add,
        )
    };
    let [x, residual, weight] = [0, 1, 2].map(|_| random::<B, 2>([tokens, n], device));
    let [bias, gamma, beta] = [0, 1, 2].map(|_| random::<B, 1>([n], device));
    let leaves = |x: &Tensor<B, 2>, residual: &Tensor<B, 2>| {
        (
            x.clone().detach().require_grad(),
            residual.clone().detach().require_grad(),
            [&bias, &gamma, &beta].map(|t| t.clone().detach().require_grad()),
        )
    };

    // Padded: the op on [B, S, N] (its mask keyed by sample and position), cotangent 0 at the
    // padded rows.
    let (x_pad, residual_pad, [b_pad, g_pad, be_pad]) =
        leaves(&padded(x.clone()), &padded(residual.clone()));
    let out_pad = ember_backend_ext::bias_dropout_add_layer_norm(
        x_pad.clone().reshape([batch, seq_len, n]),
        b_pad.clone(),
        residual_pad.clone().reshape([batch, seq_len, n]),
        g_pad.clone(),
        be_pad.clone(),
        spec,
        1e-12,
    )
    .reshape([batch * seq_len, n]);
    let mut grads_pad = weighted_sum(out_pad.clone(), &padded(weight.clone())).backward();

    let packed_op = |x: Tensor<B, 2>, residual: Tensor<B, 2>, params: [Tensor<B, 1>; 3], spec| {
        let [b, g, be] = params;
        ember_backend_ext::bias_dropout_add_layer_norm_of_packed_rows(
            x,
            (b.clone(), b),
            residual,
            ((g.clone(), g), (be.clone(), be)),
            spec,
            rows.clone(),
            1e-12,
        )
    };
    let (x_packed, residual_packed, params) = leaves(&x, &residual);
    let out = packed_op(
        x_packed.clone(),
        residual_packed.clone(),
        params.clone(),
        spec.with_seq_len(seq_len),
    );
    assert_close(
        "packed LayerNorm = the padded one's real rows",
        out.clone(),
        out_pad.clone().detach().select(0, rows.clone()),
        FWD,
    );
    let other = packed_op(
        x.clone(),
        residual.clone(),
        [&bias, &gamma, &beta].map(|t| t.clone()),
        DropoutSpec {
            seed: spec.seed ^ 1,
            ..spec.with_seq_len(seq_len)
        },
    );
    let moved: f64 = (other - out.clone().detach())
        .abs()
        .max()
        .into_scalar()
        .elem();
    assert!(moved > 0.1, "another key moves the output (by {moved})");
    let identity = Tensor::<B, 1, Int>::arange(0..tokens as i64, device);
    let unmapped = ember_backend_ext::bias_dropout_add_layer_norm_of_packed_rows(
        x.clone(),
        (bias.clone(), bias.clone()),
        residual.clone(),
        ((gamma.clone(), gamma.clone()), (beta.clone(), beta.clone())),
        spec.with_seq_len(seq_len),
        identity.clone(),
        1e-12,
    );
    let moved: f64 = (unmapped - out.clone().detach())
        .abs()
        .max()
        .into_scalar()
        .elem();
    assert!(moved > 0.1, "the row map moves the output (by {moved})");

    let mut grads = weighted_sum(out, &weight).backward();
    let grad = |t: &Tensor<B, 2>, grads: &mut B::Gradients| t.grad_remove(grads).unwrap();
    assert_close(
        "packed LayerNorm's dx = the padded one's at the real rows",
        grad(&x_packed, &mut grads),
        grad(&x_pad, &mut grads_pad).select(0, rows.clone().inner()),
        BWD,
    );
    assert_close(
        "packed LayerNorm's d residual",
        grad(&residual_packed, &mut grads),
        grad(&residual_pad, &mut grads_pad).select(0, rows.clone().inner()),
        BWD,
    );
    for (name, packed, pad) in [
        ("bias", &params[0], &b_pad),
        ("gamma", &params[1], &g_pad),
        ("beta", &params[2], &be_pad),
    ] {
        assert_close(
            &format!("packed LayerNorm's d {name}"),
            packed.grad_remove(&mut grads).unwrap(),
            pad.grad_remove(&mut grads_pad).unwrap(),
            BWD,
        );
    }
}
