"""Summarize the per-SASS source counters that benchmarks/ncu_profile.sh writes (`*_sass.csv`), per kernel and
per warp role, so a profile reads in one screen:

    python3 benchmarks/ncu_sass_summary.py out/pf_sass.csv [--top=8]

A warp-specialized kernel's SASS is split at its `setmaxnreg` instructions: the consumer region starts at
`USETMAXREG.TRY_ALLOC`, the producer region at `USETMAXREG.DEALLOC`, and the out-of-line code after the last
region (the mbarrier `try_wait` retry loops the compiler moves there) is listed instruction by instruction with
the address its loop returns to, because retries are where one role waits on the other.
"""
import collections
import csv
import sys


def kernels(path):
    out, cur = [], None
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            cur = {"name": row[1], "rows": []}
            out.append(cur)
        elif row and row[0] == "Address":
            cur["hdr"] = {n: i for i, n in enumerate(row)}
        elif cur is not None and len(row) > 5:
            cur["rows"].append(row)
    return out


def opcode(src):
    t = src.split()
    if not t:
        return ""
    return (t[1] if t[0].startswith("@") and len(t) > 1 else t[0]).split(".")[0]


def regions(rows, ix):
    """(name, first, last) row ranges: prologue, then one per setmaxnreg, then the out-of-line tail."""
    marks = [(i, "consumer" if "TRY_ALLOC" in r[ix["Source"]] else "producer")
             for i, r in enumerate(rows) if "USETMAXREG" in r[ix["Source"]]]
    exits = [i for i, r in enumerate(rows) if opcode(r[ix["Source"]]) == "EXIT"]
    end = exits[-1] + 1 if exits else len(rows)
    bounds = [(0, "prologue")] + marks
    out = []
    for (a, name), (b, _) in zip(bounds, bounds[1:] + [(end, "")]):
        out.append((name, a, b))
    out.append(("out-of-line", end, len(rows)))
    return out


def main(path):
    for k in kernels(path):
        ix, rows = k["hdr"], k["rows"]
        stalls = [n for n in ix if n.startswith("stall_") and "Not Issued" not in n]
        total = sum(int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in rows) or 1
        print(f"== {k['name']}: {sum(int(r[ix['Instructions Executed']] or 0) for r in rows) / 1e6:.1f}M warp "
              f"instructions, {total} samples")
        for name, a, b in regions(rows, ix):
            part = rows[a:b]
            ex = collections.Counter()
            st = collections.Counter()
            samples = 0
            for r in part:
                ex[opcode(r[ix["Source"]])] += int(r[ix["Instructions Executed"]] or 0)
                samples += int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
                for s in stalls:
                    st[s] += int(r[ix[s]] or 0)
            n = sum(ex.values())
            if not n:
                continue
            t = sum(st.values()) or 1
            print(f"  {name:11s} {n / 1e6:7.1f}M inst, {100 * samples / total:4.1f}% of samples; stalls "
                  + " ".join(f"{s[6:]} {100 * v / t:.0f}%" for s, v in st.most_common(6)))
            print("              " + ", ".join(f"{o} {v / 1e6:.1f}M" for o, v in ex.most_common(12)))
            if TOP:  # the instructions with the most stall samples, with their top reasons
                key = lambda r: int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
                for r in sorted(part, key=key, reverse=True)[:TOP]:
                    why = sorted(((int(r[ix[s]] or 0), s[6:]) for s in stalls), reverse=True)[:2]
                    print(f"              {r[ix['Address']][-6:]} {key(r):6d} samples ({', '.join(f'{w} {v}' for v, w in why)})"
                          f"  {r[ix['Source']].strip()[:70]}")
            if name == "out-of-line":
                for r in part:
                    e = int(r[ix["Instructions Executed"]] or 0)
                    if e > n / 50:
                        print(f"              {r[ix['Address']][-6:]} {e / 1e6:6.2f}M  {r[ix['Source']].strip()[:80]}")


TOP = 0

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--top=")]
    TOP = next((int(a[6:]) for a in sys.argv[1:] if a.startswith("--top=")), 0)
    main(args[0] if args else "out/pf_sass.csv")
