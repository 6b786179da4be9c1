// benchmarks/dev/lenet_cluster.cu -- does spreading ONE image's LeNet-5 forward over a thread-block cluster (2 or 4
// blocks sharing activations through distributed shared memory, DSMEM) cut the single-image kernel latency below
// one block's (the library's one-image predict: one block of 1,024 threads, cpp/fused_lenet.cu)?  Standalone (CUDA
// runtime only, no cydnn), llm.c dev/ style: its own main, a double CPU reference, validation, timing.  On sm_90:
//     nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/lenet_cluster benchmarks/dev/lenet_cluster.cu && /tmp/lenet_cluster
// Exit status: 0 all checks passed, 1 a check failed, 2 a CUDA error.
//
// Modern LeNet-5 (the library's CL = false): 1x28x28 -> conv1 5x5 1->6 + bias + ReLU + max-pool 2 -> conv2 5x5 6->16
// + bias + ReLU + max-pool 2 -> 256 (CHW) -> fc1 120 + ReLU -> fc2 84 + ReLU -> fc3 10 -> softmax; PyTorch layouts,
// He-uniform random weights, one random image (fixed seed), all in device memory; 10 floats out.  One kernel,
// lenet<CS, T, PUSH>, one launch = one cluster of CS blocks of T threads (CS = 1: `block`, the same code with
// __syncthreads for the cluster barriers).  Each block stages the image and its channels' conv weights in shared
// memory.  conv1, conv2: an item is (pooled output, 2x2 window position, part s of S of the CIN*5 kernel rows), a
// pooled output's 4*S items adjacent lanes (summed and max-ed by shuffles); fc1, fc2: L lanes a neuron, weights
// from global; fc3 and softmax on rank 0.  A phase's items are split into CS contiguous ranges, one per rank; S, L
// (Plan) fill a block's threads.  Outputs reach the other blocks (every buffer written once: no reuse hazards) by
//   push  the computing thread stores its value into every rank's copy (DSMEM stores), then cluster.sync();
//   pull  it stores into its own block's copy; after cluster.sync() each block copies the others' shares (DSMEM
//         loads), then __syncthreads.  fc2's outputs go to rank 0 only.
// One row per variant (threads a block, blocks an image): p50, p99 = CUDA events around ONE launch, synchronised
// after each, 2,000 launches after 200 warm-ups (events resolve ~0.5 us); b2b = 2,000 launches in a row between two
// events, us each (may be bound by the host's launch rate); graph p50 = p50 of a CUDA graph holding the one launch
// (what the library replays); max err = max |p - p_ref| (double reference), checked <= 1e-5 with the same argmax on
// a direct and a graph launch, the output NaN-filled before each.  Then the best cluster row against the best block
// row.  Clusters that cannot be resident (cudaOccupancyMaxActiveClusters) are skipped.  First, a CPU emulation of
// every variant (the same decode functions; warps lane by lane with their shuffles; each rank's shared-memory copies,
// NaN until written, and their exchanges) checks that every pooled output and neuron is written exactly once, by
// its owner rank, every kernel row of every conv output is summed once, only staged weights are read, every copy
// a block reads is complete, and the emulated probabilities against the reference.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dev_util.cuh"   // CK (a CUDA error: exit status 2), to_device

namespace cg = cooperative_groups;

#define HD __host__ __device__
#ifdef __CUDA_ARCH__
#define LDG(p) __ldg(p)
#else
#define LDG(p) (*(p))
#endif

constexpr int KS = 5, IN = 28, K1 = 6, K2 = 16, PH1 = 12, PH2 = 4, F1 = 120, F2 = 84, NC = 10;
constexpr int POOL1 = K1 * PH1 * PH1, FLAT = K2 * PH2 * PH2;  // 864, 256
// A block's staged shared memory (floats): the image, conv1's weights and bias, conv2's weights and bias.
constexpr int SX = 0, SW1 = IN * IN, SB1 = SW1 + K1 * KS * KS, SW2 = SB1 + K1, SB2 = SW2 + K2 * K1 * KS * KS;
constexpr int STAGE = SB2 + K2;

