"""FP8 e4m3 on the host (no GPU): the code table, the rounding the append kernel implements, the quantizer's
guarantees for every scale granularity, the granularity / AppendConfig domains, and a compile of every FP8
append specialization (NVRTC needs no GPU)."""
import re

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cukv import fp8
from cukv.configs.append import AppendConfig
from cukv.fp8 import E4M3_MAX, E4M3_VALUES, SCALE_FLOOR, decode_e4m3, encode_e4m3, round_e4m3

FINITE_CODES = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
POSITIVE = E4M3_VALUES[:0x7F]  # codes 0x00..0x7e: 0, 7 subnormals, 119 normals up to 448


def _nearest_e4m3(x) -> np.ndarray:
    """Brute-force reference of round_e4m3, written independently of its frexp arithmetic: the nearest entry
    of the code table (ties to the even code, i.e. the even mantissa), saturating to +-448; NaN stays NaN."""
    x = np.asarray(x, np.float32).astype(np.float64)
    a = np.abs(x)
    hi = np.clip(np.searchsorted(POSITIVE, np.minimum(a, E4M3_MAX)), 1, POSITIVE.size - 1)  # POSITIVE[hi] >= a
    lo = hi - 1
    dlo, dhi = a - POSITIVE[lo], POSITIVE[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    r = np.where(a >= E4M3_MAX, E4M3_MAX, POSITIVE[pick])
    r = np.where(np.isnan(x), np.nan, r)
    return np.copysign(r, x)


def _same(a, b) -> bool:
    """Equal values including the sign of zero; NaN equals NaN (of either sign)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=True) and \
        np.array_equal(np.signbit(a) & ~np.isnan(a), np.signbit(b) & ~np.isnan(b))


# --- the code table and round_e4m3 / encode_e4m3 / decode_e4m3


def test_code_table():
    assert FINITE_CODES.size == 254
    assert np.all(np.diff(POSITIVE) > 0), "codes 0x00..0x7e must increase with the value"
    assert POSITIVE[0] == 0 and POSITIVE[-1] == E4M3_MAX == 448.0
    assert E4M3_VALUES[0x08] == 2.0 ** -6 and E4M3_VALUES[0x38] == 1.0 and E4M3_VALUES[0x78] == 256.0
    # negative codes mirror positive ones; 0x80 is -0
    assert np.array_equal(E4M3_VALUES[0x80:0xFF], -POSITIVE)
    assert E4M3_VALUES[0x80] == 0 and np.signbit(E4M3_VALUES[0x80])


def test_every_finite_code_round_trips():
    vals = decode_e4m3(FINITE_CODES)
    assert np.isfinite(vals).all()
    assert _same(round_e4m3(vals), vals), "every e4m3 value is its own rounding"
    assert np.array_equal(encode_e4m3(vals), FINITE_CODES)
    assert np.array_equal(encode_e4m3(round_e4m3(vals)), FINITE_CODES)
    assert int(encode_e4m3(np.float64(-0.0))) == 0x80 and int(encode_e4m3(np.float64(0.0))) == 0x00
    assert int(encode_e4m3(round_e4m3(np.float32(-0.0)))) == 0x80


def test_nan_codes():
    assert np.isnan(decode_e4m3(np.array([0x7F, 0xFF], np.uint8))).all()
    assert fp8.NAN_CODE == 0x7F
    assert np.array_equal(encode_e4m3([np.nan, -np.nan]), [0x7F, 0x7F])
    assert np.isnan(round_e4m3([np.nan])).all()
    assert int(encode_e4m3(round_e4m3(np.float32(np.nan)))) == 0x7F


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_saturates_to_448(sign):
    big = np.array([448, 448.0001, 449, 463.99, 464, 464.01, 480, 512, 1e4, 3.4e38, np.inf], np.float32) * sign
    r = round_e4m3(big)
    assert np.array_equal(r, np.full(big.shape, 448.0 * sign))
    assert np.array_equal(encode_e4m3(r), np.full(big.shape, 0x7E if sign > 0 else 0xFE, np.uint8))
    # just below 448 still rounds normally: the spacing in [256, 512) is 32
    assert round_e4m3(np.float32(431.99 * sign)) == 416 * sign
    assert round_e4m3(np.float32(432 * sign)) == 448 * sign  # tie 416 (mantissa 5) / 448 (mantissa 6): even


def test_ties_round_to_even_everywhere():
    """The midpoint of every pair of adjacent e4m3 values (exact in float32: 4 significant bits) rounds to
    the value with the even mantissa (the even code); one float32 ulp either side rounds to the nearer."""
    lo, hi = POSITIVE[:-1], POSITIVE[1:]
    mid = ((lo + hi) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (lo + hi) / 2)
    lo_code = np.arange(0x7E)
    even = np.where(lo_code % 2 == 0, lo, hi)
    for sign in (1.0, -1.0):
        assert np.array_equal(round_e4m3(sign * mid), sign * even)
        assert np.array_equal(round_e4m3(np.nextafter(sign * mid, sign * np.float32(np.inf))), sign * hi)
        assert np.array_equal(round_e4m3(np.nextafter(sign * mid, np.float32(0))), sign * lo)
    # a few written out: 1.0625 between 1 (0x38) and 1.125 (0x39) -> 1; 1.1875 -> 1.25 (0x3a)
    assert round_e4m3(np.float32(1.0625)) == 1.0 and round_e4m3(np.float32(1.1875)) == 1.25
    assert round_e4m3(np.float32(272)) == 256 and round_e4m3(np.float32(304)) == 320
    # the subnormal / normal boundary: 7.5 * 2**-9 between 7 * 2**-9 (0x07) and 2**-6 (0x08) -> 2**-6
    assert round_e4m3(np.float32(7.5 * 2 ** -9)) == 2.0 ** -6


def test_subnormal_spacing():
    k = np.arange(9)
    assert np.array_equal(decode_e4m3(k.astype(np.uint8)), k * 2.0 ** -9)  # 0x08 = 2**-6 = 8 * 2**-9
    assert np.array_equal(round_e4m3((k * 2.0 ** -9).astype(np.float32)), k * 2.0 ** -9)
    assert round_e4m3(np.float32(2.0 ** -10)) == 0  # tie between 0 and 2**-9: 0 is even
    assert round_e4m3(np.float32(3 * 2.0 ** -10)) == 2.0 ** -8  # tie between codes 1 and 2
    assert round_e4m3(np.float32(1.01 * 2.0 ** -10)) == 2.0 ** -9
    assert round_e4m3(np.float32(0.99 * 2.0 ** -10)) == 0
    tiny = np.float32(1e-45)  # the smallest float32 subnormal
    assert _same(round_e4m3([tiny, -tiny]), [0.0, -0.0])
    assert np.array_equal(encode_e4m3(round_e4m3([tiny, -tiny])), [0x00, 0x80])


@settings(deadline=None, max_examples=60)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64),
       st.sampled_from([1.0, 2.0 ** -9, 2.0 ** -6, 1e-3, 100.0]))
def test_round_e4m3_matches_brute_force(xs, zoom):
    x = (np.array(xs, np.float32) * np.float32(zoom)).astype(np.float32)
    got = round_e4m3(x)
    assert _same(got, _nearest_e4m3(x))
    finite = ~np.isnan(x)
    assert np.all(np.abs(got[finite]) <= E4M3_MAX)
    # the values it returns are exactly those of codes: encoding and decoding gives them back
    assert _same(decode_e4m3(encode_e4m3(got)), got)


# --- quantize / dequantize


def _array(seed, tokens, heads, d, block):
    """[tokens, heads, d] float32 whose granules (of `block` dims, the head for block 0) are scaled by very
    different factors: all-zero granules, granules below the scale floor, tiny, ordinary and large (to 1e4)."""
    rng = np.random.default_rng(seed)
    g = block or d
    x = rng.standard_normal((tokens, heads, d // g, g))
    factors = np.array([0.0, 1e-12, 1e-8, 1e-3, 1.0, 7.0, 300.0, 1e4])
    f = rng.choice(factors, size=(tokens, heads, d // g, 1)) * rng.uniform(0.5, 1.0, (tokens, heads, d // g, 1))
    x = np.clip(x * f, -1e4, 1e4)
    if rng.random() < 0.5:  # sometimes exact e4m3 values (ones the quantizer can hit exactly)
        x.reshape(-1)[: 16] = rng.choice(POSITIVE, 16)
    x.reshape(-1, g)[-1] = 0.0  # at least one all-zero granule
    return x.reshape(tokens, heads, d).astype(np.float32)


def _bound(x, s):
    """The quantization error allowed for x in a granule of scale s. e4m3 keeps 3 mantissa bits, so rounding
    a normal ratio x / s errs by at most |x / s| * 2**-4, a subnormal one (|x / s| < 2**-6) by at most half
    the 2**-9 spacing; times s. Slack |x| * 2**-22: x / s is itself rounded to float32 first (the kernel's
    __fdiv_rn, relative error <= 2**-24, also inflating the relative term by that factor) and the float64
    difference rounds once more."""
    x = np.abs(np.asarray(x, np.float64))
    return np.maximum(x * 2.0 ** -4, np.asarray(s, np.float64) * 2.0 ** -10) + x * 2.0 ** -22


@settings(deadline=None, max_examples=50)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 5), st.integers(1, 4), st.sampled_from([64, 128, 256]),
       st.sampled_from([32, 64, 128, "head"]))
def test_quantize_granules(seed, tokens, heads, d, block):
    block = d if block == "head" else block
    assume(d % block == 0)
    x = _array(seed, tokens, heads, d, block)
    codes, scales = fp8.quantize(x, block)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    assert scales.dtype == np.float32 and scales.shape == (tokens, heads, d // block)
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    assert not np.any((codes & 0x7F) == 0x7F), "finite input never gives a NaN code"

    # scale = max(amax, 448 * floor) / 448 rounded once to float32 (the float64 quotient of two float32s
    # rounds to the same float32 as an IEEE float32 division: 53 >= 2 * 24 + 2 bits)
    g = x.astype(np.float64).reshape(tokens, heads, d // block, block)
    amax = np.abs(g).max(-1)
    assert np.array_equal(scales, np.float32(np.maximum(amax, 448 * SCALE_FLOOR) / 448))
    assert np.array_equal(scales, fp8.granule_scales(x, block))

    # each code is the e4m3 rounding (brute force) of the float32 ratio x / scale
    full = np.repeat(scales, block, axis=-1)
    ratio = (x / full).astype(np.float32)
    assert _same(decode_e4m3(codes), _nearest_e4m3(ratio))

    deq = fp8.dequantize(codes, scales, block)
    assert deq.dtype == np.float64 and deq.shape == x.shape
    assert np.array_equal(deq, decode_e4m3(codes) * full)
    err = np.abs(deq - x.astype(np.float64))
    bad = err > _bound(x, full)
    assert not bad.any(), f"{int(bad.sum())} elements outside the bound, e.g. x={x[bad][:3]} deq={deq[bad][:3]}"

    qv = np.abs(decode_e4m3(codes)).reshape(g.shape)
    assert np.all(qv <= E4M3_MAX)
    # a granule above the floor uses the full range: its amax maps to 448 (amax / fl(amax / 448) is within
    # 2 float32 ulps of 448, and the nearest e4m3 below, 416, is 32 away)
    live = amax >= 448 * SCALE_FLOOR
    assert np.all(qv.max(-1)[live] == E4M3_MAX)
    # ... one below the floor keeps the floor scale and its (smaller) values
    assert np.all(scales[~live] == np.float32(SCALE_FLOOR))
    # all-zero granules: scale 448 * SCALE_FLOOR / 448 == SCALE_FLOOR and zero codes
    zero = amax == 0
    assert zero.any()
    assert np.all(scales[zero] == np.float32(448 * SCALE_FLOOR / 448)) and SCALE_FLOOR == 448 * SCALE_FLOOR / 448
    # (codes 0x00, or 0x80 for a -0.0 input: a factor of 0 times a negative sample gives -0.0)
    zcodes, zx = codes.reshape(g.shape)[zero], x.reshape(g.shape)[zero]
    assert np.array_equal(zcodes, np.where(np.signbit(zx), 0x80, 0x00).astype(np.uint8))
    assert np.all(codes.reshape(-1, block)[-1] == 0)  # the granule _array zeroes with +0.0


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 5), st.integers(1, 4), st.sampled_from([64, 128, 256]),
       st.sampled_from([2.0 ** -7, 1 / 448, 0.037, 1.0, 3.7, 22.0]))
def test_quantize_per_tensor(seed, tokens, heads, d, tensor_scale):
    x = _array(seed, tokens, heads, d, 0)
    codes, scales = fp8.quantize(x, 0, tensor_scale=tensor_scale)
    s = np.float32(tensor_scale)
    assert scales.shape == () and scales.dtype == np.float32 and scales == s
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    assert not np.any((codes & 0x7F) == 0x7F)
    assert _same(decode_e4m3(codes), _nearest_e4m3((x / s).astype(np.float32)))
    deq = fp8.dequantize(codes, scales, 0)
    assert np.array_equal(deq, decode_e4m3(codes) * np.float64(s))
    x64 = x.astype(np.float64)
    sat = np.abs(x64) >= 448 * np.float64(s)
    # above 448 * scale: saturates to +-448 * scale
    assert np.array_equal(deq[sat], np.sign(x64[sat]) * 448 * np.float64(s))
    assert np.array_equal(codes[sat], np.where(x64[sat] > 0, 0x7E, 0xFE).astype(np.uint8))
    # below: the usual rounding bound with the tensor's scale
    assert np.all(np.abs(deq - x64)[~sat] <= _bound(x64[~sat], np.float64(s)))
    assert np.all(np.abs(deq) <= 448 * np.float64(s))


def test_quantize_per_tensor_saturates():
    s = np.float32(2.0 ** -8)  # 448 * s = 1.75
    x = np.array([0.5, -0.5, 1.75, -1.75, 1.7501, 100.0, -1e4, 0.0] * 8, np.float32).reshape(1, 1, 64)
    codes, _ = fp8.quantize(x, 0, tensor_scale=s)
    deq = fp8.dequantize(codes, s, 0)
    big = np.abs(x) >= 1.75
    assert np.array_equal(deq[big], np.sign(x[big]) * 448 * np.float64(s))
    assert np.array_equal(codes[big], np.where(x[big] > 0, 0x7E, 0xFE).astype(np.uint8))
    assert np.array_equal(deq[~big], x[~big].astype(np.float64))  # 0.5 / s = 128 and 0 are e4m3 values


@pytest.mark.parametrize("bad", [None, 0.0, -1.0, np.nan, np.inf])
def test_quantize_per_tensor_needs_a_positive_finite_scale(bad):
    with pytest.raises(ValueError, match="tensor_scale"):
        fp8.quantize(np.ones((1, 1, 64), np.float32), 0, tensor_scale=bad)


@settings(deadline=None, max_examples=30)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([(64, 32), (128, 64), (128, 128), (256, 128), (256, 256)]),
       st.integers(-20, 20))
def test_exact_e4m3_granules_round_trip(seed, shape, exp):
    """A granule holding +-448 * 2**exp and other e4m3 multiples of 2**exp gets scale 2**exp and codes that
    dequantize back to it exactly."""
    d, block = shape
    rng = np.random.default_rng(seed)
    codes = rng.choice(FINITE_CODES, size=(3, 2, d)).astype(np.uint8)
    g = codes.reshape(3, 2, d // block, block)
    g[..., 0] = rng.choice([0x7E, 0xFE], size=g.shape[:-1])
    x = (decode_e4m3(codes) * 2.0 ** exp).astype(np.float32)
    got, scales = fp8.quantize(x, block)
    assert np.all(scales == np.float32(2.0 ** exp))
    assert np.array_equal(fp8.dequantize(got, scales, block), x.astype(np.float64))
    assert np.array_equal(got, codes)  # -0 included: -0.0 / scale is -0.0, code 0x80


def test_negative_zero_keeps_its_sign():
    x = np.zeros((1, 1, 32), np.float32)
    x[0, 0, 1] = -0.0
    x[0, 0, 2] = 3.0
    codes, scales = fp8.quantize(x, 32)
    assert codes[0, 0, 1] == 0x80 and codes[0, 0, 0] == 0x00 and codes[0, 0, 2] == 0x7E
    assert scales[0, 0, 0] == np.float32(3.0 / 448)


# --- granularity domain


@pytest.mark.parametrize("granularity,head_dim,block", [
    ("tensor", 128, 0), ("token", 128, 128), ("token", 80, 80), ("token", 64, 64), (32, 64, 32), (64, 128, 64),
    (128, 128, 128), (128, 256, 128), (32, 96, 32), (np.int64(64), 256, 64),
])
def test_scale_block_accepts(granularity, head_dim, block):
    got = fp8.scale_block(granularity, head_dim)
    assert got == block and type(got) is int


@pytest.mark.parametrize("granularity,head_dim", [
    ("foo", 128), ("Token", 128), ("", 128), (48, 128), (16, 128), (256, 256), (0, 128), (-32, 128), (True, 128),
    (False, 128), (32.0, 128), ("32", 128), (None, 128), (32, 80), (64, 96), (128, 64),
])
def test_scale_block_rejects(granularity, head_dim):
    with pytest.raises(ValueError, match="scale_granularity"):
        fp8.scale_block(granularity, head_dim)


def test_granularities_listed():
    assert fp8.GRANULARITIES == ("tensor", "token", 32, 64, 128)
    for g in fp8.GRANULARITIES:
        fp8.scale_block(g, 128)


@pytest.mark.parametrize("kw,match", [
    (dict(dtype="fp8_e4m3", head_dim=64, scale_granularity="foo"), "scale_granularity='foo'"),
    (dict(dtype="fp8_e4m3", head_dim=80, scale_granularity=32), "scale_granularity=32 must divide head_dim=80"),
    (dict(dtype="fp8_e4m3", head_dim=64, scale_granularity=True), "scale_granularity=True"),
    (dict(dtype="fp8_e4m3", head_dim=24), "multiple of 16"),
    (dict(dtype="bfloat16", head_dim=64, scale_granularity="token"), "FP8 caches only"),
])
def test_cache_rejects_bad_fp8_arguments_before_allocating(kw, match):
    """These checks run before any device allocation, so they work without a GPU."""
    pytest.importorskip("cupy")
    from cukv.kvcache import PagedKVCache

    with pytest.raises(ValueError, match=re.escape(match)):
        PagedKVCache(4, 16, 2, **kw)


# --- AppendConfig FP8 domain


@pytest.mark.parametrize("kw", [
    dict(kv_dtype="fp8"), dict(kv_dtype="e4m3"), dict(kv_dtype="fp8_e5m2"), dict(kv_dtype="bfloat16"),
    dict(kv_dtype=1),
])
def test_append_config_rejects_kv_dtype(kw):
    with pytest.raises(ValueError, match=re.escape(f"AppendConfig.kv_dtype={kw['kv_dtype']!r} is not valid")):
        AppendConfig("bfloat16", 128, 16, **kw)


@pytest.mark.parametrize("head_dim,scale_block", [
    (128, 16), (128, 48), (128, 256), (128, -32), (128, True), (128, 32.0), (128, "32"), (64, 128), (256, 512),
    (96, 64), (80, 32), (80, 64),
])
def test_append_config_rejects_scale_block(head_dim, scale_block):
    with pytest.raises(ValueError, match="scale_block"):
        AppendConfig("bfloat16", head_dim, 16, kv_dtype="fp8_e4m3", scale_block=scale_block)


@pytest.mark.parametrize("head_dim", [24, 40])
def test_append_config_fp8_needs_16_byte_rows(head_dim):
    with pytest.raises(ValueError, match="multiple of 16"):
        AppendConfig("float16", head_dim, 16, kv_dtype="fp8_e4m3", scale_block=head_dim)


def _fp8_configs(page_size=16):
    """Every FP8 append specialization: bf16 / f16 input x head dims 64, 128, 256 x per tensor, 32, 64, 128
    and per token (the head dim) where the block divides the head dim."""
    out = []
    for dt in ("bfloat16", "float16"):
        for d in (64, 128, 256):
            for b in sorted({0, 32, 64, 128, d}):
                if b == 0 or d % b == 0:
                    out.append(AppendConfig(dt, d, page_size, kv_dtype="fp8_e4m3", scale_block=b))
    return out


FP8_CONFIGS = _fp8_configs()


def test_fp8_config_set():
    assert len(FP8_CONFIGS) == 24
    names = [c.name for c in FP8_CONFIGS]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"cukv_append_(bf16|f16)_e4m3s(0|32|64|128|256)_d(64|128|256)_p16", n) for n in names)


@pytest.mark.parametrize("cfg", FP8_CONFIGS + [AppendConfig("bfloat16", 80, 1, kv_dtype="fp8_e4m3", scale_block=80),
                                               AppendConfig("float16", 96, 48, kv_dtype="fp8_e4m3", scale_block=32,
                                                            threads=512)],
                         ids=lambda c: c.name)
def test_fp8_append_config_renders(cfg):
    assert cfg.quantized
    src = cfg.render()
    assert cfg.name in src
    assert f"append_kv_fp8<T, {cfg.page_size}, {cfg.head_dim}, {cfg.scale_block}>(a);" in src
    assert "append_kv<T," not in src
    assert f"__launch_bounds__({cfg.threads}) {cfg.name}(" in src
    # the unquantized config of the same shape renders the plain append under another name
    plain = AppendConfig(cfg.dtype, cfg.head_dim, cfg.page_size)
    assert "append_kv_fp8" not in plain.render() and plain.name != cfg.name


def test_fp8_grid_is_a_warp_per_row():
    cfg = AppendConfig("bfloat16", 128, 16, kv_dtype="fp8_e4m3", scale_block=128)
    assert cfg.grid(10, 8) == (10 * 8 * 32 + 255) // 256
    assert cfg.grid(1 << 30, 8) == 65535
    assert cfg.grid(0, 8) == 1


@pytest.mark.compile_ahead(build=lambda cfg: cfg)
@pytest.mark.parametrize("cfg", FP8_CONFIGS, ids=lambda c: c.name)
def test_fp8_append_compiles_without_spills(cfg, fresh_kernel_cache):
    cfg = AppendConfig(**{f: getattr(cfg, f) for f in ("dtype", "head_dim", "page_size", "threads", "kv_dtype",
                                                         "scale_block")})  # a fresh object: no cached module
    mod = cfg.compiled
    assert cfg.name in mod.functions, f"no ptxas report for {cfg.name}: {sorted(mod.functions)}"
    r = mod.functions[cfg.name]
    assert r.spill_stores == 0 and r.spill_loads == 0, f"{cfg.name} spills: {r}"
    assert r.stack_frame == 0 and r.static_smem == 0, r
    assert 0 < r.registers <= 255, r


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([64, 80, 128, 256]), st.integers(-60, 60))
def test_split_query_keeps_bf16_values(seed, d, exp):
    """prefill's FP8-scores query (two e4m3 terms per element, a power of two per row): every bf16 element at
    or above 2^-9 of its row's largest comes back exactly, and nothing moves by more than 2^-16 of that."""
    from cukv.dtypes import from_storage, to_storage

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((6, 3, d)) * np.exp2(exp + rng.integers(-8, 8, (6, 3, 1)))
    q[0, 0] = 0.0  # an all-zero row
    q[1, 1, : d // 2] *= 2.0 ** -20  # elements far below the row's largest
    q = from_storage(to_storage(q.astype(np.float32), "bfloat16"), "bfloat16")
    got = fp8.split_query(q)
    amax = np.max(np.abs(q), axis=-1, keepdims=True)
    big = np.abs(q) >= amax * 2.0 ** -9
    assert np.array_equal(got[big], q[big])
    assert np.all(np.abs(got - q) <= amax * 2.0 ** -16)
    assert np.all(got[0, 0] == 0.0)
