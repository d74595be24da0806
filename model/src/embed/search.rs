//! Similarity search over embeddings: cosine similarity of every query with every corpus
//! vector, and the top k of each query (sentence-transformers' `util.cos_sim` and
//! `util.semantic_search`).

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// A corpus entry found for a query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    /// The entry's row in the corpus.
    pub corpus_id: usize,
    /// Its cosine similarity to the query, in [−1, 1].
    pub score: f32,
}

/// Rows scaled to unit L2 norm (ε 1e-12, as `torch.nn.functional.normalize`).
///
/// # Shapes
/// `x` `[n, d]` → `[n, d]`
pub fn normalize<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let norm = x.clone().square().sum_dim(1).sqrt().clamp_min(1e-12);
    x / norm
}

/// The cosine similarity of every row of `a` with every row of `b`.
///
/// # Shapes
/// `a` `[n, d]`, `b` `[m, d]` → `[n, m]`
pub fn cos_sim<B: Backend>(a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    normalize(a).matmul(normalize(b).transpose())
}

/// The `k` corpus rows most similar (cosine) to each query, best first (ties: the lower row
/// first), as sentence-transformers' `util.semantic_search`. Reads the `[q, n]` scores to the
/// host.
///
/// # Shapes
/// `queries` `[q, d]`, `corpus` `[n, d]` → q lists of at most `k` hits
pub fn semantic_search<B: Backend>(
    queries: Tensor<B, 2>,
    corpus: Tensor<B, 2>,
    k: usize,
) -> Vec<Vec<Hit>> {
    let n = corpus.dims()[0];
    if n == 0 {
        return vec![Vec::new(); queries.dims()[0]];
    }
    let scores = cos_sim(queries, corpus)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 after convert");
    scores
        .chunks(n)
        .map(|row| {
            let mut hits: Vec<Hit> = row
                .iter()
                .enumerate()
                .map(|(corpus_id, &score)| Hit { corpus_id, score })
                .collect();
            let k = k.min(hits.len());
            let by_score = |a: &Hit, b: &Hit| {
                b.score
                    .total_cmp(&a.score)
                    .then(a.corpus_id.cmp(&b.corpus_id))
            };
            if k < hits.len() {
                hits.select_nth_unstable_by(k, by_score);
                hits.truncate(k);
            }
            hits.sort_by(by_score);
            hits
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    #[test]
    fn the_most_similar_rows_come_first() {
        let device = Default::default();
        let corpus = Tensor::<NdArray, 2>::from_data(
            TensorData::new(vec![1.0f32, 0.0, 0.0, 2.0, 1.0, 1.0, -1.0, 0.0], [4, 2]),
            &device,
        );
        let queries =
            Tensor::<NdArray, 2>::from_data(TensorData::new(vec![3.0f32, 0.1], [1, 2]), &device);
        let hits = semantic_search(queries.clone(), corpus.clone(), 2);
        assert_eq!(hits.len(), 1);
        assert_eq!(
            hits[0].iter().map(|h| h.corpus_id).collect::<Vec<_>>(),
            [0, 2]
        );
        assert!((hits[0][0].score - 3.0 / (9.01f32).sqrt()).abs() < 1e-6);
        assert!(hits[0][0].score > hits[0][1].score);
        // k larger than the corpus: every row, best first; the opposite vector last.
        let all = semantic_search(queries, corpus, 10);
        assert_eq!(all[0].len(), 4);
        assert_eq!(all[0][3].corpus_id, 3);
        assert!((all[0][3].score + 3.0 / (9.01f32).sqrt()).abs() < 1e-6);
    }
}