struct Params { const float *x, *cw1, *cb1, *cw2, *cb2, *fw1, *fb1, *fw2, *fb2, *fw3, *fb3; float *out; };

// ---------------------------------------------------------------------------------------------------------
// The work split, shared by the kernel and the CPU emulation.  Rank r of cs owns [lo(n, cs, r), lo(n, cs, r + 1))
// of n outputs; owner(i): the rank whose range holds i.
HD inline int lo(int n, int cs, int r) { return r * n / cs; }
HD inline int owner(int i, int n, int cs) { return ((i + 1) * cs - 1) / n; }

// S: parts per conv output (a power of 2, <= 8 and <= the kernel rows); L: lanes per fc output.  The most that keep
// a rank's items within its T threads (one pass where possible).
HD constexpr int conv_split(int pooled, int rows, int cs, int t, int s = 1) {
    return 2 * s <= 8 && 2 * s <= rows && pooled * 4 * 2 * s / cs <= t ? conv_split(pooled, rows, cs, t, 2 * s) : s;
}
HD constexpr int fc_lanes(int n, int t, int l = 32) { return l > 1 && n * l > t ? fc_lanes(n, t, l / 2) : l; }
template <int CS, int T>
struct Plan {
    static constexpr int S1 = conv_split(POOL1, KS, CS, T), S2 = conv_split(FLAT, K1 * KS, CS, T);
    static constexpr int L1 = fc_lanes((F1 + CS - 1) / CS, T), L2 = fc_lanes((F2 + CS - 1) / CS, T);
    static constexpr int L3 = fc_lanes(NC, T);
};

// Whether rank r stages element i of the staged block: the image always; a conv's weights and bias for the
// channels [k0, k1] of the pooled outputs r computes (channel-major).
HD inline bool staged(int i, int cs, int r) {
    if (i < SW1) return true;
    const bool c1 = i < SW2;
    const int n = c1 ? POOL1 : FLAT, per = c1 ? PH1 * PH1 : PH2 * PH2;
    const int k0 = lo(n, cs, r) / per, k1 = (lo(n, cs, r + 1) - 1) / per;
    const int k = c1 ? (i < SB1 ? (i - SW1) / (KS * KS) : i - SB1) : (i < SB2 ? (i - SW2) / (K1 * KS * KS) : i - SB2);
    return k >= k0 && k <= k1;
}
HD inline const float *stage_src(const Params &p, int i) {
    return i < SW1 ? p.x + i : i < SB1 ? p.cw1 + (i - SW1) : i < SW2 ? p.cb1 + (i - SB1)
                   : i < SB2 ? p.cw2 + (i - SW2) : p.cb2 + (i - SB2);
}

// Conv item e = (po*4 + q)*S + s: pooled output po (channel k), the conv output (oy, ox) at window position q,
// kernel rows [t0, t1) of CIN*KS (row t = c*KS + i).
struct Item { int po, k, oy, ox, t0, t1; };
template <int CIN, int H, int S>
HD inline Item decode(int e) {
    constexpr int PH = (H - KS + 1) / 2, ROWS = CIN * KS;
    const int po = e / (4 * S), q = e / S % 4, s = e % S, p = po % (PH * PH);
    return {po, po / (PH * PH), p / PH * 2 + (q >> 1), p % PH * 2 + (q & 1), s * ROWS / S, (s + 1) * ROWS / S};
}
template <int CIN, int H>
HD inline float conv_sum(const float *in, const float *w, const Item &it) {
    float acc = 0.0f;
    for (int t = it.t0; t < it.t1; ++t) {
        const int c = t / KS, i = t - c * KS;
        const float *ip = in + (c * H + it.oy + i) * H + it.ox, *wp = w + (it.k * CIN * KS + t) * KS;
#pragma unroll
        for (int j = 0; j < KS; ++j) acc = fmaf(ip[j], wp[j], acc);
    }
    return acc;
}
// fc output o, lane s of L: inputs s, s + L, ... (a fixed trip count, unrolled: every weight load in flight at once)
template <int IN_F, int L>
HD inline float fc_part(const float *in, const float *W, int o, int s) {
    constexpr int N = IN_F / L;
    const float *w = W + o * IN_F + s;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) acc = fmaf(LDG(w + j * L), in[s + j * L], acc);
    if (IN_F % L != 0 && s < IN_F % L) acc = fmaf(LDG(w + N * L), in[s + N * L], acc);
    return acc;
}

