"""Non-absorbed MLA prefill (BatchMLAPrefill) on the GPU against cukv.reference.mla_prefill (float64): ragged batches
with cached prefixes, the rope part from 16-bit and FP8 caches (random page order, NaN in every unused slot and
past the ends of k_nope / v) or a contiguous k_rope, both masks, sink, graph replay, repeat runs bit-identical.

The default subset runs in about a minute; the issue's full grid (q lengths up to 4099 over prefixes up to 3000, up
to 128 heads) is marked ``slow``. Long sequences are checked on sampled query rows (the float64 reference of every
row would take minutes)."""
import dataclasses
import functools

import numpy as np
import pytest

from cukv.testing import capture, replay
from cukv import reference
from cukv.dtypes import bf16_bits, bf16_to_float

pytestmark = pytest.mark.gpu

#: every row of a sequence up to this many queries is checked; longer ones on FULL_ROWS sampled rows
FULL_ROWS = 160
#: the kernel variants (MLAPrefillConfig.persistent, .tma, .stages, .tma_store) the correctness tests run over the
#: default tile (3 stages only on the persistent grid: one block per item spills there); "wide": plan's 192 x 96 tile
VARIANTS = {"base": (False, False, 2, False), "pers": (True, False, 3, False), "tma": (False, True, 2, False),
            "pers_tma": (True, True, 3, False), "pers_tma_st": (True, True, 3, True), "wide": (True, True, 3, False)}
#: a persistent grid this small walks several items per block in the tests' small batches
TEST_BLOCKS = 5


def variant(name, dtype="bfloat16", page_size=None):
    """(config, max_blocks) of variant ``name`` over the default tile."""
    from cukv.policy.mla_prefill import default_config

    persistent, tma, stages, tma_store = VARIANTS[name]
    base = default_config(dtype, 0 if page_size is None else page_size, name == "wide")
    # off the persistent grid a one-tile ring of 128 keys needs pv_wait (the config's stages rule)
    cfg = dataclasses.replace(base, persistent=persistent, tma=tma, stages=stages, tma_store=tma_store,
                              pv_wait=base.pv_wait or not persistent)
    return cfg, (TEST_BLOCKS if persistent else None)


each_variant = pytest.mark.parametrize("var", list(VARIANTS))


def _to_dev(x, dtype):
    import cupy as cp

    return cp.asarray(bf16_bits(x) if dtype == "bfloat16" else np.asarray(x, np.float16))


def _to_host(x, dtype):
    h = x.get() if hasattr(x, "get") else x
    return (bf16_to_float(h) if dtype == "bfloat16" else h.astype(np.float32)).astype(np.float64)


def _rounded(x, dtype):
    return _to_host(bf16_bits(x) if dtype == "bfloat16" else np.asarray(x, np.float16), dtype)


