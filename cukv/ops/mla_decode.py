"""Absorbed MLA decode (DeepSeek-V2/V3, Kimi K2, GLM) over the paged latent cache: plan on the host, run on
device buffers only (CUDA-graph capturable).

Every query head attends to the same 576-wide cache rows (512 latent + 64 rope); V is the first 512 columns of
those rows. ``q[B, s_q, H, 576]`` (or ``q_nope[..., 512]`` + ``q_pe[..., 64]``) -> ``out[B, s_q, H, 512]`` and
``lse[B, s_q, H]`` (float32, natural log, without the sink). Query ``i`` of ``s_q`` sees keys
``< len - (s_q - 1 - i)``.

:meth:`BatchMLADecode.plan` cuts every sequence into chunks of whole K tiles and orders the chunks longest
first, choosing the chunk length whose greedy schedule over the SMs finishes first (uneven batches included);
chunks of a split sequence write float32 partials that one combine kernel merges by LSE.
"""
from __future__ import annotations

import math

import numpy as np

from ..configs.mla_decode import (BLOCK_M, BLOCK_NS, COMBINE_THREADS, DIM, FP8_ROWS_REGS, NARROW_ROWS, NOPE, PARAMS,
                                  PREFETCH_TILES, ROPE, SCHEDULES, check_row_block_pairs, tma_box_rows)
from ..device import check_same_device, current_device, sm_count
from ..mla_cache import MLAKVCache
from ..operand import as_kernel_arg, ptr
from ..policy.mla_decode import COMBINE_BLOCKS_PER_SM, mla_decode_config, plan_items
from ..validate import (check_bool, check_choice, check_device_array, check_float, check_int, check_per_head, check_planned,
                        check_table, checked, host_ints, mla_dtypes)

MAX_S_Q = 8
MAX_HEADS = 128
MAX_SEQ_LEN = 2 ** 31 - 2 ** 20  # token offsets stay int32 in the kernel, with room for a chunk's end
FLOAT16 = ("bfloat16", "float16")