// ---------------------------------------------------------------------------------------------------------
// The kernel.  put: a value into this block's copy (CS = 1, pull) or, push, into rank dst's (-1: every rank's).
template <int CS, bool PUSH>
__device__ __forceinline__ void put(float *buf, int i, float v, int dst) {
    if constexpr (CS == 1 || !PUSH) buf[i] = v;
    else
#pragma unroll
        for (int q = 0; q < CS; ++q)
            if (dst < 0 || q == dst) *cg::this_cluster().map_shared_rank(buf + i, q) = v;
}
// Pull: this block copies the values it does not own from their owners' shared memory.
template <int CS, int T>
__device__ __forceinline__ void gather(float *buf, int n, int rank) {
    for (int i = threadIdx.x; i < n; i += T) {
        const int q = owner(i, n, CS);
        if (q != rank) buf[i] = *cg::this_cluster().map_shared_rank(buf + i, q);
    }
}
// After a phase whose n outputs every block needs.
template <int CS, int T, bool PUSH>
__device__ __forceinline__ void exchange(float *buf, int n, int rank) {
    if constexpr (CS == 1) {
        __syncthreads();
    } else {
        cg::this_cluster().sync();
        if constexpr (!PUSH) gather<CS, T>(buf, n, rank), __syncthreads();
    }
}

template <int CIN, int H, int COUT, int S, int CS, int T, bool PUSH>
__device__ __forceinline__ void conv_phase(const float *in, const float *w, const float *b, float *out, int rank) {
    constexpr int PP = (H - KS + 1) / 2 * ((H - KS + 1) / 2), PER = COUT * PP * 4 * S / CS;
    static_assert(COUT * PP * 4 * S % (32 * CS) == 0 && 4 * S <= 32, "a rank's items: whole warps");
    const int lane = threadIdx.x & 31, end = (rank + 1) * PER;
    for (int e0 = rank * PER + (threadIdx.x & ~31); e0 < end; e0 += T) {
        const Item it = decode<CIN, H, S>(e0 + lane);
        float v = conv_sum<CIN, H>(in, w, it);
#pragma unroll
        for (int o = 1; o < S; o *= 2) v += __shfl_xor_sync(~0u, v, o);  // the S parts
        v = fmaxf(v, __shfl_xor_sync(~0u, v, S));                      // the window (ReLU is monotonic: max first)
        v = fmaxf(v, __shfl_xor_sync(~0u, v, 2 * S));
        if (lane % (4 * S) == 0) put<CS, PUSH>(out, it.po, fmaxf(v + b[it.k], 0.0f), -1);
    }
}

template <int IN_F, int OUT, int L, int CS, int T, bool PUSH, bool RELU>
__device__ __forceinline__ void fc_phase(const float *in, const float *W, const float *b, float *out, int rank,
                                         int dst) {
    const int lane = threadIdx.x & 31, o0 = lo(OUT, CS, rank), n = (lo(OUT, CS, rank + 1) - o0) * L;
    for (int e0 = threadIdx.x & ~31; e0 < n; e0 += T) {  // warp-uniform: every lane reaches the shuffles
        const int e = e0 + lane, o = o0 + e / L;
        float v = e < n ? fc_part<IN_F, L>(in, W, o, e % L) : 0.0f;
#pragma unroll
        for (int off = L / 2; off > 0; off /= 2) v += __shfl_xor_sync(~0u, v, off);
        v += e < n ? LDG(b + o) : 0.0f;
        if (e < n && e % L == 0) put<CS, PUSH>(out, o, RELU ? fmaxf(v, 0.0f) : v, dst);
    }
}

