"""Makes the Llama-family parity reference data in this directory, with PyTorch + transformers.

What it makes (everything here except this script):
- ``tokens.bin``: one llm.c token shard (a header of 256 little-endian int32: magic 20240520,
  version 1, token count; then the tokens as little-endian uint16) of 4096 tokens over a
  vocabulary of 256: a fixed cycle of 48 tokens drawn from 64 of the ids, each token replaced by a
  uniformly random id with probability 0.1, so a model learns it and the loss falls.
- ``llama/``, ``qwen2/``, ``qwen3/``: a tiny ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
  ``Qwen3ForCausalLM`` each, as ``save_pretrained`` writes it (``config.json`` and
  ``model.safetensors``, fp32, the INITIAL weights; a tied model's file has no
  ``lm_head.weight``; transformers 5 has no ``safe_serialization`` switch: it always writes
  safetensors), and ``expected.json``: the losses of 10 training steps from those weights.

Made with (CPU only, in a scratch venv; CI never installs torch):
    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch transformers safetensors numpy
which installed torch 2.15.0, transformers 5.25.0, safetensors 0.8.0, numpy 2.4.6 (Python
3.11.7). The script refuses other torch/transformers versions unless ``--any-version`` is given.
Rerun: ``/tmp/torchvenv/bin/python tests/reference/llama_parity/make.py`` (rewrites the files;
with the same versions the bytes are the same) and check ``git diff``. It takes a few seconds.

The data rule (checked against runner/src/data: file.rs skips the 1024-byte header, so token 0 is
the first token after it; windows.rs starts window w at ``w·B·T·world_size + rank·B·T`` and reads
``B·T + 1`` tokens; mod.rs's ``split_window`` takes inputs = the first ``B·T``, targets = the last
``B·T``), with world size 1, rank 0, no shuffle, B = 2, T = 32:
    step s (1-based) reads window s-1:  w = tokens[(s-1)·B·T : (s-1)·B·T + B·T + 1]
    inputs = w[:-1].reshape(B, T), targets = w[1:].reshape(B, T)
so row b of step s holds inputs tokens[(s-1)·64 + 32·b : ... + 32] and targets one token later;
every row starts at position 0 (no attention across rows). Ten steps read tokens 0..640.

The loss of step s is the mean cross-entropy over all B·T tokens, ``F.cross_entropy`` on
``model(input_ids).logits`` (fp32) and the targets above, computed BEFORE update s (so losses[0]
is the loss of the initial weights on window 0; update 10 shows only in ``loss_after``).
Training: fp32, ``attn_implementation="eager"``, ``torch.use_deterministic_algorithms(True)``,
one thread, ``model.train()`` (every dropout probability is 0: asserted), 10 steps of
``torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)`` with two parameter
groups: weight_decay 0.1 for the parameters of >= 2 dims (embeddings, linear weights; the tied
embedding is one parameter), 0 for the rest (norm weights, biases); constant lr, no clipping.
torch's AdamW step (single-tensor path): ``p *= 1 - lr·wd``; ``m.lerp_(g, 1-β1)``;
``v = β2·v + (1-β2)·g²``; ``p -= (lr/bc1)·m / (sqrt(v)/sqrt(bc2) + eps)``, bc_i = 1 - β_i^t in
Python floats (f64).

Initial weights: ``torch.manual_seed(seed)``, then ``Cls(config)`` (transformers' own init:
matrices N(0, 0.02), norms 1, biases 0), then every norm weight := 1 + 0.1·randn and every bias
:= 0.02·randn (a torch.Generator seeded with seed + 1, in state-dict order), so that the norms
and biases matter in the forward pass and get real gradients.

``expected.json`` also holds ``loss1_f64``: the step-1 loss again in float64, computed by this
script's own float64 re-implementation of the forward pass (``reference_forward``, which also
reproduces transformers' fp32 logits, asserted), and ``loss1_f64_hf``: what
``model.double()`` gives, which is not all float64 (transformers' RMSNorm casts to float32, its
eager attention takes the softmax in float32 and its rotary embedding computes cos/sin in
float32 from float32 inverse frequencies); and two extras: ``loss_after`` (the loss on window 10
after the 10 updates, no update) and ``final_tensor_norms`` (the L2 norm of each saved tensor
after the 10 updates, to find which tensor goes astray when a replay disagrees).

About the llama RoPE scaling: the brief proposed original_max_position_embeddings 32, under which
the 8 frequencies of head_dim 16 at theta 500000 are either untouched (1) or divided by the
factor (7) and none is in llama3's smoothed band; 48 is used instead (transformers warns unless
it is below max_position_embeddings, 64), so that one frequency is untouched (wavelength 6.3 <
48/4), one is smoothed (wavelength 32.4, between 12 and 48) and six are divided by 8 (asserted).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import safetensors  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TORCH_VERSION = "2.15.0"
TRANSFORMERS_VERSION = "5.25.0"

HERE = os.path.dirname(os.path.abspath(__file__))

VOCAB = 256
N_TOKENS = 4096
PERIOD = 48
NOISE = 0.1
DATA_SEED = 20240520

B, T, STEPS = 2, 32, 10
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1

SHARD_MAGIC, SHARD_VERSION = 20240520, 1

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 48,
}

MODELS = {
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=LLAMA3,
            rms_norm_eps=1e-5,
        ),
        1,
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        ),
        2,
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attention_bias=False,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        ),
        3,
    ),
}


# ---------------------------------------------------------------------------------------------
# Data


def make_tokens():
    rs = np.random.RandomState(DATA_SEED)
    alphabet = rs.choice(VOCAB, size=64, replace=False)
    cycle = alphabet[rs.randint(0, 64, size=PERIOD)]
    tokens = np.resize(cycle, N_TOKENS)
    noisy = rs.random_sample(N_TOKENS) < NOISE
    tokens = np.where(noisy, rs.randint(0, VOCAB, size=N_TOKENS), tokens).astype(np.uint16)
    return tokens


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [SHARD_MAGIC, SHARD_VERSION, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def read_shard(path):
    """Reads a shard as runner/src/data/file.rs does (header checks included)."""
    with open(path, "rb") as f:
        data = f.read()
    magic, version, count = struct.unpack_from("<3i", data, 0)
    assert (magic, version) == (SHARD_MAGIC, SHARD_VERSION)
    assert len(data) == 256 * 4 + 2 * count
    return np.frombuffer(data, dtype="<u2", offset=256 * 4).astype(np.int64)


def window(tokens, step):
    """Inputs and targets of 1-based step `step` (world size 1, rank 0, no shuffle)."""
    start = (step - 1) * B * T
    w = torch.from_numpy(tokens[start : start + B * T + 1].copy())
    assert len(w) == B * T + 1
    return w[:-1].reshape(B, T), w[1:].reshape(B, T)


# ---------------------------------------------------------------------------------------------
# Models


def build(name):
    config_cls, model_cls, kwargs, seed = MODELS[name]
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                assert p.dim() == 1 and torch.all(p == 1), pname
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(".bias"):
                assert torch.all(p == 0), pname
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def check_dropout(model):
    cfg = model.config
    assert getattr(cfg, "attention_dropout", 0.0) == 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            assert m.p == 0.0, m
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            assert m.attention_dropout == 0.0


def check_llama3_inv_freq(model):
    """The llama model's inverse frequencies: the llama3 scaling changes some, and one of each
    kind (untouched, smoothed, divided by the factor) is present. Returns a description."""
    cfg = model.config
    rope = model.model.rotary_emb
    d = cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    plain = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaled = rope.inv_freq.clone()
    assert scaled.dtype == torch.float32
    p = cfg.rope_parameters
    orig = p["original_max_position_embeddings"]
    low_wl, high_wl = orig / p["low_freq_factor"], orig / p["high_freq_factor"]
    kinds = []
    for f, g in zip(plain.tolist(), scaled.tolist()):
        wl = 2 * math.pi / f
        if wl < high_wl:
            kinds.append("unchanged")
            assert g == f
        elif wl > low_wl:
            kinds.append("divided")
            assert abs(g - f / p["factor"]) <= 1e-7 * f
        else:
            kinds.append("smoothed")
            s = (orig / wl - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
            want = (1 - s) * f / p["factor"] + s * f
            assert abs(g - want) <= 1e-6 * f, (g, want)
    assert not torch.equal(plain, scaled), "llama3 scaling changed nothing"
    assert {"unchanged", "smoothed", "divided"} <= set(kinds), kinds
    return {"unscaled": plain.tolist(), "scaled": scaled.tolist(), "kinds": kinds}


# ---------------------------------------------------------------------------------------------
# An independent forward pass (float64 or float32), from the state dict alone


def inv_freq_f64(cfg):
    p = cfg.rope_parameters
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = p["rope_theta"]
    f = [1.0 / theta ** (2 * i / d) for i in range(d // 2)]
    if p.get("rope_type", "default") == "llama3":
        orig = p["original_max_position_embeddings"]
        lo, hi = p["low_freq_factor"], p["high_freq_factor"]
        out = []
        for x in f:
            wl = 2 * math.pi / x
            if wl < orig / hi:
                out.append(x)
            elif wl > orig / lo:
                out.append(x / p["factor"])
            else:
                s = (orig / wl - lo) / (hi - lo)
                out.append((1 - s) * x / p["factor"] + s * x)
        f = out
    return torch.tensor(f, dtype=torch.float64)


def reference_forward(sd, cfg, ids, dtype):
    """Logits of `ids` (B, T): RMSNorm, RoPE (rotate-half), GQA causal attention, SwiGLU, all in
    `dtype` (RoPE cos/sin from float64 inverse frequencies, rounded to `dtype`)."""
    W = {k: v.to(dtype) for k, v in sd.items()}
    h_, kv_ = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h_
    eps = cfg.rms_norm_eps
    b, t = ids.shape

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def lin(x, name):
        y = x @ W[name + ".weight"].T
        return y + W[name + ".bias"] if name + ".bias" in W else y

    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq_f64(cfg)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def rope(x):  # (b, heads, t, d)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    mask = torch.ones(t, t, dtype=torch.bool).tril()
    x = W["model.embed_tokens.weight"][ids]
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}."
        hn = rms(x, W[pre + "input_layernorm.weight"])
        q = lin(hn, pre + "self_attn.q_proj").view(b, t, h_, d)
        k = lin(hn, pre + "self_attn.k_proj").view(b, t, kv_, d)
        v = lin(hn, pre + "self_attn.v_proj").view(b, t, kv_, d)
        if pre + "self_attn.q_norm.weight" in W:
            q = rms(q, W[pre + "self_attn.q_norm.weight"])
            k = rms(k, W[pre + "self_attn.k_norm.weight"])
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(h_ // kv_, dim=1)
        v = v.repeat_interleave(h_ // kv_, dim=1)
        att = (q @ k.transpose(-1, -2)) * d**-0.5
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, h_ * d)
        x = x + lin(y, pre + "self_attn.o_proj")
        hn = rms(x, W[pre + "post_attention_layernorm.weight"])
        gate = lin(hn, pre + "mlp.gate_proj")
        up = lin(hn, pre + "mlp.up_proj")
        x = x + lin(F.silu(gate) * up, pre + "mlp.down_proj")
    x = rms(x, W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x @ head.T


# ---------------------------------------------------------------------------------------------
# Training


def loss_of(model, inputs, targets):
    logits = model(inputs).logits
    assert logits.dtype == torch.float32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model, tokens):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        foreach=False,
    )
    model.train()
    losses = []
    for step in range(1, STEPS + 1):
        inputs, targets = window(tokens, step)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, inputs, targets)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None and torch.any(p.grad != 0)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        inputs, targets = window(tokens, STEPS + 1)
        after = loss_of(model, inputs, targets).item()
    return losses, after


def make_model(name, tokens, versions):
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    model = build(name)
    check_dropout(model)
    extra = {}
    if name == "llama":
        extra["inv_freq"] = check_llama3_inv_freq(model)

    model.save_pretrained(out)
    # save_pretrained also writes generation_config.json (generation defaults), which is no part
    # of what zerotrain reads or writes: it is not kept.
    os.remove(os.path.join(out, "generation_config.json"))
    names = sorted(n for n in os.listdir(out) if n != "expected.json")
    assert names == ["config.json", "model.safetensors"], names
    with open(os.path.join(out, "config.json")) as f:
        config_json = json.load(f)
    saved = load_file(os.path.join(out, "model.safetensors"))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    want = {k: v for k, v in initial.items() if not (tied and k == "lm_head.weight")}
    assert set(saved) == set(want), (set(saved) ^ set(want))
    for k, v in saved.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k]), k

    # The saved directory loads back to exactly these weights, in the right class.
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(loaded) is type(model), type(loaded)
    lsd = loaded.state_dict()
    assert set(lsd) == set(initial), set(lsd) ^ set(initial)
    for k, v in lsd.items():
        assert torch.equal(v, initial[k]), k
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    del loaded

    # Step 1's loss in float64: our own float64 forward, and what model.double() gives.
    inputs, targets = window(tokens, 1)
    cfg = model.config
    with torch.no_grad():
        hf32 = model(inputs).logits
        ours32 = reference_forward(initial, cfg, inputs, torch.float32)
        err32 = (hf32 - ours32).abs().max().item()
        assert err32 < 2e-5, err32
        ours64 = reference_forward(initial, cfg, inputs, torch.float64)
        loss1_f64 = F.cross_entropy(ours64.reshape(-1, VOCAB), targets.reshape(-1)).item()
        m64 = build(name).double()
        hf64 = m64(inputs).logits
        assert hf64.dtype == torch.float64
        loss1_f64_hf = F.cross_entropy(hf64.reshape(-1, VOCAB), targets.reshape(-1)).item()
        del m64
        logit_gap = {
            "hf_f32_vs_ours_f32": err32,
            "hf_f32_vs_ours_f64": (hf32.double() - ours64).abs().max().item(),
            "hf_f64_vs_ours_f64": (hf64 - ours64).abs().max().item(),
        }

    losses, after = train(model, tokens)
    assert losses[-1] < losses[0] - 0.05, losses
    assert abs(losses[0] - loss1_f64) < 1e-4, (losses[0], loss1_f64)
    final = model.state_dict()
    expected = {
        **versions,
        "batch": B,
        "seq_len": T,
        "steps": STEPS,
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        "losses": losses,
        "loss1_f64": loss1_f64,
        "loss1_f64_hf": loss1_f64_hf,
        "loss_after": after,
        "export": {
            # In state-dict order (the file itself stores them sorted by name).
            "tensors": {k: list(v.shape) for k, v in want.items()},
            "config_keys": sorted(config_json),
        },
        "final_tensor_norms": {
            k: final[k].double().norm().item() for k in sorted(saved)
        },
        "notes": {
            "model_class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "max_abs_logit_gap_step1": logit_gap,
            **extra,
        },
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    return expected


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--any-version", action="store_true")
    args = ap.parse_args()
    versions = {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}
    if (versions["torch"], versions["transformers"]) != (TORCH_VERSION, TRANSFORMERS_VERSION):
        msg = f"made with torch {TORCH_VERSION}, transformers {TRANSFORMERS_VERSION}; found {versions}"
        if not args.any_version:
            sys.exit(msg + " (--any-version to go on)")
        print("warning:", msg)
    print("safetensors", safetensors.__version__, "numpy", np.__version__)

    path = os.path.join(HERE, "tokens.bin")
    write_shard(path, make_tokens())
    tokens = read_shard(path)
    assert len(tokens) == N_TOKENS and tokens.max() < VOCAB
    for name in MODELS:
        e = make_model(name, tokens, versions)
        print(name, "losses", [round(x, 6) for x in e["losses"]])
        print(name, "loss1_f64", e["loss1_f64"], "loss1_f64_hf", e["loss1_f64_hf"], "after", e["loss_after"])


if __name__ == "__main__":
    main()
