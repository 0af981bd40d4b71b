"""The paged KV cache, its page allocator and page tables.

Layouts are all views over one rule: K and V element ``(page, token_in_page, kv_head, dim)`` sits at
``base + dot(strides, index)`` (64-bit element offsets). So the separate ``[pages, page_size, H, D]``
pair, the combined ``[pages, 2, page_size, H, D]`` tensor and MAX's multi-layer
``[pages, 2, layers, page_size, H, D]`` tensor (one layer at a time) are the same thing to a kernel.

Examples
--------
>>> import cupy as cp, numpy as np, cukv
>>> cache = cukv.PagedKVCache(num_pages=64, page_size=16, num_kv_heads=8, head_dim=128)   # bf16, combined
>>> cache.storage.shape                                       # [pages, 2 (K, V), page_size, H, D]
(64, 2, 16, 8, 128)
>>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=8)
>>> slots = seqs.extend([20, 5])   # 20 tokens for sequence 0, 5 for sequence 1: pages get allocated
>>> slots[18:].tolist()            # sequence 0 fills pages 0 and 1, sequence 1 starts page 2 (slot 32)
[18, 19, 32, 33, 34, 35, 36]
>>> kv = cp.asarray(cukv.dtypes.to_storage(np.random.default_rng(0).standard_normal((25, 8, 128)), "bfloat16"))
>>> cukv.append_kv(cache, kv, kv, cp.asarray(slots))
>>> table = seqs.page_table()      # what kernels read: device block_table [2, 8] int32 and lengths
>>> table.block_table[:, :2].get().tolist(), table.lengths.get().tolist()
([[0, 1], [2, 0]], [20, 5])
"""
from __future__ import annotations

import numpy as np

from .arrays import as_device, canonical_kv_dtype, element_dtype, elem_strides
from .dtypes import bf16_bits, nan_bits, storage_dtype
from .fp8 import scale_block as _scale_block
from .validate import check_float, check_int, check_page_table, check_table, host_ints, is_int

LAYOUTS = ("separate", "combined", "layers")
#: PagedKVCache.dequantize converts this many bytes of float32 values at a time (an inspection helper: the size only
#: bounds its temporaries; any value works)
DEQUANTIZE_CHUNK_BYTES = 64 << 20


#: ``PageAllocator`` orders: pages handed out 0, 1, 2, ... or in a random permutation (a fragmented cache)
ORDERS = ("sequential", "random")


class PageAllocator:
    """A free list of physical page ids ``0 .. num_pages-1`` (host side, O(1) alloc and free).

    ``order='sequential'`` hands pages out in id order; ``order='random'`` in a permutation drawn from ``seed``
    (examples and tests use it to scatter a sequence's pages over the cache, as a long-running server's are).
    Freed pages are handed out again first.

    Examples
    --------
    >>> from cukv import PageAllocator
    >>> pages = PageAllocator(8)
    >>> pages.alloc(3)
    [0, 1, 2]
    >>> pages.free([1])
    >>> pages.alloc(2), pages.num_free                 # the freed page comes back first
    ([1, 3], 4)
    >>> PageAllocator(8, order="random", seed=0).alloc(4)
    [2, 4, 3, 6]
    >>> pages.alloc(5)
    Traceback (most recent call last):
    ...
    MemoryError: asked for 5 pages, 4 of 8 are free
    """

    def __init__(self, num_pages: int, order: str = "sequential", seed: int | None = None):
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not valid; accepted: {', '.join(map(repr, ORDERS))}")
        if seed is not None and order != "random":
            raise ValueError(f"seed={seed!r} applies to order='random' only")
        self.num_pages = check_int("num_pages", num_pages, 1)
        if order == "random":
            first = np.random.default_rng(seed).permutation(self.num_pages).tolist()
        else:
            first = list(range(self.num_pages))
        self._free = first[::-1]  # pop() takes from the end
        self._used = np.zeros(self.num_pages, bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        n = check_int("n", n, 0)
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} of {self.num_pages} are free")
        out = [self._free.pop() for _ in range(n)]
        self._used[out] = True
        return out

    def free(self, pages) -> None:
        for p in pages:
            p = int(p)
            if not (0 <= p < self.num_pages) or not self._used[p]:
                raise ValueError(f"page {p} is not allocated (valid: allocated ids in 0..{self.num_pages - 1})")
            self._used[p] = False
            self._free.append(p)