template <int CS, int T, bool PUSH>
__global__ void __launch_bounds__(T) lenet(const Params p) {
    using P = Plan<CS, T>;
    __shared__ __align__(16) float st[STAGE];
    __shared__ float p1[POOL1], p2[FLAT], h1[F1], h2[F2], z[NC];
    const int rank = CS > 1 ? (int)cg::this_cluster().block_rank() : 0;
    if constexpr (CS > 1 && PUSH) cg::this_cluster().barrier_arrive();  // waited for before the first DSMEM store
    constexpr int J = (STAGE + T - 1) / T;  // stage: all of a thread's loads in flight, then its stores
    float r[J];
    auto mine = [&](int j) { return threadIdx.x + j * T < STAGE && staged(threadIdx.x + j * T, CS, rank); };
#pragma unroll
    for (int j = 0; j < J; ++j) r[j] = mine(j) ? LDG(stage_src(p, threadIdx.x + j * T)) : 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j)
        if (mine(j)) st[threadIdx.x + j * T] = r[j];
    __syncthreads();
    if constexpr (CS > 1 && PUSH) cg::this_cluster().barrier_wait();  // every block of the cluster is running
    conv_phase<1, IN, K1, P::S1, CS, T, PUSH>(st + SX, st + SW1, st + SB1, p1, rank);
    exchange<CS, T, PUSH>(p1, POOL1, rank);
    conv_phase<K1, PH1, K2, P::S2, CS, T, PUSH>(p1, st + SW2, st + SB2, p2, rank);
    exchange<CS, T, PUSH>(p2, FLAT, rank);
    fc_phase<FLAT, F1, P::L1, CS, T, PUSH, true>(p2, p.fw1, p.fb1, h1, rank, -1);
    exchange<CS, T, PUSH>(h1, F1, rank);
    fc_phase<F1, F2, P::L2, CS, T, PUSH, true>(h1, p.fw2, p.fb2, h2, rank, 0);
    if constexpr (CS == 1) __syncthreads();
    else cg::this_cluster().sync();
    if (rank != 0) {  // pull: h2 must stay alive until rank 0 has copied it
        if constexpr (CS > 1 && !PUSH) cg::this_cluster().sync();
        return;
    }
    if constexpr (CS > 1 && !PUSH) gather<CS, T>(h2, F2, 0), __syncthreads(), cg::this_cluster().barrier_arrive();
    fc_phase<F2, NC, P::L3, 1, T, false, false>(h2, p.fw3, p.fb3, z, 0, -1);  // rank 0 alone
    __syncthreads();
    if (threadIdx.x < 32) {  // softmax, as the library's: exp(z - max) / sum
        const int lane = threadIdx.x;
        const float v = lane < NC ? z[lane] : -INFINITY;
        float m = v, s;
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
        const float e = s = lane < NC ? expf(v - m) : 0.0f;
        for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(~0u, s, o);
        if (lane < NC) p.out[lane] = e / s;
    }
    if constexpr (CS > 1 && !PUSH) cg::this_cluster().barrier_wait();
}

// ---------------------------------------------------------------------------------------------------------
// The model (x, cw1, cb1, cw2, cb2, fw1, fb1, fw2, fb2, fw3, fb3), the double reference, the CPU emulation.
struct Model { std::vector<float> a[11]; };
static Params params(const float *const *a, float *out) {
    return {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], out};
}

static uint64_t g_rng = 0x2545F4914F6CDD1DULL;
static float uniform() {  // [-1, 1)
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) * (1.0 / (1ULL << 24)) * 2.0 - 1.0);
}
static Model make_model() {  // weights He-uniform, biases PyTorch's default bound, the image in [-1, 1)
    const int n[11] = {IN * IN, K1 * 25, K1, K2 * K1 * 25, K2, F1 * FLAT, F1, F2 * F1, F2, NC * F2, NC};
    const int fan[5] = {25, K1 * 25, FLAT, F1, F2};
    Model m;
    for (int i = 0; i < 11; ++i) {
        const double bound = i == 0 ? 1.0 : i % 2 ? std::sqrt(6.0 / fan[i / 2]) : 1.0 / std::sqrt(fan[i / 2 - 1]);
        for (int j = 0; j < n[i]; ++j) m.a[i].push_back((float)(uniform() * bound));
    }
    return m;
}

