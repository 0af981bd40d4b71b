"""Prefill on the GPU against the float64 reference (ragged batches, paged and contiguous, masks, sink)."""
import numpy as np
import pytest

from cukv import reference
from cukv.dtypes import from_storage, to_storage
from cukv.testing import assert_close

pytestmark = pytest.mark.gpu


def _case(rng, q_lens, cache_lens, hq, hkv, d, page_size, dtype="bfloat16", layout="combined", big=False,
          k_ramp=None):
    """A ragged case; ``k_ramp`` scales each sequence's keys from ``k_ramp`` (its first key) down to 1 (its last)."""
    import cupy as cp

    import cukv

    q_lens, cache_lens = np.asarray(q_lens), np.asarray(cache_lens)
    kv_lens = q_lens + cache_lens
    b = len(q_lens)
    total_kv = int(kv_lens.sum())
    k = rng.standard_normal((total_kv, hkv, d)).astype(np.float32)
    if k_ramp is not None:
        k *= np.concatenate([np.linspace(k_ramp, 1.0, n) for n in kv_lens]).astype(np.float32)[:, None, None]
    v = rng.standard_normal((total_kv, hkv, d)).astype(np.float32)
    q = rng.standard_normal((int(q_lens.sum()), hq, d)).astype(np.float32)
    ks, vs, qs = (to_storage(x, dtype) for x in (k, v, q))
    case = {"q": cp.asarray(qs), "q_host": from_storage(qs, dtype), "k_host": from_storage(ks, dtype),
            "v_host": from_storage(vs, dtype), "q_offsets": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
            "kv_offsets": np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32), "kv_lens": kv_lens.astype(np.int32)}
    if page_size:
        pages_per = -(-kv_lens // page_size)
        base = 65536 + 5 if big else 0
        num_pages = int(pages_per.sum()) + 3 + base
        cache = cukv.PagedKVCache(num_pages, page_size, hkv, d, dtype=dtype, layout=layout, fill="nan")
        ids = np.arange(base, num_pages)
        rng.shuffle(ids)
        table = np.zeros((b, max(1, int(pages_per.max()))), np.int32)
        slots, cur = [], 0
        for s in range(b):
            table[s, : pages_per[s]] = ids[cur: cur + pages_per[s]]
            cur += pages_per[s]
            pos = np.arange(kv_lens[s])
            slots.append(table[s, pos // page_size].astype(np.int64) * page_size + pos % page_size)
        cukv.append_kv(cache, cp.asarray(ks), cp.asarray(vs), cp.asarray(np.concatenate(slots)))
        case["kv"] = (cache, cukv.PageTable(cp.asarray(table), cp.asarray(case["kv_lens"]), page_size))
    else:
        case["kv"] = (cp.asarray(ks), cp.asarray(vs), cp.asarray(case["kv_offsets"]))
    return case


def _reference(case, hq, causal=True, window=None, chunk=None, softcap=None, sink=None):
    outs, lses = [], []
    qo, ko = case["q_offsets"], case["kv_offsets"]
    for s in range(len(qo) - 1):
        ql, kl = qo[s + 1] - qo[s], ko[s + 1] - ko[s]
        if ql == 0:
            continue
        q = case["q_host"][qo[s]: qo[s + 1]]
        k, v = case["k_host"][ko[s]: ko[s + 1]], case["v_host"][ko[s]: ko[s + 1]]
        pos = kl - ql + np.arange(ql)
        kw = dict(causal=causal, window=window, softcap=softcap, sink=sink)
        if chunk:
            kw["chunk"] = chunk
        o, lse = reference.attention(q, k, v, pos, **kw)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def _run(case, hq, hkv, d, page_size, dtype="bfloat16", mask="causal", window=None, chunk=None, softcap=None,
         sink=None, config=None, max_blocks=None):
    import cupy as cp

    import cukv

    pf = cukv.BatchPrefill(hq, hkv, d, page_size=page_size or None, dtype=dtype, config=config, max_blocks=max_blocks)
    pf.plan(case["q_offsets"], case["kv_lens"], mask=mask, window=window, chunk=chunk)
    out = cp.full(case["q"].shape, 0x7FC0 if dtype == "bfloat16" else np.nan, case["q"].dtype)  # NaN-poisoned
    lse = cp.full((case["q"].shape[0], hq), np.nan, cp.float32)
    sk = None if sink is None else cp.asarray(np.asarray(sink, np.float32))
    pf.run(case["q"], case["kv"], out=out, lse=lse, sink=sk, softcap=softcap)
    return from_storage(out.get(), dtype), lse.get()


CASES = [
    # q_lens, cache_lens, hq, hkv, d, page
    ([1, 17, 100, 1000], [0, 0, 0, 0], 4, 2, 128, 16),
    ([17, 100, 4099], [5, 1000, 0], 8, 2, 128, 1),
    ([64, 300], [0, 33], 4, 4, 64, 128),
    ([100, 129], [7, 0], 6, 2, 80, 48),
    ([100, 129], [7, 0], 4, 1, 96, 16),
    ([200, 5], [0, 61], 2, 2, 192, 16),
    ([150, 64], [10, 0], 4, 2, 256, 16),
    ([130, 3], [0, 70], 2, 1, 512, 16),
    ([1000, 17], [0, 2000], 4, 1, 128, 0),   # contiguous K/V
]


@pytest.mark.parametrize("q_lens,cache_lens,hq,hkv,d,page", CASES)
def test_prefill_causal(rng, q_lens, cache_lens, hq, hkv, d, page):
    case = _case(rng, q_lens, cache_lens, hq, hkv, d, page)
    out, lse = _run(case, hq, hkv, d, page)
    want_o, want_lse = _reference(case, hq)
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


@pytest.mark.parametrize("d,page", [(256, 16), (256, 0), (512, 16)])
def test_prefill_lazy_rescale_growing_scores(rng, d, page):
    """At d256 and d512 a warp rescales O only when a row's max grows by more than 2^8 in the exponent
    (templates/prefill_kernel.cuh kRescaleLog2). Keys grow toward the sequence start, which the tile walk reaches last,
    so the running max grows past that bound several times per row and P approaches 2^8 between rescales."""
    hq, hkv = 4, 2
    case = _case(rng, [700, 90, 1], [300, 0, 130], hq, hkv, d, page, k_ramp=6.0)
    out, lse = _run(case, hq, hkv, d, page)
    want_o, want_lse = _reference(case, hq)
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


@pytest.mark.parametrize("mask,window,chunk,softcap,sink", [
    ("none", None, None, None, None),
    ("causal", 64, None, None, None),
    ("causal", None, 96, None, None),
    ("causal", None, None, 30.0, None),
    ("causal", None, None, None, "sink"),
    ("none", 200, None, 20.0, "sink"),
])
@pytest.mark.parametrize("page", [16, 0])
def test_prefill_masks(rng, mask, window, chunk, softcap, sink, page):
    hq, hkv, d = 4, 2, 128
    case = _case(rng, [300, 17, 1], [100, 0, 40], hq, hkv, d, page)
    sk = rng.standard_normal(hq).astype(np.float32) * 2 if sink else None
    out, lse = _run(case, hq, hkv, d, page, mask=mask, window=window, chunk=chunk, softcap=softcap, sink=sk)
    want_o, want_lse = _reference(case, hq, causal=mask == "causal", window=window, chunk=chunk, softcap=softcap, sink=sk)
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


def test_prefill_fp16_big_page_ids(rng):
    hq, hkv, d = 4, 1, 128
    case = _case(rng, [77, 33], [20, 0], hq, hkv, d, 16, dtype="float16", big=True)
    out, lse = _run(case, hq, hkv, d, 16, dtype="float16")
    want_o, want_lse = _reference(case, hq)
    assert_close(out, want_o, "float16")


def test_prefill_fully_masked_rows(rng):
    # window 1 with a sink: each row sees only itself; q_len > kv_len rows see nothing when causal
    hq, hkv, d = 2, 1, 64
    case = _case(rng, [5], [0], hq, hkv, d, 0)
    # shrink kv below q: kv_offsets say 3 keys for 5 queries -> first two queries at negative positions
    import cupy as cp
    case["kv_offsets"] = np.array([0, 3], np.int32)
    case["kv_lens"] = np.array([3], np.int32)
    k, v, _ = case["kv"]
    case["kv"] = (k, v, cp.asarray(case["kv_offsets"]))
    out, lse = _run(case, hq, hkv, d, 0)
    want_o, want_lse = _reference(case, hq)
    assert np.all(out[:2] == 0) and np.all(np.isneginf(lse[:2]))
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


def test_prefill_speculative(rng):
    # 2..8 new tokens per sequence over a long cached prefix (speculative decode through prefill)
    hq, hkv, d = 8, 2, 128
    case = _case(rng, [2, 5, 8, 3], [900, 31, 4000, 0], hq, hkv, d, 16)
    out, lse = _run(case, hq, hkv, d, 16)
    want_o, want_lse = _reference(case, hq)
    assert_close(out, want_o, "bfloat16")


def test_prefill_kv_offsets_past_the_arrays_read_nothing_outside(rng):
    # kv_offsets that overrun k/v (a user error the host cannot see without a sync) read holes (zeros),
    # never memory past the arrays: the run finishes and the output stays finite
    import cupy as cp

    hq, hkv, d = 2, 1, 64
    case = _case(rng, [40], [0], hq, hkv, d, 0)
    k, v, _ = case["kv"]
    case["kv_offsets"] = np.array([0, 40 + 300], np.int32)
    case["kv_lens"] = np.array([340], np.int32)
    case["kv"] = (k, v, cp.asarray(case["kv_offsets"]))
    out, lse = _run(case, hq, hkv, d, 0, mask="none")
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))


@pytest.mark.parametrize("bm,d,page,mask,window,softcap", [
    (192, 128, 16, "causal", None, None),
    (128, 128, 0, "causal", 64, 30.0),
    (128, 256, 16, "none", None, None),
    (192, 64, 16, "causal", None, None),
])
def test_prefill_pingpong(rng, bm, d, page, mask, window, softcap):
    # S issued in warpgroup ring order on the 16-bit path (FP8 defaults at d128/d256 take it through the FP8 tests);
    # ragged rows leave the last block's warpgroups with rows past the sequence, which must still pass the ring
    from cukv.configs.prefill import PrefillConfig
    from cukv.policy.prefill import DEFAULTS

    _, bn, bk, st = DEFAULTS[d]
    cfg = PrefillConfig("bfloat16", d, page, bm, min(bn, 64), bk, st, pingpong=True)
    hq, hkv = 4, 2
    case = _case(rng, [300, 17, 1, 129], [100, 0, 40, 0], hq, hkv, d, page)
    out, lse = _run(case, hq, hkv, d, page, mask=mask, window=window, softcap=softcap, config=cfg)
    want_o, want_lse = _reference(case, hq, causal=mask == "causal", window=window, softcap=softcap)
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


@pytest.mark.parametrize("d,page,layout", [
    (128, 16, "combined"), (64, 48, "separate"), (256, 16, "layers"), (80, 32, "combined"), (512, 16, "combined"),
    (128, 0, None), (64, 0, None),  # contiguous K/V: one page of every token
])
def test_prefill_tma_matches_cp_async(rng, d, page, layout):
    # K/V by tensor copies (the 16-bit default where the pages allow them): tiles inside a sequence come as boxes,
    # the tile holding its end by cp.async, whose zero fill keeps the NaN-poisoned unused slots out of P V. The
    # ring holds the same values either way, so the output is bitwise the cp.async producer's.
    import dataclasses

    from cukv.policy.prefill import default_config

    cfg = default_config("bfloat16", d, page)
    assert cfg.tma, cfg.name
    hq, hkv, bn = 4, 2, cfg.BN
    # sequences ending mid-tile and on a tile boundary, with and without a cached prefix
    case = _case(rng, [2 * bn + 5, 3 * bn, 1, 40], [bn, 0, 2 * bn - 1, 7], hq, hkv, d, page, layout=layout or "combined")
    out, lse = _run(case, hq, hkv, d, page, config=cfg)
    # (the cp.async producer launches a block per item: the persistent grid needs tensor copies)
    out_cp, lse_cp = _run(case, hq, hkv, d, page, config=dataclasses.replace(cfg, tma=False, persistent=False))
    assert np.array_equal(out, out_cp) and np.array_equal(lse, lse_cp)
    want_o, want_lse = _reference(case, hq)
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


@pytest.mark.parametrize("d,page,mask,window,chunk,softcap,sink,grid", [
    (128, 16, "causal", None, None, None, None, None),
    (128, 16, "causal", None, None, None, None, 3),    # many items per block: the ring and query carry over
    (64, 16, "causal", 48, None, 20.0, [0.5, -1.0, 2.0, 0.0], 2),
    (256, 16, "none", None, None, None, None, 5),
    (256, 0, "causal", None, 96, None, None, 4),       # contiguous K/V; chunks leave items that see few keys
    (96, 48, "causal", None, None, None, None, 1),     # one block walks every item
])
def test_prefill_persistent_16bit(rng, d, page, mask, window, chunk, softcap, sink, grid):
    # the 16-bit persistent grid (PrefillConfig.persistent): the launch-per-item kernel's outputs bit for bit, twice
    # (the item counter resets itself at the end of each launch), and the float64 reference
    import dataclasses

    from cukv.policy.prefill import default_config

    cfg = default_config("bfloat16", d, page)
    assert cfg.persistent
    base = dataclasses.replace(cfg, persistent=False)
    hq, hkv = 4, 2
    bn = cfg.BN
    case = _case(rng, [2 * bn + 5, 300, 1, 3 * bn, 40], [bn, 0, 2 * bn - 1, 0, 7], hq, hkv, d, page)
    kw = dict(mask=mask, window=window, chunk=chunk, softcap=softcap, sink=sink, max_blocks=grid)
    out, lse = _run(case, hq, hkv, d, page, config=cfg, **kw)
    out2, lse2 = _run(case, hq, hkv, d, page, config=cfg, **kw)
    out_b, lse_b = _run(case, hq, hkv, d, page, config=base, **kw)
    assert np.array_equal(out, out_b) and np.array_equal(lse, lse_b, equal_nan=True)
    assert np.array_equal(out2, out) and np.array_equal(lse2, lse, equal_nan=True)
    want_o, want_lse = _reference(case, hq, causal=mask == "causal", window=window, chunk=chunk, softcap=softcap,
                                  sink=sink)
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


@pytest.mark.parametrize("d,page,mask,tile", [
    (256, 16, "causal", (128, 64, 256, 4)),   # the 64-key tile, overlapped by default
    (256, 0, "none", (128, 64, 256, 4)),
    (128, 16, "causal", (128, 128, 128, 4)),
    (256, 16, "causal", None),                # d256's default: 128 keys in a ring of one tile, pv_wait on
])
def test_prefill_pv_wait(rng, d, page, mask, tile):
    # P V completed before the next S (PrefillConfig.pv_wait) changes when the wgmmas are waited for, not what they
    # add: the same tile's outputs bit for bit either way, and the float64 reference
    import dataclasses

    from cukv.policy.prefill import default_config, tile_config

    cfg = tile_config("bfloat16", d, page, *tile) if tile else default_config("bfloat16", d, page)
    other = dataclasses.replace(cfg, pv_wait=not cfg.pv_wait) if tile else None
    hq, hkv = 4, 2
    bn = cfg.BN
    case = _case(rng, [2 * bn + 5, 300, 1, 3 * bn], [bn, 0, 2 * bn - 1, 7], hq, hkv, d, page)
    out, lse = _run(case, hq, hkv, d, page, config=cfg, mask=mask)
    if other is not None:
        out_o, lse_o = _run(case, hq, hkv, d, page, config=other, mask=mask)
        assert np.array_equal(out, out_o) and np.array_equal(lse, lse_o, equal_nan=True)
    want_o, want_lse = _reference(case, hq, causal=mask == "causal")
    assert_close(out, want_o, "bfloat16")
    assert_close(lse, want_lse, "float32", atol=2e-3, rtol=2e-3, name="lse")


def test_contiguous_kv_misaligned_is_refused(rng):
    # contiguous K/V are read by 16-byte copies (cp.async or TMA boxes): a view 2 bytes past a boundary is refused
    import cupy as cp

    import cukv

    hq, hkv, d = 4, 2, 128
    case = _case(rng, [70], [0], hq, hkv, d, 0)
    k, v, offs = case["kv"]
    flat = cp.empty(k.size + 8, k.dtype)
    k_off = flat[1:1 + k.size].reshape(k.shape)
    k_off[...] = k
    pf = cukv.BatchPrefill(hq, hkv, d, page_size=None).plan(case["q_offsets"], case["kv_lens"])
    with pytest.raises(ValueError, match="k starts at device address .* not 16-byte aligned"):
        pf.run(case["q"], (k_off, v, offs))
    out = pf.run(case["q"], (k, v, offs))  # the aligned arrays still run
    assert_close(from_storage(out.get(), "bfloat16"), _reference(case, hq)[0], "bfloat16")
