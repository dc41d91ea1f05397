"""Block-wise quantization: a tensor sent in 8 or 4 bits a number, each block with its own scale.

What ZeRO++ sends (zeropp.py, chapter 3c): qwZ all-gathers the weights as int8 and qgZ reduces
the gradients as int4 (or int8), each dequantized on arrival. Pure tensor code: no process groups
here, the collectives send what `quantize` returns. Symmetric, per block (the last one padded):

    qmax  = 2^(bits-1) - 1                 127 for int8, 7 for int4
    scale = max|x in block| / qmax         one fp32 (or bf16) number per block
    code  = round(x / scale)               in -qmax .. qmax
    x'    = code * scale                   dequantized: |x - x'| <= scale / 2

    x      [ 0.9  -0.1  0.3  -1.27 | 0.02  0.01  0  -0.04 ]   block 4, int8
    scale  [ 0.01                  | 0.000315             ]
    code   [ 90   -10   30   -127  | 63    32    0  -127  ]

int4 packs two codes a byte (`quantized_bytes` counts them with their scales). Read
docs/03c_zero_plus_plus.md: why blocks, and the bytes.
"""

from __future__ import annotations

import math

import torch


def qmax(bits: int) -> int:
    """The largest code of a symmetric `bits`-bit integer: 127 for 8 bits, 7 for 4."""
    return 2 ** (bits - 1) - 1


def quantized_bytes(numel: int, block: int, bits: int, scale_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of `numel` numbers quantized in blocks of `block`: the codes and one scale a block."""
    blocks = math.ceil(numel / block)
    return blocks * (block * bits // 8 + torch.finfo(scale_dtype).bits // 8)


def _check(block: int, bits: int, scale_dtype: torch.dtype) -> None:
    if bits not in (4, 8):
        raise ValueError(f"quantize: bits {bits}: choose 8 (int8) or 4 (int4, two codes a byte)")
    if block < 1 or (bits == 4 and block % 2):
        raise ValueError(f"quantize: block {block}: give a block of 1 or more numbers, even for 4 bits")
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize: scales in {scale_dtype}: choose torch.float32 or torch.bfloat16")


def block_scales(blocks: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """max|block| / qmax per block, stored in scale_dtype and never below the exact value: a scale
    rounded down would push the largest code past qmax."""
    exact = blocks.abs().amax(dim=1) / qmax(bits)  # [blocks], float64
    stored = exact.to(scale_dtype)
    as_int = torch.int32 if scale_dtype == torch.float32 else torch.int16
    # Positive floats order as their bits: adding one to the bits gives the next larger number.
    stored = torch.where(stored.double() < exact, (stored.view(as_int) + 1).view(scale_dtype), stored)
    if not torch.isfinite(stored).all():
        raise ValueError(f"quantize: a block's largest value / {qmax(bits)} is beyond {scale_dtype}'s range")
    return stored


def quantize(x: torch.Tensor, block: int, bits: int = 8,
             scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (codes, scales): int8 codes [blocks, block] (bits 8) or uint8 [blocks, block/2], two
    codes a byte (bits 4); scales [blocks] in scale_dtype. The last block is padded with zeros."""
    _check(block, bits, scale_dtype)
    if not torch.isfinite(x).all():
        raise ValueError("quantize: x holds inf or nan, which no scale can represent")
    flat = x.detach().reshape(-1).double()  # float64: x / scale and code * scale round nothing away
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)  # [blocks, block]
    scales = block_scales(blocks, bits, scale_dtype)
    divisor = scales.double().clamp_min(torch.finfo(torch.float64).tiny)[:, None]  # a zero block: codes 0
    codes = torch.round(blocks / divisor).clamp_(-qmax(bits), qmax(bits)).to(torch.int8)  # [blocks, block]
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8)  # 1..15
        codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # [blocks, block/2]
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, shape: torch.Size | tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes, scales) from `quantize` -> a tensor of `shape` and `dtype`: code * its block's scale."""
    if bits == 4:
        low, high = (codes & 15).to(torch.int8) - 8, (codes >> 4).to(torch.int8) - 8
        codes = torch.stack((low, high), dim=2).flatten(1)  # [blocks, block]
    values = codes.double() * scales.double()[:, None]  # [blocks, block]
    return values.reshape(-1)[:math.prod(shape)].view(shape).to(dtype)
