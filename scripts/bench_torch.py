#!/usr/bin/env python3
"""PyTorch's side of the GPU benchmark: gpt2-124M, bf16 autocast over fp32 weights, fused AdamW,
T = 1024, B = 16, on synthetic tokens; PyTorch eager and torch.compile (`--eager`: eager only,
as scripts/gpu-check runs it, sparing torch.compile's minute of compiling).

Prints tokens/s, median step time and MFU: llm.c's FLOP count (6·N + 6·L·C·T per token, N the
parameters, the tied wte counted once) against the bf16 rate of an 8192³ matmul measured here.
Without a GPU it says "no GPU present" and exits 0. Run by scripts/gpu-check, last.

With ZEROTRAIN_BENCH_JSON naming the file runner's `gpu` bench wrote in the same run, it then
prints both side by side, every MFU against this script's matmul rate, and zerotrain's
tokens/s over PyTorch eager's at the same B.
"""

import ctypes
import json
import math
import os
import statistics
import sys
import time

B, T = 16, 1024
V, L, H, C = 50257, 12, 12, 768
WARMUP, STEPS = 3, 10


def no_gpu(why):
    print(f"bench_torch: no GPU present ({why})")
    sys.exit(0)


try:
    ctypes.CDLL("libcuda.so.1")
except OSError:
    no_gpu("libcuda.so.1 not loadable")

import torch  # noqa: E402  (only where a driver is)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if not torch.cuda.is_available():
    no_gpu("torch.cuda.is_available() is false")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # LM head tied to wte
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


def matmul_tflops():
    """Median bf16 rate of an 8192³ matmul, TFLOP/s: the peak MFU is measured against."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def bench(compiled, flops_per_step, peak):
    torch.manual_seed(0)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    step_fn = torch.compile(model) if compiled else model
    x = torch.randint(0, V, (B, T), device="cuda")
    y = torch.randint(0, V, (B, T), device="cuda")
    times = []
    for i in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    assert math.isfinite(loss.item()), "loss is not finite"
    step = statistics.median(times)
    return step, B * T / step, flops_per_step / step / 1e12 / peak


def main():
    print(f"bench_torch: torch {torch.__version__}, {torch.cuda.get_device_name()}")
    peak = matmul_tflops()
    n_params = sum(p.numel() for p in GPT().parameters())
    flops_per_step = (6 * n_params + 6 * L * C * T) * B * T
    print(f"bf16 8192³ matmul: {peak:.0f} TFLOP/s; N = {n_params:,}; "
          f"{flops_per_step / 1e12:.2f} TFLOP per step (llm.c's count)")
    print(f"{'mode':<14} {'step ms':>8} {'tokens/s':>10} {'MFU':>6}")
    results = {}
    modes = (("eager", False),) if "--eager" in sys.argv[1:] else (("eager", False), ("torch.compile", True))
    for name, compiled in modes:
        step, tps, mfu = bench(compiled, flops_per_step, peak)
        results[name] = (tps, mfu)
        print(f"{name:<14} {step * 1e3:>8.1f} {tps:>10,.0f} {mfu:>6.1%}")
    print("summary: " + ", ".join(f"{k} {t:,.0f} tok/s MFU {m:.1%}" for k, (t, m) in results.items())
          + f", peak {peak:.0f} TFLOP/s")
    side_by_side(results, flops_per_step, peak)


def side_by_side(results, flops_per_step, peak):
    """zerotrain's rows (ZEROTRAIN_BENCH_JSON) beside PyTorch's, MFU against one peak."""
    path = os.environ.get("ZEROTRAIN_BENCH_JSON")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        ours = json.load(f)["rows"]
    print()
    print(f"| run | B | tokens/s | MFU (vs {peak:.0f} TFLOP/s) | × PyTorch eager |")
    print("|---|---:|---:|---:|---:|")
    eager = results["eager"][0]
    for name, (tps, mfu) in results.items():
        print(f"| PyTorch {name} | {B} | {tps:,.0f} | {mfu:.1%} | {tps / eager:.2f} |")
    per_token = flops_per_step / (B * T)
    # PyTorch's side is gpt2-124M: the other models' rows are zerotrain's alone.
    for r in (r for r in ours if r.get("model", "gpt2-124M") == "gpt2-124M"):
        tps = r["tokens_per_second"]
        mfu = tps * per_token / 1e12 / peak
        print(f"| zerotrain | {r['batch']} | {tps:,.0f} | {mfu:.1%} | {tps / eager:.2f} |")


if __name__ == "__main__":
    main()
