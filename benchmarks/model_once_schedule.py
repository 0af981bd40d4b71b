"""A schedule model of convert-once on the persistent grid (no GPU): which converter order and throttle keep the
consumers fed, and how much of the workspace the consumers find in L2.

Causal prompts of equal length, MHA or GQA, BM a multiple of BN. The model:
- `--sms` blocks take work items (query tile, query head) in the kernel's order: query heads in turn, each head's
  items heaviest first (the last query tiles of every sequence first). An item walks its key tiles from its
  diagonal down to 0, one tile per `--step-us`, and waits for a tile until its four quarters are converted.
- `3 * --sms` converter warps take quarters (KV head, tile, quarter) from one counter, `--quarter-us` each, in
  the order `--order` gives a KV head's tiles: `seq_up` (the kernel's: sequence by sequence, bottom up) or
  `top_down` (from every sequence's top tile down). `--ahead N` holds a converter until an item of KV head k - N is
  taken. Both levers were built as kernel macros in session 31 and removed in session 33, when neither won on the
  H100 (benchmarks/NOTES.md).
- L2 is one LRU of `--l2-mb` over quarter-sized pieces: converters read codes and write the workspace through it,
  consumers read the workspace.

Defaults are MHA d256 b4 L4096 (BM 128, BN 64) with session 30's figures. There, the model gives 21.7 us per SM of
consumer waits and the conversion done at ~400 us: `CUKV_ONCE_STATS` measured 19 us and ~390 us.

    PYTHONPATH=. python3 benchmarks/model_once_schedule.py --order seq_up
    PYTHONPATH=. python3 benchmarks/model_once_schedule.py --order top_down
"""
import argparse
import heapq
from collections import OrderedDict

import numpy as np


def once_tile_order(tiles_per_seq) -> np.ndarray:
    """The workspace tiles (sequences' tiles back to back) by distance below their sequence's top tile, longer
    sequences first among equals: the order the heaviest work items demand them in."""
    t = np.asarray(tiles_per_seq, dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(t)[:-1]]).astype(np.int64)
    seq = np.repeat(np.arange(t.size), t)
    n = np.arange(int(t.sum())) - start[seq]
    return np.lexsort((seq, -t[seq], t[seq] - 1 - n)).astype(np.int32)


def tile_order(order, seqs, kv_tiles):
    """A KV head's (sequence, tile) pairs in the converters' order: the kernel's, or from the tops down."""
    if order == "seq_up":
        return [(s, n) for s in range(seqs) for n in range(kv_tiles)]
    return [divmod(int(i), kv_tiles) for i in once_tile_order([kv_tiles] * seqs)]


class LRU:
    def __init__(self, capacity):
        self.capacity, self.size, self.entries, self.hits, self.misses = capacity, 0, OrderedDict(), 0, 0

    def touch(self, key, nbytes, count):
        if key in self.entries:
            self.entries.move_to_end(key)
            self.hits += count
            return
        self.misses += count
        self.entries[key] = nbytes
        self.size += nbytes
        while self.size > self.capacity:
            self.size -= self.entries.popitem(last=False)[1]


def simulate(seqs=4, q_tiles=32, kv_tiles=64, kv_heads=16, group=1, step_us=1.95, quarter_us=9.5, sms=132,
             order="seq_up", ahead=0, l2_mb=50.0, quarter_bytes=16 * 256 * 2 * 2):
    per_q = kv_tiles // q_tiles  # key tiles per query tile
    items = [(k, s, j) for k in range(kv_heads) for _ in range(group) for j in reversed(range(q_tiles))
             for s in range(seqs)]
    quarters = [(k, s, n, q) for k in range(kv_heads) for s, n in tile_order(order, seqs, kv_tiles) for q in range(4)]
    l2 = LRU(int(l2_mb * 2**20))
    events = []  # (time, kind, who, payload, tile): kind 0 converter free, 1 block step, 2 quarter done
    for b in range(min(sms, len(items))):
        heapq.heappush(events, (0.0, 1, b, items[b], per_q * items[b][2] + per_q - 1))
    for c in range(3 * sms):
        heapq.heappush(events, (0.0, 0, c, None, 0))
    next_item, latest, next_quarter = min(sms, len(items)), min(sms, len(items)) - 1, 0
    done, ready, blocked, held = set(), set(), {}, []
    waits = end = conv_end = 0.0
    while events:
        t, kind, who, payload, tile = heapq.heappop(events)
        if kind == 0:
            if next_quarter == len(quarters):
                conv_end = max(conv_end, t)
                continue
            if ahead and quarters[next_quarter][0] - ahead > items[latest][0]:
                held.append(who)
                continue
            k, s, n, q = quarters[next_quarter]
            next_quarter += 1
            l2.touch(("codes", k, s, n, q), quarter_bytes // 2, 0)
            heapq.heappush(events, (t + quarter_us, 2, who, (k, s, n, q), 0))
        elif kind == 2:
            k, s, n, q = payload
            l2.touch(("ws", k, s, n, q), quarter_bytes, 0)
            done.add(payload)
            if all((k, s, n, x) in done for x in range(4)):
                ready.add((k, s, n))
                for b, item, btile, since in blocked.pop((k, s, n), []):
                    waits += t - since
                    heapq.heappush(events, (t, 1, b, item, btile))
            heapq.heappush(events, (t, 0, who, None, 0))
        else:
            k, s, j = payload
            if tile < 0:  # the item is done: take the next
                if next_item < len(items):
                    latest, item = next_item, items[next_item]
                    next_item += 1
                    heapq.heappush(events, (t, 1, who, item, per_q * item[2] + per_q - 1))
                    for c in held:
                        heapq.heappush(events, (t, 0, c, None, 0))
                    held = []
                continue
            if (k, s, tile) not in ready:
                blocked.setdefault((k, s, tile), []).append((who, payload, tile, t))
                continue
            for q in range(4):
                l2.touch(("ws", k, s, tile, q), quarter_bytes, 1)
            end = t + step_us
            heapq.heappush(events, (end, 1, who, payload, tile - 1))
    reads = l2.hits + l2.misses
    return dict(end_us=end, converted_us=conv_end, waits_us_per_sm=waits / sms, ws_reads=reads,
                ws_miss_pct=100 * l2.misses / max(reads, 1), ws_miss_mb=l2.misses * quarter_bytes / 2**20)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--q-tiles", type=int, default=32, help="query tiles per sequence")
    ap.add_argument("--kv-tiles", type=int, default=64, help="key tiles per sequence (a multiple of --q-tiles)")
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--group", type=int, default=1, help="query heads per KV head")
    ap.add_argument("--step-us", type=float, default=1.95, help="one key tile of one item")
    ap.add_argument("--quarter-us", type=float, default=9.5, help="one converted quarter")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--order", choices=["seq_up", "top_down"], default="seq_up")
    ap.add_argument("--ahead", type=int, default=0)
    ap.add_argument("--l2-mb", type=float, default=50.0)
    a = ap.parse_args()
    r = simulate(a.seqs, a.q_tiles, a.kv_tiles, a.kv_heads, a.group, a.step_us, a.quarter_us, a.sms, a.order, a.ahead,
                 a.l2_mb)
    print(f"order {a.order} ahead {a.ahead} L2 {a.l2_mb} MB: end {r['end_us']:.0f} us, converted by "
          f"{r['converted_us']:.0f} us, consumer waits {r['waits_us_per_sm']:.1f} us/SM, workspace reads missing L2 "
          f"{r['ws_miss_pct']:.1f}% ({r['ws_miss_mb']:.0f} MB)")


if __name__ == "__main__":
    main()
