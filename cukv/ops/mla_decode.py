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

import heapq
import math

import numpy as np

from ..arrays import as_device
from ..configs.mla_decode import BLOCK_M, DIM, NOPE, PARAMS, ROPE, MLADecodeConfig
from ..device import sm_count
from ..mla_cache import MLAKVCache, check_device_array, check_int

MAX_S_Q = 8
MAX_HEADS = 128
# A block's fixed cost (query load, ring fill, epilogue, its share of the combine) in K tiles, for plan's
# schedule model: fitted to two H200 timings (docs/mla.md "Plan model"): 8-tile chunks of b1 h128 ctx 32768
# took 50 us and the skewed batch cut into 18-tile chunks 148 us, against 2.66 us per tile in steady state.
ITEM_OVERHEAD_TILES = 8.0
MAX_CHUNKS = 512  # chunks per (sequence, row block): the combine kernel's shared arrays (kMlaMaxChunks)


def _float16_kind(a, declared, name: str) -> str:
    if declared:
        return declared
    if str(a.dtype) == "float16":
        return "float16"
    if str(a.dtype) == "uint16":
        return "bfloat16"
    raise TypeError(f"{name} has dtype {a.dtype}; accepted: float16, or bfloat16 (a torch/JAX bf16 tensor or CuPy "
                    "uint16 holding bf16 bits)")


def _makespan(costs: list[float], slots: int) -> float:
    """Finish time of blocks of these costs launched in order onto ``slots`` SMs (each takes the next block)."""
    heap = [0.0] * min(slots, len(costs))
    for c in costs:
        heapq.heapreplace(heap, heap[0] + c)
    return max(heap) if heap else 0.0