class PagedKVCache:
    """Pages of K and V for one attention layer (or one layer view of a multi-layer tensor).

    Parameters
    ----------
    num_pages, page_size, num_kv_heads, head_dim : int
        Geometry. Any page size from 1 up; head_dim a multiple of 8 (16-byte rows).
    dtype : {'bfloat16', 'float16', 'fp8_e4m3'}
        Element type (bf16 is held as uint16 bit patterns in CuPy, e4m3 as uint8 codes).
    layout : {'combined', 'separate', 'layers'}
        ``combined``: one ``[pages, 2, page_size, H, D]`` array; ``separate``: two ``[pages, page_size, H, D]``;
        ``layers``: ``[pages, 2, num_layers, page_size, H, D]`` and this object views ``layer``.
    fill : float or None
        ``'nan'`` poisons every slot (tests do this so unwritten slots cannot pass unnoticed).
    scale_granularity : {'token', 'tensor', 32, 64, 128}
        FP8 caches only: one float32 scale per (token, head), per K/V tensor, or per (token, head, block of
        g dims). Scales live in ``k_scales``/``v_scales``, laid out like the pages (the last axis is the
        block: ``[pages, page_size, H, D // g]``); per tensor they are two device scalars that
        :meth:`set_tensor_scales` writes (default 1.0).

    Examples
    --------
    >>> import cupy as cp, cukv
    >>> cache = cukv.PagedKVCache(64, 16, 8, 128, dtype="fp8_e4m3", scale_granularity=64)
    >>> cache.k.dtype == cp.uint8, cache.k.shape, cache.k_scales.shape    # e4m3 codes; a scale per 64 dims
    (True, (64, 16, 8, 128), (64, 16, 8, 2))
    >>> sep = cukv.PagedKVCache(8, 16, 2, 64, dtype="float16", layout="separate", fill="nan")
    >>> bool(cp.isnan(sep.v).all())                              # unwritten slots poisoned, as tests do
    True
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype="bfloat16",
                 layout: str = "combined", num_layers: int = 1, layer: int = 0, fill=None,
                 scale_granularity=None):
        import cupy as cp

        num_pages, page_size = check_int("num_pages", num_pages, 1), check_int("page_size", page_size, 1)
        num_kv_heads, head_dim = check_int("num_kv_heads", num_kv_heads, 1), check_int("head_dim", head_dim, 1)
        num_layers = check_int("num_layers", num_layers, 1)
        if head_dim % 8:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 8 (kernels move 16-byte rows)")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}; accepted: {', '.join(LAYOUTS)}")
        layer = check_int("layer", layer, 0, num_layers - 1)
        self.dtype = canonical_kv_dtype(dtype)
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.layout = layout
        self._set_granularity(scale_granularity)
        st = storage_dtype(self.dtype)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k, self.v, self.storage = _alloc(layout, shape, st, num_layers, layer)
        self.k_scales = self.v_scales = self.scale_storage = None
        if self.quantized:
            if self.scale_block == 0:
                self.scale_storage = cp.ones(2, cp.float32)
                self.k_scales, self.v_scales = self.scale_storage[0], self.scale_storage[1]
            else:
                sshape = shape[:3] + (head_dim // self.scale_block,)
                self.k_scales, self.v_scales, self.scale_storage = _alloc(layout, sshape, cp.float32, num_layers, layer)
        if fill is not None:
            self.fill(fill)

    def _set_granularity(self, scale_granularity) -> None:
        if self.dtype == "fp8_e4m3":
            if self.head_dim % 16:
                raise ValueError(f"head_dim={self.head_dim} must be a multiple of 16 for an FP8 cache (16-byte rows)")
            self.scale_granularity = "token" if scale_granularity is None else scale_granularity
            self.scale_block = _scale_block(self.scale_granularity, self.head_dim)
        elif scale_granularity is not None:
            raise ValueError(f"scale_granularity={scale_granularity!r} applies to FP8 caches only; dtype is {self.dtype}")
        else:
            self.scale_granularity, self.scale_block = None, None

    @property
    def quantized(self) -> bool:
        return self.dtype == "fp8_e4m3"

    def set_tensor_scales(self, k_scale, v_scale) -> None:
        """Per-tensor FP8 caches: write the K and V scales (floats or device scalars; device-to-device copies,
        so a CUDA graph that appends or attends sees the new values on replay)."""
        import cupy as cp

        if not self.quantized or self.scale_block != 0:
            raise ValueError("set_tensor_scales applies to FP8 caches with scale_granularity='tensor'")
        for name, val, dst in (("k_scale", k_scale, self.k_scales), ("v_scale", v_scale, self.v_scales)):
            if isinstance(val, cp.ndarray):
                if val.size != 1:
                    raise ValueError(f"{name} must be a scalar; got shape {tuple(val.shape)}")
                dst[...] = val.reshape(()).astype(cp.float32)
            else:
                dst.fill(check_float(name, val, positive=True))

    def dequantize(self, chunk_bytes: int = DEQUANTIZE_CHUNK_BYTES):
        """The cache's values as bf16 (uint16 bits) device arrays ``(k, v)`` ``[pages, page_size, H, D]``,
        for inspection: ``e4m3(code) * scale`` computed in float32, then rounded to bf16. Unwritten slots read as
        whatever their bytes and scales hold (NaN codes stay NaN). Pages are converted a group at a time, so the
        float32 temporaries stay near ``chunk_bytes`` whatever the cache's size."""
        import cupy as cp

        if not self.quantized:
            raise ValueError(f"dequantize applies to FP8 caches; this cache holds {self.dtype}")
        from .fp8 import E4M3_VALUES

        chunk_bytes = check_int("chunk_bytes", chunk_bytes, 1)
        table = cp.asarray(E4M3_VALUES.astype(np.float32))
        page_floats = self.page_size * self.num_kv_heads * self.head_dim
        step = max(1, chunk_bytes // (4 * page_floats))
        out = []
        for codes, scales in ((self.k, self.k_scales), (self.v, self.v_scales)):
            res = cp.empty(codes.shape, cp.uint16)
            for p0 in range(0, self.num_pages, step):
                vals = table[codes[p0:p0 + step]]
                if self.scale_block == 0:
                    vals *= scales
                else:  # [pages, page_size, H, D // g, g] * [..., D // g, 1]: no repeated scale array
                    g = self.scale_block
                    vals = vals.reshape(vals.shape[:3] + (-1, g))
                    vals *= scales[p0:p0 + step][..., None]
                res[p0:p0 + step] = bf16_bits(vals.reshape(res[p0:p0 + step].shape), cp)
            out.append(res)
        return tuple(out)

    @classmethod
    def from_arrays(cls, k, v, dtype=None) -> "PagedKVCache":
        """Wrap existing ``[pages, page_size, H, D]`` K and V arrays (any strides with a unit dim stride,
        e.g. views of a FlashInfer or vLLM cache, or torch tensors through DLPack) without copying."""
        kd, kdt = as_device(k, "k")
        vd, vdt = as_device(v, "v")
        dt = canonical_kv_dtype(dtype) if dtype is not None else element_dtype(kd, kdt, "k")
        if element_dtype(vd, vdt or (dt if vd.dtype == kd.dtype else None), "v") != dt:
            raise TypeError(f"k and v dtypes differ ({kd.dtype} vs {vd.dtype})")
        if kd.ndim != 4 or kd.shape != vd.shape:
            raise ValueError(f"k and v must both be [pages, page_size, heads, dim]; got {kd.shape} and {vd.shape}")
        self = cls.__new__(cls)
        self.dtype = dt
        self.num_pages, self.page_size, self.num_kv_heads, self.head_dim = map(int, kd.shape)
        self.layout = "external"
        self.storage = (kd, vd)
        self.k, self.v = kd, vd
        self.scale_granularity = self.scale_block = None
        self.k_scales = self.v_scales = self.scale_storage = None
        self._check_alignment()
        return self

    def _check_alignment(self) -> None:
        vec = 16 // self.k.itemsize
        for name, a in (("k", self.k), ("v", self.v)):
            s = elem_strides(a)
            if s[3] != 1:
                raise ValueError(f"{name} must have a unit stride over head_dim; strides (elements) are {s}")
            if any(x % vec for x in s[:3]) or a.data.ptr % 16:
                raise ValueError(f"{name} rows must be 16-byte aligned: strides (elements) {s} must be multiples "
                                 f"of {vec} and the base address a multiple of 16")
        if self.head_dim % vec:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of {vec}")

    @property
    def ks_strides(self) -> tuple[int, int, int, int]:
        """Element strides of the K scales (zeros per tensor: every granule reads the one scalar)."""
        return (0, 0, 0, 0) if self.k_scales is None or self.scale_block == 0 else elem_strides(self.k_scales)

    @property
    def vs_strides(self) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0) if self.v_scales is None or self.scale_block == 0 else elem_strides(self.v_scales)

    @property
    def k_strides(self) -> tuple[int, int, int, int]:
        return elem_strides(self.k)

    @property
    def v_strides(self) -> tuple[int, int, int, int]:
        return elem_strides(self.v)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def fill(self, value) -> None:
        """Fill every slot (``'nan'`` writes NaN bit patterns)."""
        val = nan_bits(self.dtype) if (isinstance(value, str) and value.lower() == "nan") else value
        for a in (self.storage if isinstance(self.storage, tuple) else (self.storage,)):
            a.fill(val)
        if self.quantized and self.scale_block != 0 and isinstance(value, str) and value.lower() == "nan":
            for a in (self.scale_storage if isinstance(self.scale_storage, tuple) else (self.scale_storage,)):
                a.fill(np.nan)

    def __repr__(self) -> str:
        q = f", scale_granularity={self.scale_granularity!r}" if self.quantized else ""
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, num_kv_heads="
                f"{self.num_kv_heads}, head_dim={self.head_dim}, dtype='{self.dtype}', layout='{self.layout}'{q})")


