#!/usr/bin/env python3
"""transformers' side of the CPU benchmarks (`cargo bench -p runner --bench llama` and
`--bench long`): a SmolLM2-135M-shaped `LlamaForCausalLM` or a gpt2-124M `GPT2LMHeadModel`
(random weights), AdamW, synthetic tokens, on this machine's CPU with the threads given; fp32,
or bf16 autocast over fp32 weights (what zerotrain's bf16 is: bf16 compute, fp32 master
weights); eager attention, or PyTorch's `scaled_dot_product_attention` (`--attn sdpa`).

    python bench_torch_cpu.py --dtype fp32|bf16 [--model smollm2-135M|gpt2-124M]
        [--batch 4] [--seq 128] [--attn eager|sdpa] [--threads N] [--warmup 2] [--steps 5]
        [--lora R [--qlora]]

With `--lora R`, PEFT's LoRA adapters of rank R (alpha 2R, no dropout) on every linear
projection (`"all-linear"`) are trained on the frozen model instead (needs peft). With
`--qlora` too, the model is loaded through bitsandbytes' 4-bit NF4 (`BitsAndBytesConfig`,
blocks of 64, no double quantization, the row's dtype as the compute dtype) first, as QLoRA
trains (needs bitsandbytes; its CPU back end dequantizes each weight for its product).

Prints one JSON object: {"dtype", "threads", "steps", "median_step_s", "tokens_per_second",
"torch", "transformers"}. Denormals are flushed, as zerotrain flushes them: without it AdamW's
state drifts into denormals and a step slows several-fold. Needs torch and transformers (a
scratch virtual environment; CI never runs it).
"""

import argparse
import json
import statistics
import time

import torch
import transformers

# SmolLM2-135M (tests/reference/hf_configs/smollm2-135M.json).
CONFIG = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)


def build(name, attn):
    """The model `name`, randomly initialised, with attention implementation `attn`."""
    if name == "gpt2-124M":
        config = transformers.GPT2Config(n_positions=4096, attn_implementation=attn)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(**CONFIG, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config)


def quantized(model, compute_dtype):
    """`model` reloaded with its linear layers (not the head) in bitsandbytes' NF4."""
    import tempfile

    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    import bitsandbytes

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        model = type(model).from_pretrained(
            d, quantization_config=config, device_map="cpu",
            attn_implementation=model.config._attn_implementation,
        ).train()
    nf4 = sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.modules())
    assert nf4 == 7 * model.config.num_hidden_layers, f"{nf4} NF4 layers"
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=["fp32", "bf16"], required=True)
    ap.add_argument("--model", choices=["smollm2-135M", "gpt2-124M"], default="smollm2-135M")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lora", type=int, default=0)
    ap.add_argument("--qlora", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    B, T = args.batch, args.seq
    model = build(args.model, args.attn).train()
    if args.qlora:
        model = quantized(model, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    vocab = model.config.vocab_size
    if args.lora:
        import peft

        config = peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear")
        model = peft.get_peft_model(model, config).train()
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    other = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
    )
    x = torch.randint(0, vocab, (B, T))
    y = torch.randint(0, vocab, (B, T))
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    assert torch.isfinite(loss), "loss is not finite"
    step = statistics.median(times)
    print(json.dumps({
        "model": args.model, "batch": B, "seq": T, "attn": args.attn,
        "dtype": args.dtype, "threads": args.threads, "steps": args.steps,
        "median_step_s": step, "tokens_per_second": B * T / step,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "lora": args.lora, "qlora": args.qlora,
    }))


if __name__ == "__main__":
    main()
