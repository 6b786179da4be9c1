// benchmarks/dev/host_upload.cu -- what bounds a numpy call of 10,000 images: 31 MB of float32 in the caller's
// pageable memory, uploaded chunk by chunk while the device computes the chunk before (cpp/pipe.cu, cpp/fastpath.cu's
// LeNet-5 chunks)?  Issue 14 asks for 1.5x PyTorch's images/s; the zoo's small networks reached 1.10-2.3x over
// session 33's runs, with both sides moving 20-40 % from run to run, and a probe could not tell 1 fill thread from 8.
// Standalone (CUDA runtime only, no cydnn), llm.c dev/ style:
//     nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/host_upload benchmarks/dev/host_upload.cu && /tmp/host_upload
//     /tmp/host_upload --cpu      (the host fills alone, into plain memory: runs without a GPU)
// Exit status: 0 all checks passed, 1 a check failed, 2 a CUDA error.
//
// Every strategy moves the whole input into one device buffer, C images a chunk, and launches a stand-in for the
// plan per chunk: a kernel that adds the chunk's 32-bit words into a checksum (wrapping, so in any order) and, with
// --compute-us K, holds its first block for K us (a plan's graph).  Strategies:
//   pageable   cudaMemcpyAsync straight from the caller's pageable memory (the driver stages it: what PyTorch's
//              torch.from_numpy(x).cuda() does)
//   spawn/N    into one of two pinned slots, the fill split over N threads started per fill (cpp/host_copy.h's
//              parallel_copy, the library today; N = 1: one memcpy), then cudaMemcpyAsync on a copy stream
//   pool/N     the same with N threads that live across fills (a persistent pool)
//   register   cudaHostRegister of the whole input once per call, the chunks copied straight from it, unregistered
//              at the end (no host copy; the registration's own cost is in the time)
// One row per (strategy, chunk, K): median and best of 15 calls (ms), GB/s of the median, the checksum against the
// host's.  The calls repeat in rounds, every strategy once a round, so that a slow moment of the host hits all.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dev_util.cuh"   // CK (a CUDA error: exit status 2)

constexpr size_t kImages = 10000, kImageBytes = 784 * 4;   // MNIST float32
constexpr size_t kTotal = kImages * kImageBytes;            // 31.4 MB
constexpr size_t kMinSlice = size_t(1) << 20;               // as cpp/host_copy.h

static double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ------------------------------------------------------------------------------------------------ host fills
// The slices of a fill: as host_copy.h's parallel_copy (at most `threads`, each >= kMinSlice, cache-line aligned).
static std::vector<std::pair<size_t, size_t>> slices(size_t n, int threads) {
    size_t parts = std::min(n / kMinSlice, (size_t)threads);
    if (parts <= 1) return {{0, n}};
    const size_t slice = (n / parts + 63) & ~size_t(63);
    std::vector<std::pair<size_t, size_t>> out;
    size_t done = 0;
    for (size_t k = 0; k + 1 < parts && done + slice < n; ++k, done += slice) out.push_back({done, slice});
    out.push_back({done, n - done});   // the caller's
    return out;
}

static void spawn_copy(void *dst, const void *src, size_t n, int threads) {
    const auto s = slices(n, threads);
    std::vector<std::thread> workers;
    for (size_t k = 0; k + 1 < s.size(); ++k)
        workers.emplace_back([=] { std::memcpy((char *)dst + s[k].first, (const char *)src + s[k].first, s[k].second); });
    std::memcpy((char *)dst + s.back().first, (const char *)src + s.back().first, s.back().second);
    for (auto &w : workers) w.join();
}

