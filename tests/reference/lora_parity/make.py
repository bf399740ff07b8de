"""LoRA parity reference data: what PEFT on transformers computes when training adapters on the
tiny models of ``../llama_parity`` (``llama``, ``qwen3``) and on a tiny GPT-2 made here, for the
trainer's LoRA parity test (issue 43). Nothing in CI reads it yet: the LoRA trainer is the next
step; the data is made now, with its script, so that the test has PEFT's numbers to meet.

For each model ``<name>/``:
- ``adapter/``: the starting adapter as PEFT's ``save_pretrained`` writes it
  (``adapter_config.json``, ``adapter_model.safetensors``; its model card left out and
  ``base_model_name_or_path`` the folder's name, not this machine's path): ``LoraConfig(r=4, lora_alpha=8,
  lora_dropout=0.0, target_modules="all-linear")`` (GPT-2: ``fan_in_fan_out=True``), then every
  ``lora_A`` and ``lora_B`` := 0.05·N(0, 1) from a generator seeded 43 + the model's seed in
  state-dict order, so that B is not zero and the adapters change the step-1 loss.
- ``trained/``: the adapter after the 10 updates, as ``save_pretrained`` writes it.
- ``expected.json``: the 10 losses (each before its update), ``loss_after`` (window 10 after the
  updates), PEFT's trainable and total parameter counts, the L2 norm of every adapter tensor
  after the updates, and the logits' sum and sum of squares on window 10 of the merged model
  (``merge_and_unload``), which a merged export must reproduce.
- ``gpt2/`` only: ``config.json`` and ``model.safetensors`` of the tiny ``GPT2LMHeadModel``
  (vocabulary 256, 64 positions, 2 layers, 4 heads, C 32, dropouts 0; transformers' init from
  ``torch.manual_seed(4)``).

Data, loss and optimizer are ``../llama_parity/make.py``'s (B 2, T 32, ``tokens.bin`` windows,
mean cross-entropy before each update, ``AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
foreach=False)``), over the adapter tensors only, all of them decayed (weight_decay 0.1: every
adapter tensor has 2 dims); fp32, eager attention, one thread, deterministic algorithms.

Made once in a scratch venv (``pip install torch transformers peft safetensors numpy``: torch
2.15.0, transformers 5.25.0, PEFT 0.21.2); CI never installs torch. Rerun with
``python tests/reference/lora_parity/make.py``: with the same versions the bytes are the same.
"""

import importlib.util
import json
import os
import shutil
import sys

# PEFT keeps target_modules as a set and saves it in iteration order: fix string hashing so
# that adapter_config.json comes out the same every run.
if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
PARITY = os.path.join(HERE, "..", "llama_parity")

spec = importlib.util.spec_from_file_location("llama_parity", os.path.join(PARITY, "make.py"))
lp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lp)

PEFT_VERSION = "0.21.2"
RANK, ALPHA = 4, 8


def tiny_gpt2():
    torch.manual_seed(4)
    cfg = GPT2Config(
        vocab_size=lp.VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    out = os.path.join(HERE, "gpt2")
    model.save_pretrained(out)
    os.remove(os.path.join(out, "generation_config.json"))
    return out


def save_adapter(model, name, folder):
    """`save_pretrained`, with the base named by the model's folder name rather than this
    machine's path, and without the model card PEFT writes beside the adapter."""
    model.peft_config["default"].base_model_name_or_path = name
    out = os.path.join(HERE, name, folder)
    model.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))
    return out


def seeded_adapters(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def train(model, tokens):
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dim() >= 2 for p in trainable)
    opt = torch.optim.AdamW(
        [{"params": trainable, "weight_decay": lp.WD}],
        lr=lp.LR,
        betas=lp.BETAS,
        eps=lp.EPS,
        foreach=False,
    )
    model.train()
    losses = []
    for step in range(1, lp.STEPS + 1):
        inputs, targets = lp.window(tokens, step)
        opt.zero_grad(set_to_none=True)
        loss = lp.loss_of(model, inputs, targets)
        loss.backward()
        for p in trainable:
            assert p.grad is not None and torch.any(p.grad != 0)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        inputs, targets = lp.window(tokens, lp.STEPS + 1)
        after = lp.loss_of(model, inputs, targets).item()
    return losses, after


def make(name, base_dir, seed, tokens):
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    gpt2 = base.config.model_type == "gpt2"
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules="all-linear",
        fan_in_fan_out=gpt2,
    )
    model = get_peft_model(base, config)
    seeded_adapters(model, 43 + seed)
    save_adapter(model, name, "adapter")
    trainable, total = model.get_nb_trainable_parameters()
    losses, after = train(model, tokens)
    trained = save_adapter(model, name, "trained")
    norms = {
        n: p.detach().norm().item() for n, p in model.named_parameters() if p.requires_grad
    }
    # A fresh load of the trained adapter, merged into the base: what a merged export computes.
    fresh = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    merged = PeftModel.from_pretrained(fresh, trained).merge_and_unload()
    with torch.no_grad():
        inputs, targets = lp.window(tokens, lp.STEPS + 1)
        logits = merged(inputs).logits.double()
        merged_loss = lp.loss_of(merged, inputs, targets).item()
    assert abs(merged_loss - after) < 1e-5 * abs(after), (merged_loss, after)
    expected = {
        "made_with": {
            "torch": torch.__version__.split("+")[0],
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "lora": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "target_modules": "all-linear"},
        "trainable_parameters": trainable,
        "all_parameters": total,
        "losses": losses,
        "loss_after": after,
        "merged_logits_sum": logits.sum().item(),
        "merged_logits_sum_squares": (logits * logits).sum().item(),
        "final_adapter_norms": norms,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    return expected


def main():
    assert peft.__version__ == PEFT_VERSION, peft.__version__
    for name in ("llama", "qwen3", "gpt2"):
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
    tokens = lp.read_shard(os.path.join(PARITY, "tokens.bin"))
    models = [
        ("llama", os.path.join(PARITY, "llama"), 1),
        ("qwen3", os.path.join(PARITY, "qwen3"), 3),
        ("gpt2", tiny_gpt2(), 4),
    ]
    for name, base_dir, seed in models:
        e = make(name, base_dir, seed, tokens)
        print(name, e["trainable_parameters"], [round(x, 6) for x in e["losses"]], e["loss_after"])


if __name__ == "__main__":
    main()
