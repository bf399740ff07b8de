"""NF4 reference tensors: what bitsandbytes 0.50.0 (CPU, torch 2.15.0) stores and returns for
`bitsandbytes.functional.quantize_4bit(x, blocksize=64, quant_type="nf4")` and
`dequantize_4bit` of that, for a handful of inputs chosen to reach every branch of its CPU path:

- `bf16_weight`: a (96, 64) bf16 weight, N(0, 0.02) as transformers initialises linear layers;
- `bf16_ragged`: (10, 13) bf16, 130 values, so the last block holds 2 (bitsandbytes divides
  that block by its absmax where full blocks multiply by the reciprocal);
- `fp16_wide`: (3, 128) fp16 with values up to 60000 and an all-zero block;
- `fp32_ties`: (2, 64) fp32 whose first block has absmax 1 and holds every midpoint between
  adjacent NF4 codes exactly (bucketize sends a tie to the lower code), its second block the
  midpoints' neighbours one ulp either side;
- `fp32_odd`: (1, 67) fp32, an odd last dimension (bitsandbytes' generic dequantization path);
- `fp32_short`: (1, 72) fp32, a full block and a short one holding the same values: near
  midpoints, where multiplying by the reciprocal of the absmax and dividing by it pick different
  codes.

For each `<name>`: `<name>.input` (the tensor, its own dtype), `<name>.codes` (uint8, packed two
to a byte, the even index in the high nibble, as bitsandbytes stores them), `<name>.absmax`
(fp32, one per block of 64) and `<name>.dequantized` (the input's dtype).

Made once in a scratch venv (`pip install torch bitsandbytes==0.50.0 safetensors`); CI never
installs torch. `python tests/reference/nf4/make.py` rewrites `nf4.safetensors` beside it with
the same bytes.
"""

import os

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
from safetensors.torch import save_file

assert bnb.__version__ == "0.50.0", bnb.__version__
torch.manual_seed(20261206)

NF4 = F.get_4bit_type("nf4", device="cpu")


def ties():
    midpoints = (NF4[:-1] + NF4[1:]) / 2
    first = torch.zeros(64)
    first[0] = 1.0
    first[1 : 1 + 15] = midpoints
    first[16 : 16 + 15] = -midpoints.flip(0)
    second = torch.zeros(64)
    second[0] = -1.0
    up = torch.nextafter(midpoints, torch.tensor(2.0))
    down = torch.nextafter(midpoints, torch.tensor(-2.0))
    second[1 : 1 + 15] = up
    second[16 : 16 + 15] = down
    return torch.stack([first, second])


def wide():
    x = torch.randn(3, 128) * 20000
    x[1, :64] = 0.0
    x[2, 5] = 60000.0
    return x.to(torch.float16)


def short():
    # Values within a few ulps of a midpoint times the absmax where x·(1/absmax) and x/absmax
    # fall on different sides of the midpoint.
    am = torch.tensor(2.2913756, dtype=torch.float32)
    midpoints = (NF4[:-1] + NF4[1:]) / 2
    split = []
    for m in midpoints:
        x = m * am
        for _ in range(4):
            for y in (x, -x):
                q_mul = torch.bucketize(y * (1.0 / am), midpoints)
                q_div = torch.bucketize(y / am, midpoints)
                if q_mul != q_div and len(split) < 7:
                    split.append(y.item())
            x = torch.nextafter(x, torch.tensor(9.0))
    assert len(split) >= 3, split
    block = torch.tensor([am.item()] + split)
    full = torch.zeros(64)
    full[: len(block)] = block
    tail = torch.zeros(8)
    tail[: len(block)] = block
    return torch.cat([full, tail]).reshape(1, 72)


inputs = {
    "bf16_weight": (torch.randn(96, 64) * 0.02).to(torch.bfloat16),
    "bf16_ragged": torch.randn(10, 13).to(torch.bfloat16),
    "fp16_wide": wide(),
    "fp32_ties": ties(),
    "fp32_odd": torch.randn(1, 67),
    "fp32_short": short(),
}

tensors = {}
for name, x in inputs.items():
    codes, state = F.quantize_4bit(x, blocksize=64, quant_type="nf4")
    back = F.dequantize_4bit(codes, state)
    assert back.dtype == x.dtype and back.shape == x.shape
    tensors[f"{name}.input"] = x.contiguous()
    tensors[f"{name}.codes"] = codes.reshape(-1).contiguous()
    tensors[f"{name}.absmax"] = state.absmax.contiguous()
    tensors[f"{name}.dequantized"] = back.contiguous()

here = os.path.dirname(os.path.abspath(__file__))
save_file(tensors, os.path.join(here, "nf4.safetensors"))
print({k: (tuple(v.shape), str(v.dtype)) for k, v in tensors.items()})