// N - 1 threads that wait for a fill; the caller takes the last slice and waits for the others.
class Pool {
public:
    explicit Pool(int threads) : n_(threads) {
        for (int i = 0; i + 1 < n_; ++i) workers_.emplace_back([this, i] { run(i); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto &w : workers_) w.join();
    }
    void copy(void *dst, const void *src, size_t n) {
        const auto s = slices(n, n_);
        {
            std::lock_guard<std::mutex> g(m_);
            dst_ = (char *)dst, src_ = (const char *)src, s_ = s;
            left_.store((int)s.size() - 1);
            ++gen_;
        }
        cv_.notify_all();
        std::memcpy((char *)dst + s.back().first, (const char *)src + s.back().first, s.back().second);
        while (left_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
    }

private:
    void run(int i) {
        uint64_t seen = 0;
        for (;;) {
            std::unique_lock<std::mutex> l(m_);
            cv_.wait(l, [&] { return stop_ || gen_ != seen; });
            if (stop_) return;
            seen = gen_;
            const bool mine = (size_t)i + 1 < s_.size();
            const auto part = mine ? s_[i] : std::pair<size_t, size_t>{0, 0};
            char *dst = dst_;
            const char *src = src_;
            l.unlock();
            if (mine) {
                std::memcpy(dst + part.first, src + part.first, part.second);
                left_.fetch_sub(1, std::memory_order_release);
            }
        }
    }
    int n_;
    std::vector<std::thread> workers_;
    std::mutex m_;
    std::condition_variable cv_;
    bool stop_ = false;
    uint64_t gen_ = 0;
    char *dst_ = nullptr;
    const char *src_ = nullptr;
    std::vector<std::pair<size_t, size_t>> s_;
    std::atomic<int> left_{0};
};

static uint64_t host_sum(const void *p, size_t n) {
    uint32_t s = 0;
    const uint32_t *w = (const uint32_t *)p;
    for (size_t i = 0; i < n / 4; ++i) s += w[i];
    return s;
}

// ------------------------------------------------------------------------------------------------ device side
__global__ void chunk_kernel(const uint32_t *x, size_t words, unsigned long long *sum, long long hold_ns) {
    if (hold_ns > 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while ((long long)(t - t0) < hold_ns);
    }
    uint32_t s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
        s += x[i];
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(~0u, s, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(sum, (unsigned long long)s);
}

struct Device {
    char *dx = nullptr;
    unsigned long long *sum = nullptr;
    void *slot[2] = {};
    cudaStream_t main = nullptr, copy = nullptr;
    cudaEvent_t uploaded[2] = {};
};

// One call of a strategy: the whole input up, a kernel per chunk; returns the checksum (mod 2^32).
static uint32_t one_call(Device &d, const std::string &how, int threads, Pool *pool, const char *src, size_t chunk,
                         long long hold_ns) {
    CK(cudaMemsetAsync(d.sum, 0, sizeof(unsigned long long), d.main));
    if (how == "register") CK(cudaHostRegister((void *)src, kTotal, cudaHostRegisterDefault));
    for (size_t off = 0, k = 0; off < kTotal; off += chunk, ++k) {
        const size_t n = std::min(chunk, kTotal - off);
        const int slot = (int)(k & 1);
        if (how == "pageable" || how == "register") {
            CK(cudaMemcpyAsync(d.dx + off, src + off, n, cudaMemcpyHostToDevice, d.copy));
        } else {
            CK(cudaEventSynchronize(d.uploaded[slot]));   // the slot's last upload has left it
            if (pool != nullptr) pool->copy(d.slot[slot], src + off, n);
            else spawn_copy(d.slot[slot], src + off, n, threads);
            CK(cudaMemcpyAsync(d.dx + off, d.slot[slot], n, cudaMemcpyHostToDevice, d.copy));
        }
        CK(cudaEventRecord(d.uploaded[slot], d.copy));
        CK(cudaStreamWaitEvent(d.main, d.uploaded[slot], 0));
        chunk_kernel<<<132, 256, 0, d.main>>>((const uint32_t *)(d.dx + off), n / 4, d.sum, hold_ns);
        CK(cudaGetLastError());
    }
    unsigned long long s = 0;
    CK(cudaMemcpyAsync(&s, d.sum, sizeof(s), cudaMemcpyDeviceToHost, d.main));
    CK(cudaStreamSynchronize(d.main));
    if (how == "register") CK(cudaHostUnregister((void *)src));
    return (uint32_t)s;
}

struct Row { std::string how; int threads; std::vector<double> ms; bool ok = true; };

int main(int argc, char **argv) {
    const bool cpu = argc > 1 && std::string(argv[1]) == "--cpu";
    long long hold_us = 0;
    for (int i = 1; i + 1 < argc; ++i)
        if (std::string(argv[i]) == "--compute-us") hold_us = atoll(argv[i + 1]);
    std::vector<char> src(kTotal);   // the caller's array, pageable and touched (as a numpy array is)
    for (size_t i = 0; i < kTotal; ++i) src[i] = (char)(i * 2654435761u >> 13);
    const uint32_t want = (uint32_t)host_sum(src.data(), kTotal);
    const size_t chunk_bytes = 4096 * kImageBytes;
    int status = 0;

    if (cpu) {   // the fills alone, into plain memory: every byte must arrive
        std::vector<char> dst(chunk_bytes);
        for (int t : {1, 2, 4, 8}) {
            Pool pool(t);
            for (int p = 0; p < 2; ++p) {
                double best = 1e30;
                bool ok = true;
                for (int r = 0; r < 9; ++r) {
                    std::memset(dst.data(), 0, dst.size());
                    const double t0 = now_ms();
                    for (size_t off = 0; off + chunk_bytes <= kTotal; off += chunk_bytes) {
                        if (p) pool.copy(dst.data(), src.data() + off, chunk_bytes);
                        else spawn_copy(dst.data(), src.data() + off, chunk_bytes, t);
                        ok &= std::memcmp(dst.data(), src.data() + off, chunk_bytes) == 0;
                    }
                    best = std::min(best, now_ms() - t0);
                }
                printf("cpu %-6s/%d: 2 fills of %zu bytes: best %.3f ms  %s\n", p ? "pool" : "spawn", t, chunk_bytes,
                       best, ok ? "ok" : "FAILED");
                status |= !ok;
            }
        }
        return status;
    }

    Device d;
    CK(cudaMalloc(&d.dx, kTotal));
    CK(cudaMalloc(&d.sum, sizeof(unsigned long long)));
    CK(cudaStreamCreateWithFlags(&d.main, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&d.copy, cudaStreamNonBlocking));
    for (int s = 0; s < 2; ++s) {
        CK(cudaHostAlloc(&d.slot[s], chunk_bytes, cudaHostAllocDefault));
        CK(cudaEventCreateWithFlags(&d.uploaded[s], cudaEventDisableTiming));
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s; %zu images of %zu bytes (%.1f MB) from pageable memory; host threads %u\n", prop.name, kImages,
           kImageBytes, kTotal / 1e6, std::thread::hardware_concurrency());
    for (long long hold : {0LL, hold_us > 0 ? hold_us : 50LL}) {
        for (size_t images : {1024, 4096}) {
            const size_t chunk = images * kImageBytes;
            std::vector<Row> rows = {{"pageable", 0, {}}, {"spawn", 1, {}}, {"spawn", 2, {}}, {"spawn", 4, {}},
                                     {"spawn", 8, {}},    {"pool", 2, {}},  {"pool", 4, {}},  {"pool", 8, {}},
                                     {"register", 0, {}}};
            std::vector<std::unique_ptr<Pool>> pools;
            for (auto &r : rows) pools.emplace_back(r.how == "pool" ? new Pool(r.threads) : nullptr);
            for (int round = 0; round < 17; ++round)
                for (size_t i = 0; i < rows.size(); ++i) {
                    const double t0 = now_ms();
                    const uint32_t got = one_call(d, rows[i].how, rows[i].threads, pools[i].get(), src.data(), chunk,
                                                  hold * 1000);
                    const double ms = now_ms() - t0;
                    if (round >= 2) rows[i].ms.push_back(ms);   // two warm-up rounds
                    rows[i].ok &= got == want;
                }
            printf("\nchunks of %zu images, a kernel holding %lld us per chunk\n", images, hold);
            printf("  %-10s threads  median ms  best ms  GB/s (median)  images/s (median)  check\n", "strategy");
            for (auto &r : rows) {
                std::sort(r.ms.begin(), r.ms.end());
                const double med = r.ms[r.ms.size() / 2];
                printf("  %-10s %7d  %9.3f  %7.3f  %13.1f  %17.0f  %s\n", r.how.c_str(), r.threads, med, r.ms[0],
                       kTotal / med / 1e6, kImages / med * 1e3, r.ok ? "ok" : "FAILED");
                status |= !r.ok;
            }
        }
    }
    printf("\n%s\n", status ? "a check FAILED" : "all checks passed");
    return status;
}