def plan_items(lengths, row_blocks: int, block_n: int, num_sms: int, chunk_tiles: int | None = None):
    """The work list: ``(batch, row_block, begin, end)`` chunks, longest first, and the chunk length in tiles.

    A chunk length of ``c`` tiles cuts each sequence of ``n`` tiles into ``ceil(n / c)`` chunks. Chunk lengths
    are tried from the one that fills every SM twice up to the longest sequence; the one whose greedy
    schedule (blocks taken in launch order by the first free SM, each costing its tiles plus
    ``ITEM_OVERHEAD_TILES``) ends first wins, the longest among near ties (fewer partials to merge)."""
    tiles = [-(-int(n) // block_n) for n in lengths]
    total = row_blocks * sum(tiles)
    most = max(tiles + [1])
    least = max(1, -(-total // (2 * num_sms)), -(-most // MAX_CHUNKS))  # <= 2 chunks per SM (+ 1 per row block)
    if chunk_tiles is None:
        cands = sorted({max(least, -(-most // k)) for k in range(1, most + 1) if -(-most // k) >= least} | {least, most})
        if len(cands) > 48:
            idx = np.unique(np.geomspace(1, len(cands), 48).astype(int) - 1)
            cands = [cands[i] for i in idx]
        best = None
        for c in cands:
            costs = sorted((min(c, t - j * c) + ITEM_OVERHEAD_TILES for t in tiles for j in range(max(1, -(-t // c)))
                            for _ in range(row_blocks)), reverse=True)
            span = _makespan(costs, num_sms)
            if best is None or span < best[0] * 0.99 or (span <= best[0] * 1.01 and c > best[1]):
                best = (min(span, best[0]) if best else span, c)
        chunk_tiles = best[1]
    c = max(1, int(chunk_tiles), -(-most // MAX_CHUNKS))
    items = []
    for b, t in enumerate(tiles):
        n_chunks = max(1, -(-t // c))
        for rb in range(row_blocks):
            for j in range(n_chunks):
                begin = j * c * block_n
                end = min(int(lengths[b]), (j + 1) * c * block_n)
                items.append((b, rb, begin, end, n_chunks))
    items.sort(key=lambda x: -(x[3] - x[2]))
    return items, c


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
        the producer dequantizes into bf16 tiles in shared memory (docs/mla.md, "FP8"). Not yet run on a GPU.
    block_n, num_kv_stages : int
        Tile length (32 or 64 tokens) and ring depth (see :class:`~cukv.configs.mla_decode.MLADecodeConfig`).

    Examples
    --------
    >>> import cupy as cp, numpy as np, cukv                                        # doctest: +SKIP
    >>> from cukv.dtypes import bf16_bits
    >>> cache = cukv.MLAKVCache(num_pages=64, page_size=64, dtype="bfloat16", fill="zeros")
    >>> table = cp.arange(64, dtype=cp.int32).reshape(2, 32)
    >>> dec = cukv.BatchMLADecode(num_heads=16).plan([1000, 37], s_q=1)
    >>> q = cp.asarray(bf16_bits(np.random.randn(2, 1, 16, 576)))              # bf16 bits (CuPy has no bf16)
    >>> out, lse = dec.run(q, cache, table, return_lse=True)                    # [2, 1, 16, 512], [2, 1, 16]
    """

    def __init__(self, num_heads: int, dtype="bfloat16", *, kv_dtype=None, block_n: int = 64, num_kv_stages: int = 2):
        from ..arrays import canonical_dtype, canonical_kv_dtype

        self.num_heads = check_int("num_heads", num_heads, 1, MAX_HEADS)
        dt = canonical_dtype(dtype)
        kvd = None if kv_dtype is None else canonical_kv_dtype(kv_dtype, "kv_dtype")
        if kvd not in (None, "fp8_e4m3"):
            if kvd != dt:
                raise TypeError(f"kv_dtype={kv_dtype!r} with dtype={dtype!r}: a 16-bit cache must match the query dtype")
            kvd = None
        self.config = MLADecodeConfig(dt, block_n, num_kv_stages, kvd)
        self.dtype = self.config.dtype
        self._planned = False
        self._cap = 0

    def plan(self, seq_lens, s_q: int = 1, *, chunk_tiles: int | None = None) -> "BatchMLADecode":
        """Fix the work list for sequences of ``seq_lens[B]`` cached tokens (host ints, or a device array that
        is copied to the host once here; the new tokens are included) and ``s_q`` new tokens each (1..8).
        Call again with new lengths before replaying a captured :meth:`run`: buffers are reused while the
        batch and ``s_q`` stay the same. Compiles the kernel (or loads it from the disk cache)."""
        import cupy as cp

        s_q = check_int("s_q", s_q, 1, MAX_S_Q)
        if hasattr(seq_lens, "get") and not isinstance(seq_lens, np.ndarray):
            seq_lens = seq_lens.get()
        lens = np.asarray(seq_lens)
        if lens.ndim != 1 or lens.size == 0 or lens.dtype.kind not in "iu":
            raise ValueError(f"seq_lens must be a non-empty 1-d array of integers; got shape {lens.shape} "
                             f"dtype {lens.dtype}")
        if (lens < 0).any() or (lens > 2 ** 31 - 2 ** 20).any():
            raise ValueError(f"seq_lens must lie in 0..{2 ** 31 - 2 ** 20}; got min {lens.min()} max {lens.max()}")
        if chunk_tiles is not None:
            chunk_tiles = check_int("chunk_tiles", chunk_tiles, 1)
        b = int(lens.size)
        rows = s_q * self.num_heads
        nrb = -(-rows // BLOCK_M)
        sms = sm_count()
        items, self.chunk_tiles = plan_items(lens, nrb, self.config.block_n, sms, chunk_tiles)
        cap = max(2 * sms + b * nrb, len(items))
        if cap > self._cap or (b, s_q) != (getattr(self, "batch_size", None), getattr(self, "s_q", None)):
            self._cap = cap
            self._items = cp.zeros((cap, 8), cp.int32)
            self._num_items = cp.zeros((1,), cp.int32)
            self._rb_indptr = cp.zeros((b * nrb + 1,), cp.int32)
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
        self._items.set(host)
        self._num_items.set(np.array([len(items)], np.int32))
        self._rb_indptr.set(indptr)
        self._rb_slots.set(slots)
        self._lens.set(lens.astype(np.int32))
        self.batch_size, self.s_q, self.row_blocks, self.num_items = b, s_q, nrb, len(items)
        self.max_seq_len = int(lens.max())
        mod = self.config.compiled
        self._fn = mod.function(self.config.name, self.config.smem_bytes)
        self._combine = mod.function(self.config.name + "_combine")
        self._planned = True
        return self

    def _queries(self, q, q_nope, q_pe):
        b, s_q, h = self.batch_size, self.s_q, self.num_heads
        if q is not None:
            if q_nope is not None or q_pe is not None:
                raise ValueError("pass either q or (q_nope, q_pe), not both")
            qa, qd = check_device_array("q", q, ndim=4, last=DIM)
            dt = _float16_kind(qa, qd, "q")
            if qa.shape[:3] != (b, s_q, h):
                raise ValueError(f"q has shape {tuple(qa.shape)}; plan() expects [{b}, {s_q}, {h}, {DIM}]")
            parts = (("q", qa, 0), ("q", qa, NOPE))
        else:
            if q_nope is None or q_pe is None:
                raise ValueError("pass q[B, s_q, H, 576], or both q_nope[B, s_q, H, 512] and q_pe[B, s_q, H, 64]")
            na, nd = check_device_array("q_nope", q_nope, ndim=4, last=NOPE)
            pa, pd = check_device_array("q_pe", q_pe, ndim=4, last=ROPE)
            dt = _float16_kind(na, nd, "q_nope")
            dt_pe = _float16_kind(pa, pd, "q_pe")
            if dt_pe != dt:
                raise TypeError(f"q_nope is {dt} and q_pe is {dt_pe}; they must match")
            for n, a, d in (("q_nope", na, NOPE), ("q_pe", pa, ROPE)):
                if a.shape[:3] != (b, s_q, h):
                    raise ValueError(f"{n} has shape {tuple(a.shape)}; plan() expects [{b}, {s_q}, {h}, {d}]")
            parts = (("q_nope", na, 0), ("q_pe", pa, 0))
        if dt != self.dtype:
            raise TypeError(f"the query is {dt}; this BatchMLADecode was built for {self.dtype}")
        out = []
        for n, a, off in parts:
            if a.strides[3] != a.itemsize:
                raise ValueError(f"{n}'s last dimension must be contiguous (stride {a.strides[3]} bytes)")
            addr = int(a.data.ptr) + off * a.itemsize
            if addr % 16 or any(s % 16 for s in a.strides[:3]):
                raise ValueError(f"{n} must start on a 16-byte boundary with 16-byte multiple strides; "
                                 f"address {addr:#x}, strides {a.strides}")
            out.append((addr, [s // a.itemsize for s in a.strides[:3]], a))
        return out, parts[0][1]

    def run(self, q=None, cache: MLAKVCache | None = None, block_table=None, *, q_nope=None, q_pe=None, out=None,
            lse=None, return_lse: bool = False, softmax_scale: float | None = None, sink=None, stream=None):
        """Attend the planned batch's queries to ``cache`` through ``block_table[B, max_pages]`` (int32; page
        ids outside the cache read as zeros). Returns ``out`` (and ``lse`` when ``return_lse``). ``sink[H]``
        float32 logits join the softmax denominator (not multiplied by the scale). ``softmax_scale`` defaults
        to ``1/sqrt(576)`` (DeepSeek passes ``192**-0.5 * mscale**2``). Pass ``out``/``lse`` to capture the
        call in a CUDA graph."""
        import cupy as cp

        if not self._planned:
            raise RuntimeError("call plan(seq_lens, s_q) before run()")
        if not isinstance(cache, MLAKVCache):
            raise TypeError(f"cache must be an MLAKVCache; got {type(cache).__name__}")
        if cache.quantized != (self.config.kv_dtype is not None):
            raise TypeError(f"cache holds {cache.dtype} rows; this BatchMLADecode was built for "
                            f"{self.config.kv_dtype or self.dtype} (pass kv_dtype='fp8_e4m3' for FP8 rows)")
        if not cache.quantized and cache.dtype != self.dtype:
            raise TypeError(f"cache holds {cache.dtype}; this BatchMLADecode was built for {self.dtype}")
        qs, like = self._queries(q, q_nope, q_pe)
        b, s_q, h = self.batch_size, self.s_q, self.num_heads
        bt, _ = check_device_array("block_table", block_table, ndim=2, dtypes=("int32",))
        if bt.shape[0] < b:
            raise ValueError(f"block_table has {bt.shape[0]} rows; the plan has {b} sequences")
        if bt.strides[1] != 4:
            raise ValueError(f"block_table's rows must be contiguous (stride {bt.strides[1]} bytes)")
        if bt.shape[1] * cache.page_size < self.max_seq_len:
            raise ValueError(f"block_table has {bt.shape[1]} pages per row ({bt.shape[1] * cache.page_size} tokens "
                             f"of page size {cache.page_size}); the plan's longest sequence is {self.max_seq_len}")
        shape = (b, s_q, h, NOPE)
        if out is None:
            out = cp.empty(shape, like.dtype)
        else:
            out, od = check_device_array("out", out)
            if tuple(out.shape) != shape or out.dtype != like.dtype or not out.flags.c_contiguous:
                raise ValueError(f"out must be a contiguous {like.dtype} array of shape {shape}; got "
                                 f"{out.dtype} {tuple(out.shape)}")
        if lse is None and return_lse:
            lse = cp.empty((b, s_q, h), cp.float32)
        elif lse is not None:
            lse, _ = check_device_array("lse", lse)
            if tuple(lse.shape) != (b, s_q, h) or lse.dtype != cp.float32 or not lse.flags.c_contiguous:
                raise ValueError(f"lse must be a contiguous float32 array of shape {(b, s_q, h)}")
        if sink is not None:
            sink, _ = check_device_array("sink", sink, ndim=1, dtypes=("float32",))
            if sink.shape != (h,):
                raise ValueError(f"sink has shape {tuple(sink.shape)}; expected ({h},)")
        scale = 1.0 / math.sqrt(DIM) if softmax_scale is None else float(softmax_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale={softmax_scale!r} must be a positive finite float")

        rec = np.zeros((), PARAMS)
        rec["q_nope"], rec["q_pe"] = qs[0][0], qs[1][0]
        rec["q_nope_stride"], rec["q_pe_stride"] = qs[0][1], qs[1][1]
        rec["out"], rec["lse"] = out.data.ptr, (lse.data.ptr if lse is not None else 0)
        rec["part_o"], rec["part_lse"] = self._part_o.data.ptr, self._part_lse.data.ptr
        rec["sink"] = sink.data.ptr if sink is not None else 0
        rec["cache"], rec["page_stride"], rec["row_stride"] = cache.ptr, cache.page_stride, cache.row_stride
        rec["num_pages"], rec["page_size"] = cache.num_pages, cache.page_size
        rec["block_table"], rec["table_stride"], rec["table_width"] = bt.data.ptr, bt.strides[0] // 4, bt.shape[1]
        rec["seq_lens"], rec["items"], rec["num_items"] = self._lens.data.ptr, self._items.data.ptr, self._num_items.data.ptr
        rec["rb_indptr"], rec["rb_slots"] = self._rb_indptr.data.ptr, self._rb_slots.data.ptr
        rec["batch"], rec["s_q"], rec["heads"], rec["rows"] = b, s_q, h, s_q * h
        rec["row_blocks"], rec["scale_log2"] = self.row_blocks, scale * math.log2(math.e)
        raw = rec.tobytes()
        arg = np.frombuffer(raw, dtype=np.dtype((np.void, len(raw))))[0]
        with (stream or cp.cuda.get_current_stream()):
            self._fn((self._cap,), (self.config.num_threads,), (arg,), shared_mem=self.config.smem_bytes)
            self._combine((s_q * h, b), (128,), (arg,))
        return (out, lse) if return_lse else out


def mla_decode(q, cache: MLAKVCache, block_table, seq_lens, **kwargs):
    """One-shot convenience: plan for these lengths and run (use :class:`BatchMLADecode` in a loop)."""
    qa, qd = as_device(q, "q")
    if qa.ndim != 4:
        raise ValueError(f"q has shape {tuple(qa.shape)}; expected [B, s_q, H, 576]")
    dt = qd or ("bfloat16" if str(qa.dtype) == "uint16" else str(qa.dtype))
    dec = BatchMLADecode(qa.shape[2], dt, kv_dtype="fp8_e4m3" if cache.quantized else None).plan(seq_lens, qa.shape[1])
    return dec.run(q, cache, block_table, **kwargs)