def _alloc(layout: str, shape: tuple, dtype, num_layers: int, layer: int):
    """(k, v, storage) views of one allocation in ``layout``; shape is ``[pages, page_size, H, last]``."""
    import cupy as cp

    if layout == "separate":
        storage = (cp.empty(shape, dtype), cp.empty(shape, dtype))
        return storage[0], storage[1], storage
    if layout == "combined":
        storage = cp.empty((shape[0], 2) + shape[1:], dtype)
        return storage[:, 0], storage[:, 1], storage
    storage = cp.empty((shape[0], 2, num_layers) + shape[1:], dtype)
    return storage[:, 0, layer], storage[:, 1, layer], storage


class PageTable:
    """What attention kernels read: ``block_table[B, max_pages]`` int32 (logical -> physical page) and
    ``lengths[B]`` int32 (tokens to attend to, new ones included). Both are device arrays; a CUDA graph
    captured over a PageTable replays with whatever the arrays hold at replay time.

    Examples
    --------
    >>> import cupy as cp, cukv
    >>> table = cukv.PageTable(cp.asarray([[3, 1, 0], [2, 0, 0]], cp.int32), cp.asarray([40, 9], cp.int32), page_size=16)
    >>> table.batch_size, table.max_pages
    (2, 3)
    >>> fi = cukv.PageTable.from_flashinfer(indptr=[0, 3, 4], indices=[3, 1, 0, 2], last_page_len=[8, 9], page_size=16)
    >>> fi.block_table.get().tolist(), fi.lengths.get().tolist()    # the same table in FlashInfer's CSR form
    ([[3, 1, 0], [2, 0, 0]], [40, 9])
    >>> cukv.PageTable(table.block_table, table.lengths.astype(cp.int64), page_size=16)
    Traceback (most recent call last):
    ...
    TypeError: lengths must be int32 of shape (2,); got int64 (2,)
    """

    def __init__(self, block_table, lengths, page_size: int):
        import cupy as cp

        bt, _ = as_device(block_table, "block_table")
        ln, _ = as_device(lengths, "lengths")
        if bt.dtype != cp.int32 or bt.ndim != 2:
            raise TypeError(f"block_table must be a 2-D int32 array; got {bt.dtype} with shape {tuple(bt.shape)}")
        if bt.strides[1] != 4:
            raise ValueError(f"block_table rows must be contiguous; strides {bt.strides}")
        if ln.dtype != cp.int32 or ln.shape != (bt.shape[0],):
            raise TypeError(f"lengths must be int32 of shape ({bt.shape[0]},); got {ln.dtype} {tuple(ln.shape)}")
        if not ln.flags.c_contiguous:
            raise ValueError("lengths must be contiguous")
        self.block_table, self.lengths, self.page_size = bt, ln, check_int("page_size", page_size, 1)

    @property
    def batch_size(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def max_pages(self) -> int:
        return int(self.block_table.shape[1])

    @classmethod
    def from_flashinfer(cls, indptr, indices, last_page_len, page_size: int, max_pages: int | None = None):
        """FlashInfer's CSR page table: pages of sequence b are ``indices[indptr[b]:indptr[b+1]]`` and its
        last page holds ``last_page_len[b]`` tokens (1..page_size)."""
        page_size = check_int("page_size", page_size, 1)
        max_pages = check_int("max_pages", max_pages, 1, none_ok=True)
        indptr, indices = host_ints("indptr", indptr), host_ints("indices", indices)
        last = host_ints("last_page_len", last_page_len)
        if indptr.ndim != 1 or indptr.size < 1 or indptr[0] != 0 or np.any(np.diff(indptr) < 0):
            raise ValueError("indptr must be 1-D, start at 0 and never decrease")
        b = indptr.size - 1
        if last.shape != (b,):
            raise ValueError(f"last_page_len has shape {last.shape}; expected ({b},)")
        if indptr[-1] > indices.size:
            raise ValueError(f"indptr[-1]={indptr[-1]} exceeds len(indices)={indices.size}")
        npages = np.diff(indptr)
        bad = (npages > 0) & ((last < 1) | (last > page_size))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"last_page_len[{i}]={last[i]} must be in 1..{page_size} for a non-empty sequence")
        lengths = np.where(npages > 0, (npages - 1) * page_size + last, 0)
        longest = int(npages.max(initial=0))
        if max_pages is not None and int(max_pages) < longest:
            raise ValueError(f"max_pages={max_pages} is less than the longest sequence's {longest} pages")
        width = max(1, longest) if max_pages is None else int(max_pages)
        table = np.zeros((b, width), np.int32)
        for i in range(b):
            table[i, : npages[i]] = indices[indptr[i]: indptr[i + 1]]
        return cls._upload(table, lengths, page_size)

    @classmethod
    def from_vllm(cls, block_table, seq_lens, page_size: int):
        """vLLM's ``block_table[B, max_blocks]`` and ``seq_lens[B]`` (the slot mapping goes to append_kv).

        Examples
        --------
        >>> import cupy as cp, numpy as np, cukv
        >>> table = cukv.PageTable.from_vllm(np.array([[3, 1, 0], [2, 0, 0]]), np.array([40, 9]), page_size=16)
        >>> table.block_table.dtype == cp.int32, table.lengths.get().tolist()
        (True, [40, 9])
        >>> cukv.PageTable.from_vllm(np.array([[3, 1, 0], [2, 0, 0]]), np.array([40, 49]), page_size=16)
        Traceback (most recent call last):
        ...
        ValueError: seq_lens[1]=49 needs 4 pages; block_table has 3 columns (a row holds at most 48 tokens)
        """
        page_size = check_int("page_size", page_size, 1)
        bt, sl = host_ints("block_table", block_table), host_ints("seq_lens", seq_lens)
        if bt.ndim != 2:
            raise ValueError(f"block_table must be 2-D; got shape {bt.shape}")
        if sl.shape != (bt.shape[0],):
            raise ValueError(f"seq_lens has shape {sl.shape}; expected ({bt.shape[0]},)")
        check_table(bt, sl, page_size, None, names=("block_table", "seq_lens"))  # the cache is not known here
        return cls._upload(bt.astype(np.int32), sl, page_size)

    @classmethod
    def _upload(cls, table, lengths, page_size):
        import cupy as cp

        return cls(cp.asarray(np.ascontiguousarray(table, np.int32)), cp.asarray(np.asarray(lengths, np.int32)), page_size)

    def validate(self, cache: PagedKVCache) -> None:
        """Check on the host that every page a length reaches is a valid physical page (syncs the GPU)."""
        check_page_table(self, cache.num_pages)


