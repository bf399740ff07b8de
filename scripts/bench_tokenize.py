#!/usr/bin/env python3
"""The tokenization bench's data and its reference: the `tokenizers` Python package.

`--make DIR` writes DIR/corpus.jsonl (the Python standard library's .py files, one document
each, up to --mb megabytes: real text that every machine with Python has) and DIR/tokenizer.json,
a byte-level BPE of 32,000 ids trained on it with `tokenizers` (with tokenizer_config.json
naming its end-of-sequence token).

`--encode DIR` reads the documents back and times `Tokenizer.encode_batch` over all of them,
`--repeat` times; prints one JSON object: the corpus's megabytes (of document text), the median
seconds and the tokens. `RAYON_NUM_THREADS` sets its threads, as for zerotrain.

Used by `cargo bench -p runner --bench tokenize` (ZEROTRAIN_TOKENIZERS_PYTHON: a Python with
`pip install tokenizers`).
"""

import argparse
import json
import pathlib
import statistics
import sysconfig
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def make(out: pathlib.Path, mb: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    budget = int(mb * 1e6)
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        budget -= len(text.encode())
        if budget <= 0:
            break
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32_000,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))


def encode(out: pathlib.Path, repeat: int) -> None:
    with open(out / "corpus.jsonl", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    seconds, tokens = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        enc = tok.encode_batch(docs)
        seconds.append(time.perf_counter() - start)
        tokens = sum(len(e.ids) for e in enc)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    print(json.dumps({"mb": mb, "median_s": statistics.median(seconds), "tokens": tokens}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--make", type=pathlib.Path)
    p.add_argument("--mb", type=float, default=40.0)
    p.add_argument("--encode", type=pathlib.Path)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    if a.make:
        make(a.make, a.mb)
    if a.encode:
        encode(a.encode, a.repeat)


if __name__ == "__main__":
    main()