class BatchMLADecode:
    """Absorbed MLA decode over an :class:`~cukv.MLAKVCache` (FlashInfer-style plan/run).

    Parameters
    ----------
    num_heads : int
        Query heads, 1..128 (heads and the ``s_q`` new tokens fold into 64-row blocks).
    dtype : {'bfloat16', 'float16'}
        Query, output and (16-bit) cache element type.
    kv_dtype : {None, 'fp8_e4m3'}
        None for a 16-bit cache of ``dtype``; 'fp8_e4m3' for 656-byte FP8 rows (``dtype`` must be bfloat16), which
        the producer dequantizes into bf16 tiles in shared memory (docs/mla.md, "FP8").
    block_n, num_kv_stages : int, optional
        Tile length (32 or 64 tokens) and ring depth (2..8); None takes :mod:`cukv.policy.mla_decode`'s defaults
        (see :class:`~cukv.configs.mla_decode.MLADecodeConfig`).
    schedule : {None, 'split', 'alternate', 'narrow'}
        How the two consumer warpgroups share the K tiles: 'split' halves every tile, 'alternate' gives each every
        other tile whole (16-bit caches only), 'narrow' does too for a batch of at most 32 query rows
        (``s_q * num_heads``) in one 16- or 32-row block, the tile's tokens as the wgmma M (block_n 64); None
        takes the policy's default, which ``plan`` decides from ``s_q`` (docs/mla.md, "Schedules").
    slice_release : bool, optional
        A full and an empty barrier per 64-column slice of each ring stage, so each slice is refilled as soon as its
        last reader is done (schedule 'alternate' with TMA; None or True with schedule None picks 'alternate');
        None takes the policy's default: on from 128 heads (docs/mla.md, "Schedules").
    multicast : bool, optional
        Each chunk's two row blocks run as a cluster pair (an even count of 64-row blocks, ``s_q * num_heads /
        64``): with ``slice_release`` the pair copies every full tile once and multicasts it to both; with an FP8
        cache (schedule 'split', ``fp8_rows`` 8) each block dequantizes half of every tile and copies it into the
        other's. None takes the policy's default (:data:`cukv.policy.mla_decode.DEFAULT_MULTICAST`, for chunks of
        at least :data:`~cukv.policy.mla_decode.MULTICAST_MIN_TILES` tiles).
    persistent : bool, optional
        With ``slice_release``: one block per SM, each taking every grid-th work item, the ring and the next item's
        query block loading across items. None takes :data:`cukv.policy.mla_decode.DEFAULT_PERSISTENT`.
    prefetch_tiles, fp8_rows : int, optional
        The producer's L2 prefetch distance in tiles (0..4) and, for an FP8 cache, the rows each producer lane
        loads before dequantizing them (8 or 16, 16 with block_n 64 only); None takes the policy's defaults for
        the cache (:mod:`cukv.policy.mla_decode`).

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.dtypes import from_storage, to_storage
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> def bf16(*shape): return to_storage(rng.standard_normal(shape), "bfloat16")    # bf16 bits on the host
    >>> cache = cukv.MLAKVCache(num_pages=24, page_size=64, dtype="bfloat16", fill="nan")   # NaN: never read
    >>> table = np.arange(24, dtype=np.int32).reshape(2, 12)          # block_table[B, max_pages]
    >>> lens = [700, 37]
    >>> slots = np.concatenate([np.arange(700), 12 * 64 + np.arange(37)])
    >>> rows = bf16(737, 576)
    >>> cukv.append_mla(cache, cp.asarray(rows[:, :512]), cp.asarray(rows[:, 512:]), cp.asarray(slots))
    >>> dec = cukv.BatchMLADecode(num_heads=16).plan(lens, s_q=1)     # host plan, once per batch
    >>> q = bf16(2, 1, 16, 576)
    >>> out, lse = dec.run(cp.asarray(q), cache, cp.asarray(table), return_lse=True)
    >>> out.shape, lse.shape
    ((2, 1, 16, 512), (2, 1, 16))
    >>> pages = from_storage(cache.data.get(), "bfloat16")
    >>> want, want_lse = reference.mla_decode(from_storage(q, "bfloat16"), pages, table, lens)
    >>> assert_close(from_storage(out.get(), "bfloat16"), want, "bfloat16") < 0.01
    True
    >>> assert_close(lse.get(), want_lse, "float32", atol=2e-3, rtol=2e-3) < 0.01
    True
    """

    def __init__(self, num_heads: int, dtype="bfloat16", *, kv_dtype=None, block_n: int | None = None,
                 num_kv_stages: int | None = None, schedule: str | None = None, tma: bool | None = None,
                 prefetch_tiles: int | None = None, fp8_rows: int | None = None, slice_release: bool | None = None,
                 multicast: bool | None = None, persistent: bool | None = None):
        self.num_heads = check_int("num_heads", num_heads, 1, MAX_HEADS)
        block_n = check_choice("block_n", block_n, (None,) + BLOCK_NS)
        num_kv_stages = check_int("num_kv_stages", num_kv_stages, 2, 8, none_ok=True, note="the default")
        schedule = check_choice("schedule", schedule, (None,) + SCHEDULES)
        tma = check_bool("tma", tma) if tma is not None else None
        slice_release = check_bool("slice_release", slice_release) if slice_release is not None else None
        multicast = check_bool("multicast", multicast) if multicast is not None else None
        persistent = check_bool("persistent", persistent) if persistent is not None else None
        prefetch_tiles = check_choice("prefetch_tiles", prefetch_tiles, (None,) + PREFETCH_TILES)
        fp8_rows = check_choice("fp8_rows", fp8_rows, (None,) + tuple(FP8_ROWS_REGS))
        dt, kvd = mla_dtypes(dtype, kv_dtype)
        if kvd is not None and schedule == "alternate":
            raise ValueError("schedule='alternate' is not offered with kv_dtype='fp8_e4m3' (its consumers would "
                             "spill); use schedule='split' or None")
        if kvd is not None and tma:
            raise ValueError("tma=True is not offered with kv_dtype='fp8_e4m3' (the producer dequantizes FP8 rows "
                             "itself); use tma=None or False")
        if kvd is None and fp8_rows not in (None, 8):
            raise ValueError(f"fp8_rows={fp8_rows!r} applies to an FP8 cache only (kv_dtype='fp8_e4m3'); "
                             "use None or 8 with a 16-bit cache")
        if schedule == "narrow" and (self.num_heads > NARROW_ROWS[-1] or block_n not in (None, 64)
                                     or slice_release):
            raise ValueError(f"schedule='narrow' serves at most {NARROW_ROWS[-1]} query rows (s_q * num_heads) with "
                             f"block_n 64 and no slice_release; got num_heads={self.num_heads}, block_n={block_n!r}, "
                             f"slice_release={slice_release!r}")
        if slice_release and (kvd is not None or schedule in ("split", "narrow") or tma is False or prefetch_tiles):
            raise ValueError(f"slice_release=True needs the alternating schedule over tensor copies of a 16-bit cache; "
                             f"got kv_dtype={kvd!r}, schedule={schedule!r}, tma={tma!r}, "
                             f"prefetch_tiles={prefetch_tiles!r} (use kv_dtype=None, schedule None or 'alternate', "
                             "tma None or True, prefetch_tiles None or 0)")
        if multicast and slice_release is False and kvd is None:
            raise ValueError("multicast=True shares the per-slice ring's copies between a cluster pair: use "
                             "slice_release None or True, or multicast None or False")
        self._choices = (dt, kvd, block_n, num_kv_stages, schedule, tma, prefetch_tiles, fp8_rows, slice_release,
                         self.num_heads)
        self._multicast, self._persistent = multicast, persistent
        self.config = mla_decode_config(*self._choices, rows=self.num_heads,  # plan() decides again from s_q
                                        multicast=multicast, persistent=persistent)
        self._derived = self.config
        self.dtype = self.config.dtype
        self._planned = False
        self._device = None
        self._cap = 0

    def plan(self, seq_lens, s_q: int = 1, *, chunk_tiles: int | None = None) -> "BatchMLADecode":
        """Fix the work list for sequences of ``seq_lens[B]`` cached tokens (host ints, or a device array that
        is copied to the host once here; the new tokens are included) and ``s_q`` new tokens each (1..8).
        Call again with new lengths before replaying a captured :meth:`run`: buffers are reused while the
        batch and ``s_q`` stay the same. Compiles the kernel (or loads it from the disk cache)."""
        import cupy as cp

        s_q = check_int("s_q", s_q, 1, MAX_S_Q)
        chunk_tiles = check_int("chunk_tiles", chunk_tiles, 1, none_ok=True, note="the plan's choice")
        lens = host_ints("seq_lens", seq_lens, ndim=1)
        if lens.size == 0:
            raise ValueError("seq_lens is empty; plan at least one sequence")
        if (lens < 0).any() or (lens > MAX_SEQ_LEN).any():
            i = int(np.argmax((lens < 0) | (lens > MAX_SEQ_LEN)))
            raise ValueError(f"seq_lens[{i}]={lens[i]} must be in 0..{MAX_SEQ_LEN}")
        b = int(lens.size)
        rows = s_q * self.num_heads
        # the policy's config for these rows; a config set by hand (a probe's) stays, and so does the current instance
        # (with the module it compiled) while the choice is the same
        by_hand = self.config is not self._derived
        nrb = -(-rows // BLOCK_M)
        sms = sm_count()
        # (block_n is the constructor's choice: the same for every s_q and either form of the pairs)
        items, self.chunk_tiles = plan_items(lens, nrb, self.config.block_n, sms, chunk_tiles)
        cfg = self.config if by_hand else mla_decode_config(*self._choices, rows=rows, multicast=self._multicast,
                                                             chunk_tiles=self.chunk_tiles,  # pairs by chunk length
                                                             persistent=self._persistent)
        cfg = self.config if cfg == self.config else cfg
        if cfg.schedule == "narrow" and rows > cfg.block_rows:
            raise ValueError(f"schedule='narrow' serves at most {cfg.block_rows} query rows; s_q={s_q} x "
                             f"num_heads={self.num_heads} = {rows} ({cfg.name}; use schedule None or 'split')")
        check_row_block_pairs(cfg, nrb, f"s_q={s_q} x num_heads={self.num_heads} = {rows} rows make")
        self.config = cfg
        if not by_hand:
            self._derived = cfg
        device = current_device()
        if self._planned and device != self._device:  # a new device: buffers and kernels of its own
            self._cap = 0
        cap = max(2 * sms + b * nrb, len(items))
        cap += cap % 2  # (cluster pairs: an even grid)
        if cap > self._cap or (b, s_q) != (getattr(self, "batch_size", None), getattr(self, "s_q", None)):
            self._cap = cap
            self._items = cp.zeros((cap, 8), cp.int32)
            self._num_items = cp.zeros((2,), cp.int32)
            self._rb_indptr = cp.zeros((b * nrb + 1,), cp.int32)
            self._comb_rbs = cp.zeros((b * nrb, 4), cp.int32)
            self._rb_slots = cp.zeros((cap,), cp.int32)
            self._lens = cp.zeros((b,), cp.int32)
            self._part_o = cp.empty((cap, BLOCK_M, NOPE), cp.float32)
            self._part_lse = cp.empty((cap, BLOCK_M), cp.float32)
        host = np.zeros((self._cap, 8), np.int32)
        per_rb = [[] for _ in range(b * nrb)]
        for idx, (bb, rb, begin, end, n_chunks) in enumerate(items):
            host[idx, :5] = (bb, rb, begin, end, idx if n_chunks > 1 else -1)
            per_rb[bb * nrb + rb].append(idx)
        indptr = np.zeros(b * nrb + 1, np.int32)
        indptr[1:] = np.cumsum([len(x) for x in per_rb])
        slots = np.zeros(self._cap, np.int32)
        slots[:indptr[-1]] = [i for x in per_rb for i in x]
        comb = combine_list(indptr)
        self._items.set(host)
        self._num_items.set(np.array([len(items), len(comb)], np.int32))
        self._rb_indptr.set(indptr)
        self._comb_rbs[:len(comb)].set(comb)
        self._rb_slots.set(slots)
        self._lens.set(lens.astype(np.int32))
        self._host_lens = lens
        self.batch_size, self.s_q, self.row_blocks, self.num_items = b, s_q, nrb, len(items)
        # persistent blocks: one per SM (an even count: cluster pairs), each taking every grid-th item
        self._grid = min(self._cap, sms - sms % 2) if self.config.persistent else self._cap
        self.combine_row_blocks = len(comb)
        self.max_seq_len = int(lens.max())
        mod = self.config.compiled
        self._fn = mod.function(self.config.name, self.config.smem_bytes)
        self._combine = mod.function(self.config.name + "_combine")
        self._planned, self._device = True, device
        return self

    def _queries(self, q, q_nope, q_pe):
        """``([(address, element strides[3]) of the latent part, of the rope part], the query array)``."""
        b, s_q, h = self.batch_size, self.s_q, self.num_heads
        if q is not None:
            if q_nope is not None or q_pe is not None:
                raise ValueError("pass either q or (q_nope, q_pe), not both")
            qa, dt = check_device_array("q", q, dtypes=FLOAT16, shape=(b, s_q, h, DIM), unit_last_stride=True)
            parts, dts = (("q", qa, 0), ("q", qa, NOPE)), (dt,)
        else:
            if q_nope is None or q_pe is None:
                raise ValueError("pass q[B, s_q, H, 576], or both q_nope[B, s_q, H, 512] and q_pe[B, s_q, H, 64]")
            na, dt = check_device_array("q_nope", q_nope, dtypes=FLOAT16, shape=(b, s_q, h, NOPE),
                                        unit_last_stride=True)
            pa, dt_pe = check_device_array("q_pe", q_pe, dtypes=FLOAT16, shape=(b, s_q, h, ROPE),
                                           unit_last_stride=True)
            parts, dts = (("q_nope", na, 0), ("q_pe", pa, 0)), (dt, dt_pe)
        for n, d in zip(("q",) if q is not None else ("q_nope", "q_pe"), dts):
            if d != self.dtype:
                raise TypeError(f"{n} is {d}; this BatchMLADecode was built for {self.dtype}")
        out = []
        for n, a, off in parts:
            addr = int(a.data.ptr) + off * a.itemsize
            if addr % 16 or any(s % 16 for s in a.strides[:3]):
                raise ValueError(f"{n} must start on a 16-byte boundary with 16-byte multiple strides; "
                                 f"address {addr:#x}, strides {a.strides}")
            out.append((addr, [s // a.itemsize for s in a.strides[:3]]))
        return out, parts[0][1]

    def _outputs(self, like, out, lse, return_lse):
        import cupy as cp

        b, s_q, h = self.batch_size, self.s_q, self.num_heads
        shape = (b, s_q, h, NOPE)
        if out is None:
            out = cp.empty(shape, like.dtype)
        else:
            out = check_device_array("out", out, dtypes=(like.dtype,), shape=shape, contiguous=True, align=16)
        if lse is None and return_lse:
            lse = cp.empty((b, s_q, h), cp.float32)
        elif lse is not None:
            lse = check_device_array("lse", lse, dtypes=(np.float32,), shape=(b, s_q, h), contiguous=True, align=4)
        return out, lse

    def run(self, q=None, cache: MLAKVCache | None = None, block_table=None, *, q_nope=None, q_pe=None, out=None,
            lse=None, return_lse: bool = False, softmax_scale: float | None = None, sink=None, stream=None,
            check: bool | None = None):
        """Attend the planned batch's queries to ``cache`` through ``block_table[B, max_pages]`` (int32).
        Returns ``out`` (and ``lse`` when ``return_lse``). ``sink[H]`` float32 logits join the softmax
        denominator (not multiplied by the scale). ``softmax_scale`` defaults to ``1/sqrt(576)`` (DeepSeek passes
        ``192**-0.5 * mscale**2``). Pass ``out``/``lse`` to capture the call in a CUDA graph.

        Table entries are not read on the hot path: a page id outside the cache reads as zeros, which dilutes
        the softmax silently. ``check=True`` (or ``CUKV_CHECK=1``) copies the table's first ``B`` rows to the
        host first (a device sync) and refuses a page id outside the cache among each row's used pages."""
        import cupy as cp

        return_lse, check = check_bool("return_lse", return_lse), checked(check)
        scale = check_float("softmax_scale", softmax_scale, positive=True, none_ok=True, note="1/sqrt(576)")
        check_planned(self, "plan(seq_lens, s_q)")
        check_same_device("BatchMLADecode", self._device)
        if not isinstance(cache, MLAKVCache):
            raise TypeError(f"cache must be an MLAKVCache; got {type(cache).__name__}")
        if cache.quantized != (self.config.kv_dtype is not None):
            raise TypeError(f"cache holds {cache.dtype} rows; this BatchMLADecode was built for "
                            f"{self.config.kv_dtype or self.dtype} (pass kv_dtype='fp8_e4m3' for FP8 rows)")
        if not cache.quantized and cache.dtype != self.dtype:
            raise TypeError(f"cache holds {cache.dtype}; this BatchMLADecode was built for {self.dtype}")
        qs, like = self._queries(q, q_nope, q_pe)
        b, s_q, h = self.batch_size, self.s_q, self.num_heads
        bt = check_device_array("block_table", block_table, dtypes=(np.int32,), ndim=2, unit_last_stride=True)
        if bt.shape[0] < b:
            raise ValueError(f"block_table has {bt.shape[0]} rows; the plan has {b} sequences")
        if bt.shape[1] * cache.page_size < self.max_seq_len:
            raise ValueError(f"block_table has {bt.shape[1]} pages per row ({bt.shape[1] * cache.page_size} tokens "
                             f"of page size {cache.page_size}); the plan's longest sequence is {self.max_seq_len}")
        out, lse = self._outputs(like, out, lse, return_lse)
        sink = check_per_head("sink", sink, h)
        if check:
            check_table(bt[:b].get(), self._host_lens, cache.page_size, cache.num_pages, ("block_table", "seq_lens"))
        scale = 1.0 / math.sqrt(DIM) if scale is None else scale

        rec = np.zeros((), PARAMS)
        rec["q_nope"], rec["q_pe"] = qs[0][0], qs[1][0]
        rec["q_nope_stride"], rec["q_pe_stride"] = qs[0][1], qs[1][1]
        rec["out"], rec["lse"] = ptr(out), ptr(lse)
        rec["part_o"], rec["part_lse"] = ptr(self._part_o), ptr(self._part_lse)
        rec["sink"] = ptr(sink)
        rec["cache"], rec["page_stride"], rec["row_stride"] = cache.ptr, cache.page_stride, cache.row_stride
        rec["num_pages"], rec["page_size"] = cache.num_pages, cache.page_size
        rec["block_table"], rec["table_stride"], rec["table_width"] = ptr(bt), bt.strides[0] // 4, bt.shape[1]
        rec["seq_lens"], rec["items"], rec["num_items"] = ptr(self._lens), ptr(self._items), ptr(self._num_items)
        rec["rb_indptr"], rec["rb_slots"] = ptr(self._rb_indptr), ptr(self._rb_slots)
        rec["comb_rbs"] = ptr(self._comb_rbs)
        rec["batch"], rec["s_q"], rec["heads"], rec["rows"] = b, s_q, h, s_q * h
        rec["row_blocks"], rec["scale_log2"] = self.row_blocks, scale * math.log2(math.e)
        arg = as_kernel_arg(rec)
        args = (arg, _cache_map(cache, self.config.block_n)) if self.config.tma else (arg,)
        stream = stream or cp.cuda.get_current_stream()
        with stream:
            self._fn((self._grid,), (self.config.num_threads,), args, shared_mem=self.config.smem_bytes)
            # a captured launch serves later plans of this batch: it covers every row block
            launch_combine(self._combine, arg, b * self.row_blocks if capturing(stream) else self.combine_row_blocks,
                           s_q * h)
        return (out, lse) if return_lse else out


def mla_decode(q, cache: MLAKVCache, block_table, seq_lens, *, kv_dtype=None, **kwargs):
    """One-shot convenience: plan for these lengths and run (use :class:`BatchMLADecode` in a loop: ``plan``
    costs host work and a device copy). ``q[B, s_q, H, 576]``; ``kwargs`` go to :meth:`BatchMLADecode.run`.

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv
    >>> from cukv import reference
    >>> from cukv.testing import assert_close
    >>> rng = np.random.default_rng(0)
    >>> cache = cukv.MLAKVCache(num_pages=4, page_size=16, dtype="float16", fill="nan")
    >>> rows = rng.standard_normal((50, 576)).astype(np.float16)
    >>> cukv.append_mla(cache, cp.asarray(rows[:, :512]), cp.asarray(rows[:, 512:]), cp.arange(50))
    >>> q = rng.standard_normal((1, 2, 8, 576)).astype(np.float16)    # s_q = 2: bottom-right causal
    >>> out = cukv.mla_decode(cp.asarray(q), cache, cp.asarray([[0, 1, 2, 3]], np.int32), [50])
    >>> want, _ = reference.mla_decode(q, cache.data.get(), np.array([[0, 1, 2, 3]]), [50])
    >>> assert_close(out.get(), want, "float16") < 0.01
    True
    """
    qa, dt = check_device_array("q", q, dtypes=FLOAT16, shape=(None, None, None, DIM))
    if not isinstance(cache, MLAKVCache):
        raise TypeError(f"cache must be an MLAKVCache; got {type(cache).__name__}")
    kvd = kv_dtype if kv_dtype is not None else ("fp8_e4m3" if cache.quantized else None)
    dec = BatchMLADecode(qa.shape[2], dt, kv_dtype=kvd).plan(seq_lens, qa.shape[1])
    return dec.run(q, cache, block_table, **kwargs)


def combine_list(rb_indptr) -> np.ndarray:
    """The row blocks the combine kernel merges: ``[n, 4]`` int32 rows (``sequence * row_blocks + row block``, its
    first entry in ``rb_slots``, its chunks, 0) of the entries of ``rb_indptr`` split into more than one chunk."""
    indptr = np.asarray(rb_indptr, np.int64)
    k = np.flatnonzero(np.diff(indptr) > 1)
    return np.stack([k, indptr[k], indptr[k + 1] - indptr[k], np.zeros_like(k)], axis=1).astype(np.int32)


def capturing(stream) -> bool:
    """Whether ``stream`` is capturing a CUDA graph (a query CUDA refuses, such as the legacy stream's beside a
    global capture, counts as capturing)."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001 (cupy raises its CUDARuntimeError, or a driver error)
        return True


def launch_combine(fn, arg, row_blocks: int, rows: int) -> None:
    """The combine kernel over ``row_blocks`` listed row blocks of ``rows`` query rows (at most 64 per block) on the
    current stream; none: no launch. The grid strides over the listed rows (templates/mla_decode_combine.cuh)."""
    if row_blocks:
        work = row_blocks * min(rows, BLOCK_M)
        fn((min(work, COMBINE_BLOCKS_PER_SM * sm_count()),), (COMBINE_THREADS,), (arg,))


def _cache_map(cache: MLAKVCache, block_n: int):
    """The ``MLACacheMap`` kernel argument of a ``tma`` config (templates/mla_decode_producer.cuh): the cache's
    tensor map with boxes of 64 values x :func:`~cukv.configs.mla_decode.tma_box_rows` tokens and the 128-byte
    swizzle of the ring, then the box rows (0: the page size does not suit tensor copies; every tile by cp.async)."""
    from .. import tma

    rows = tma_box_rows(cache.page_size, block_n)
    # the rows as bytes [pages][page_size][1][1152]
    shape, strides = (cache.num_pages, cache.page_size, 1, DIM * 2), (cache.page_stride, cache.row_stride, DIM * 2, 1)
    desc = (tma.encode_bytes("cache", cache.ptr, shape, strides, 128, rows, tma.SWIZZLE_128B) if rows
            else bytes(tma.MAP_BYTES))
    return as_kernel_arg(np.frombuffer(desc + np.array([rows] + [0] * 15, np.int32).tobytes(), np.uint8))
