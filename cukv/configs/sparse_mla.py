"""SparseMLAConfig: the template parameters of the sparse MLA kernel (templates/sparse_mla.cu.j2), the absorbed MLA
decode kernel with a per-token key list (``MLAPrefillSparse``). The fields and derived sizes are
:class:`~cukv.configs.mla_decode.MLADecodeConfig`'s; the shared memory adds the per-stage validity words."""
from __future__ import annotations

import dataclasses

from .checks import SHORT, check_bool, check_rule
from .mla_decode import CONSUMER_REGS, PRODUCER_REGS, SMEM_LIMIT, MLADecodeConfig

#: persistent gathers (``persistent``): the per-slice consumers spill at 216 registers (28 bytes), so they keep 224
#: and the producer's item loop spills instead (8 bytes at 56)
PERSISTENT_REGS = (PRODUCER_REGS, CONSUMER_REGS)


@dataclasses.dataclass(frozen=True)
class SparseMLAConfig(MLADecodeConfig):
    """One compiled specialization of sparse MLA (576/512, 64 query rows per block, "split" consumers).

    Examples
    --------
    >>> from cukv.configs.sparse_mla import SparseMLAConfig
    >>> cfg = SparseMLAConfig("bfloat16", block_n=64, num_kv_stages=2)
    >>> cfg.name, cfg.smem_bytes                        # the dense decode's 231488 + 64 bytes of validity words
    ('cukv_sparse_mla_bf16_n64_s2', 231552)
    """

    template = "sparse_mla.cu.j2"
    gathers = True
    #: the per-slice gathers (``slice_release``, one work item a block) prefetch into L2 the query block of the item
    #: one wave ahead (``blockIdx.x`` + ``%nsmid``, one block an SM) once their last tile is issued
    #: (``MLAKVProducerPipeline::prefetch_next_q``)
    next_q: bool = False

    def __post_init__(self):
        super().__post_init__()
        c = "SparseMLAConfig"
        check_rule(c, "schedule", self.schedule, self.schedule in ("split", "narrow") or (
            self.schedule == "alternate" and self.slice_release),
                   "sparse MLA runs the 'split' or the 'narrow' consumers, or the alternating ones over per-slice "
                   "barriers (slice_release=True)")
        check_rule(c, "slice_release", self.slice_release, not self.slice_release or self.block_n == 64,
                   "sparse gathers into per-slice stages take block_n=64")
        check_rule(c, "persistent", self.persistent, not (self.persistent and self.multicast),
                   "persistent blocks gather without the cluster pair: use multicast=False, or persistent=False")
        check_bool(c, "next_q", self.next_q)
        check_rule(c, "next_q", self.next_q, not self.next_q or (self.slice_release and not self.persistent),
                   "the next wave's query block is prefetched by the per-slice gathers of one item a block: use "
                   "slice_release=True and persistent=False, or next_q=False")
        check_rule(c, "num_kv_stages", self.num_kv_stages, self.smem_bytes <= SMEM_LIMIT,
                   f"the ring needs {self.smem_bytes} bytes of shared memory with block_n={self.block_n}; "
                   f"at most {SMEM_LIMIT} (227 KB) fit")

    @property
    def regs(self) -> tuple:
        return PERSISTENT_REGS if self.persistent else super().regs

    def render_params(self) -> dict:
        return {**super().render_params(), "next_q": self.next_q}

    @property
    def valid_bytes(self) -> int:
        """The producer's validity words: 4 per stage (one per producer warp), 64-byte rounded."""
        return (16 * self.num_kv_stages + 63) // 64 * 64

    @property
    def smem_bytes(self) -> int:
        return super().smem_bytes + self.valid_bytes

    @property
    def name(self) -> str:
        kv = "_e4m3" if self.kv_dtype else ""
        pf = f"_pf{self.prefetch_tiles}" if self.prefetch_tiles else ""
        rows = f"_r{self.fp8_rows}" if self.fp8_rows != 8 else ""
        lr = "_lr" if self.lazy_rescale else ""
        lr += "_rf" if self.kv_dtype and self.fp8_rope_first else ""
        nr = f"_nr{self.block_rows}" if self.schedule == "narrow" else ""
        mc = "_mc" if self.multicast else ""
        sl = "_alt_slices" if self.slice_release else ""
        sl += "_ps" if self.persistent else ""
        sl += "_nq" if self.next_q else ""
        return (f"cukv_sparse_mla_{SHORT[self.dtype]}{kv}_n{self.block_n}_s{self.num_kv_stages}{nr}{pf}{rows}{sl}"
                f"{mc}{lr}")
