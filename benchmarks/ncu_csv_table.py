"""Prints, for every kernel of an ``ncu --csv --page raw`` export that ran 20 us or more, its launch shape and its
L2 / DRAM traffic (the metrics benchmarks/ncu_peers.sh collects). Usage: python3 benchmarks/ncu_csv_table.py FILE"""
import csv
import sys

UNIT = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9,
        "byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "hz": 1.0, "khz": 1e3, "mhz": 1e6, "ghz": 1e9}
LAUNCH = ("launch__grid_size", "launch__block_size", "launch__registers_per_thread",
          "launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_static")


def main(path):
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    hdr, units = rows[start], rows[start + 1]
    col = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[start + 2:] if len(r) == len(hdr)]

    def g(r, m):
        """Metric m of row r in base units (ns, bytes, cycles/s), or the text ncu printed."""
        v = r[col[m]].replace(",", "") if m in col else "?"
        try:
            return float(v) * UNIT.get(units[col[m]].lower(), 1.0)
        except ValueError:
            return v

    def f(r, m, fmt=".0f"):
        v = g(r, m)
        return format(v, fmt) if isinstance(v, float) else v

    launch = [h for h in hdr if h.startswith("launch__") and ("cluster" in h or h in LAUNCH)]
    for r in data:
        t = g(r, "gpu__time_duration.sum")
        if not isinstance(t, float) or t < 20000:  # ns: memsets and small copies
            continue
        print(r[col["Kernel Name"]][:100])
        print("   ", f"{t / 1e3:.1f} us at {g(r, 'sm__cycles_elapsed.avg.per_second') / 1e6:.0f} MHz;",
              " ".join(f"{h[8:]}={r[col[h]]}" for h in launch))
        rd, wr = g(r, "lts__t_sectors_op_read.sum"), g(r, "lts__t_sectors_op_write.sum")
        print("   ", f"L2 reads {rd * 32 / 1e9:.2f} GB, writes {wr * 32 / 1e9:.2f} GB, "
              f"hit {f(r, 'lts__t_sector_hit_rate.pct', '.1f')}%;",
              f"DRAM read {g(r, 'dram__bytes_read.sum') / 1e9:.2f} GB, write {g(r, 'dram__bytes_write.sum') / 1e9:.2f} GB;",
              f"gmma active {f(r, 'sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed', '.1f')}%")


if __name__ == "__main__":
    main(sys.argv[1])
