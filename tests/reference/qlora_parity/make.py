"""QLoRA parity reference data: what PEFT on transformers computes when training the adapters of
``../lora_parity`` on a base loaded through bitsandbytes' 4-bit NF4, for the trainer's QLoRA
parity test (issue 43).

For each model ``<name>`` of ``../lora_parity`` (``llama``, ``qwen3``, ``gpt2``; their bases
``../llama_parity/llama``, ``../llama_parity/qwen3`` and ``../lora_parity/gpt2``), the base is
loaded with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=torch.float32)`` on the CPU (every
linear layer but the LM head in NF4, blocks of 64, GPT-2's Conv1D weights transposed first), the
starting adapter ``../lora_parity/<name>/adapter`` is loaded on it trainable, and it is trained
as ``../lora_parity/make.py`` trains (same windows, loss and AdamW, fp32, one thread).
``<name>.json`` holds the 10 losses (each before its update) and the versions.

bitsandbytes 0.50.0's AVX-512 CPU dequantization (``cdequantize_blockwise_cpu_nf4_*``, used
for 2-D weights whose rows hold a multiple of 16 values) takes a row's absmax from
``row·(n // 64) + col // 64``, which is its quantizer's block only when a row holds a multiple of
64 values; these tiny models' ``down_proj`` rows hold 176, so on this path they would be
dequantized with other blocks' absmax. Here every NF4 weight is dequantized by bitsandbytes' own
generic path instead (``backends.default.ops._dequantize_4bit_compute``: the quantizer's flat
blocks, as its CUDA kernel and its CPU path for odd rows dequantize), registered over the CPU
kernel before anything loads.

Made once in a scratch venv (``pip install torch transformers peft safetensors
bitsandbytes==0.50.0``: torch 2.15.0, transformers 5.25.0, PEFT 0.21.2, bitsandbytes 0.50.0);
CI never installs torch. Rerun with ``python tests/reference/qlora_parity/make.py``.
"""

import importlib.util
import json
import os

import bitsandbytes
import peft
import torch
import transformers
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

HERE = os.path.dirname(os.path.abspath(__file__))
LORA = os.path.join(HERE, "..", "lora_parity")
PARITY = os.path.join(HERE, "..", "llama_parity")


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lp = load("llama_parity", os.path.join(PARITY, "make.py"))
lora = load("lora_parity", os.path.join(LORA, "make.py"))


def dequantize_flat():
    """bitsandbytes' generic dequantization for every shape on the CPU (see above)."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    @torch.library.register_kernel("bitsandbytes::dequantize_4bit", "cpu")
    def _(A, absmax, blocksize, quant_type, shape, dtype):
        A = A if A.dtype == torch.uint8 else A.view(torch.uint8)
        code = _get_4bit_code(quant_type, A.device)
        return _dequantize_4bit_compute(
            A.reshape(-1), absmax, code, blocksize, shape, dtype
        )


def make(name, base_dir, tokens):
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(
        base_dir,
        attn_implementation="eager",
        quantization_config=config,
        device_map="cpu",
    )
    layers = (
        base.config.num_hidden_layers
        if hasattr(base.config, "num_hidden_layers")
        else base.config.n_layer
    )
    nf4 = sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in base.modules())
    assert nf4 == layers * (4 if name == "gpt2" else 7), nf4
    model = PeftModel.from_pretrained(
        base, os.path.join(LORA, name, "adapter"), is_trainable=True
    )
    losses, _ = lora.train(model, tokens)
    expected = {
        "made_with": {
            "torch": torch.__version__.split("+")[0],
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__,
        },
        "quantization": "nf4, blocks of 64, no double quantization, fp32 compute; "
        "dequantized by bitsandbytes' generic path (see make.py)",
        "losses": losses,
    }
    with open(os.path.join(HERE, f"{name}.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    return expected


def main():
    assert bitsandbytes.__version__ == "0.50.0", bitsandbytes.__version__
    dequantize_flat()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokens = lp.read_shard(os.path.join(PARITY, "tokens.bin"))
    models = [
        ("llama", os.path.join(PARITY, "llama")),
        ("qwen3", os.path.join(PARITY, "qwen3")),
        ("gpt2", os.path.join(LORA, "gpt2")),
    ]
    for name, base_dir in models:
        e = make(name, base_dir, tokens)
        print(name, [round(x, 6) for x in e["losses"]])


if __name__ == "__main__":
    main()