static std::vector<double> reference(const Model &m) {
    using V = std::vector<double>;
    auto conv_pool = [&](const V &in, int cin, int h, int wi, int cout) {  // weights m.a[wi], bias m.a[wi + 1]
        const int ph = (h - KS + 1) / 2;
        V out((size_t)cout * ph * ph, 0.0);  // 0: ReLU's floor under the window's max
        for (int k = 0; k < cout; ++k)
            for (int o = 0; o < ph * ph * 4; ++o) {  // o: pooled output * 4 + window position
                const int oy = o / 4 / ph * 2 + o % 4 / 2, ox = o / 4 % ph * 2 + o % 2;
                double s = m.a[wi + 1][k];
                for (int c = 0; c < cin; ++c)
                    for (int t = 0; t < KS * KS; ++t)
                        s += in[(c * h + oy + t / KS) * h + ox + t % KS] * (double)m.a[wi][(k * cin + c) * KS * KS + t];
                out[k * ph * ph + o / 4] = std::max(out[k * ph * ph + o / 4], s);
            }
        return out;
    };
    auto fc = [&](const V &in, int wi, bool relu) {
        V out(m.a[wi + 1].size());
        for (size_t o = 0; o < out.size(); ++o) {
            double s = m.a[wi + 1][o];
            for (size_t i = 0; i < in.size(); ++i) s += (double)m.a[wi][o * in.size() + i] * in[i];
            out[o] = relu ? std::max(s, 0.0) : s;
        }
        return out;
    };
    V z = fc(fc(fc(conv_pool(conv_pool(V(m.a[0].begin(), m.a[0].end()), 1, IN, 1, K1), K1, PH1, 3, K2), 5, true), 7,
                true), 9, false);
    const double mx = *std::max_element(z.begin(), z.end());
    double s = 0.0;
    for (double &v : z) s += (v = std::exp(v - mx));
    for (double &v : z) v /= s;  // softmax
    return z;
}

static double compare(const float *p, const std::vector<double> &ref, bool &ok) {
    double err = 0.0;
    for (int i = 0; i < NC; ++i) {
        const double e = std::fabs((double)p[i] - ref[i]);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
    }
    ok = err <= 1e-5 && std::max_element(p, p + NC) - p == std::max_element(ref.begin(), ref.end()) - ref.begin();
    return err;
}

