"""PEFT's trainable and total parameter counts (`PeftModel.get_nb_trainable_parameters()`, what
`print_trainable_parameters` prints) for LoRA configs on the reference models of
`tests/reference/hf_configs`, built on the meta device (no weights) by transformers 5.25.0 and
PEFT 0.21.2. `scheduler/tests/lora.rs` reproduces every row.

Made once in a scratch venv (`pip install torch transformers peft`); CI never installs torch.
`python tests/reference/peft/make_counts.py` rewrites `counts.json` beside it with the same
bytes.
"""

import json
import os

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

here = os.path.dirname(os.path.abspath(__file__))
configs = os.path.join(here, "..", "hf_configs")
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# (reference config, LoraConfig keyword arguments); target_modules None is PEFT's default.
CASES = [
    ("llama-3.1-8B.json", {"r": 16, "lora_alpha": 32, "target_modules": SEVEN}),
    ("llama-3.1-8B.json", {}),
    ("llama-3.1-8B.json", {"r": 64, "target_modules": "all-linear"}),
    ("smollm2-135M.json", {"r": 16, "target_modules": SEVEN}),
    ("qwen3-0.6B.json", {"r": 8, "target_modules": "all-linear"}),
    ("qwen2.5-0.5B.json", {"r": 4, "target_modules": ["o_proj", "down_proj"]}),
    ("gpt2.json", {}),
    ("gpt2.json", {"r": 4, "target_modules": ["c_proj"], "fan_in_fan_out": True}),
    ("gpt2.json", {"r": 4, "target_modules": ["mlp.c_proj"], "fan_in_fan_out": True}),
    ("gpt2.json", {"r": 2, "target_modules": "all-linear", "fan_in_fan_out": True}),
]

rows = []
for config, kwargs in CASES:
    cfg = AutoConfig.from_pretrained(os.path.join(configs, config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    peft_model = get_peft_model(model, LoraConfig(**kwargs))
    trainable, total = peft_model.get_nb_trainable_parameters()
    rows.append(
        {"config": config, "lora": kwargs, "trainable": trainable, "all": total}
    )

out = {
    "made_by": f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}",
    "rows": rows,
}
with open(os.path.join(here, "counts.json"), "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print(json.dumps(rows, indent=1))
