"""A list-scheduling model of the causal attention backward's task claims (kernels/attention_bwd_kernel.cuh).

A task is one key block of one (batch, kv head) pair; under a causal mask it visits group x (query blocks from
its first visible one) block pairs, so its work falls with its key block. The persistent CTAs claim tasks in
order from a counter, each when it is free. This model takes a task's time as its block-pair count (no per-task
or per-pair fixed cost, every pair alike) and prints each order's makespan over the mean work per CTA (1.0 is
perfect balance):
  pairs  every pair's key blocks in turn, heaviest first (main's order: Kernel::work_of, variants >= 2);
  auto   the last ceil(4 x CTAs / key blocks) pairs key block slowest (branch bwdtail's tail_pairs rule);
  all    every pair key block slowest (one heaviest-first list; the least L2 sharing of Q / dO and dQ rows);
  head split 2 / group: pair order with each pair's query heads over 2 or `group` units (branch bwdsplit).
The model leaves out L2, and L2 decided it: measured on one H100 (session 42, docs/design-attention.md "the claim
order's tail"), auto lost 5-24 % on the causal GQA rows and all lost on every row, where the model promised up to
14 %. Use it for the balance side of an order, beside a measurement of what the order does to L2.

Usage: python scripts/bwd_claim_model.py [--ctas 132]   (the bench's causal shapes, D 128 and D 64)
       python scripts/bwd_claim_model.py --shape B S N KV --block-keys 128
"""

from __future__ import annotations

import argparse
import heapq
import math


def tail_pairs_auto(pairs: int, key_blocks: int, ctas: int) -> int:
    """Branch bwdtail's rule (attention_bwd.cu tail_pairs there): about four waves of tasks claimed heaviest first."""
    return min(pairs, math.ceil(4 * ctas / key_blocks))


def claim_order(pairs: int, key_blocks: int, tail: int) -> list[tuple[int, int]]:
    """(pair, key block) in claim order (branch bwdtail's Kernel::claim_order; tail 0 is main's work_of)."""
    head = [(p, b) for p in range(pairs - tail) for b in range(key_blocks)]
    return head + [(pairs - tail + p, b) for b in range(key_blocks) for p in range(tail)]


def makespan_ratio(batch: int, seq: int, heads: int, kv_heads: int, block_keys: int, ctas: int, tail: int,
                   block_queries: int = 64, split: int = 1) -> float:
    """Makespan / mean work per CTA for a causal self-attention backward (Tq = Tk = seq, no offsets). split: the
    head split (branch bwdsplit, Globals::head_split): each pair is `split` units of group / split query heads, in
    turn, each unit's key blocks fastest (tail 0 only)."""
    key_blocks, query_blocks, group = -(-seq // block_keys), -(-seq // block_queries), heads // kv_heads
    pairs = batch * kv_heads
    work = [group * (query_blocks - (b * block_keys) // block_queries) for b in range(key_blocks)]
    units = pairs * split
    free = [(0, i) for i in range(min(ctas, units * key_blocks))]
    end = 0
    for _, b in claim_order(units, key_blocks, min(tail, units)):
        t, i = heapq.heappop(free)
        t += work[b] / split
        end = max(end, t)
        heapq.heappush(free, (t, i))
    return end / (pairs * sum(work) / len(free))


def row(batch: int, seq: int, heads: int, kv_heads: int, block_keys: int, ctas: int) -> str:
    pairs, key_blocks = batch * kv_heads, -(-seq // block_keys)
    auto = tail_pairs_auto(pairs, key_blocks, ctas)
    ratios = [makespan_ratio(batch, seq, heads, kv_heads, block_keys, ctas, t) for t in (0, auto, pairs)]
    splits = [makespan_ratio(batch, seq, heads, kv_heads, block_keys, ctas, 0, split=math.gcd(s, heads // kv_heads))
              for s in (2, heads // kv_heads)]
    return (f"B{batch:<3} S{seq:<6} N{heads:<3} KV{kv_heads:<3} keys/block {block_keys:<4} pairs {pairs:<5} "
            f"tail {auto:<4} pair order {ratios[0]:.4f}  auto {ratios[1]:.4f}  all {ratios[2]:.4f}  "
            f"head split 2 {splits[0]:.4f}  group {splits[1]:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--shape", type=int, nargs=4, metavar=("B", "S", "N", "KV"))
    ap.add_argument("--block-keys", type=int, default=128, help="128 (D 128, D 64 l2order_dqfirst) or 192 (D 64 w3)")
    a = ap.parse_args()
    if a.shape:
        print(row(*a.shape, a.block_keys, a.ctas))
        return
    # The bench's causal rows: B x S = 64k tokens; D 128 at N 16 (128-key blocks), D 64 at N 32 (w3: 192 keys).
    for block_keys, heads in ((128, 16), (192, 32)):
        for seq in (1024, 4096, 16384, 65536):
            for group in (1, 8):
                print(row(65536 // seq, seq, heads, heads // group, block_keys, a.ctas))


if __name__ == "__main__":
    main()