// Emulation: one vector per rank for each shared buffer (NaN until written); a warp's shuffles lane by lane.
using Copies = std::vector<std::vector<float>>;
template <class Op>
static void xor_lanes(float *v, int off, Op op) {
    float t[32];
    for (int l = 0; l < 32; ++l) t[l] = op(v[l], v[l ^ off]);
    std::copy(t, t + 32, v);
}
static float add(float a, float b) { return a + b; }
static float max2(float a, float b) { return fmaxf(a, b); }
template <int CS, bool PUSH>
static void emu_put(Copies &out, int rank, int i, float v, int dst) {  // as put()
    for (int q = 0; q < CS; ++q)
        if (CS == 1 || !PUSH ? q == rank : dst < 0 || q == dst) out[q][i] = v;
}
template <int CS, bool PUSH>
static void emu_gather(Copies &buf, int n, bool all) {  // pull: as gather() on every rank (or on rank 0)
    if constexpr (CS > 1 && !PUSH)
        for (int r = 0; r < (all ? CS : 1); ++r)
            for (int i = 0; i < n; ++i)
                if (owner(i, n, CS) != r) buf[r][i] = buf[owner(i, n, CS)][i];
}
template <int CIN, int H, int COUT, int S, int CS, int T, bool PUSH>
static void emu_conv(const Copies &in, int in_off, const Copies &st, int w_off, int b_off, Copies &out, bool &ok) {
    constexpr int OH = H - KS + 1, POOLED = COUT * (OH / 2) * (OH / 2), PER = POOLED * 4 * S / CS, ROWS = CIN * KS;
    std::vector<int> taps(COUT * OH * OH * ROWS, 0), writes(POOLED, 0);
    for (int r = 0; r < CS; ++r)
        for (int w = 0; w < T / 32; ++w)
            for (int e0 = r * PER + w * 32; e0 < (r + 1) * PER; e0 += T) {  // as conv_phase's loop
                Item it[32];
                float v[32];
                for (int l = 0; l < 32; ++l) {
                    it[l] = decode<CIN, H, S>(e0 + l);
                    v[l] = conv_sum<CIN, H>(in[r].data() + in_off, st[r].data() + w_off, it[l]);
                    for (int t = it[l].t0; t < it[l].t1; ++t) {
                        ++taps[((it[l].k * OH + it[l].oy) * OH + it[l].ox) * ROWS + t];
                        ok &= staged(w_off + (it[l].k * ROWS + t) * KS, CS, r) && staged(b_off + it[l].k, CS, r);
                    }
                }
                for (int o = 1; o < S; o *= 2) xor_lanes(v, o, add);
                xor_lanes(v, S, max2), xor_lanes(v, 2 * S, max2);
                for (int l = 0; l < 32; l += 4 * S) {
                    ++writes[it[l].po];
                    ok &= owner(it[l].po, POOLED, CS) == r;
                    emu_put<CS, PUSH>(out, r, it[l].po, fmaxf(v[l] + st[r][b_off + it[l].k], 0.0f), -1);
                }
            }
    for (int c : taps) ok &= c == 1;
    for (int c : writes) ok &= c == 1;
    emu_gather<CS, PUSH>(out, POOLED, true);
}
template <int IN_F, int OUT, int L, int CS, int T, bool PUSH, bool RELU>
static void emu_fc(const Copies &in, const float *W, const float *b, Copies &out, int dst, bool &ok) {
    std::vector<int> writes(OUT, 0);
    for (int r = 0; r < CS; ++r) {
        const int o0 = lo(OUT, CS, r), n = (lo(OUT, CS, r + 1) - o0) * L;
        for (int w = 0; w < T / 32; ++w)
            for (int e0 = w * 32; e0 < n; e0 += T) {  // as fc_phase's loop
                float v[32];
                for (int l = 0; l < 32; ++l)
                    v[l] = e0 + l < n ? fc_part<IN_F, L>(in[r].data(), W, o0 + (e0 + l) / L, (e0 + l) % L) : 0.0f;
                for (int off = L / 2; off > 0; off /= 2) xor_lanes(v, off, add);
                for (int l = 0, e = e0, o; l < 32; ++l, ++e)
                    if (e < n && e % L == 0) {
                        ++writes[o = o0 + e / L];
                        ok &= owner(o, OUT, CS) == r;
                        emu_put<CS, PUSH>(out, r, o, RELU ? fmaxf(v[l] + b[o], 0.0f) : v[l] + b[o], dst);
                    }
            }
    }
    for (int c : writes) ok &= c == 1;
    emu_gather<CS, PUSH>(out, OUT, dst < 0);
}
static bool finite(const Copies &c, int ranks) {  // the copies the blocks read: complete
    for (int r = 0; r < ranks; ++r)
        for (float v : c[r]) if (!std::isfinite(v)) return false;
    return true;
}
template <int CS, int T, bool PUSH>
static bool emulate(const Model &m, const std::vector<double> &ref) {
    using P = Plan<CS, T>;
    const float *a[11];
    for (int i = 0; i < 11; ++i) a[i] = m.a[i].data();
    const Params hp = params(a, nullptr);
    auto copies = [](int ranks, int n) { return Copies(ranks, std::vector<float>(n, NAN)); };
    Copies st = copies(CS, STAGE), p1 = copies(CS, POOL1), p2 = copies(CS, FLAT), h1 = copies(CS, F1);
    Copies h2 = copies(CS, F2), z = copies(1, NC);
    for (int r = 0; r < CS; ++r)
        for (int i = 0; i < STAGE; ++i)
            if (staged(i, CS, r)) st[r][i] = *stage_src(hp, i);
    bool ok = true;
    for (int n : {POOL1, FLAT, F1, F2})  // owner() against the ranges, before the exchanges index by it
        for (int i = 0; i < n; ++i) ok &= lo(n, CS, owner(i, n, CS)) <= i && i < lo(n, CS, owner(i, n, CS) + 1);
    if (!ok) return printf("  cs %d: FAILED: owner() disagrees with the ranks' ranges\n", CS), false;
    emu_conv<1, IN, K1, P::S1, CS, T, PUSH>(st, SX, st, SW1, SB1, p1, ok);
    emu_conv<K1, PH1, K2, P::S2, CS, T, PUSH>(p1, 0, st, SW2, SB2, p2, ok);
    emu_fc<FLAT, F1, P::L1, CS, T, PUSH, true>(p2, hp.fw1, hp.fb1, h1, -1, ok);
    emu_fc<F1, F2, P::L2, CS, T, PUSH, true>(h1, hp.fw2, hp.fb2, h2, 0, ok);
    emu_fc<F2, NC, P::L3, 1, T, false, false>(Copies{h2[0]}, hp.fw3, hp.fb3, z, -1, ok);
    ok &= finite(p1, CS) && finite(p2, CS) && finite(h1, CS) && finite(h2, 1);
    const float mx = *std::max_element(z[0].begin(), z[0].end());
    float prob[NC], s = 0.0f;
    for (int i = 0; i < NC; ++i) s += (prob[i] = expf(z[0][i] - mx));
    for (float &v : prob) v /= s;
    bool close;
    const double err = compare(prob, ref, close);
    printf("  cs %d, %4d threads, %-4s: S1 %d S2 %d L1 %2d L2 %2d L3 %2d  max err %.2e  %s\n", CS, T,
           CS == 1 ? "" : PUSH ? "push" : "pull", P::S1, P::S2, P::L1, P::L2, P::L3, err, ok && close ? "ok" : "FAILED");
    return ok && close;
}