def make_problem(rng, q_lens, prefixes, heads, page_size, dtype="bfloat16", cache_dtype=None, lead=3, tail=5):
    """Device operands and their float64 values. ``page_size`` None: a contiguous k_rope; otherwise an MLAKVCache
    (``cache_dtype``: the 16-bit ``dtype`` or 'fp8_e4m3') with each sequence's rows in random pages, NaN in every
    unused slot and page, and table entries past each row's pages out of range, -1 or a NaN page. k_nope / v /
    k_rope hold NaN rows before the batch's first row (``lead``) and after its last (``tail``)."""
    import cupy as cp

    from cukv.mla_cache import MLAKVCache

    kv_lens = [q + p for q, p in zip(q_lens, prefixes)]
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    ko = lead + np.concatenate([[0], np.cumsum(kv_lens)])
    rows = int(ko[-1]) + tail
    q = _rounded(rng.standard_normal((qo[-1], heads, 192)), dtype)
    kn = _rounded(rng.standard_normal((rows, heads, 128)), dtype)
    vv = _rounded(rng.standard_normal((rows, heads, 128)), dtype)
    kr = _rounded(rng.standard_normal((rows, 64)), dtype)
    for a in (kn, vv, kr):
        a[:lead] = np.nan
        a[ko[-1]:] = np.nan
    p = dict(q_offsets=qo, kv_offsets=ko, kv_lengths=np.array(kv_lens), q=q, k_nope=kn, v=vv, k_rope=kr,
             dq=_to_dev(q, dtype), dkn=_to_dev(kn, dtype), dv=_to_dev(vv, dtype), dtype=dtype)
    if page_size is None:
        p["dkr"] = _to_dev(kr, dtype)
        return p
    cache_dtype = cache_dtype or dtype
    b = len(kv_lens)
    need = [-(-n // page_size) for n in kv_lens]
    width = max(1, max(need) + 2)
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages)
    table = np.zeros((b, width), np.int32)
    k = 0
    for i, n in enumerate(kv_lens):
        table[i, :need[i]] = perm[k:k + need[i]]
        k += need[i]
        table[i, need[i]:] = rng.choice([-1, num_pages, 2 ** 30, int(perm[-1])], size=width - need[i])
    cache = MLAKVCache(num_pages, page_size, cache_dtype, fill="nan")
    latent = rng.standard_normal((rows, 512))
    if cache_dtype == "fp8_e4m3":
        codes = reference.mla_quantize_fp8(latent, kr)  # the rope part is bf16 in the row
        host = np.full((num_pages, page_size, 656), 0xFF, np.uint8)
        src = codes
    else:
        host = np.full((num_pages, page_size, 576), np.nan)
        src = np.concatenate([latent, kr], 1)
    for i, n in enumerate(kv_lens):
        for t in range(n):
            host[table[i, t // page_size], t % page_size] = src[ko[i] + t]
    if cache_dtype == "fp8_e4m3":
        cache.data[...] = cp.asarray(host)
    else:
        cache.data[...] = _to_dev(host, cache_dtype).view(cache.data.dtype)
    p.update(cache=cache, table=cp.asarray(table), host_pages=host)
    return p


def expected(p, rows_of, mask="causal", sink=None, scale=None):
    """The reference on the rows rows_of(b, q_len) of each sequence (sequence by sequence)."""
    qo, ko, kl = p["q_offsets"], p["kv_offsets"], p["kv_lengths"]
    out = {}
    for b in range(len(kl)):
        q_len = int(qo[b + 1] - qo[b])
        rows = rows_of(q_len)
        if not len(rows):
            continue
        lo, hi = int(ko[b]), int(ko[b + 1])
        # rows i of the sequence: as one sequence of (i + 1) queries over its keys up to position kv_len - q_len + i
        for i in rows:
            n = hi - lo - (q_len - 1 - i) if mask == "causal" else hi - lo
            qi = p["q"][qo[b] + i: qo[b] + i + 1]
            n_keys = max(n, 0)
            o, s = reference.mla_prefill(qi, [0, 1], p["k_nope"][lo: lo + n_keys], p["v"][lo: lo + n_keys],
                                         p["k_rope"][lo: lo + n_keys], [0, n_keys], mask="none", sink=sink,
                                         softmax_scale=scale)
            out[int(qo[b] + i)] = (o[0], s[0])
    return out


def rows_sampled(rng):
    def rows_of(q_len):
        if q_len <= FULL_ROWS:
            return range(q_len)
        pick = rng.choice(q_len, FULL_ROWS - 4, replace=False)
        return sorted(set(pick.tolist()) | {0, 1, q_len - 2, q_len - 1})
    return rows_of


def check(p, out, lse, want, dtype):
    o = _to_host(out, dtype)
    lh = lse.get()
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    assert np.isfinite(o).all(), "NaN or inf reached the output"
    for t, (ro, rl) in want.items():
        np.testing.assert_allclose(o[t], ro, atol=tol, rtol=tol, err_msg=f"token {t}")
        assert np.array_equal(np.isinf(lh[t]), np.isinf(rl)), f"token {t}: {lh[t]} vs {rl}"
        fin = np.isfinite(rl)
        np.testing.assert_allclose(lh[t][fin], rl[fin], atol=2e-3, rtol=1e-4, err_msg=f"lse of token {t}")


def run_case(rng, q_lens, prefixes, heads, page_size, dtype="bfloat16", cache_dtype=None, mask="causal", sink=False,
             scale=None, var="base", tail_heads=None):
    import cupy as cp

    from cukv.ops.mla_prefill import BatchMLAPrefill

    p = make_problem(rng, q_lens, prefixes, heads, page_size, dtype, cache_dtype)
    sk = rng.standard_normal(heads).astype(np.float32) if sink else None
    config, blocks = variant(var, dtype, page_size)
    pf = BatchMLAPrefill(heads, page_size, dtype, config=config, max_blocks=blocks).plan(
        p["q_offsets"], p["kv_lengths"], kv_offsets=p["kv_offsets"], mask=mask, tail_heads=tail_heads)
    src = dict(k_rope=p["dkr"]) if page_size is None else dict(cache=p["cache"], block_table=p["table"])
    out, lse = pf.run(p["dq"], p["dkn"], p["dv"], **src, return_lse=True, softmax_scale=scale, check=True,
                      sink=None if sk is None else cp.asarray(sk))
    check(p, out, lse, expected(p, rows_sampled(rng), mask, sk, scale), dtype)
    return pf, p, src, out, lse


# ---- the default subset (time-bounded)

@each_variant
@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_small_ragged_batch(rng, page_size, mask, var):
    run_case(rng, [1, 17, 128, 300], [0, 5, 40, 200], 16, page_size, mask=mask, var=var)


@each_variant
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtypes_and_sink(rng, dtype, var):
    run_case(rng, [17, 64], [5, 0], 4, 16, dtype=dtype, sink=True, scale=0.05, var=var)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_rope_rows_helper_reads_the_cache_the_kernel_reads(rng, cache_dtype):
    """reference.mla_rope_rows over the cache's host copy gives the rope rows the problem wrote."""
    p = make_problem(rng, [17, 129], [5, 70], 2, 16, cache_dtype=cache_dtype)
    got = reference.mla_rope_rows(p["cache"].data.get(), p["table"].get(), p["kv_lengths"])
    ko = p["kv_offsets"]
    np.testing.assert_array_equal(got, p["k_rope"][ko[0]: ko[-1]])


@each_variant
def test_rope_from_fp8_rows(rng, var):
    run_case(rng, [17, 129], [5, 270], 16, 64, cache_dtype="fp8_e4m3", var=var)


@each_variant
def test_page_size_48_compiles_on_demand(rng, var):
    run_case(rng, [100], [260], 2, 48, var=var)


@pytest.mark.parametrize("var", ["base", "pers_tma"])
@pytest.mark.parametrize("heads", [1, 32, 128])
def test_head_counts(rng, heads, var):
    run_case(rng, [33, 7], [0, 300], heads, 64, var=var)


@pytest.mark.parametrize("var", ["pers_tma", "wide"])
@pytest.mark.parametrize("tail_heads", [1, 2, 5, 13])
def test_tail_heads_orders(rng, tail_heads, var):
    """Every (item, head) pair runs once whatever the persistent grid's last section (of 13 heads)."""
    pf, *_ = run_case(rng, [300, 17, 129], [0, 40, 700], 13, 16, var=var, tail_heads=tail_heads)
    assert pf._tail_heads == tail_heads


@each_variant
def test_fully_masked_rows_and_empty_sequences(rng, var):
    """Causal rows of a sequence with fewer keys than queries see nothing: 0 and -inf; a sequence with no queries
    is skipped."""
    import cupy as cp

    from cukv.ops.mla_prefill import BatchMLAPrefill

    p = make_problem(rng, [6, 0, 3], [0, 4, 0], 2, None)
    # sequence 0: 6 queries over only 2 of its keys (kv_lengths below q_len)
    kl = p["kv_lengths"].copy()
    kl[0] = 2
    ko = np.concatenate([[p["kv_offsets"][0]], p["kv_offsets"][0] + np.cumsum(kl)])
    cfg, blocks = variant(var)
    pf = BatchMLAPrefill(2, None, config=cfg, max_blocks=blocks).plan(p["q_offsets"], kl, kv_offsets=ko)
    out, lse = pf.run(p["dq"], p["dkn"], p["dv"], k_rope=p["dkr"], return_lse=True)
    o, lh = _to_host(out, "bfloat16"), lse.get()
    assert (o[:4] == 0).all() and np.isneginf(lh[:4]).all()
    assert np.isfinite(lh[4:]).all() and np.isfinite(o).all()
    cp.cuda.Stream.null.synchronize()


@each_variant
def test_repeat_runs_are_bit_identical(rng, var):
    pf, p, src, out, lse = run_case(rng, [300, 40], [100, 0], 16, 16, var=var)
    for _ in range(3):
        o2, l2 = pf.run(p["dq"], p["dkn"], p["dv"], **src, return_lse=True)
        assert (o2 == out).all() and (l2 == lse).all()


@each_variant
def test_graph_replay(rng, var):
    """run is capturable: replays read the new contents of the same buffers."""
    import cupy as cp

    from cukv.ops.mla_prefill import BatchMLAPrefill

    p = make_problem(rng, [70, 9], [30, 0], 8, 16)
    cfg, blocks = variant(var, page_size=16)
    pf = BatchMLAPrefill(8, 16, config=cfg, max_blocks=blocks).plan(p["q_offsets"], p["kv_lengths"],
                                                                     kv_offsets=p["kv_offsets"])
    out = cp.empty((p["dq"].shape[0], 8, 128), p["dq"].dtype)
    lse = cp.empty((p["dq"].shape[0], 8), cp.float32)
    src = dict(cache=p["cache"], block_table=p["table"])
    graph, stream = capture(lambda s: pf.run(p["dq"], p["dkn"], p["dv"], **src, out=out, lse=lse, stream=s))
    for _ in range(2):
        q = _rounded(rng.standard_normal(p["q"].shape), "bfloat16")
        p["q"] = q
        p["dq"][...] = _to_dev(q, "bfloat16")
        out.fill(0)
        replay(graph, stream)
        check(p, out, lse, expected(p, rows_sampled(rng)), "bfloat16")


# ---- tma_store: the output through shared memory by TMA gives the direct stores' bits

def _run_into(pf, p, src, **kw):
    """pf.run into an output and an LSE prefilled with NaN (0x7FFF is a NaN in bf16 and fp16): a row the kernel
    does not write stays NaN."""
    import cupy as cp

    out = cp.empty((p["dq"].shape[0], pf.num_heads, 128), p["dq"].dtype)
    out.view(cp.uint16).fill(0x7FFF)
    lse = cp.full((p["dq"].shape[0], pf.num_heads), np.nan, cp.float32)
    pf.run(p["dq"], p["dkn"], p["dv"], **src, out=out, lse=lse, **kw)
    return out, lse


@functools.lru_cache(maxsize=1)
def _store_problem(heads, prefix):
    """test_tma_store_matches_direct_stores's operands, shared by its masks and variants (the float64 operands of
    128 heads take seconds to draw). At 128 heads only the first sequence has the prefix."""
    prefixes = [prefix, 0, 0, 0] if heads == 128 else [prefix, 0, prefix, 0]
    return make_problem(np.random.default_rng(heads * 10007 + prefix), [1, 17, 128, 1000], prefixes, heads, 16)


def _compare_tma_store(rng, p, heads, cfg, blocks, mask):
    """cfg with tma_store off and on over p (rope from its page-16 cache): every row written, the reference on sampled
    rows, and the same bits (out and LSE)."""
    import cupy as cp

    from cukv.ops.mla_prefill import BatchMLAPrefill

    got = []
    for tma_store in (False, True):
        c = dataclasses.replace(cfg, tma_store=tma_store)
        pf = BatchMLAPrefill(heads, 16, config=c, max_blocks=blocks).plan(
            p["q_offsets"], p["kv_lengths"], kv_offsets=p["kv_offsets"], mask=mask)
        got.append(_run_into(pf, p, dict(cache=p["cache"], block_table=p["table"])))
    (o0, l0), (o1, l1) = got
    check(p, o1, l1, expected(p, rows_sampled(rng), mask), "bfloat16")
    assert bool((o1.view(cp.uint16) == o0.view(cp.uint16)).all()), "tma_store changed the output's bits"
    assert bool((l1.view(cp.uint32) == l0.view(cp.uint32)).all()), "tma_store changed the LSE's bits"


@pytest.mark.parametrize("var", ["base", "pers_tma"])
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("heads,prefix", [(1, 0), (1, 3000), (16, 0), (16, 3000), (128, 0), (128, 3000)])
def test_tma_store_matches_direct_stores(rng, heads, prefix, mask, var):
    """Ragged q lengths 1/17/128/1000 (warps whose rows cross a sequence's end copy them from their staging tile,
    the others by tensor copies) over cached prefixes, NaN in unused cache slots and k_nope / v rows: tma_store=True
    writes every row, matches the reference and equals tma_store=False bit for bit (out and LSE)."""
    cfg, blocks = variant(var, page_size=16)
    _compare_tma_store(rng, _store_problem(heads, prefix), heads, cfg, blocks, mask)


@pytest.mark.parametrize("bn,stages", [(64, 4), (96, 2)])
def test_tma_store_three_consumer_warpgroups(rng, bn, stages):
    """BM 192 (12 consumer warps, 48 KB of staging) beside the rings that leave room for it."""
    from cukv.configs.mla_prefill import MLAPrefillConfig

    cfg = MLAPrefillConfig("bfloat16", BM=192, BN=bn, stages=stages, page_size=16, pingpong=True, pv_wait=True,
                           persistent=True, tma=True)
    _compare_tma_store(rng, _store_problem(16, 3000), 16, cfg, TEST_BLOCKS, "causal")


def test_tma_store_float16_and_sink(rng):
    import cupy as cp

    from cukv.ops.mla_prefill import BatchMLAPrefill

    p = make_problem(rng, [300, 33], [70, 0], 4, None, dtype="float16")
    sink = cp.asarray(rng.standard_normal(4).astype(np.float32))
    cfg, blocks = variant("pers_tma", "float16")
    got = []
    for tma_store in (False, True):
        pf = BatchMLAPrefill(4, None, "float16", config=dataclasses.replace(cfg, tma_store=tma_store),
                             max_blocks=blocks).plan(p["q_offsets"], p["kv_lengths"], kv_offsets=p["kv_offsets"])
        got.append(_run_into(pf, p, dict(k_rope=p["dkr"]), sink=sink))
    (o0, l0), (o1, l1) = got
    check(p, o1, l1, expected(p, rows_sampled(rng), sink=sink.get()), "float16")
    assert bool((o1.view(cp.uint16) == o0.view(cp.uint16)).all())
    assert bool((l1.view(cp.uint32) == l0.view(cp.uint32)).all())


def test_tma_store_refuses_a_misaligned_output(rng):
    import cupy as cp

    from cukv.ops.mla_prefill import BatchMLAPrefill

    p = make_problem(rng, [40], [0], 2, None)
    cfg, _ = variant("pers_tma_st")
    pf = BatchMLAPrefill(2, None, config=cfg).plan(p["q_offsets"], p["kv_lengths"], kv_offsets=p["kv_offsets"])
    n = 40 * 2 * 128
    out = cp.empty(n + 1, p["dq"].dtype)[1:].reshape(40, 2, 128)  # 2 bytes past an allocation's start
    with pytest.raises(ValueError, match="out: base address .* 16-byte aligned"):
        pf.run(p["dq"], p["dkn"], p["dv"], k_rope=p["dkr"], out=out)


def test_checked_mode_refuses_pages_out_of_range(rng):
    from cukv.ops.mla_prefill import BatchMLAPrefill

    p = make_problem(rng, [20], [10], 2, 16)
    bad = p["table"].copy()
    bad[0, 0] = p["cache"].num_pages
    pf = BatchMLAPrefill(2, 16).plan(p["q_offsets"], p["kv_lengths"], kv_offsets=p["kv_offsets"])
    with pytest.raises(ValueError, match=r"block_table\[0, 0\]"):
        pf.run(p["dq"], p["dkn"], p["dv"], cache=p["cache"], block_table=bad, check=True)


def test_device_argument_errors(rng):
    import cupy as cp

    from cukv.ops.mla_prefill import BatchMLAPrefill

    p = make_problem(rng, [8], [0], 2, None)
    pf = BatchMLAPrefill(2, None).plan(p["q_offsets"], p["kv_lengths"], kv_offsets=p["kv_offsets"])
    with pytest.raises(ValueError, match="q has width 128"):
        pf.run(p["dq"][:, :, :128], p["dkn"], p["dv"], k_rope=p["dkr"])
    with pytest.raises(ValueError, match="v has 1 heads"):
        pf.run(p["dq"], p["dkn"], p["dv"][:, :1], k_rope=p["dkr"])
    with pytest.raises(ValueError, match="k_rope is missing"):
        pf.run(p["dq"], p["dkn"], p["dv"])
    with pytest.raises(TypeError, match="q is float16"):
        pf.run(cp.zeros(p["dq"].shape, cp.float16), p["dkn"], p["dv"], k_rope=p["dkr"])


# ---- the full grid

@pytest.mark.slow
@pytest.mark.parametrize("q_len", [1, 17, 128, 1000, 4099])
@pytest.mark.parametrize("prefix", [0, 5, 3000])
@pytest.mark.parametrize("heads", [1, 16, 32, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64, 48])
def test_grid(rng, q_len, prefix, heads, page_size):
    run_case(rng, [q_len, 17], [prefix, 5], heads, page_size, sink=heads == 16)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_grid_rope_sources(rng, cache_dtype, mask):
    run_case(rng, [4099, 1000, 1], [3000, 0, 5], 16, 64, cache_dtype=cache_dtype, mask=mask)
