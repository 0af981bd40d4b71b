"""Sparse MLA (DeepSeek-V3.2 / GLM-5 DSA, the seed's ``MLAPrefillSparse``): absorbed MLA attention (576 / 512, V =
the first 512 columns of each row) where every query token has its own top-k list of cache rows.

``q[T, H, 576]`` attends, for token ``t``, to the cache rows ``indices[t, j]`` (each ``page * page_size +
offset``, a row of the cache viewed as ``[num_pages * page_size]`` rows). Key ``j`` is valid when ``0 <= idx <
num_rows`` and ``j < topk_lengths[t]``; anything else is skipped and never read. Returns ``out[T, H, 512]``,
``lse[T, H]`` (natural log, without the sink) and ``max_logits[T, H]`` (the largest ``q . k * softmax_scale`` over
valid keys); a token with no valid key gets 0, -inf and -inf.

The kernel is the absorbed MLA decode's (templates/mla_decode*.cuh, with ``SPARSE``): one "sequence" per query
token whose heads fill the 64-row blocks, the producer reading each key's row number from ``indices`` and
publishing which rows of a tile are real, the consumers masking the others. Long lists are split over the SMs as
the decode splits long sequences (:func:`cukv.policy.mla_decode.plan_items`), and a combine kernel merges them.
"""
from __future__ import annotations

import math

import numpy as np

from ..configs.mla_decode import BLOCK_M, BLOCK_NS, DIM, NARROW_ROWS, NOPE, PARAMS, check_row_block_pairs
from ..device import check_same_device, current_device, sm_count
from ..mla_cache import MLAKVCache
from ..operand import as_kernel_arg, ptr
from ..policy.mla_decode import plan_items, sparse_mla_config
from ..validate import (check_bool, check_choice, check_device_array, check_float, check_int, check_per_head,
                        check_planned, check_sparse_indices, mla_dtypes)
from .mla_decode import combine_list, launch_combine

MAX_HEADS = 128
MAX_TOPK = 1 << 20
FLOAT16 = ("bfloat16", "float16")


def _as_cache(kv) -> MLAKVCache:
    """An :class:`MLAKVCache`, or a contiguous-row array ``[N, 576]`` (16-bit) / ``[N, 656]`` (uint8, FP8) viewed
    as one page of N rows."""
    if isinstance(kv, MLAKVCache):
        return kv
    a = check_device_array("kv", kv, ndim=2)
    return MLAKVCache.from_arrays(a[None])