// ---------------------------------------------------------------------------------------------------------
// The driver.
struct Variant {  // a kernel and its CPU emulation
    const char *name;
    int cs, threads;
    void (*kernel)(Params);
    bool (*emulate)(const Model &, const std::vector<double> &);
};
#define VAR(name, CS, T, PUSH) {name, CS, T, lenet<CS, T, PUSH>, emulate<CS, T, PUSH>}
static const Variant kVariants[] = {
    VAR("block", 1, 1024, false),         VAR("block", 1, 512, false),
    VAR("cluster2 push", 2, 1024, true),  VAR("cluster2 pull", 2, 1024, false),
    VAR("cluster2 push", 2, 512, true),   VAR("cluster2 pull", 2, 512, false),
    VAR("cluster4 push", 4, 1024, true),  VAR("cluster4 pull", 4, 1024, false),
    VAR("cluster4 push", 4, 512, true),   VAR("cluster4 pull", 4, 512, false),
};
constexpr int kWarm = 200, kRuns = 2000;

// t[0], t[1]: p50, p99 (us) of CUDA events around each of kRuns single launches after kWarm, synchronised after
// each; t[2]: us per launch of kRuns launches in a row between two events.
template <class F>
static void timing(F launch, cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1, double *t) {
    std::vector<float> ms;
    float x;
    for (int i = 0; i < kWarm + kRuns; ++i) {
        CK(cudaEventRecord(e0, s));
        launch();
        CK(cudaEventRecord(e1, s)), CK(cudaEventSynchronize(e1)), CK(cudaEventElapsedTime(&x, e0, e1));
        if (i >= kWarm) ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    t[0] = ms[ms.size() / 2] * 1e3, t[1] = ms[ms.size() * 99 / 100] * 1e3;
    CK(cudaEventRecord(e0, s));
    for (int i = 0; i < kRuns; ++i) launch();
    CK(cudaEventRecord(e1, s)), CK(cudaEventSynchronize(e1)), CK(cudaEventElapsedTime(&x, e0, e1));
    t[2] = x * 1e3 / kRuns;
}
template <class F>  // one checked run, the output filled with NaN first
static double checked(F launch, cudaStream_t s, float *dout, const std::vector<double> &ref, bool &ok) {
    float h[NC];
    CK(cudaMemsetAsync(dout, 0xff, sizeof h, s));
    launch();
    CK(cudaStreamSynchronize(s)), CK(cudaMemcpy(h, dout, sizeof h, cudaMemcpyDeviceToHost));
    return compare(h, ref, ok);
}

int main() {
    const Model m = make_model();
    const std::vector<double> ref = reference(m);
    std::vector<double> top(ref);
    std::sort(top.rbegin(), top.rend());
    printf("reference (double): argmax %d, top two probabilities %.6f %.6f\nCPU emulation of each variant's work "
           "split:\n", (int)(std::max_element(ref.begin(), ref.end()) - ref.begin()), top[0], top[1]);
    bool failed = false;
    for (const Variant &v : kVariants) failed |= !v.emulate(m, ref);
    if (failed) return printf("FAILED: the CPU emulation\n"), 1;

    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("\n%s, %d SMs, sm_%d%d; one image a launch\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);
    if (prop.major < 9) return printf("thread-block clusters need compute capability 9.0 or newer\n"), 2;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)), CK(cudaEventCreate(&e1));
    const float *da[11];
    for (int i = 0; i < 11; ++i) da[i] = to_device(m.a[i]);
    float *dout;
    CK(cudaMalloc(&dout, NC * sizeof(float)));
    const Params dp = params(da, dout);

    printf("  %-14s %7s %6s %8s %8s %8s %9s %10s  %s\n", "variant", "threads", "blocks", "p50 us", "p99 us", "b2b us",
           "graph p50", "max err", "check");
    double best[2][3] = {{1e30, 0, 0}, {1e30, 0, 0}};  // [block, cluster][p50, graph p50, b2b]
    const Variant *bv[2] = {nullptr, nullptr};
    for (const Variant &v : kVariants) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = (unsigned)v.cs, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(v.cs), cfg.blockDim = dim3(v.threads), cfg.stream = s;
        cfg.attrs = attr, cfg.numAttrs = v.cs > 1 ? 1 : 0;  // block: a plain launch
        int n = 1;
        const cudaError_t e = v.cs > 1 ? cudaOccupancyMaxActiveClusters(&n, v.kernel, &cfg) : cudaSuccess;
        if (e != cudaSuccess || n == 0) {
            (void)cudaGetLastError();
            printf("  %-14s %7d %6d  SKIPPED: cudaOccupancyMaxActiveClusters: %s, %d clusters\n", v.name, v.threads,
                   v.cs, cudaGetErrorString(e), n);
            continue;
        }
        auto launch = [&] { CK(cudaLaunchKernelEx(&cfg, v.kernel, dp)); };
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        launch();
        CK(cudaStreamEndCapture(s, &graph)), CK(cudaGraphInstantiate(&exec, graph, 0));
        auto replay = [&] { CK(cudaGraphLaunch(exec, s)); };

        bool ok1, ok2;
        const double err = std::max(checked(launch, s, dout, ref, ok1), checked(replay, s, dout, ref, ok2));
        double t[3], g[3];
        timing(launch, s, e0, e1, t);
        timing(replay, s, e0, e1, g);
        failed |= !(ok1 && ok2);
        printf("  %-14s %7d %6d %8.2f %8.2f %8.2f %9.2f %10.2e  %s\n", v.name, v.threads, v.cs, t[0], t[1], t[2], g[0],
               err, ok1 && ok2 ? "ok" : !ok1 ? "FAILED (direct launch)" : "FAILED (graph launch)");
        const int c = v.cs > 1;
        if (ok1 && ok2 && t[0] < best[c][0]) best[c][0] = t[0], best[c][1] = g[0], best[c][2] = t[2], bv[c] = &v;
        CK(cudaGraphExecDestroy(exec)), CK(cudaGraphDestroy(graph));
    }
    if (bv[0] && bv[1])
        printf("\nsummary: best cluster variant %s (%d threads) vs block (%d threads): p50 %.2f vs %.2f us (%.2fx), "
               "graph p50 %.2f vs %.2f us (%.2fx), b2b %.2f vs %.2f us (%.2fx)\n", bv[1]->name, bv[1]->threads,
               bv[0]->threads, best[1][0], best[0][0], best[0][0] / best[1][0], best[1][1], best[0][1],
               best[0][1] / best[1][1], best[1][2], best[0][2], best[0][2] / best[1][2]);
    else
        printf("\nsummary: no %s variant passed\n", bv[0] ? "cluster" : "block");
    printf("%s\n", failed ? "FAILED: some checks failed" : "all checks passed");
    for (const float *d : da) CK(cudaFree((void *)d));
    CK(cudaFree(dout));
    return failed ? 1 : 0;
}
