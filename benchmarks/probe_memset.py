"""What a small memsetAsync costs in a stream of kernels (convert-once clears its flags with one per run).

    PYTHONPATH=. python3 benchmarks/probe_memset.py --nbytes 53376
"""
import argparse

import cupy as cp

from cukv import compiler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nbytes", type=int, default=53376)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    buf = cp.zeros(args.nbytes // 4, cp.int32)
    # the bench timer's spin kernel (templates/spin.cu.j2) stands in for the prefill between the memsets
    spin = compiler.build("spin.cu.j2", "cukv_spin", name="cukv_spin").function("cukv_spin")
    st = cp.cuda.get_current_stream()
    for label, with_memset in (("spin 20 us", False), ("spin 20 us + memset", True)):
        times = []
        for _ in range(5):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            for _ in range(args.reps):
                if with_memset:
                    cp.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, st.ptr)
                spin((132,), (32,), (cp.int64(20000),))
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / args.reps)
        times.sort()
        print(f"{label}: {times[2]:.2f} us per step (median of 5 x {args.reps})", flush=True)


if __name__ == "__main__":
    main()
