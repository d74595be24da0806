//! The gather and scatter of packed rows (`PackedRowOps`, Note [Padding removed]): against
//! Burn's `select` and `select_assign` into zeros, forward and backward, bit for bit (they
//! copy); the inverse map made on the device equals the host's.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};
use ember_backend_ext::{FusedOps, gather_rows, scatter_rows, slots_of_rows};

use super::common::{assert_close, random, values};
use super::weighted_sum;

/// The real tokens of the packed-row tests' three samples, padded to 11: the first one short,
/// so that from its fifth row on no packed row sits at its own index among the padded rows.
pub const PACKED_LENGTHS: [usize; 3] = [4, 11, 7];

/// The padded rows `b·S + s` of samples of `lengths` real tokens padded to `seq_len`, in order.
pub fn padded_rows(lengths: &[usize], seq_len: usize) -> Vec<i64> {
    lengths
        .iter()
        .enumerate()
        .flat_map(|(b, &len)| (0..len).map(move |s| (b * seq_len + s) as i64))
        .collect()
}

/// [`padded_rows`] on the device, and their count T.
pub fn packed_rows<B: Backend>(
    lengths: &[usize],
    seq_len: usize,
    device: &B::Device,
) -> (Tensor<B, 1, Int>, usize) {
    let rows = padded_rows(lengths, seq_len);
    let tokens = rows.len();
    (
        Tensor::from_data(TensorData::new(rows, [tokens]), device),
        tokens,
    )
}

/// Three samples of 4, 11 and 7 real tokens padded to 11 (rows of 40): the scatter puts each
/// packed row at its padded row and zeros elsewhere, the gather takes them back, and each one's
/// gradient is the other of the cotangent.
pub fn check_gather_and_scatter_rows<B: AutodiffBackend + FusedOps>(device: &B::Device)
where
    B::InnerBackend: FusedOps,
{
    let (seq_len, n, lengths) = (11usize, 40usize, PACKED_LENGTHS);
    let padded = lengths.len() * seq_len;
    let (rows, tokens) = packed_rows::<B>(&lengths, seq_len, device);
    let slots = slots_of_rows(&rows, padded);
    let mut expected_slots = vec![tokens as i64; padded];
    for (t, row) in padded_rows(&lengths, seq_len).into_iter().enumerate() {
        expected_slots[row as usize] = t as i64;
    }
    let slot_values = slots
        .clone()
        .into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap();
    assert_eq!(slot_values, expected_slots, "the inverse map");

    let x = random::<B, 2>([tokens, n], device).require_grad();
    let scattered = scatter_rows(x.clone(), rows.clone(), slots.clone());
    let reference = Tensor::<B, 2>::zeros([padded, n], device).select_assign(
        0,
        rows.clone(),
        x.clone().detach(),
        IndexingUpdateOp::Add,
    );
    assert_close(
        "scatter = select_assign into zeros",
        scattered.clone(),
        reference,
        (0.0, 0.0),
    );
    let weight = random::<B, 2>([padded, n], device);
    let mut grads = weighted_sum(scattered.clone(), &weight).backward();
    assert_close(
        "scatter's backward = the cotangent's real rows",
        x.grad_remove(&mut grads).unwrap(),
        weight.clone().select(0, rows.clone()).inner(),
        (0.0, 0.0),
    );

    let y = scattered.detach().require_grad();
    let gathered = gather_rows(y.clone(), rows.clone(), slots.clone());
    assert_close(
        "gather of the scatter = the packed rows",
        gathered.clone(),
        x.clone().detach(),
        (0.0, 0.0),
    );
    let weight = random::<B, 2>([tokens, n], device);
    let mut grads = weighted_sum(gathered, &weight).backward();
    let grad = y.grad_remove(&mut grads).unwrap();
    let expected = Tensor::<B, 2>::zeros([padded, n], device)
        .select_assign(0, rows.clone(), weight, IndexingUpdateOp::Add)
        .inner();
    assert_close(
        "gather's backward = the cotangent scattered",
        grad.clone(),
        expected,
        (0.0, 0.0),
    );
    let padding_row = lengths[0] * n; // sample 0's first padded position
    assert!(
        values(grad)[padding_row..padding_row + n]
            .iter()
            .all(|&v| v == 0.0),
        "zeros at the padding"
    );
}

/// The inverse map at its edges against the host's: no real row (T = 0), every row real
/// (T = R), only the last padded row, every other row, and a single padded row.
pub fn check_slots_of_rows_at_the_edges<B: Backend + FusedOps>(device: &B::Device) {
    let cases: [(&[i64], usize); 5] = [
        (&[], 5),
        (&[0, 1, 2, 3, 4], 5),
        (&[4], 5),
        (&[0, 2, 4], 5),
        (&[0], 1),
    ];
    for (rows, padded) in cases {
        let tokens = rows.len();
        let device_rows =
            Tensor::<B, 1, Int>::from_data(TensorData::new(rows.to_vec(), [tokens]), device);
        let slots = slots_of_rows(&device_rows, padded)
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .unwrap();
        let mut expected = vec![tokens as i64; padded];
        for (t, &row) in rows.iter().enumerate() {
            expected[row as usize] = t as i64;
        }
        assert_eq!(slots, expected, "the slots of rows {rows:?} among {padded}");
    }
}
