#!/usr/bin/env python3
"""How many shared-memory wavefronts does tile 7 (cpp/fused_net_wsplit.cuh, a 2x2 pooling folded in) spend on its
activation and weight reads, against a conflict-free ideal?  A model on the CPU of conv_wsplit's split of work (the
block's work items over `per` threads, S ways of input channels, staged weight chunks) and of wsplit_sums' loads,
instruction by instruction and warp by warp, for one block (rank 0) of a cluster:

  - a 32-bit load (an activation): the lanes' word addresses grouped by bank (address mod 32); the wavefronts are
    the most distinct addresses in one bank (a broadcast of one address costs nothing more);
  - a 128-bit load (four staged weights): the distinct 16-byte addresses grouped by their 4-bank group, the most in
    one group.

At one wavefront a clock (the H100's shared memory serves 128 bytes a cycle an SM) and ~2 GHz, the count is a floor
on the layer's time from its loads alone.  Session 34: the CNN's layers 24->48 and 48->96 on 16 blocks spend
5,364 and 4,644 wavefronts (2.7 and 2.3 us; the loads alone would need 1,620 each), with the 32-bit activation
loads 3.9x and 3.3x their ideal -- the same picture as ncu's 2.9-way conflicts over the whole kernel (67,933
shared-load requests, 196,979 wavefronts; this model's block: ~3,650 requests for the three convolutions).  Why:
a lane's 2x2 window reads columns 2j + dx + kx - 1, so a warp's lanes hit even or odd banks only, and rows two
apart (2W floats) and the ways' planes (H*W floats) fall on the same banks for W = 16 and 8.

    python3 benchmarks/dev/wsplit_banks.py                      # the CNN's three convolutions at 16 blocks
    python3 benchmarks/dev/wsplit_banks.py 24,16,16,48 --ranks 8

Not a measurement: a model of the kernel's address pattern, to judge remappings before writing them (a lane pair
sharing a window, one column each, would read consecutive columns).  It follows the kernel as of session 35 (the
4x4 patch: ``patch=True``); where the kernel changes, this file must follow it.

Session 35 (the defaults: the CNN's table at 16 blocks): the patch's activation loads are 276 / 2,208 / 1,920
wavefronts for the CNN's three layers against an ideal of 144 / 576 / 576 (the lane pairs: 162 / 648 / 1,008).
Of the flips tried (every choice of a lane bit 2-4 or window-row bit 0-2 for columns and for rows, searched),
columns flipped by lane bit 4 and rows by lane bit 3 ("lane bits 4, 3") reach the ideal on all three: ~0.07, 0.8
and 0.7 us of loads at 2 GHz, for 32 selects an input channel.  Session 36 timed that flip in the CNN's generated
kernel (a patch, since deleted: benchmarks/dev/README.md): no gain (21.76 against 21.63 us of stamps).
"""
import argparse
from collections import defaultdict

THREADS = 512         # kWsplitThreads


