//! The samplers' tests: determinism, disjoint ranks, quotas, the snake deal, the exchange.

use super::*;
use std::sync::Arc;

#[test]
fn snake_dealing_of_a_hand_made_group() {
    // Two ranks, three samples each, identified by their lengths.
    let draws = vec![vec![10u16, 50, 30], vec![40, 20, 60]];
    let dealt = deal_snake(&draws, |&l| l);
    // Sorted: 60 50 | 40 30 | 20 10; row 0 left to right, row 1 right to left, row 2 again.
    assert_eq!(dealt, vec![vec![60, 30, 20], vec![50, 40, 10]]);
    // Three ranks, two rows: [9 8 7] → ranks 0 1 2; [6 5 4] → ranks 2 1 0.
    let dealt = deal_snake(&[vec![9u16, 4], vec![8, 5], vec![7, 6]], |&l| l);
    assert_eq!(dealt, vec![vec![9, 4], vec![8, 5], vec![7, 6]]);
    // Ties keep member order, then draw order.
    let dealt = deal_snake(&[vec![5u16, 5], vec![5, 5]], |&l| l);
    assert_eq!(dealt.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 2]);
}

#[test]
fn rank_subsets_are_disjoint_and_cover_each_bin() {
    for (sizes, world) in [
        (vec![5, 7, 3, 4], 2), // whole shards
        (vec![5, 7, 3, 4], 4),
        (vec![5, 7, 3], 4), // fewer shards than ranks: strided samples
        (vec![10], 3),
    ] {
        let total: usize = sizes.iter().sum();
        let mut seen = vec![0; total];
        for rank in 0..world {
            for i in rank_subset(&sizes, rank, world) {
                seen[i as usize] += 1;
            }
        }
        assert!(
            seen.iter().all(|&c| c == 1),
            "{sizes:?} over {world}: {seen:?}"
        );
    }
    // Whole shards: rank 1 of 2 owns shards 1 and 3 (samples 5..12 and 15..19).
    let mine = rank_subset(&[5, 7, 3, 4], 1, 2);
    assert_eq!(mine, (5..12).chain(15..19).collect::<Vec<u32>>());
}

#[test]
fn proportional_quota_sums_to_the_batch() {
    assert_eq!(
        proportional_quota(&[600, 300, 100, 0], 16),
        vec![10, 5, 1, 0]
    );
    assert_eq!(proportional_quota(&[1, 1, 1], 4), vec![2, 1, 1]);
    assert_eq!(proportional_quota(&[0, 0], 4), vec![0, 0]);
}

fn toy() -> (Vec<Vec<usize>>, Arc<Vec<Vec<u16>>>) {
    // Three bins of 40, 30 and 20 samples in 2 shards each; lengths inside each bin.
    let sizes = vec![vec![20, 20], vec![15, 15], vec![10, 10]];
    let lengths = vec![
        (0..40).map(|i| 10 + (i % 100) as u16).collect(),
        (0..30).map(|i| 130 + i as u16).collect(),
        (0..20).map(|i| 300 + i as u16).collect(),
    ];
    (sizes, Arc::new(lengths))
}

fn config(kind: SamplerKind) -> SamplerConfig {
    SamplerConfig {
        kind,
        local_batch: 6,
        presort_group: 2,
        bin_quota: None,
        seed: 7,
        exchange: false,
    }
}

#[test]
fn samplers_are_deterministic_and_resume_from_their_state() {
    let (sizes, lengths) = toy();
    for kind in [
        SamplerKind::Random,
        SamplerKind::Stratified,
        SamplerKind::Presort,
    ] {
        let c = config(kind);
        let mut a = RankSampler::new(&c, &sizes, lengths.clone(), 1, 2).unwrap();
        let mut b = RankSampler::new(&c, &sizes, lengths.clone(), 1, 2).unwrap();
        let first: Vec<_> = (0..9).map(|_| a.next_batch()).collect();
        let again: Vec<_> = (0..9).map(|_| b.next_batch()).collect();
        assert_eq!(first, again, "{kind}");
        // Beyond one epoch: 9 steps of 6 > 45 samples per rank.
        assert!(a.state().streams[0].iter().any(|s| s.epoch > 0), "{kind}");
        // Stop after 3 steps, save, restore into a fresh sampler: the same continuation.
        let mut c3 = RankSampler::new(&c, &sizes, lengths.clone(), 1, 2).unwrap();
        for _ in 0..3 {
            c3.next_batch();
        }
        let saved: SamplerState =
            serde_json::from_str(&serde_json::to_string(&c3.state()).unwrap()).unwrap();
        let mut resumed = RankSampler::new(&c, &sizes, lengths.clone(), 1, 2).unwrap();
        resumed.restore(&saved).unwrap();
        let rest: Vec<_> = (3..9).map(|_| resumed.next_batch()).collect();
        assert_eq!(rest, first[3..], "{kind}");
        // Another seed, another sequence.
        let mut other = RankSampler::new(
            &SamplerConfig {
                seed: 8,
                ..c.clone()
            },
            &sizes,
            lengths.clone(),
            1,
            2,
        )
        .unwrap();
        assert_ne!(other.next_batch(), first[0], "{kind}");
    }
}

