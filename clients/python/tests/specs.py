"""Job specs the tests submit."""

from typing import Any

# 5 steps of the 141,056-parameter model: well under a second on one CPU device.
TINY: dict[str, Any] = {
    "model": {"preset": "gpt2-tiny"},
    "training": {"steps": 5, "micro_batch_size": 2, "seq_len": 32},
}

# Runs until cancelled.
ENDLESS: dict[str, Any] = dict(TINY, training={"steps": 1_000_000, "micro_batch_size": 2, "seq_len": 32})
