#!/usr/bin/env python3
"""The reference side of `cargo xtask bench data`: pre-training example creation as Google's
`create_pretraining_data.py` does it (google-research/bert, the script MLPerf's BERT data
pipeline runs, `language_model/tensorflow/bert/cleanup_scripts`), re-implemented here in plain
Python as that script is: BERT's `FullTokenizer` (BasicTokenizer: clean text, split CJK,
lower-case, strip accents, split punctuation; WordPiece: greedy longest match, `##`
continuations, `[UNK]` past 100 characters), `create_instances_from_document`,
`truncate_seq_pair`, `create_masked_lm_predictions` (80% `[MASK]`, 10% kept, 10% random), one
`random.Random(seed)` for all draws. It writes MLPerf's HDF5 fields with h5py (as NVIDIA's and
MLPerf's converters store them) instead of TFRecords, so that both sides do the same work:
text in, shard out.

    python create_pretraining_data.py --input corpus.txt --vocab vocab.txt --output out.hdf5 \
        --max-seq-length 128 --max-predictions 20 --dupe-factor 1 --seed 12345

Prints one JSON line: documents, instances, tokens (real tokens written), seconds (read to
written file), peak_rss_mib (this process's peak resident memory).
"""
import argparse
import collections
import json
import random
import resource
import sys
import time
import unicodedata

import h5py
import numpy as np


def is_whitespace(ch):
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def is_control(ch):
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch).startswith("C")


def is_punctuation(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def is_cjk(cp):
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def basic_tokenize(text):
    """BERT's BasicTokenizer with do_lower_case=True."""
    cleaned = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or is_control(ch):
            continue
        if is_cjk(cp):
            cleaned.extend((" ", ch, " "))
        elif is_whitespace(ch):
            cleaned.append(" ")
        else:
            cleaned.append(ch)
    tokens = []
    for word in "".join(cleaned).split():
        word = unicodedata.normalize("NFD", word.lower())
        word = "".join(ch for ch in word if unicodedata.category(ch) != "Mn")
        current = []
        for ch in word:
            if is_punctuation(ch):
                if current:
                    tokens.append("".join(current))
                    current = []
                tokens.append(ch)
            else:
                current.append(ch)
        if current:
            tokens.append("".join(current))
    return tokens


def wordpiece(word, vocab):
    if len(word) > 100:
        return ["[UNK]"]
    pieces, start = [], 0
    while start < len(word):
        end, found = len(word), None
        while start < end:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                found = piece
                break
            end -= 1
        if found is None:
            return ["[UNK]"]
        pieces.append(found)
        start = end
    return pieces


def tokenize(text, vocab):
    return [piece for word in basic_tokenize(text) for piece in wordpiece(word, vocab)]


def truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del trunc[0]
        else:
            trunc.pop()


def create_masked_lm_predictions(tokens, masked_lm_prob, max_predictions, vocab_words, rng):
    candidates = [i for i, t in enumerate(tokens) if t not in ("[CLS]", "[SEP]")]
    rng.shuffle(candidates)
    output = list(tokens)
    num_to_predict = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    masked = []
    for index in candidates:
        if len(masked) >= num_to_predict:
            break
        if rng.random() < 0.8:
            replacement = "[MASK]"
        elif rng.random() < 0.5:
            replacement = tokens[index]
        else:
            replacement = vocab_words[rng.randint(0, len(vocab_words) - 1)]
        output[index] = replacement
        masked.append((index, tokens[index]))
    masked.sort()
    return output, [i for i, _ in masked], [t for _, t in masked]


Instance = collections.namedtuple("Instance", "tokens segment_ids positions labels is_random_next")


def create_instances_from_document(all_documents, document_index, args, vocab_words, rng):
    document = all_documents[document_index]
    max_num_tokens = args.max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < args.short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances, current_chunk, current_length, i = [], [], 0, 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = rng.randint(1, len(current_chunk) - 1) if len(current_chunk) >= 2 else 1
                tokens_a = [t for j in range(a_end) for t in current_chunk[j]]
                tokens_b = []
                is_random_next = False
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    i -= len(current_chunk) - a_end
                else:
                    tokens_b = [t for j in range(a_end, len(current_chunk)) for t in current_chunk[j]]
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                tokens = ["[CLS]"] + tokens_a + ["[SEP]"] + tokens_b + ["[SEP]"]
                segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                tokens, positions, labels = create_masked_lm_predictions(
                    tokens, args.masked_lm_prob, args.max_predictions, vocab_words, rng)
                instances.append(Instance(tokens, segment_ids, positions, labels, is_random_next))
            current_chunk, current_length = [], 0
        i += 1
    return instances


def write_hdf5(path, instances, vocab, seq_len, max_pred):
    n = len(instances)
    input_ids = np.zeros((n, seq_len), dtype=np.int32)
    input_mask = np.zeros((n, seq_len), dtype=np.int8)
    segment_ids = np.zeros((n, seq_len), dtype=np.int8)
    positions = np.zeros((n, max_pred), dtype=np.int32)
    labels = np.zeros((n, max_pred), dtype=np.int32)
    next_sentence = np.zeros((n,), dtype=np.int8)
    tokens = 0
    for k, inst in enumerate(instances):
        length = len(inst.tokens)
        tokens += length
        input_ids[k, :length] = [vocab[t] for t in inst.tokens]
        input_mask[k, :length] = 1
        segment_ids[k, :length] = inst.segment_ids
        positions[k, :len(inst.positions)] = inst.positions
        labels[k, :len(inst.labels)] = [vocab[t] for t in inst.labels]
        next_sentence[k] = int(inst.is_random_next)
    with h5py.File(path, "w") as f:
        for name, data in [("input_ids", input_ids), ("input_mask", input_mask),
                           ("segment_ids", segment_ids), ("masked_lm_positions", positions),
                           ("masked_lm_ids", labels), ("next_sentence_labels", next_sentence)]:
            f.create_dataset(name, data=data)
    return tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--max-predictions", type=int, default=20)
    parser.add_argument("--masked-lm-prob", type=float, default=0.15)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--dupe-factor", type=int, default=1)
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()

    started = time.perf_counter()
    with open(args.vocab, encoding="utf-8") as f:
        vocab_words = [line.rstrip("\n") for line in f]
    vocab = {word: i for i, word in enumerate(vocab_words)}
    all_documents = [[]]
    with open(args.input, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                all_documents.append([])
                continue
            tokens = tokenize(line, vocab)
            if tokens:
                all_documents[-1].append(tokens)
    all_documents = [d for d in all_documents if d]
    rng = random.Random(args.seed)
    rng.shuffle(all_documents)
    instances = []
    for _ in range(args.dupe_factor):
        for document_index in range(len(all_documents)):
            instances.extend(create_instances_from_document(
                all_documents, document_index, args, vocab_words, rng))
    rng.shuffle(instances)
    tokens = write_hdf5(args.output, instances, vocab, args.max_seq_length, args.max_predictions)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({"documents": len(all_documents), "instances": len(instances),
                      "tokens": tokens, "seconds": seconds, "peak_rss_mib": peak}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
