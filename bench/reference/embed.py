#!/usr/bin/env python3
"""The sentence-transformers side of `cargo xtask bench embed`.

Loads a model folder with `SentenceTransformer`, sets the threads, and times `encode` of the
sentences (one per line of --sentences): `--rounds` timed rounds after one warm-up, each either
all sentences in batches of --batch-size, or (--batch-size 1) each sentence alone. Prints one JSON
line: {"seconds": [per round], "dim": ..., "torch": version, "sentence_transformers": version}.
The embeddings of the last round are written to --out (numpy .npy) when given, for ember's side
to compare.
"""
import argparse
import json
import time

import numpy as np
import torch
from sentence_transformers import SentenceTransformer, __version__ as st_version


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--sentences", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sentences = open(args.sentences, encoding="utf-8").read().splitlines()
    model = SentenceTransformer(args.model, device=args.device)
    model.eval()

    def encode():
        out = model.encode(sentences, batch_size=args.batch_size, convert_to_numpy=True,
                           show_progress_bar=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return out

    encode()  # warm-up
    seconds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        emb = encode()
        seconds.append(time.perf_counter() - start)
    if args.out:
        np.save(args.out, emb.astype(np.float32))
    print(json.dumps({"seconds": seconds, "dim": int(emb.shape[1]), "torch": torch.__version__,
                      "sentence_transformers": st_version}))


if __name__ == "__main__":
    main()