def split(C, H, W, K, ranks, rank, scratch, wcap, ks=3):
    """conv_wsplit's numbers for a 2x2-pooled layer (stride 1, padding ks // 2): work items a block, ways, the
    block's first item and count, its staged channels and their row length, the input channels a chunk."""
    kk = ks * ks
    QH, QW = H // 2, W // 2
    cog, pxg = (K + 3) // 4, QW
    row_items = QH * pxg
    items = cog * row_items
    per = -(-items // ranks)
    ways = min(THREADS // per, C, scratch // (16 * per))
    lo = per * rank
    hi = min(lo + per, items)
    c_lo = (lo // row_items) * 4
    c_span = min(((hi - 1) // row_items + 1) * 4, K) - c_lo
    cs = (c_span + 3) // 4 * 4
    fit = wcap // (cs * kk)
    chunk = C if fit <= 0 else min(fit, C)
    return dict(per=per, ways=ways, lo=lo, n_items=hi - lo, row_items=row_items, pxg=pxg, c_lo=c_lo, cs=cs,
                chunk=chunk, kk=kk)


def _lds32(out, addrs):
    """One warp's 32-bit shared load (word addresses): the most distinct addresses in one bank."""
    banks = defaultdict(set)
    for addr in addrs:
        banks[addr % 32].add(addr)
    if banks:
        out["lds32"] += max(len(v) for v in banks.values())
        out["lds32_ideal"] += 1


def _lds128(out, addrs):
    """One warp's 128-bit shared load (word addresses of float4s): the most distinct ones in one 4-bank group."""
    groups = defaultdict(set)
    for addr in addrs:
        groups[(addr // 4) % 8].add(addr // 4)
    if groups:
        out["lds128"] += max(len(v) for v in groups.values())
        out["lds128_ideal"] += 1


def _timed(out):
    out["us_at_2ghz"] = round((out["lds32"] + out["lds128"]) / 2e3, 2)
    out["ideal_us"] = round((out["lds32_ideal"] + out["lds128_ideal"]) / 2e3, 2)
    return out


def _shift(W):
    """The bit of a window row that moves its first pixel's bank by another 32-word row: rows of windows are 2W words
    apart, so for W >= 16 every window row starts on the same banks, for W = 8 every other one (16 apart)."""
    return max(0, (16 // W).bit_length() - 1) if W < 16 else 0


# (whether a lane loads its patch's columns in the order 1, 0, 3, 2; whether its rows in that order) from its lane,
# window row y0 and the plane's width W: at each load, flipped lanes read the other parity of banks (columns) or
# banks W words away (rows)
FLIPS = {
    "none": lambda lane, y0, W: (0, 0),
    "half-warp": lambda lane, y0, W: (lane >> 4, 0),                                  # the upper 16 lanes' columns
    "window row": lambda lane, y0, W: ((y0 >> _shift(W)) & 1, 0),                     # every other bank row's columns
    "window row, rows": lambda lane, y0, W: ((y0 >> _shift(W)) & 1, (y0 >> (_shift(W) + 1)) & 1),   # and rows
    "lane bits 4, 3": lambda lane, y0, W: ((lane >> 4) & 1, (lane >> 3) & 1),       # columns by bit 4, rows by 3
}


def wavefronts(C, H, W, K, ranks=16, rank=0, scratch=6144, wcap=3456, ks=3, patch=False, flip="none"):
    """Today's loads; ``patch``: each window's (ks + 1)^2 input patch loaded once an input channel (wsplit_sums since
    session 35) instead of ks^2 x 4 pixels; ``flip`` (a FLIPS key, with the patch): lanes that load the patch's
    columns or rows in the order 1, 0, 3, 2 -- at each load the flipped lanes read other banks."""
    s = split(C, H, W, K, ranks, rank, scratch, wcap, ks)
    per, S, pad = s["per"], s["ways"], ks // 2
    lanes = []                                  # (active, way, window row, window column, first channel)
    for t in range(THREADS):
        i, way = t % per, t // per
        active = way < S and i < s["n_items"]
        item = s["lo"] + (i if active else 0)
        g, rest = divmod(item, s["row_items"])
        y0, j = divmod(rest, s["pxg"])
        lanes.append((active, way, y0, j, 4 * g))
    out = dict(lds32=0, lds32_ideal=0, lds128=0, lds128_ideal=0, **{k: s[k] for k in ("per", "ways", "chunk", "cs")})
    for w in range(THREADS // 32):
        warp = lanes[32 * w:32 * w + 32]
        for c0 in range(0, C, s["chunk"]):
            c1 = min(c0 + s["chunk"], C)
            rounds = max((len(range(c0 + way, c1, S)) for a, way, *_ in warp if a), default=0)
            for r in range(rounds):
                if patch:
                    live = [(lane, way, y0, j, co0) for lane, (a, way, y0, j, co0) in enumerate(warp)
                            if a and c0 + way + r * S < c1]
                    for pr in range(ks + 1):
                        for pc in range(ks + 1):
                            _lds32(out, [(c0 + way + r * S) * H * W + y * W + x for lane, way, y0, j, co0 in live
                                         for fc, fr in [FLIPS[flip](lane, y0, W)]
                                         for y, x in [(2 * y0 - pad + (pr ^ fr), 2 * j - pad + (pc ^ fc))]
                                         if 0 <= y < H and 0 <= x < W])
                    for tap in range(s["kk"]):
                        _lds128(out, [((way + r * S) * s["kk"] + tap) * s["cs"] + (co0 - s["c_lo"])
                                      for lane, way, y0, j, co0 in live])
                    continue
                for ky in range(ks):
                    for kx in range(ks):
                        live = [(way, y0, j, co0) for a, way, y0, j, co0 in warp if a and c0 + way + r * S < c1]
                        _lds128(out, [((way + r * S) * s["kk"] + ky * ks + kx) * s["cs"] + (co0 - s["c_lo"])
                                      for way, y0, j, co0 in live])      # the weights' float4
                        for p in range(4):            # the window's four pixels, row by row
                            _lds32(out, [(c0 + way + r * S) * H * W + y * W + x for way, y0, j, co0 in live
                                         for y, x in [(2 * y0 + p // 2 - pad + ky, 2 * j + p % 2 - pad + kx)]
                                         if 0 <= y < H and 0 <= x < W])
    return _timed(out)


def pair_wavefronts(C, H, W, K, ranks=16, rank=0, scratch=6144, ks=3, swap=True):
    """The remapping to judge (not in the kernel): a lane pair shares a window of 8 channels (two groups), lane dx
    taking column dx of both rows, so that a warp's lanes read consecutive columns; with ``swap`` the upper half-warp
    reads the window's two rows in the other order (rows 2W + W apart: the other half of the banks).  16 sums a
    thread as today, S ways with the scratch holding 16 values a thread; the weights' rows staged as today (8
    channels: two float4 a tap, assumed staged whole: wcap not modelled)."""
    kk, pad = ks * ks, ks // 2
    QH, QW = H // 2, W // 2
    pairs = -(-((K + 3) // 4) // 2)
    row_items = QH * QW
    items = pairs * row_items
    per = -(-items // ranks)                    # window pairs a block
    tpw = 2 * per                               # threads a way
    S = min(THREADS // tpw, C, scratch // (16 * tpw))
    lo = per * rank
    n_items = min(per, items - lo)
    c_lo = (lo // row_items) * 8
    cs = (min(((lo + n_items - 1) // row_items + 1) * 8, K) - c_lo + 3) // 4 * 4
    lanes = []
    for t in range(THREADS):
        i, way = t % tpw, t // tpw
        item, dx = divmod(i, 2)
        active = way < S and item < n_items
        g, rest = divmod(lo + (item if active else 0), row_items)
        y0, j = divmod(rest, QW)
        lanes.append((active, way, y0, j, dx, (t % 32) >> 4, 8 * g))
    out = dict(lds32=0, lds32_ideal=0, lds128=0, lds128_ideal=0, per=per, ways=S)
    for w in range(THREADS // 32):
        warp = lanes[32 * w:32 * w + 32]
        rounds = max((len(range(way, C, S)) for a, way, *_ in warp if a), default=0)
        for r in range(rounds):
            for ky in range(ks):
                for kx in range(ks):
                    live = [(way + r * S, y0, j, dx, h, co0) for a, way, y0, j, dx, h, co0 in warp
                            if a and way + r * S < C]
                    for half in range(2):       # the 8 channels' two float4
                        _lds128(out, [(ci * kk + ky * ks + kx) * cs + (co0 - c_lo) + 4 * half
                                      for ci, y0, j, dx, h, co0 in live])
                    for rr in range(2):
                        _lds32(out, [ci * H * W + y * W + x for ci, y0, j, dx, h, co0 in live
                                     for y, x in [(2 * y0 + (rr ^ h if swap else rr) - pad + ky, 2 * j + dx - pad + kx)]
                                     if 0 <= y < H and 0 <= x < W])
    return _timed(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("layers", nargs="*", default=["3,32,32,24", "24,16,16,48", "48,8,8,96"],
                   help="C,H,W,K of 3x3 convolutions (padding 1) with a 2x2 max pooling folded in")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--scratch", type=int, default=6144, help="floats of the layer's input buffer (the table's)")
    p.add_argument("--wcap", type=int, default=3456, help="floats of staged weights (the table's)")
    a = p.parse_args()
    for layer in a.layers:
        C, H, W, K = (int(v) for v in layer.split(","))
        print(f"conv {C}->{K} on {H}x{W} +pool, {a.ranks} blocks: today", wavefronts(C, H, W, K, a.ranks, 0,
                                                                                  a.scratch, a.wcap))
        print(f"{'':>34s} lane pairs", pair_wavefronts(C, H, W, K, a.ranks, 0, a.scratch))
        for flip in FLIPS:
            print(f"{'':>34s} 4x4 patch, flip {flip}:", wavefronts(C, H, W, K, a.ranks, 0, a.scratch, a.wcap,
                                                                       patch=True, flip=flip))


if __name__ == "__main__":
    main()
