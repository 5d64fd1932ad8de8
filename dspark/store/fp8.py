"""FP8 (e4m3fn) hidden states with a float32 scale per token and layer, in numpy.

A stored value is `decode(hidden) * hidden_scale[..., None]`, where `hidden_scale` is the
row's amax / 448 (448 = e4m3fn's largest finite value), or 1 for an all-zero row, so
every row uses e4m3's full range. e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3
mantissa bits; exponent field 0 is subnormal (m * 2^-9); 0x7F / 0xFF are NaN; no inf.
Rounding is to nearest, ties to even, like torch's `float8_e4m3fn` cast.
Numpy only, so writers and readers stay torch-free.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E4M3_MIN_EXP = -6  # exponent of the smallest normal, 2^-6
E4M3_MANTISSA_BITS = 3


def _decode_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man * 2.0 ** (E4M3_MIN_EXP - E4M3_MANTISSA_BITS), (1 + man / 8) * 2.0 ** (exp - 7))
    mag[(exp == 15) & (man == 7)] = np.nan
    return (sign * mag).astype(np.float32)


E4M3_VALUES = _decode_table()
"""float32 [256]: the value of every e4m3fn bit pattern."""


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (exact: bf16 is fp32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of finite float32 values, rounded to nearest even like torch's cast."""
    return _round_to_bf16_bits(np.array(x, dtype=np.float32))  # a copy, rounded in place


def _round_to_bf16_bits(u: np.ndarray) -> np.ndarray:
    """bf16 bits of float32 `u`, which is overwritten (rounded in place: few temporaries, fast)."""
    u = u.view(np.uint32)
    half = np.right_shift(u, 16)
    half &= 1
    half += 0x7FFF  # round half to even: ties round up only when the kept bit is odd
    u += half
    u >>= 16
    return u.astype(np.uint16)


def encode_e4m3(y: np.ndarray) -> np.ndarray:
    """e4m3fn bit patterns (uint8) of float32 values in [-448, 448] (larger ones are clipped)."""
    y = np.clip(np.asarray(y, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    a = np.abs(y)
    _, exp = np.frexp(a)  # a = mantissa * 2^exp with mantissa in [0.5, 1)
    e = np.maximum(exp - 1, E4M3_MIN_EXP)  # the binade of a (the subnormals share the smallest)
    quanta = np.round(np.ldexp(a, E4M3_MANTISSA_BITS - e))  # a in units of the binade's step; ties to even
    carry = quanta >= 16  # rounded up into the next binade
    e, quanta = np.where(carry, e + 1, e), np.where(carry, 8, quanta)
    normal = quanta >= 8
    field = np.where(normal, e + 7, 0)
    man = np.where(normal, quanta - 8, quanta)
    return (np.signbit(y).astype(np.uint8) << 7) | (field << 3).astype(np.uint8) | man.astype(np.uint8)


def quantize(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bit patterns uint16 [T, L, H] -> (e4m3fn bits uint8 [T, L, H], scale float32 [T, L]).

    Raises ValueError on non-finite states (no scale represents them).
    """
    x = bf16_bits_to_f32(bits)  # [T, L, H]
    amax = np.abs(x).max(axis=-1)  # [T, L]
    if not np.isfinite(amax).all():
        raise ValueError("hidden holds inf/NaN, which FP8 cannot store (use extract.store_dtype=bf16)")
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    return encode_e4m3(x / scale[..., None]), scale


def dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3fn bits uint8 [T, L, H] and scale float32 [T, L] -> bf16 bit patterns uint16 [T, L, H]."""
    values = np.take(E4M3_VALUES, codes)  # a fresh float32 array (take: ~2x faster than indexing)
    values *= scale[..., None]
    return _round_to_bf16_bits(values)
