"""Quantizing append on the GPU: the codes and scales it writes into a NaN-poisoned FP8 cache equal
:func:`cukv.fp8.quantize` on the host bit for bit, for every scale granularity, layout and input dtype, and
nothing outside the written slots changes."""
import numpy as np
import pytest

import cukv
from cukv import fp8
from cukv.dtypes import bf16_bits, bf16_to_float, from_storage, to_storage

pytestmark = pytest.mark.gpu

GRANULARITIES = ["tensor", "token", 32, 64, 128]
CASES = [(d, g) for d in (64, 128, 256) for g in GRANULARITIES if not (isinstance(g, int) and d % g)]


def _tokens(rng, n, heads, d, dtype):
    """[n, heads, d] inputs in storage form and their exact float32 values. Every (token, head) row and every
    32-dim block gets its own random factor, so granules differ by orders of magnitude; token 1 is all zero
    and token 2 lies below the scale floor (448 * 2**-32); values stay within +-1e4."""
    x = rng.standard_normal((n, heads, d))
    x *= np.exp(rng.uniform(-6, 6, (n, heads, 1)))
    x *= np.repeat(np.exp(rng.uniform(-3, 3, (n, heads, d // 32))), 32, axis=-1)
    x[1] = 0.0
    x[2] = rng.standard_normal((heads, d)) * (1e-9 if dtype == "bfloat16" else 2e-8)  # fp16: subnormals
    x = np.clip(x, -1e4, 1e4).astype(np.float32)
    stored = to_storage(x, dtype)
    return stored, from_storage(stored, dtype).astype(np.float32)


def _setup(rng, d, gran, layout, dtype, heads=2, page_size=16, **cache_kw):
    """A NaN-filled FP8 cache, three sequences appended through one append_kv call with two padding tokens
    (slot -1 and a slot past the end) mixed in. Returns what the checks need."""
    import cupy as cp

    max_pages = -(-25 // page_size) + 1  # the longest sequence holds 25 tokens
    cache = cukv.PagedKVCache(3 * max_pages + 2, page_size, heads, d, dtype="fp8_e4m3", layout=layout, fill="nan",
                              scale_granularity=gran, **cache_kw)
    seqs = cukv.SequenceTable(cache, max_batch=3, max_pages_per_seq=max_pages)
    seqs.extend([5, 0, 3])
    slots = seqs.extend([20, 7, 13])  # sequences 0 and 2 continue mid-page
    n = slots.size + 2
    slot_mapping = np.insert(slots, [3, slots.size], [-1, cache.num_slots + 5]).astype(np.int64)
    assert slot_mapping.size == n
    k_st, kf = _tokens(rng, n, heads, d, dtype)
    v_st, vf = _tokens(rng, n, heads, d, dtype)
    tensor_scales = (None, None)
    if cache.scale_block == 0:
        # non-trivial scales, small enough that the largest values saturate
        ks, vs = 0.7 * np.abs(kf).max() / 448, 1.3 * np.abs(vf).max() / 448 / 3
        cache.set_tensor_scales(ks, vs)
        tensor_scales = (cache.k_scales.get(), cache.v_scales.get())
        assert tensor_scales[0] == np.float32(ks) and tensor_scales[1] == np.float32(vs)
    kd, vd = cp.asarray(k_st), cp.asarray(v_st)
    assert kd.dtype == (cp.uint16 if dtype == "bfloat16" else cp.float16)
    cukv.append_kv(cache, kd, vd, cp.asarray(slot_mapping))
    cp.cuda.get_current_stream().synchronize()
    real = (slot_mapping >= 0) & (slot_mapping < cache.num_slots)
    return cache, slot_mapping[real], (kf[real], vf[real]), tensor_scales


def _unwritten(cache, slots):
    mask = np.ones((cache.num_pages, cache.page_size), bool)
    mask[slots // cache.page_size, slots % cache.page_size] = False
    return mask


def _check_written(cache, slots, values, tensor_scales):
    ps, block = cache.page_size, cache.scale_block
    pg, off = slots // ps, slots % ps
    mask = _unwritten(cache, slots)
    assert mask.sum() == cache.num_slots - slots.size
    deq_bits = cache.dequantize()
    for name, codes_d, scales_d, x, ts, dq in (("k", cache.k, cache.k_scales, values[0], tensor_scales[0], deq_bits[0]),
                                              ("v", cache.v, cache.v_scales, values[1], tensor_scales[1], deq_bits[1])):
        want_codes, want_scales = fp8.quantize(x, block, tensor_scale=ts)
        codes = codes_d.get()
        assert codes.dtype == np.uint8 and codes.shape == (cache.num_pages, ps, cache.num_kv_heads, cache.head_dim)
        got = codes[pg, off]
        bad = got != want_codes
        assert not bad.any(), (f"{name}: {int(bad.sum())} codes differ from cukv.fp8.quantize, first at "
                               f"{np.argwhere(bad)[0]}: got 0x{int(got[bad][0]):02x}, want 0x{int(want_codes[bad][0]):02x}")
        assert np.all(codes[mask] == fp8.NAN_CODE), f"{name}: a slot nobody appended to changed"
        scales = scales_d.get()
        if block == 0:
            assert scales.shape == () and scales.view(np.uint32) == np.float32(ts).view(np.uint32)
            sc_full = scales
        else:
            assert scales.dtype == np.float32 and scales.shape == (cache.num_pages, ps, cache.num_kv_heads,
                                                                    cache.head_dim // block)
            assert np.array_equal(scales[pg, off].view(np.uint32), want_scales.view(np.uint32)), f"{name} scales"
            assert np.isnan(scales[mask]).all(), f"{name}: a scale nobody appended to changed"
            sc_full = scales[pg, off]

        # dequantize(): e4m3 * scale, as bf16. The device computes the product in float32 and rounds that to
        # bf16; the float64 product is exact (4 + 24 significant bits), so float64 -> float32 -> bf16 here is
        # the same two roundings, and must match bit for bit. Rounding the float64 product straight to bf16
        # differs where the float32 rounding lands exactly on a bf16 tie: ~1e-5 of the elements for bf16
        # inputs, but ~0.5% for fp16 ones (amax has 11 bits and 1/448 = 1/7 * 2**-6 repeats 001, so
        # products sit just beside bf16 ties); by one bf16 ulp at most, checked below.
        exact = fp8.dequantize(got, sc_full, block)
        dq = dq.get()
        got_f = bf16_to_float(dq[pg, off]).astype(np.float64)
        want_f = bf16_to_float(bf16_bits(exact.astype(np.float32))).astype(np.float64)
        assert np.array_equal(got_f, want_f), f"{name}: dequantize() differs from e4m3 * scale rounded to bf16"
        m, e = np.frexp(exact)
        once = np.ldexp(np.round(m * 256) / 256, e)  # exact -> bf16 (8 significant bits), ties to even
        assert np.all(np.abs(got_f - once) <= np.abs(exact) * 2.0 ** -7)
        assert np.isnan(bf16_to_float(dq[mask])).all()
        # and the quantization error bound against the appended values
        full = sc_full if block == 0 else np.repeat(sc_full, block, axis=-1)
        x64 = x.astype(np.float64)
        ok = np.abs(x64) < 448 * np.asarray(full, np.float64)  # per tensor: larger values saturate
        err = np.abs(exact - x64)
        bound = np.maximum(np.abs(x64) * 2.0 ** -4, np.asarray(full, np.float64) * 2.0 ** -10) + np.abs(x64) * 2.0 ** -22
        assert np.all((err <= bound)[ok] if block == 0 else err <= bound)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["combined", "separate"])
@pytest.mark.parametrize("d,gran", CASES, ids=[f"d{d}-{g}" for d, g in CASES])
def test_append_matches_host_quantizer(rng, d, gran, layout, dtype):
    cache, slots, values, ts = _setup(rng, d, gran, layout, dtype)
    assert cache.quantized and cache.scale_block == fp8.scale_block(gran, d)
    _check_written(cache, slots, values, ts)


@pytest.mark.parametrize("gran", GRANULARITIES)
def test_append_page_size_one_and_many_heads(rng, gran):
    cache, slots, values, ts = _setup(rng, 128, gran, "combined", "bfloat16", heads=5, page_size=1)
    _check_written(cache, slots, values, ts)


@pytest.mark.parametrize("gran", GRANULARITIES)
def test_layers_layout_writes_only_its_layer(rng, gran):
    cache, slots, values, ts = _setup(rng, 128, gran, "layers", "bfloat16", num_layers=2, layer=1)
    _check_written(cache, slots, values, ts)
    st = cache.storage.get()  # [pages, 2, layers, page_size, H, D]
    assert st.shape == (cache.num_pages, 2, 2, cache.page_size, cache.num_kv_heads, cache.head_dim)
    assert np.all(st[:, :, 0] == fp8.NAN_CODE), "layer 0 was written"
    assert np.any(st[:, :, 1] != fp8.NAN_CODE)
    if cache.scale_block:
        sc = cache.scale_storage.get()
        assert sc.shape == st.shape[:-1] + (cache.head_dim // cache.scale_block,)
        assert np.isnan(sc[:, :, 0]).all(), "layer 0 scales were written"
        assert not np.isnan(sc[:, :, 1]).all()


def test_repeat_append_is_bit_identical(rng):
    """Appending the same tokens again rewrites the same bytes (no dependence on what the slots held)."""
    import cupy as cp

    cache, slots, values, ts = _setup(rng, 128, 64, "combined", "float16")
    pg, off = slots // cache.page_size, slots % cache.page_size

    def written():
        return [a.get()[pg, off].view(np.uint8) for a in (cache.k, cache.v, cache.k_scales, cache.v_scales)]

    before = written()
    cache.storage.fill(0)
    cache.scale_storage.fill(0)
    k = cp.asarray(to_storage(values[0], "float16"))  # exactly the fp16 values appended before
    v = cp.asarray(to_storage(values[1], "float16"))
    cukv.append_kv(cache, k, v, cp.asarray(slots))
    for a, b in zip(before, written()):
        assert np.array_equal(a, b)
