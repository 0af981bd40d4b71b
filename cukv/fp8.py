"""FP8 e4m3 numerics on the host: the exact quantizer the append kernel implements, and dequantization.

cukv's quantized cache stores e4m3 codes (``uint8``: CuPy has no float8 type) and float32 scales, and a
value reads back as ``e4m3(code) * scale``. Scale granularity is one of

``'tensor'``
    one scale for K and one for V, chosen by the caller and held in a device scalar;
``'token'``
    one scale per (token, head);
``32``, ``64``, ``128``
    one scale per (token, head, block of g dims); g must divide the head dim.

Kernels see the granularity as ``scale_block`` (0 for per tensor, else the block width in dims: 'token' is
the head dim) and compute a granule's scale as ``max(amax, 448 * SCALE_FLOOR) / 448`` in float32, then each
code as ``e4m3_rn_satfinite(x / scale)`` with IEEE float32 division, exactly like :func:`quantize` below,
so the GPU append is bit-identical to this module.

Examples
--------
>>> import numpy as np
>>> from cukv import fp8
>>> x = np.random.default_rng(0).standard_normal((3, 2, 128))      # [tokens, heads, dims]
>>> codes, scales = fp8.quantize(x, block=128)                       # per-token scales (block = head dim)
>>> codes.dtype, codes.shape, scales.shape
(dtype('uint8'), (3, 2, 128), (3, 2, 1))
>>> bool(np.allclose(scales[..., 0], np.abs(x).max(-1) / 448))     # amax / 448
True
>>> err = np.abs(fp8.dequantize(codes, scales, 128) - x).max() / np.abs(x).max()
>>> bool(err < 2 ** -4)                                              # e4m3 keeps 3 mantissa bits
True
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
#: smallest scale the quantizer produces: an all-zero granule gets this scale and zero codes, so no
#: division by zero; a power of two so that ``448 * SCALE_FLOOR`` and the division stay exact
SCALE_FLOOR = 2.0 ** -32
#: e4m3 NaN (0x7f / 0xff): what ``fill='nan'`` writes into an FP8 cache
NAN_CODE = np.uint8(0x7F)
GRANULARITIES = ("tensor", "token", 32, 64, 128)


def _code_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = sign * val
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val


#: float64 value of every e4m3 code (0x7f and 0xff are NaN)
E4M3_VALUES = _code_table()
_POSITIVE = E4M3_VALUES[:0x7F]  # codes 0x00..0x7e increase with the value


def round_e4m3(x) -> np.ndarray:
    """float32 -> nearest e4m3 value (ties to even, saturating to +-448), as float64. NaN stays NaN."""
    x = np.asarray(x, np.float32).astype(np.float64)
    a = np.abs(x)
    _, e = np.frexp(np.where(a > 0, a, 1.0))  # a = m * 2**e, m in [0.5, 1)
    spacing = np.exp2(np.maximum(e - 1, -6) - 3.0)  # 3 mantissa bits; subnormal spacing 2**-9
    r = np.minimum(np.round(a / spacing) * spacing, E4M3_MAX)  # np.round: half to even
    return np.copysign(r, x)


def encode_e4m3(values) -> np.ndarray:
    """e4m3 values (from :func:`round_e4m3`) -> uint8 codes; the sign bit follows ``signbit`` (-0 -> 0x80)."""
    v = np.asarray(values, np.float64)
    mag = np.searchsorted(_POSITIVE, np.abs(v)).astype(np.uint8)
    code = mag | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))
    return np.where(np.isnan(v), NAN_CODE, code).astype(np.uint8)


def decode_e4m3(codes) -> np.ndarray:
    """uint8 codes -> float64 values."""
    return E4M3_VALUES[np.asarray(codes, np.uint8)]


def scale_block(granularity, head_dim: int) -> int:
    """The kernels' form of a granularity: 0 per tensor, else dims per scale (the head dim for 'token')."""
    if isinstance(granularity, str) and granularity in ("tensor", "token"):
        return 0 if granularity == "tensor" else int(head_dim)
    if isinstance(granularity, (int, np.integer)) and not isinstance(granularity, bool) and int(granularity) in (32, 64, 128):
        g = int(granularity)
        if head_dim % g:
            raise ValueError(f"scale_granularity={g} must divide head_dim={head_dim}")
        return g
    raise ValueError(f"scale_granularity={granularity!r} is not valid; accepted: 'tensor', 'token', 32, 64, 128 "
                     "(32/64/128: dims per scale, dividing the head dim)")


