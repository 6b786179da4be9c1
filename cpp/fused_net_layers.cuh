// fused_net_layers.cuh -- the fused network's layers other than the convolutions (linear, pooling,
// global average pooling, epilogue only), the input's load and one image's whole forward, as
// block-cooperative __device__ functions of one cluster.  Included by fused_net.cu (one launch a
// call) and fused_net_resident.cu (a resident kernel that serves one-image calls), each inside its
// sm_90 guard, each with its own load macros (fused_net_conv.cuh: CYDNN_NET_LDW, CYDNN_NET_LDX).
#pragma once

#include "fused_net_conv.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
namespace {

// Linear: a warp takes ROWS output features at once, the lanes split the inputs (coalesced rows
// of the weight, float4 where every row starts on 16 bytes), a warp reduction per row: many
// loads in flight, which a one-image forward needs (it reads each weight once: latency-bound).
// Where a block has few rows (a layer of few outputs spread over a cluster: 8 rows a block for 128
// outputs at 16 blocks, most warps idle), the warps of a row group split its inputs P ways instead,
// each part reduced by its warp and the P parts added in part order through `part` (32 floats of
// shared memory; nullptr: no split), so P times the loads are in flight.  In the generated kernels
// on the H100 (docs/performance.md, session 26) the all-conv net's 2048 -> 10 layer: 22.2 -> 20.1 us
// for the whole image.
constexpr int ROWS = 4;

// The ways linear_layer splits a row group's inputs for a block of `rows` rows and `n` input steps
// (float4s or floats), `warps` warps: 1 (no split) unless every part gets a warp's width of inputs
// and the parts fit in 32 floats.
__device__ __forceinline__ int linear_parts(int rows, int n, int warps) {
    const int groups = (rows + ROWS - 1) / ROWS;
    if (groups == 0 || groups * ROWS > 16) return 1;
    int parts = warps / groups;
    if (parts > 32 / (groups * ROWS)) parts = 32 / (groups * ROWS);
    if (parts > n / 32) parts = n / 32;
    return parts >= 2 ? parts : 1;
}

// Rows o0 .. o0 + ROWS of the weight (a row past hi: read, not stored) against inputs k0, k0 + 32, ...
// < k1 (in float4s where vec), lane by lane; then reduced over the warp (every lane holds the sums).
__device__ __forceinline__ void linear_rows(const cydnnNetLayer &L, const float *in, long o0, long hi, bool vec,
                                            int k0, int k1, float (&acc)[ROWS]) {
    const int IN = L.c, lane = threadIdx.x % 32;
    const float *wr[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        acc[r] = 0.0f;
        wr[r] = L.weight + (o0 + r < hi ? o0 + r : o0) * IN;
    }
    if (vec) {
        const float4 *x4 = reinterpret_cast<const float4 *>(in);
#pragma unroll 2
        for (int i = k0 + lane; i < k1; i += 32) {
            const float4 x = x4[i];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float4 w = CYDNN_NET_LDW(reinterpret_cast<const float4 *>(wr[r]) + i);
                acc[r] = fmaf(w.x, x.x, fmaf(w.y, x.y, fmaf(w.z, x.z, fmaf(w.w, x.w, acc[r]))));
            }
        }
    } else {
#pragma unroll 4
        for (int i = k0 + lane; i < k1; i += 32) {
            const float x = in[i];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(CYDNN_NET_LDW(wr[r] + i), x, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
}

// `local`: the block stores its outputs into its own `next` only (the next layer is a tail, linear_tail, which
// reads only the block's own share): no distributed stores, and the caller's barrier a __syncthreads.
CYDNN_NET_FN void linear_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                             int rank, int ranks, float *part = nullptr, bool local = false) {
    const int IN = L.c;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    long lo, hi;
    share(L.k, rank, ranks, lo, hi);
    const bool vec = IN % 4 == 0 && (reinterpret_cast<uintptr_t>(L.weight) & 15) == 0;
    const int n = vec ? IN / 4 : IN, rows = (int)(hi - lo);
    // parts == 1: warp w takes row groups w, w + warps, ... over all the inputs; else warp w takes part
    // w % parts of row group w / parts (one group each: parts * groups <= warps).  One call of
    // linear_rows either way (NVRTC's time grows with every inlined copy).
    const int parts = part == nullptr ? 1 : linear_parts(rows, n, warps);
    const int g = warp / parts, p = warp - g * parts, each = (n + parts - 1) / parts;
    const int k0 = p * each, k1 = k0 + each < n ? k0 + each : n;
    for (long o0 = lo + (long)g * ROWS; o0 < hi; o0 += (long)(warps / parts) * ROWS) {
        float acc[ROWS];
        linear_rows(L, in, o0, hi, vec, k0, k1, acc);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const long o = o0 + r;
            if (parts > 1) {
                if (lane == 0) part[(g * ROWS + r) * parts + p] = acc[r];
            } else if (local) {
                if (o < hi && lane == 0) next[o] = epilogue(L, acc[r], (int)o);
            } else if (o < hi && lane < ranks) {
                cluster.map_shared_rank(next, lane)[o] = epilogue(L, acc[r], (int)o);
            }
        }
    }
    if (parts == 1) return;                           // block-uniform
    __syncthreads();
    for (int t = threadIdx.x; t < rows * (local ? 1 : ranks); t += blockDim.x) {
        const int row = t % rows, to = t / rows;
        float s = 0.0f;
        for (int q = 0; q < parts; ++q) s += part[row * parts + q];
        (local ? next : cluster.map_shared_rank(next, to))[lo + row] = epilogue(L, s, (int)(lo + row));
    }
}

// A tail: the last layer, linear, of few outputs (a table's linear layer of tile 1; compiler/fused_net.py marks
// it).  Every block holds its own share [lo, hi) of the input (share(L.c, ...), as the layer before gave it: a
// linear layer before a tail stores only into its own block, `local`), multiplies it by those columns of the
// weight -- a warp an output, the lanes over the share, a warp reduction -- and stores the L.k partial sums into
// rank 0's `in` after the input, at L.c + rank * L.k (rank 0 reads nothing there until the barrier after this
// layer; L.c + 16 * L.k floats fit: cydnn_fused_net_check).  After that cluster barrier rank 0 adds them up
// (linear_tail_sum).  Against a linear layer: no output broadcast, and the layer before needs no cluster barrier.
CYDNN_NET_FN void linear_tail(const cydnnNetLayer &L, float *in, cg::cluster_group &cluster, int rank, int ranks) {
    const long IN = L.c;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    long lo, hi;
    share(IN, rank, ranks, lo, hi);
    float *partial = cluster.map_shared_rank(in, 0) + IN + (long)rank * L.k;
    for (int j = warp; j < L.k; j += warps) {
        const float *wr = L.weight + (long)j * IN;
        float acc = 0.0f;
        for (long o = lo + lane; o < hi; o += 32) acc = fmaf(CYDNN_NET_LDW(wr + o), in[o], acc);
        for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) partial[j] = acc;
    }
}