#[test]
fn ranks_draw_disjoint_samples_within_an_epoch() {
    let (sizes, lengths) = toy();
    for kind in [SamplerKind::Random, SamplerKind::Stratified] {
        let c = config(kind);
        let mut seen = std::collections::HashSet::new();
        for rank in 0..2 {
            let mut s = RankSampler::new(&c, &sizes, lengths.clone(), rank, 2).unwrap();
            // 3 steps of 6 stay inside the first epoch of every stream.
            for _ in 0..3 {
                for r in s.next_batch() {
                    assert!(seen.insert(r), "{kind}: {r:?} drawn twice");
                }
            }
        }
        assert_eq!(seen.len(), 36);
    }
}

#[test]
fn stratified_batches_take_the_quota_of_every_bin() {
    let (sizes, lengths) = toy();
    let mut s = RankSampler::new(
        &config(SamplerKind::Stratified),
        &sizes,
        lengths.clone(),
        0,
        2,
    )
    .unwrap();
    assert_eq!(s.quota(), &[3, 2, 1]); // 40:30:20 of 6
    for _ in 0..10 {
        let batch = s.next_batch();
        let per_bin: Vec<usize> = (0..3)
            .map(|b| batch.iter().filter(|r| r.bin == b).count())
            .collect();
        assert_eq!(per_bin, vec![3, 2, 1]);
    }
    let given = SamplerConfig {
        bin_quota: Some(vec![1, 1, 4]),
        ..config(SamplerKind::Stratified)
    };
    let err = RankSampler::new(&given, &sizes, lengths.clone(), 0, 2).map(|_| ());
    assert!(err.is_ok());
    let wrong = SamplerConfig {
        bin_quota: Some(vec![1, 1]),
        ..config(SamplerKind::Stratified)
    };
    let err = RankSampler::new(&wrong, &sizes, lengths, 0, 2).unwrap_err();
    assert!(
        err.to_string().contains("2 quotas for 3 length bins"),
        "{err}"
    );
}

#[test]
fn presort_members_get_one_sample_of_each_row() {
    let (sizes, lengths) = toy();
    let c = config(SamplerKind::Presort);
    let mut r0 = RankSampler::new(&c, &sizes, lengths.clone(), 0, 2).unwrap();
    let mut r1 = RankSampler::new(&c, &sizes, lengths.clone(), 1, 2).unwrap();
    let len = |r: &SampleRef| lengths[r.bin as usize][r.index as usize];
    for _ in 0..4 {
        let (a, b) = (r0.next_batch(), r1.next_batch());
        let mut group: Vec<SampleRef> = a.iter().chain(&b).copied().collect();
        group.sort();
        group.dedup();
        assert_eq!(group.len(), 12, "the two ranks' batches are disjoint");
        // Row i of the sorted group gives one sample to each rank.
        let mut all: Vec<u16> = a.iter().chain(&b).map(len).collect();
        all.sort_unstable_by(|x, y| y.cmp(x));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let row = [all[2 * i], all[2 * i + 1]];
            assert!(row.contains(&len(x)) && row.contains(&len(y)));
        }
    }
}

#[test]
fn exchanging_presort_equals_the_group_simulation() {
    let (sizes, lengths) = toy();
    let simulate = config(SamplerKind::Presort);
    let exchange = SamplerConfig {
        exchange: true,
        ..simulate.clone()
    };
    let build = |c: &SamplerConfig| -> Vec<RankSampler> {
        (0..4)
            .map(|r| RankSampler::new(c, &sizes, lengths.clone(), r, 4).unwrap())
            .collect()
    };
    let (mut simulated, mut exchanging) = (build(&simulate), build(&exchange));
    for _ in 0..6 {
        // What an allgather hands every rank: the world's own draws, in rank order,
        // through the byte encoding a collective carries.
        let draws: Vec<Vec<SampleRef>> = exchanging
            .iter_mut()
            .map(|s| decode_refs(&encode_refs(&s.draw_own())).unwrap())
            .collect();
        for (rank, (sim, ex)) in simulated.iter_mut().zip(&exchanging).enumerate() {
            assert_eq!(ex.deal_from(&draws), sim.next_batch(), "rank {rank}");
        }
    }
    // Only its own streams are in an exchanging sampler's state.
    assert_eq!(exchanging[1].state().streams.len(), 1);
    assert!(decode_refs(&[0u8; 7]).is_err());
}
