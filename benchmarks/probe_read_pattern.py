"""What does the paged decode's read pattern cost, and what does the L2 flush cost? (issue 55)

Times bulk copies (``cp.async.bulk`` into shared memory, one issuing thread per block, ``stages`` copies in
flight) over a buffer read once, in two orders:

* ``seq``: chunk ``b, b + grid, ...`` (the read ceiling's own order);
* ``rand``: the same chunks in a random permutation (pages of a paged cache in random physical order).

and, for the sequential 32 KB reader over a decode-sized buffer, two ways to flush L2 before each timed call: the
harness's old 256 MB write (``fill(1)``: L2 then holds dirty lines that the timed kernel's reads evict, a write-back
during the measurement) against the same write followed by ``discard.global.L2`` of its lines (``Timer``'s flush), and
for a 32 MB buffer also no flush (L2-resident: a flush that evicts must be slower than that). Prints TB/s per variant.

    PYTHONPATH=. python3 benchmarks/probe_read_pattern.py [--gb 4] [--chunks 2048,4096,8192,32768]
"""
import argparse

import cupy as cp
import numpy as np

from cukv import compiler
from cukv.bench.timing import Timer, ceiling_kernel
from cukv.device import sm_count

SRC = r"""
#include "hopper.cuh"
extern "C" __global__ void __launch_bounds__(32) probe_gather(const unsigned char* src, const int* order,
                                                               long long chunks, unsigned* out) {
  constexpr int S = PROBE_STAGES, CHUNK = PROBE_CHUNK;
  extern __shared__ __align__(1024) unsigned char buf[];
  __shared__ __align__(8) unsigned long long bars[S];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < S; ++s) cukv::mbar_init(cukv::smem_addr(&bars[s]), 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto issue = [&](long long c, int s) {
    const cukv::u32 bar = cukv::smem_addr(&bars[s]);
    const long long chunk = order ? (long long)order[c] : c;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(CHUNK) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(cukv::smem_addr(buf + s * CHUNK)), "l"(src + chunk * CHUNK), "r"(CHUNK), "r"(bar)
                 : "memory");
  };
  long long c = blockIdx.x;
  int k = 0;
  for (int s = 0; s < S && c + (long long)s * gridDim.x < chunks; ++s) issue(c + (long long)s * gridDim.x, s);
  for (; c < chunks; c += gridDim.x, ++k) {
    const int s = k % S;
    cukv::mbar_wait(cukv::smem_addr(&bars[s]), (k / S) & 1);
    const long long next = c + (long long)S * gridDim.x;
    if (next < chunks) issue(next, s);
  }
  if (buf[0] == 0x5a && chunks < 0) out[0] = 1;  // never taken
}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0, help="buffer read by the order variants")
    ap.add_argument("--flush-gb", default="0.03125,0.5,1,4",
                    help="buffer sizes for the flush comparison (up to 64 MB also timed without a flush: L2-resident)")
    ap.add_argument("--chunks", default="2048,4096,8192,32768")
    ap.add_argument("--inflight-kb", type=int, default=192, help="bytes in flight per SM (stages = this / (chunk x blocks per SM))")
    ap.add_argument("--blocks-per-sm", default="1,2")
    args = ap.parse_args()
    timer = Timer()
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    nbytes = int(args.gb * (1 << 30)) // (1 << 15) * (1 << 15)
    src = cp.ones(nbytes // 4, cp.int32)
    out = cp.zeros(1, cp.uint32)
    rng = np.random.default_rng(0)
    for chunk in map(int, args.chunks.split(",")):
        chunks = nbytes // chunk
        perm = cp.asarray(rng.permutation(chunks).astype(np.int32))
        for bps in map(int, args.blocks_per_sm.split(",")):
            stages = max(2, min(args.inflight_kb * 1024 // (chunk * bps), 200 * 1024 // chunk))
            mod = compiler.compile_source(f"probe_gather_c{chunk}_s{stages}", SRC,
                                          defines={"PROBE_STAGES": stages, "PROBE_CHUNK": chunk})
            f = mod.function("probe_gather", chunk * stages)
            row = []
            for order_name, order in (("seq", np.uint64(0)), ("rand", perm)):
                ms = timer.median_ms(lambda: f((sm_count() * bps,), (32,), (src, order, np.int64(chunks), out),
                                               shared_mem=chunk * stages), reps=10, warmup=3)
                row.append(f"{order_name} {nbytes / ms / 1e9:.3f}")
            print(f"chunk {chunk:6d} stages {stages:3d} blocks/SM {bps}: TB/s " + "  ".join(row), flush=True)
    del src
    # the flush: the old write against write + discard, on the sequential 32 KB reader over smaller buffers
    name, mod, block, smem = ceiling_kernel(("bulk", 32768, 6, 1))
    f = mod.function(name, smem)
    write_flush, discard_flush = Timer(flush="write")._flush, timer._flush
    for gb in map(float, args.flush_gb.split(",")):
        nb = int(gb * (1 << 30)) // (1 << 15) * (1 << 15)
        buf = cp.ones(nb // 4, cp.int32)
        row = []
        flushes = (("write", write_flush), ("write+discard", discard_flush)) + ((("none", lambda: None),) if nb <= 64 << 20 else ())
        for fname, fl in flushes:
            timer._flush = fl
            ms = timer.median_ms(lambda: f((sm_count(),), (block,), (buf, np.int64(nb // 16), out), shared_mem=smem),
                                 reps=15, warmup=3)
            row.append(f"{fname}-flush {ms * 1e3:.1f} us {nb / ms / 1e9:.3f} TB/s")
        timer._flush = discard_flush
        print(f"seq bulk 32K x6 over {nb >> 20} MB: " + "  ".join(row), flush=True)
        del buf


if __name__ == "__main__":
    main()