def check_cache_and_table(owner: str, cache, table) -> None:
    """TypeError unless ``cache`` is a :class:`PagedKVCache` and ``table`` a :class:`PageTable`."""
    if not isinstance(cache, PagedKVCache) or not isinstance(table, PageTable):
        raise TypeError(f"{owner} reads a PagedKVCache through a PageTable; got {type(cache).__name__} and "
                        f"{type(table).__name__}")


def check_paged_kv(owner: str, cfg, num_kv_heads: int, cache, table) -> None:
    """The (cache, table) pair a kernel built from ``cfg`` (dtype, kv_dtype, head_dim, page_size, scale_block)
    can read; raises naming what differs. Shared by BatchDecode.run and BatchPrefill.run."""
    check_cache_and_table(owner, cache, table)
    want = cfg.kv_dtype or cfg.dtype
    quantized = cfg.kv_dtype is not None
    if cache.dtype != want or cache.head_dim != cfg.head_dim or cache.num_kv_heads != num_kv_heads \
            or cache.page_size != cfg.page_size or (quantized and cache.scale_block != cfg.scale_block):
        q = f", scale block {cfg.scale_block}" if quantized else ""
        raise ValueError(f"cache {cache!r} does not match this {owner} (cache dtype {want}, {num_kv_heads} KV heads, "
                         f"head_dim {cfg.head_dim}, page_size {cfg.page_size}{q})")
    if table.page_size != cfg.page_size:
        raise ValueError(f"table.page_size={table.page_size}; the cache uses {cfg.page_size}")