// Rank 0, after the barrier that follows linear_tail: output j = the epilogue of the blocks' partial sums added in
// rank order, into `next`; then a block barrier (write_output reads them).
CYDNN_NET_FN void linear_tail_sum(const cydnnNetLayer &L, const float *in, float *next, int ranks) {
    const float *partial = in + L.c;
    for (int j = threadIdx.x; j < L.k; j += blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < ranks; ++r) s += partial[(long)r * L.k + j];
        next[j] = epilogue(L, s, j);
    }
    __syncthreads();
}

// Max or average pooling with PyTorch's rules: max ignores padding and NaN
// (strictly greater wins, from -inf); average divides by kh*kw, padding
// counted as zeros (count_include_pad).  Global average pooling is the
// average over the whole plane.
CYDNN_NET_FN void pool_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                           int rank, int ranks, bool is_max) {
    const int H = L.h, W = L.w, OH = L.oh, OW = L.ow;
    long lo, hi;
    share((long)L.c * OH * OW, rank, ranks, lo, hi);
    for (long o = lo + threadIdx.x; o < hi; o += blockDim.x) {
        const int c = (int)(o / ((long)OH * OW));
        const int rest = (int)(o - (long)c * OH * OW);
        const int oy = rest / OW, ox = rest - oy * OW;
        const float *plane = in + (long)c * H * W;
        float v = is_max ? -INFINITY : 0.0f;
        for (int ky = 0; ky < L.kh; ++ky) {
            const int iy = oy * L.sh - L.ph + ky;
            if (iy < 0 || iy >= H) continue;
            for (int kx = 0; kx < L.kw; ++kx) {
                const int ix = ox * L.sw - L.pw + kx;
                if (ix < 0 || ix >= W) continue;
                const float x = plane[(long)iy * W + ix];
                if (is_max) {
                    if (x > v) v = x;
                } else {
                    v += x;
                }
            }
        }
        if (!is_max) v /= (float)(L.kh * L.kw);
        store_all(cluster, next, ranks, o, epilogue(L, v, c));
    }
}

