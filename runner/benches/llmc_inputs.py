"""Inputs for timing llm.c's `train_gpt2.c` without network access (see docs/benchmarks.md).

Writes, into the current directory (llm.c's working directory):
- `gpt2_124M.bin`: a GPT-2 124M checkpoint in llm.c's format (256 int32 header: magic 20240326,
  version 3, maxT 1024, V 50257, L 12, NH 12, C 768, padded V 50304; then the float32
  parameters in `fill_in_parameter_sizes` order) with random weights: N(0, 0.02) matrices,
  LayerNorm weights 1, biases 0. Step time does not depend on the values.
- `dev/data/tinyshakespeare/tiny_shakespeare_{train,val}.bin`: token shards in llm.c's data
  format (256 int32 header: magic 20240520, version 1, token count; then uint16 tokens), random
  tokens below V.
"""

import array
import os
import random
import struct

MAX_T, V, VP, L, NH, C = 1024, 50257, 50304, 12, 12, 768
rng = random.Random(1)

# (kind, element count) in llm.c's parameter order: wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw,
# attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, lnfw, lnfb.
TENSORS = [
    ("normal", VP * C), ("normal", MAX_T * C), ("one", L * C), ("zero", L * C),
    ("normal", L * 3 * C * C), ("zero", L * 3 * C), ("normal", L * C * C), ("zero", L * C),
    ("one", L * C), ("zero", L * C), ("normal", L * 4 * C * C), ("zero", L * 4 * C),
    ("normal", L * C * 4 * C), ("zero", L * C), ("one", C), ("zero", C),
]


def write_checkpoint(path):
    header = [20240326, 3, MAX_T, V, L, NH, C, VP] + [0] * 248
    # A pool of normal values, repeated: realistic magnitudes at a fraction of the time.
    pool = array.array("f", (rng.gauss(0.0, 0.02) for _ in range(1 << 20)))
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        for kind, n in TENSORS:
            if kind == "normal":
                for start in range(0, n, len(pool)):
                    pool[: min(len(pool), n - start)].tofile(f)
            else:
                array.array("f", [1.0 if kind == "one" else 0.0]).tofile(f) if n == 1 else \
                    array.array("f", [1.0 if kind == "one" else 0.0] * n).tofile(f)


def write_shard(path, tokens):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header = [20240520, 1, tokens] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        array.array("H", (rng.randrange(V) for _ in range(tokens))).tofile(f)


if __name__ == "__main__":
    write_checkpoint("gpt2_124M.bin")
    write_shard("dev/data/tinyshakespeare/tiny_shakespeare_train.bin", 200_000)
    write_shard("dev/data/tinyshakespeare/tiny_shakespeare_val.bin", 20_000)
