"""Block-wise quantization (quantize.py): every number within half its block's scale, the scale
max|block| / (2^(bits-1) - 1) (rounded up to its dtype), on random and adversarial blocks; the
bytes sent equal ceil(n / b) * (b * bits / 8 + scale bytes)."""

import math
import re

import pytest
import torch

from minipar.quantize import dequantize, quantize, quantized_bytes

# The bound |x - x'| <= scale / 2 is exact in real numbers; quantize divides and dequantize
# multiplies in float64, whose rounding (2^-53 relative, on codes of at most 127) adds at most
# 127 * 2^-53 scale: 2^-40 of the scale covers it.
SLACK = 2.0**-40
# A stored scale is the exact max|block| / qmax rounded up to its dtype: at most one step above,
# 2^-23 relative for float32, 2^-7 for bfloat16 (their mantissas' bits), and among the denormal
# numbers one denormal step.
STEP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def check_bound(x: torch.Tensor, block: int, bits: int, scale_dtype=torch.float32) -> torch.Tensor:
    """Quantize and dequantize x; assert each number's error and each scale; return the errors."""
    codes, scales = quantize(x, block, bits, scale_dtype)
    back = dequantize(codes, scales, bits, x.shape, torch.float64)
    flat = x.double().reshape(-1)
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    exact = blocks.abs().amax(dim=1) / (2 ** (bits - 1) - 1)  # the formula, per block
    stored = scales.double()
    step = STEP[scale_dtype]  # relative; below the normal range the steps are tiny * step apart
    assert (stored >= exact).all() and (stored <= exact * (1 + step) + torch.finfo(scale_dtype).tiny * step).all()
    per_number = stored.repeat_interleave(block)[: flat.numel()]
    error = (flat - back.reshape(-1)).abs()
    assert (error <= per_number * (0.5 + SLACK)).all(), (error / per_number).max()
    assert back.shape == x.shape
    return error


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32-scales", "bf16-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_random_numbers_are_within_half_their_blocks_scale(bits, scale_dtype, dtype):
    g = torch.Generator().manual_seed(bits)
    for shape, block in [((1000,), 256), ((7, 33), 64), ((5,), 2), ((3, 4), 16), ((300,), 300)]:
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 3, shape, generator=g))
        check_bound(x.to(dtype), block, bits, scale_dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_adversarial_blocks_zeros_one_huge_value_halves_and_tiny_values(bits):
    q = 2 ** (bits - 1) - 1
    zeros = torch.zeros(8)
    codes, scales = quantize(zeros, 4, bits)
    assert (scales == 0).all() and (dequantize(codes, scales, bits, (8,)) == 0).all()  # exact, no 0/0
    # One huge value: its own block's small numbers round to 0 (within its scale / 2), the next
    # block, of small numbers alone, keeps them to its own much finer scale.
    small = torch.linspace(-1, 1, 8, dtype=torch.float64)
    x = torch.cat([small[:7], torch.tensor([1e30], dtype=torch.float64), small])
    error = check_bound(x, 8, bits)
    codes, scales = quantize(x, 8, bits)
    back = dequantize(codes, scales, bits, x.shape, torch.float64)
    assert (back[:7] == 0).all() and back[7] == q * scales[0].item()  # 1e30 up to its scale / 2
    assert error[8:].max() <= 0.5 / q * (1 + 2**-20)  # the second block's scale is 1 / q
    # A negative largest value takes code -qmax; numbers at exact half steps stay within the bound.
    halves = torch.tensor([-float(q), 0.5, 1.5, -2.5, q - 0.5, 0.0], dtype=torch.float64)
    check_bound(halves, 6, bits)
    assert dequantize(*quantize(halves, 6, bits), bits, (6,), torch.float64)[0] == -q
    # Tiny values: denormal floats, and float64 numbers far below float32's range (the scale is
    # then float32's smallest positive number, and every code 0).
    check_bound(torch.tensor([1e-40, -3e-42, 0.0, 2e-45]), 4, bits)
    check_bound(torch.tensor([1e-300, -1e-310, 0.0, 0.0], dtype=torch.float64), 4, bits)
    check_bound(torch.tensor([3.0]), 1, 8)  # a block of one: exact


def test_every_int4_code_survives_the_packing():
    # 2 codes a byte: x = k * scale for k = -7..7 comes back exactly, in any position.
    x = torch.arange(-7, 8, dtype=torch.float64).roll(3).repeat(2)  # 30 numbers, max 7: scale 1
    codes, scales = quantize(x, 30, 4)
    assert codes.dtype == torch.uint8 and codes.shape == (1, 15) and scales.tolist() == [1.0]
    assert torch.equal(dequantize(codes, scales, 4, x.shape, torch.float64), x)


@pytest.mark.parametrize("numel,block,bits,scale_dtype,expected", [
    (1000, 256, 8, torch.float32, 4 * (256 + 4)),  # ceil(1000 / 256) = 4 blocks
    (1000, 256, 4, torch.float32, 4 * (128 + 4)),
    (1000, 256, 4, torch.bfloat16, 4 * (128 + 2)),
    (512, 256, 8, torch.bfloat16, 2 * (256 + 2)),
    (1, 64, 8, torch.float32, 64 + 4),
])
def test_bytes_of_codes_and_scales_equal_the_formula(numel, block, bits, scale_dtype, expected):
    codes, scales = quantize(torch.randn(numel), block, bits, scale_dtype)
    sent = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
    formula = math.ceil(numel / block) * (block * bits // 8 + {torch.float32: 4, torch.bfloat16: 2}[scale_dtype])
    assert sent == formula == expected == quantized_bytes(numel, block, bits, scale_dtype)


@pytest.mark.parametrize("x,block,bits,scale_dtype,message", [
    (torch.ones(4), 4, 3, torch.float32, "bits 3: choose 8 (int8) or 4"),
    (torch.ones(4), 0, 8, torch.float32, "block 0: give a block of 1 or more numbers"),
    (torch.ones(4), 3, 4, torch.float32, "block 3: give a block of 1 or more numbers, even for 4 bits"),
    (torch.ones(4), 4, 8, torch.float16, "scales in torch.float16: choose torch.float32 or torch.bfloat16"),
    (torch.tensor([1.0, float("inf")]), 2, 8, torch.float32, "x holds inf or nan"),
    (torch.tensor([1.0, float("nan")]), 2, 8, torch.float32, "x holds inf or nan"),
    (torch.tensor([1e300], dtype=torch.float64), 1, 8, torch.float32, "beyond torch.float32's range"),
])
def test_what_cannot_be_quantized_is_refused_in_one_line(x, block, bits, scale_dtype, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        quantize(x, block, bits, scale_dtype)
    assert "\n" not in str(e.value)