def plan_work(num_tokens: int, topk: int, row_blocks: int, block_n: int, num_sms: int,
              chunk_tiles: int | None = None):
    """The host side of :meth:`SparseMLA.plan`: every token's list of ``topk`` keys cut into chunks as the MLA decode
    cuts a sequence (:func:`~cukv.policy.mla_decode.plan_items`). Returns ``items[n, 8]`` int32 (token, row block,
    first key, end key, partial slot or -1), ``rb_indptr[num_tokens * row_blocks + 1]`` and ``rb_slots`` int32 (the
    partial slots of each split (token, row block), numbered 0.. in a compact range), and the chunk length in tiles.

    Examples
    --------
    >>> from cukv.ops.sparse_mla import plan_work
    >>> items, indptr, slots, c = plan_work(num_tokens=2, topk=2048, row_blocks=1, block_n=64, num_sms=132)
    >>> c, len(items), len(slots), items[0, :5].tolist()      # 2 lists of 32 tiles over 132 SMs: split
    (1, 64, 64, [0, 0, 0, 64, 0])
    >>> plan_work(num_tokens=4096, topk=2048, row_blocks=2, block_n=64, num_sms=132)[2].size   # prefill: none
    0
    """
    if chunk_tiles is None and num_tokens * row_blocks >= 2 * num_sms:
        # whole lists, as plan_items would choose (its chunks hold at least total / (2 SMs) tiles, here a whole
        # list's), without its search over chunk lengths (half the host time of a long prefill's plan)
        chunk_tiles = -(-topk // block_n)
    items, chunk = plan_items(np.full(num_tokens, topk), row_blocks, block_n, num_sms, chunk_tiles)
    host = np.zeros((len(items), 8), np.int32)
    per_rb = {}
    n_parts = 0
    for i, (b, rb, begin, end, n_chunks) in enumerate(items):
        part = -1
        if n_chunks > 1:
            part, n_parts = n_parts, n_parts + 1
            per_rb.setdefault(b * row_blocks + rb, []).append(part)
        host[i, :5] = (b, rb, begin, end, part)
    counts = np.zeros(num_tokens * row_blocks, np.int64)
    for k, v in per_rb.items():
        counts[k] = len(v)
    indptr = np.zeros(num_tokens * row_blocks + 1, np.int32)
    indptr[1:] = np.cumsum(counts)
    slots = np.array([p for k in sorted(per_rb) for p in per_rb[k]], np.int32)
    return host, indptr, slots, chunk


class SparseMLA:
    """Sparse MLA over a cache (plan/run; :meth:`run` launches only, so it can be captured in a CUDA graph).

    Parameters
    ----------
    num_heads : int
        Query heads, 1..128 (a token's heads are the rows of one or two 64-row blocks).
    dtype : {'bfloat16', 'float16'}
        Query, output and (16-bit) cache element type.
    kv_dtype : {None, 'fp8_e4m3'}
        None for 16-bit rows of ``dtype``; 'fp8_e4m3' for 656-byte FP8 rows, dequantized on chip (``dtype`` must be
        bfloat16).
    block_n, num_kv_stages : int, optional
        Keys per tile (32 or 64) and ring depth; None takes the MLA decode policy's defaults.
    schedule : {None, 'split', 'narrow', 'alternate'}
        The consumers: 'split' (64-row blocks), 'narrow' (up to 32 heads in one 16- or 32-row block, the tile's
        tokens as the wgmma M) or 'alternate' (16-bit rows, 64-row blocks: each warpgroup scores every other tile,
        over per-slice barriers, each slice gathered as it frees); None takes the policy's: 'narrow' up to 32 heads
        (docs/mla.md, "Schedules").
    multicast : bool, optional
        A token's two row blocks (128 heads) run as a cluster pair: with FP8 rows and 'split', each dequantizing half of
        every tile into both (docs/mla.md, "Cluster pairs"); with 'alternate', each gathering half of every slice and
        forwarding it into the other. None takes the policy's (:data:`cukv.policy.mla_decode.SPARSE_MULTICAST`,
        :data:`~cukv.policy.mla_decode.SPARSE_SLICES_MULTICAST`: both off, measured slower or level).
    persistent : bool, optional
        With 'alternate' (and no cluster pair): one block per SM, each taking every grid-th work item, the next
        item's query block and first slices gathered while the last one ends. None takes
        :data:`cukv.policy.mla_decode.SPARSE_PERSISTENT`.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> kv = rng.standard_normal((300, 576)).astype(np.float16)          # contiguous rows (or an MLAKVCache)
    >>> q = rng.standard_normal((5, 16, 576)).astype(np.float16)
    >>> idx = rng.integers(-20, 320, (5, 128)).astype(np.int32)          # -1 .. and >= 300: skipped
    >>> att = cukv.SparseMLA(num_heads=16, dtype="float16").plan(num_tokens=5, topk=128)
    >>> out, lse, max_logits = att.run(cp.asarray(q), cp.asarray(kv), cp.asarray(idx))
    >>> want, want_lse, want_max = reference.sparse_mla(q, kv, idx)
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    >>> bool(np.allclose(max_logits.get(), want_max, atol=2e-3, rtol=2e-3))
    True
    """

    def __init__(self, num_heads: int, dtype="bfloat16", *, kv_dtype=None, block_n: int | None = None,
                 num_kv_stages: int | None = None, schedule: str | None = None, multicast: bool | None = None,
                 persistent: bool | None = None):
        self.num_heads = check_int("num_heads", num_heads, 1, MAX_HEADS)
        block_n = check_choice("block_n", block_n, (None,) + BLOCK_NS)
        num_kv_stages = check_int("num_kv_stages", num_kv_stages, 2, 8, none_ok=True, note="the default")
        schedule = check_choice("schedule", schedule, (None, "split", "narrow", "alternate"))
        dt, kvd = mla_dtypes(dtype, kv_dtype)
        if schedule == "narrow" and (self.num_heads > NARROW_ROWS[-1] or block_n not in (None, 64)):
            raise ValueError(f"schedule='narrow' serves at most {NARROW_ROWS[-1]} heads with block_n 64; got "
                             f"num_heads={self.num_heads}, block_n={block_n!r} (use schedule='split' or None)")
        if schedule == "alternate" and (kvd is not None or block_n not in (None, 64)):
            raise ValueError(f"schedule='alternate' gathers 16-bit rows into 64-token tiles; got kv_dtype={kvd!r}, "
                             f"block_n={block_n!r} (use kv_dtype=None and block_n None or 64, or schedule 'split' or "
                             "None)")
        multicast = check_bool("multicast", multicast) if multicast is not None else None
        persistent = check_bool("persistent", persistent) if persistent is not None else None
        self.config = sparse_mla_config(dt, kvd, block_n, num_kv_stages, self.num_heads, schedule, multicast,
                                        persistent)
        if persistent and not self.config.persistent:
            raise ValueError(f"persistent=True runs the per-slice gathers (schedule='alternate': 16-bit rows, 64-token "
                             f"tiles) without the cluster pair; this SparseMLA compiles {self.config.name} (pass "
                             "schedule='alternate' and multicast=False, or persistent=None)")
        check_row_block_pairs(self.config, -(-self.num_heads // BLOCK_M), f"num_heads={self.num_heads} makes")
        self.dtype = dt
        self._planned = False
        self._device = None

    def plan(self, num_tokens: int, topk: int, *, chunk_tiles: int | None = None) -> "SparseMLA":
        """Fix the work list for ``num_tokens`` query tokens of ``topk`` keys each (shapes only: the same plan
        serves every call of these shapes). Compiles the kernel (or loads it from the disk cache)."""
        import cupy as cp

        t_n = check_int("num_tokens", num_tokens, 1, 2 ** 31 - 1)
        topk = check_int("topk", topk, 1, MAX_TOPK)
        chunk_tiles = check_int("chunk_tiles", chunk_tiles, 1, none_ok=True, note="the plan's choice")
        bn = self.config.block_n
        nrb = -(-self.num_heads // BLOCK_M)
        host, indptr, slots, self.chunk_tiles = plan_work(t_n, topk, nrb, bn, sm_count(), chunk_tiles)
        n_parts = len(slots)
        self._items = cp.asarray(host)
        comb = combine_list(indptr)
        self._num_items = cp.asarray(np.array([len(host), len(comb)], np.int32))
        self._rb_indptr = cp.asarray(indptr) if n_parts else None
        self._rb_slots = cp.asarray(slots) if n_parts else None
        self._comb_rbs = cp.asarray(comb) if n_parts else None
        self._part_o = cp.empty((n_parts, BLOCK_M, NOPE), cp.float32) if n_parts else None
        self._part_lse = cp.empty((n_parts, BLOCK_M), cp.float32) if n_parts else None
        self._part_max = cp.empty((n_parts, BLOCK_M), cp.float32) if n_parts else None
        self.num_tokens, self.topk, self.row_blocks = t_n, topk, nrb
        self.num_items, self.num_parts, self.combine_row_blocks = len(host), n_parts, len(comb)
        # persistent blocks: one per SM, each taking every grid-th item
        self._grid = min(self.num_items, sm_count()) if self.config.persistent else self.num_items
        mod = self.config.compiled
        self._fn = mod.function(self.config.name, self.config.smem_bytes)
        self._combine = mod.function(self.config.name + "_combine")
        self._planned, self._device = True, current_device()
        return self

    def run(self, q, kv, indices, *, topk_lengths=None, sink=None, softmax_scale: float | None = None,
            indices_stride: int | None = None, out=None, lse=None, max_logits=None, stream=None, _lengths_div=1):
        """Attend the planned tokens' queries ``q[T, H, 576]`` to their key lists. ``kv``: an
        :class:`~cukv.MLAKVCache` or a ``[N, 576]`` (16-bit) / ``[N, 656]`` (uint8 FP8 rows) array. ``indices``:
        int32 or uint32 ``[T, >= topk]`` (the first ``topk`` entries of each row are read; a column slice of a wider
        buffer works in place), or any dense buffer with ``indices_stride`` elements between tokens.
        ``topk_lengths[T]`` int32: each list's valid prefix (values past topk read as topk). ``sink[H]`` float32
        logits join the denominator (not scaled). ``softmax_scale`` defaults to ``1/sqrt(576)``. Pass ``out``,
        ``lse`` and ``max_logits`` to capture the call in a CUDA graph. Returns ``(out, lse, max_logits)``."""
        import cupy as cp

        scale = check_float("softmax_scale", softmax_scale, positive=True, none_ok=True, note="1/sqrt(576)")
        check_planned(self, "plan(num_tokens, topk)")
        check_same_device("SparseMLA", self._device)
        cache = _as_cache(kv)
        if cache.quantized != (self.config.kv_dtype is not None):
            raise TypeError(f"kv holds {cache.dtype} rows; this SparseMLA was built for "
                            f"{self.config.kv_dtype or self.dtype} (pass kv_dtype='fp8_e4m3' for FP8 rows)")
        if not cache.quantized and cache.dtype != self.dtype:
            raise TypeError(f"kv holds {cache.dtype}; this SparseMLA was built for {self.dtype}")
        t_n, h = self.num_tokens, self.num_heads
        qa, dt = check_device_array("q", q, dtypes=FLOAT16, shape=(t_n, h, DIM), unit_last_stride=True)
        if dt != self.dtype:
            raise TypeError(f"q is {dt}; this SparseMLA was built for {self.dtype}")
        if int(qa.data.ptr) % 16 or any(s % 16 for s in qa.strides[:2]):
            raise ValueError(f"q must start on a 16-byte boundary with 16-byte multiple strides; address "
                             f"{int(qa.data.ptr):#x}, strides {qa.strides}")
        idx, _, stride = check_sparse_indices(indices, t_n, self.topk, indices_stride)
        if topk_lengths is not None:
            topk_lengths = check_device_array("topk_lengths", topk_lengths, dtypes=(np.int32,),
                                              shape=(t_n // _lengths_div,), contiguous=True, align=4)
        sink = check_per_head("sink", sink, h)
        if out is None:
            out = cp.empty((t_n, h, NOPE), qa.dtype)
        else:
            out = check_device_array("out", out, dtypes=(qa.dtype,), shape=(t_n, h, NOPE), contiguous=True, align=16)
        if lse is None:
            lse = cp.empty((t_n, h), cp.float32)
        else:
            lse = check_device_array("lse", lse, dtypes=(np.float32,), shape=(t_n, h), contiguous=True, align=4)
        if max_logits is None:
            max_logits = cp.empty((t_n, h), cp.float32)
        else:
            max_logits = check_device_array("max_logits", max_logits, dtypes=(np.float32,), shape=(t_n, h),
                                            contiguous=True, align=4)
        scale = 1.0 / math.sqrt(DIM) if scale is None else scale

        rec = np.zeros((), PARAMS)
        q_stride = [qa.strides[0] // 2, 0, qa.strides[1] // 2]
        rec["q_nope"], rec["q_pe"] = int(qa.data.ptr), int(qa.data.ptr) + 2 * NOPE
        rec["q_nope_stride"], rec["q_pe_stride"] = q_stride, q_stride
        rec["out"], rec["lse"], rec["max_logits"] = ptr(out), ptr(lse), ptr(max_logits)
        rec["part_o"], rec["part_lse"], rec["part_max"] = ptr(self._part_o), ptr(self._part_lse), ptr(self._part_max)
        rec["sink"] = ptr(sink)
        rec["cache"], rec["page_stride"], rec["row_stride"] = cache.ptr, cache.page_stride, cache.row_stride
        rec["num_pages"], rec["page_size"] = cache.num_pages, cache.page_size
        rec["num_rows"] = min(cache.num_pages * cache.page_size, 2 ** 31 - 1)
        rec["items"], rec["num_items"] = ptr(self._items), ptr(self._num_items)
        rec["rb_indptr"], rec["rb_slots"] = ptr(self._rb_indptr), ptr(self._rb_slots)
        rec["comb_rbs"] = ptr(self._comb_rbs)
        rec["batch"], rec["s_q"], rec["heads"], rec["rows"] = t_n, 1, h, h
        rec["row_blocks"], rec["scale_log2"] = self.row_blocks, scale * math.log2(math.e)
        rec["indices"], rec["indices_stride"], rec["topk"] = ptr(idx), stride, self.topk
        rec["topk_lengths"], rec["lengths_div"] = ptr(topk_lengths), _lengths_div
        arg = as_kernel_arg(rec)
        with (stream or cp.cuda.get_current_stream()):
            self._fn((self._grid,), (self.config.num_threads,), (arg,), shared_mem=self.config.smem_bytes)
            launch_combine(self._combine, arg, self.combine_row_blocks, h)  # (the plan is the shapes': fixed)
        return out, lse, max_logits


def _kv_dtype(cache_or_rows) -> str | None:
    c = _as_cache(cache_or_rows)
    return "fp8_e4m3" if c.quantized else None


def sparse_mla_prefill(q, kv, indices, *, topk_lengths=None, sink=None, softmax_scale: float | None = None,
                       indices_stride: int | None = None, topk: int | None = None):
    """One-shot sparse MLA over ``q[T, H, 576]``: plan and run (keep a :class:`SparseMLA` to reuse the plan).
    ``topk`` defaults to the list width (``indices.shape[1]``, or ``indices_stride``). Returns ``(out[T, H, 512],
    lse[T, H], max_logits[T, H])``; see :meth:`SparseMLA.run` for the arguments.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(1)
    >>> cache = cukv.MLAKVCache(num_pages=4, page_size=64, dtype="float16", fill="nan")   # NaN: unused rows
    >>> rows = rng.standard_normal((200, 576)).astype(np.float16)
    >>> cukv.append_mla(cache, cp.asarray(rows[:, :512]), cp.asarray(rows[:, 512:]), cp.arange(200))
    >>> idx = rng.integers(0, 200, (3, 64)).astype(np.int32)
    >>> idx[1, 10:] = -1                                      # token 1 sees its first 10 keys only
    >>> q = rng.standard_normal((3, 8, 576)).astype(np.float16)
    >>> out, lse, mx = cukv.sparse_mla_prefill(cp.asarray(q), cache, cp.asarray(idx))
    >>> want, _, _ = reference.sparse_mla(q, cache.data.get().reshape(-1, 576), idx)
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    """
    qa, dt = check_device_array("q", q, dtypes=FLOAT16, shape=(None, None, DIM))
    idx, topk, _ = check_sparse_indices(indices, qa.shape[0], topk, indices_stride)
    att = SparseMLA(qa.shape[1], dt, kv_dtype=_kv_dtype(kv)).plan(qa.shape[0], topk)
    return att.run(q, kv, indices, topk_lengths=topk_lengths, sink=sink, softmax_scale=softmax_scale,
                   indices_stride=indices_stride)


def sparse_mla_decode(q, cache, indices, *, topk_lengths=None, sink=None, softmax_scale: float | None = None):
    """Sparse MLA decode: ``q[B, s_q, H, 576]`` over ``cache`` with ``indices[B, s_q, topk]`` (int32 or uint32);
    ``topk_lengths`` int32 ``[B, s_q]`` (per token) or ``[B]`` (per request, shared by its ``s_q`` tokens).
    Returns ``(out[B, s_q, H, 512], lse[B, s_q, H], max_logits[B, s_q, H])``. The tokens are planned as a sparse
    prefill of ``B * s_q`` tokens (long lists split over the SMs); keep a :class:`SparseMLA` planned for ``B *
    s_q`` tokens and pass the flattened arrays to capture it in a CUDA graph.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.dtypes import from_storage, to_storage
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.MLAKVCache(num_pages=8, page_size=64, dtype="bfloat16")
    >>> rows = to_storage(rng.standard_normal((512, 576)), "bfloat16")              # bf16 bits on the host
    >>> cukv.append_mla(cache, cp.asarray(rows[:, :512]), cp.asarray(rows[:, 512:]), cp.arange(512))
    >>> table = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)      # two requests of 256 tokens
    >>> pos = rng.integers(0, 256, (2, 2, 128))                       # an indexer's picks [B, s_q, topk]
    >>> idx = cukv.sparse_indices(pos, table, page_size=64)           # -> page * 64 + offset
    >>> q = to_storage(rng.standard_normal((2, 2, 16, 576)), "bfloat16")
    >>> lens = cp.asarray([128, 50], np.int32)                         # per request: request 1 reads 50 keys
    >>> out, lse, mx = cukv.sparse_mla_decode(cp.asarray(q), cache, cp.asarray(idx), topk_lengths=lens)
    >>> out.shape, lse.shape, mx.shape
    ((2, 2, 16, 512), (2, 2, 16), (2, 2, 16))
    >>> want, _, _ = reference.sparse_mla(from_storage(q, "bfloat16").reshape(4, 16, 576),
    ...                                   from_storage(cache.data.get(), "bfloat16").reshape(-1, 576),
    ...                                   idx.reshape(4, 128), [128, 128, 50, 50])
    >>> assert_close(from_storage(out.get(), "bfloat16").reshape(4, 16, 512), want, "bfloat16") < 0.01
    True
    """
    qa, dt = check_device_array("q", q, dtypes=FLOAT16, shape=(None, None, None, DIM))
    b, s_q, h = qa.shape[:3]
    ia = check_device_array("indices", indices, dtypes=(np.int32, np.uint32), shape=(b, s_q, None))
    div = 1
    if topk_lengths is not None:
        la = check_device_array("topk_lengths", topk_lengths, dtypes=(np.int32,), contiguous=True)
        if la.shape == (b,):
            div = s_q
        elif la.shape != (b, s_q):
            raise ValueError(f"topk_lengths has shape {tuple(la.shape)}; expected [{b}, {s_q}] or [{b}]")
        topk_lengths = la.reshape(-1)
    att = SparseMLA(h, dt, kv_dtype=_kv_dtype(cache)).plan(b * s_q, ia.shape[2])
    out, lse, mx = att.run(qa.reshape(b * s_q, h, DIM), cache, ia.reshape(b * s_q, ia.shape[2]),
                           topk_lengths=topk_lengths, sink=sink, softmax_scale=softmax_scale, _lengths_div=div)
    return out.reshape(b, s_q, h, NOPE), lse.reshape(b, s_q, h), mx.reshape(b, s_q, h)


def sparse_indices(positions, block_table, page_size: int, request=None):
    """Per-request token positions -> sparse MLA row numbers ``page * page_size + offset`` through a page table.
    ``positions[..., topk]`` integer token positions (negative: invalid), ``block_table[B, max_pages]`` int32;
    ``request`` gives each list's row of the table (an integer array of ``positions.shape[:-1]``); None reads
    ``positions`` as ``[B, ..., topk]`` (the leading axis is the request). A negative position, one past the
    table's width, or a negative page id gives -1 (skipped by the kernel). Works on NumPy or CuPy arrays; returns
    int32 of ``positions``' shape.

    Examples
    --------
    >>> import numpy as np
    >>> from cukv.ops.sparse_mla import sparse_indices
    >>> table = np.array([[7, 2], [5, -1]], np.int32)
    >>> sparse_indices(np.array([[0, 17, -1], [3, 20, 40]]), table, page_size=16).tolist()
    [[112, 33, -1], [83, -1, -1]]
    """
    import cupy as cp

    page_size = check_int("page_size", page_size, 1)
    xp = cp.get_array_module(positions)
    pos = xp.asarray(positions).astype(xp.int64)
    table = xp.asarray(block_table)
    if table.ndim != 2:
        raise ValueError(f"block_table has shape {tuple(table.shape)}; expected [B, max_pages]")
    if request is None:
        if pos.ndim < 2 or pos.shape[0] > table.shape[0]:
            raise ValueError(f"positions has shape {tuple(pos.shape)}; with request=None it must be [B, ..., topk] "
                             f"with B <= {table.shape[0]} (block_table's rows)")
        req = xp.arange(pos.shape[0]).reshape((-1,) + (1,) * (pos.ndim - 1))
    else:
        req = xp.asarray(request).astype(xp.int64)
        if req.shape != pos.shape[:-1]:
            raise ValueError(f"request has shape {tuple(req.shape)}; expected positions.shape[:-1] = "
                             f"{tuple(pos.shape[:-1])}")
        req = req[..., None]
    pi = pos // page_size
    ok = (pos >= 0) & (pi < table.shape[1])
    page = table[xp.broadcast_to(req, pos.shape), xp.where(ok, pi, 0)].astype(xp.int64)
    ok &= page >= 0
    return xp.where(ok, page * page_size + pos % page_size, -1).astype(xp.int32)