// Global average pooling: a warp per channel.
CYDNN_NET_FN void gap_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                          int rank, int ranks) {
    const int HW = L.h * L.w;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    long lo, hi;
    share(L.c, rank, ranks, lo, hi);
    for (long c = lo + warp; c < hi; c += warps) {
        float acc = 0.0f;
        for (int i = lane; i < HW; i += 32) acc += in[c * HW + i];
        for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane < ranks) cluster.map_shared_rank(next, lane)[c] = epilogue(L, acc / (float)HW, (int)c);
    }
}

// Epilogue only (an activation or batch norm with nothing before it to ride on).
CYDNN_NET_FN void epilogue_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                               int rank, int ranks) {
    const long inner = (long)L.h * L.w, total = (long)L.c * inner;
    long lo, hi;
    share(total, rank, ranks, lo, hi);
    for (long i = lo + threadIdx.x; i < hi; i += blockDim.x)
        store_all(cluster, next, ranks, i, epilogue(L, in[i], (int)(i / inner)));
}

// The image into `cur` of every block.  Each block reads only its share of the input (x may be
// mapped host memory, read over PCIe: a round trip of a microsecond or more) and stores it into
// every block of the cluster.  The reads are issued before the first cluster barrier (a block
// may write another's shared memory only once that block has started), so that their latency
// overlaps the barrier's; a thread holds up to kInRegs of them, which covers a share of
// kInRegs * kNetThreads values (16 K: any cluster size for a 3x32x32 image).  Plain loads: the
// read-only path is not for mapped memory.
constexpr int kInRegs = 8;

CYDNN_NET_FN void load_input(const float *src, long in_size, float *cur, cg::cluster_group &cluster, int rank,
                           int ranks) {
    long lo, hi;
    share(in_size, rank, ranks, lo, hi);
    // the values a thread holds: of the largest share (share's), kWsplitThreads threads (blockDim.x: every kernel
    // that calls this one -- fused_net.cu's, fused_net_resident.cu's, fused_train.cu's -- asserts so); a constant
    // where in_size and ranks are (a generated kernel), so the slots past it and the loop below are not compiled
    const long per = (in_size + ranks - 1) / ranks;
    const int regs = (int)((per + kWsplitThreads - 1) / kWsplitThreads);
    if (regs <= kInRegs) {
        float v[kInRegs];
#pragma unroll
        for (int u = 0; u < kInRegs; ++u) {
            const long i = lo + threadIdx.x + (long)u * blockDim.x;
            v[u] = u < regs && i < hi ? CYDNN_NET_LDX(src + i) : 0.0f;
        }
        cluster.sync();   // every block has started: its shared memory may be written
#pragma unroll
        for (int u = 0; u < kInRegs; ++u) {
            const long i = lo + threadIdx.x + (long)u * blockDim.x;
            if (u < regs && i < hi) store_all(cluster, cur, ranks, i, v[u]);
        }
    } else {
        cluster.sync();
        for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) store_all(cluster, cur, ranks, i, CYDNN_NET_LDX(src + i));
    }
    cluster.sync();       // every block holds the whole image
}


