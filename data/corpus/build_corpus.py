#!/usr/bin/env python3
"""Build ember's embedded default corpus from Wikipedia lead sections.

Input:  shared/data/wiki_vital_summaries_en.json  ({title: {title, extract, description, topic}})
Output: data/corpus/wiki_vital_en.txt.zst          (one sentence per line, a blank line between
                                                    documents, one document per article;
                                                    zstd level 19, compiled into ember's binary)

The format is the one Google's BERT `create_pretraining_data.py` reads. Articles are shuffled with a
fixed seed so that the held-out slice (the last documents; see ember_data::corpus) mixes topics
instead of being the end of the alphabet. Text: Wikipedia, CC BY-SA 4.0 (see ATTRIBUTION.md).

Usage: python3 data/corpus/build_corpus.py [SRC_JSON] [OUT_ZST]
Only the standard library and the `zstd` command (Debian: zstd) are used, so the output is
reproducible byte for byte.
"""
import json
import random
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SRC = HERE.parent.parent.parent / "shared" / "data" / "wiki_vital_summaries_en.json"
DEFAULT_OUT = HERE / "wiki_vital_en.txt.zst"
SEED = 12345

# Tokens that end in a period but do not end a sentence (checked case-insensitively).
ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "ft", "gen", "col", "lt", "capt",
    "sgt", "rev", "hon", "gov", "pres", "vs", "etc", "e.g", "i.e", "c", "ca", "cf", "al", "approx",
    "no", "nos", "vol", "vols", "fig", "op", "ed", "eds", "est", "inc", "ltd", "co", "corp", "jan",
    "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "u.s", "u.k",
    "u.n", "a.d", "b.c", "b.c.e", "c.e", "ph.d", "p", "pp", "lit", "var", "subsp", "sp", "spp",
}

# A candidate boundary: sentence-final punctuation, optional closing quotes/brackets, whitespace,
# then something that can start a sentence (capital letter, digit or an opening quote/bracket).
BOUNDARY = re.compile(r"([.!?])([\"'\u201d\u2019)\]]*)\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split a paragraph into sentences with a rule-based splitter (no abbreviations or initials)."""
    text = unicodedata.normalize("NFC", " ".join(text.split()))
    sentences, start = [], 0
    for m in BOUNDARY.finditer(text):
        if m.group(1) == ".":
            before = text[start:m.start(1)]
            last_word = before.rsplit(" ", 1)[-1].lstrip("(\"'\u201c")
            # Initials ("Arthur C. Clarke") and known abbreviations do not end a sentence.
            if len(last_word) == 1 and last_word.isalpha():
                continue
            if last_word.lower() in ABBREVIATIONS:
                continue
        end = m.end(2)
        sentence = text[start:end].strip()
        if sentence:
            sentences.append(sentence)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SRC
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT
    articles = list(json.loads(src.read_text(encoding="utf-8")).values())
    articles.sort(key=lambda a: a["title"])
    random.Random(SEED).shuffle(articles)
    documents = []
    for article in articles:
        sentences = []
        for paragraph in article["extract"].split("\n"):
            sentences.extend(split_sentences(paragraph))
        if sentences:
            documents.append("\n".join(sentences))
    text = ("\n\n".join(documents) + "\n").encode("utf-8")
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(subprocess.run(["zstd", "-19", "-q", "-c"], input=text, check=True,
                                   capture_output=True).stdout)
    tmp.replace(out)
    n_sentences = sum(d.count("\n") + 1 for d in documents)
    print(f"wrote {out}: {len(documents)} documents, {n_sentences} sentences")


if __name__ == "__main__":
    main()