class SequenceTable:
    """Host-side book-keeping for a batch of sequences over a :class:`PagedKVCache`: grows each sequence
    page by page from a shared :class:`PageAllocator` and hands out slot mappings and page tables.

    Slot ``s`` of the cache is token ``s % page_size`` of physical page ``s // page_size``.

    Examples
    --------
    >>> import cupy as cp, cukv
    >>> cache = cukv.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=1, head_dim=64, dtype="float16")
    >>> seqs = cukv.SequenceTable(cache, max_batch=2, max_pages_per_seq=4,
    ...                           allocator=cukv.PageAllocator(8, order="random", seed=0))   # scattered pages
    >>> seqs.extend([6, 3]).tolist()              # sequence 0 gets pages 2 and 4, sequence 1 page 3
    [8, 9, 10, 11, 16, 17, 12, 13, 14]
    >>> seqs.extend([1, 2]).tolist()              # one token more for 0, two for 1 (a new page: 6)
    [18, 15, 24]
    >>> seqs.block_table().tolist(), seqs.lengths.tolist()
    ([[2, 4, 0, 0], [3, 6, 0, 0]], [7, 5])
    >>> seqs.release(0)                           # sequence 0 finished: its pages go back to the allocator
    >>> seqs.allocator.alloc(2)
    [4, 2]
    >>> table = seqs.page_table()                 # a PageTable on the device, for run()
    >>> table.lengths.get().tolist()
    [0, 5]
    """

    def __init__(self, cache: PagedKVCache, max_batch: int, max_pages_per_seq: int,
                 allocator: PageAllocator | None = None):
        max_batch = check_int("max_batch", max_batch, 1)
        self.max_pages_per_seq = check_int("max_pages_per_seq", max_pages_per_seq, 1)
        if not all(is_int(getattr(cache, a, None)) for a in ("num_pages", "page_size")):
            raise TypeError(f"cache must be a PagedKVCache (or have integer num_pages and page_size); "
                            f"got {type(cache).__name__}")
        if allocator is not None and not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator or None; got {type(allocator).__name__}")
        self.cache = cache
        self.allocator = allocator or PageAllocator(cache.num_pages)
        self.pages = [[] for _ in range(max_batch)]
        self.lengths = np.zeros(max_batch, np.int64)

    def extend(self, counts) -> np.ndarray:
        """Reserve ``counts[b]`` new tokens at the end of sequence b; returns their slots (int64, in batch
        order, sequence by sequence) for :func:`cukv.append_kv`."""
        counts = host_ints("counts", counts)
        if counts.shape != self.lengths.shape or np.any(counts < 0):
            raise ValueError(f"counts must be {self.lengths.shape[0]} non-negative integers; got {counts.tolist()}")
        ps = self.cache.page_size
        slots = []
        for b, n in enumerate(counts):
            new_len = self.lengths[b] + n
            need = -(-new_len // ps) - len(self.pages[b])
            if len(self.pages[b]) + need > self.max_pages_per_seq:
                raise ValueError(f"sequence {b} would need {len(self.pages[b]) + need} pages; "
                                 f"max_pages_per_seq={self.max_pages_per_seq}")
            if need > 0:
                self.pages[b].extend(self.allocator.alloc(int(need)))
            pos = np.arange(self.lengths[b], new_len)
            pages = np.asarray(self.pages[b], np.int64)
            slots.append(pages[pos // ps] * ps + pos % ps if pos.size else np.zeros(0, np.int64))
            self.lengths[b] = new_len
        return np.concatenate(slots) if slots else np.zeros(0, np.int64)

    def release(self, b: int) -> None:
        self.allocator.free(self.pages[b])
        self.pages[b] = []
        self.lengths[b] = 0

    def block_table(self) -> np.ndarray:
        t = np.zeros((len(self.pages), self.max_pages_per_seq), np.int32)
        for b, p in enumerate(self.pages):
            t[b, : len(p)] = p
        return t

    def page_table(self) -> PageTable:
        return PageTable._upload(self.block_table(), self.lengths, self.cache.page_size)