def resolve_kv(dtype: str, kv_dtype, scale_granularity, head_dim: int) -> tuple[str | None, int]:
    """A kernel's ``(kv_dtype, scale_block)`` from what a user passed: ``kv_dtype`` None or the query dtype
    means a 16-bit cache (no granularity allowed); 'fp8_e4m3' takes ``scale_granularity`` (default 'token')."""
    from .arrays import canonical_kv_dtype

    kvd = None if kv_dtype is None else canonical_kv_dtype(kv_dtype, "kv_dtype")
    if kvd is not None and kvd != "fp8_e4m3":
        if kvd != dtype:
            raise TypeError(f"kv_dtype={kv_dtype!r} with dtype={dtype!r}: a 16-bit cache must match the query dtype")
        kvd = None
    if kvd is None:
        if scale_granularity is not None:
            raise ValueError(f"scale_granularity={scale_granularity!r} applies to kv_dtype='fp8_e4m3' only")
        return None, 0
    return kvd, scale_block("token" if scale_granularity is None else scale_granularity, head_dim)


def granule_scales(x, block: int) -> np.ndarray:
    """Scales of ``x[..., D]`` per ``block`` dims (float32, shape ``[..., D // block]``)."""
    x = np.asarray(x, np.float32)
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    amax = np.max(np.abs(g), axis=-1)
    return (np.maximum(amax, np.float32(E4M3_MAX * SCALE_FLOOR)) / np.float32(E4M3_MAX)).astype(np.float32)


def quantize(x, block: int, tensor_scale: float | None = None):
    """Quantize ``x[..., D]`` (float, read as float32) like the append kernel.

    ``block`` is the kernels' scale block (see :func:`scale_block`); for ``block == 0`` (per tensor) the
    caller's ``tensor_scale`` is used. Returns ``(codes uint8 [..., D], scales float32 [..., D // block])``
    (scales is a float32 scalar array for per tensor).
    """
    x = np.asarray(x, np.float32)
    if block == 0:
        if tensor_scale is None or not np.isfinite(tensor_scale) or tensor_scale <= 0:
            raise ValueError(f"tensor_scale={tensor_scale!r} must be a positive finite float for per-tensor scales")
        s = np.float32(tensor_scale)
        full = np.broadcast_to(s, x.shape)
        scales = np.asarray(s, np.float32)
    else:
        scales = granule_scales(x, block)
        full = np.repeat(scales, block, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = (x / full).astype(np.float32)  # IEEE float32 division, like __fdiv_rn
    return encode_e4m3(round_e4m3(ratio)), scales


def dequantize(codes, scales, block: int) -> np.ndarray:
    """float64 ``e4m3(codes) * scale`` (``scales`` as returned by :func:`quantize` or read from a cache)."""
    v = decode_e4m3(codes)
    s = np.asarray(scales, np.float64)
    if block == 0:
        return v * s
    return v * np.repeat(s, block, axis=-1)


def split_query(q) -> np.ndarray:
    """The query as prefill's FP8-scores path feeds the e4m3 tensor cores (``PrefillConfig.fp8_scores``), as
    float64: each row ``q[..., D]`` (read as float32) is scaled by ``2^k = 256 / p``, ``p`` the smallest power of
    two at or above its largest ``|q|`` (at least ``2^-100``), and held as two e4m3 terms ``hi = e4m3(q * 2^k)``,
    ``lo = e4m3(q * 2^k - hi)``; returns ``(hi + lo) / 2^k``. About 8 significant bits, like bf16."""
    q = np.asarray(q, np.float32)
    amax = np.maximum(np.max(np.abs(q), axis=-1, keepdims=True), np.float32(2.0 ** -100)).astype(np.float64)
    p = np.exp2(np.ceil(np.log2(amax)))
    k = 256.0 / p
    x = (q.astype(np.float64) * k).astype(np.float32)  # exact: a power of two
    hi = round_e4m3(x)
    lo = round_e4m3((x.astype(np.float64) - hi).astype(np.float32))  # exact in float32
    return (hi + lo) / k