// The maximum m of z[0..n) and the sum s of exp(z - m), by block reductions through red (32 floats of
// the block's shared memory); every thread gets both.
CYDNN_NET_FN void softmax_stats(const float *z, long n, float *red, float &m, float &s) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    m = -INFINITY;
    for (long i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, z[i]);
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = -INFINITY;
    for (int w = 0; w < warps; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    s = 0.0f;
    for (long i = threadIdx.x; i < n; i += blockDim.x) s += expf(z[i] - m);
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    s = 0.0f;
    for (int w = 0; w < warps; ++w) s += red[w];
}

// Rank 0's last step: y (out_size values) from the last activation `cur`, softmax'd where asked.
CYDNN_NET_FN void write_output(const float *cur, float *y, long out_size, bool softmax, float *red) {
    if (!softmax) {
        for (long i = threadIdx.x; i < out_size; i += blockDim.x) y[i] = cur[i];
        return;
    }
    float m, s;
    softmax_stats(cur, out_size, red, m, s);
    for (long i = threadIdx.x; i < out_size; i += blockDim.x) y[i] = expf(cur[i] - m) / s;
}

// One image through the whole table: x (in_size values) into the two ping-pong buffers of every
// block of the cluster, the layers, and rank 0 writes y (out_size values; softmax'd where the table
// says).  Every block of the cluster calls it; red: 32 floats of the block's shared memory.  (A
// kernel generated for one network, compiler/fused_net_gen.py, writes this loop out, one layer
// function call a layer with the shapes as constants.)
CYDNN_NET_FN void forward_image(const cydnnNet &net, const float *x, float *y, float *smem, float *red,
                                int buf_floats, cg::cluster_group &cluster, int rank, int ranks) {
    float *cur = smem, *next = smem + buf_floats, *wbuf = smem + 2L * buf_floats;
    load_input(x, net.in_size, cur, cluster, rank, ranks);
    for (int l = 0; l < net.num_layers; ++l) {
        const cydnnNetLayer &L = net.layers[l];
        // a linear layer before a tail keeps its outputs in its own block (linear_layer's `local`)
        const bool local = l + 1 < net.num_layers && net.layers[l + 1].op == CYDNN_NET_LINEAR &&
                           net.layers[l + 1].tile == 1 && L.op == CYDNN_NET_LINEAR;
        switch (L.op) {
            case CYDNN_NET_CONV:
                conv_dispatch(L, cur, next, cluster, rank, ranks, wbuf, net.wcap, cur, buf_floats);
                break;
            case CYDNN_NET_LINEAR:
                if (L.tile == 1)
                    linear_tail(L, cur, cluster, rank, ranks);
                else
                    linear_layer(L, cur, next, cluster, rank, ranks, red, local);
                break;
            case CYDNN_NET_MAX_POOL: pool_layer(L, cur, next, cluster, rank, ranks, true); break;
            case CYDNN_NET_AVG_POOL: pool_layer(L, cur, next, cluster, rank, ranks, false); break;
            case CYDNN_NET_GLOBAL_AVG_POOL: gap_layer(L, cur, next, cluster, rank, ranks); break;
            default: epilogue_layer(L, cur, next, cluster, rank, ranks); break;
        }
        if (local) {
            __syncthreads();  // the tail reads only this block's own share
        } else {
            cluster.sync();   // every block's slice has landed everywhere; nobody reads `cur` any more
        }
        if (L.op == CYDNN_NET_LINEAR && L.tile == 1 && rank == 0) linear_tail_sum(L, cur, next, ranks);
        float *t = cur;
        cur = next;
        next = t;
    }
    if (rank == 0) write_output(cur, y, net.out_size, net.softmax != 0, red);
}

}  // namespace
#endif  // sm_90
