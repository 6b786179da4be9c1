// host_copy.h -- a host-to-host copy of megabytes split over a few threads (internal, host code only).
//
// One core's memcpy into pinned memory (6-10 GB/s) is slower than the DMA that follows it (20+ GB/s on
// PCIe 5): the numpy-in paths that stage many images in pinned memory (pipe.cu's slots, fastpath.cu's
// LeNet-5 chunks) split the fill over up to `threads` threads, each copying a contiguous slice of at least
// kMinSlice bytes, the calling thread taking the last one.
//
// The other slices go to a pool of threads that live for the process (CopyPool): on the H100's host,
// benchmarks/dev/host_upload.cu moved 10,000 MNIST images (31 MB, chunks of 1,024 and 4,096 images) in
// 1.25-1.70 ms with 4 pooled threads against 1.70-2.59 ms with 4 threads started per fill (session 34).
// The pool is made on the first fill that needs it, grows to the threads asked for (at most kMaxCopyThreads), and
// its threads sleep on a condition variable between fills.  It never blocks a caller that cannot have it:
//   - one fill at a time: a fill that finds the pool busy (another thread's fill) starts its own threads;
//   - after fork() the child's pool is a new one (the parent's threads do not exist there; the pid tells);
//   - if the system refuses a thread, the slices left over are copied by the caller.
// The pool is never destroyed: its threads block in a wait and end with the process.
#pragma once

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

namespace cydnn {

constexpr size_t kMinSlice = size_t(1) << 20;      // below 1 MiB a slice costs more to hand out than to copy
constexpr int kMaxCopyThreads = 64;                // the most threads a fill takes (a pipe's, cydnn_host_copy's)

// How a fill was done (parallel_copy's answer, for tests): one memcpy, the pool, or threads started for it.
enum CopyWay { kCopyOne = 0, kCopyPool = 1, kCopySpawn = 2 };

class CopyPool {
public:
    // dst <- src: `parts` - 1 slices of `slice` bytes to the pool's threads, the rest here.  False (nothing
    // copied) when the pool is busy with another caller's fill or has no thread.
    bool copy(char *dst, const char *src, size_t n, size_t parts, size_t slice) {
        std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        grow((int)parts - 1);
        size_t given = parts - 1 < (size_t)workers_ ? parts - 1 : (size_t)workers_;
        if (given == 0) return false;
        {
            std::lock_guard<std::mutex> g(m_);
            dst_ = dst, src_ = src, slice_ = slice, given_ = given;
            left_.store((int)given, std::memory_order_relaxed);
            ++gen_;
        }
        cv_.notify_all();
        const size_t done = given * slice;
        std::memcpy(dst + done, src + done, n - done);
        while (left_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
        return true;
    }

    // The pool of this process (made now if need be), or nullptr when another thread is making it.  The pid is
    // the pool's own (one pointer to load): a pid and a pointer kept apart could be read half old, half new by a
    // child's thread while another makes the child's pool, and hand it the parent's, whose threads it has not.
    static CopyPool *of_this_process() {
        static std::atomic<CopyPool *> pool{nullptr};
        static std::mutex making;
        const pid_t pid = getpid();
        CopyPool *p = pool.load(std::memory_order_acquire);
        if (p != nullptr && p->pid_ == pid) return p;
        // None yet, or the parent's (after fork): a new one.  try_lock: a mutex copied locked by fork()
        // must not hang the child, which then starts its own threads for this fill.
        std::unique_lock<std::mutex> l(making, std::try_to_lock);
        if (!l.owns_lock()) return nullptr;
        p = pool.load(std::memory_order_acquire);
        if (p != nullptr && p->pid_ == pid) return p;
        p = new (std::nothrow) CopyPool(pid);                 // never freed (see the top of the file)
        if (p != nullptr) pool.store(p, std::memory_order_release);
        return p;
    }

private:
    explicit CopyPool(pid_t pid) : pid_(pid) {}

    // Workers up to `want` (under busy_): a refused thread leaves the pool as it is.
    void grow(int want) {
        if (want > kMaxCopyThreads) want = kMaxCopyThreads;
        try {
            while (workers_ < want) {
                std::thread(&CopyPool::run, this, workers_, gen_).detach();
                ++workers_;
            }
        } catch (const std::system_error &) {
        } catch (const std::bad_alloc &) {
        }
    }

    // seen: the generation when the thread was made (gen_ changes under busy_ only, which grow's caller holds),
    // so the fill about to start is a new one to it however late the thread starts running.
    void run(int i, unsigned long long seen) {
        for (;;) {
            std::unique_lock<std::mutex> l(m_);
            cv_.wait(l, [&] { return gen_ != seen; });
            seen = gen_;
            if ((size_t)i >= given_) continue;
            char *dst = dst_ + (size_t)i * slice_;
            const char *src = src_ + (size_t)i * slice_;
            const size_t n = slice_;
            l.unlock();
            std::memcpy(dst, src, n);
            left_.fetch_sub(1, std::memory_order_release);
        }
    }

    std::mutex busy_;                    // held by the caller of a fill from start to end
    std::mutex m_;                       // the fill's description below
    std::condition_variable cv_;
    unsigned long long gen_ = 0;         // one per fill
    char *dst_ = nullptr;
    const char *src_ = nullptr;
    size_t slice_ = 0, given_ = 0;       // workers 0 .. given_ - 1 copy slice i
    std::atomic<int> left_{0};           // slices not yet copied by the workers
    int workers_ = 0;                    // changed under busy_ only
    const pid_t pid_;                    // the process whose threads these are
};

// dst <- src (n bytes) with up to `threads` threads, the calling thread taking the last slice.
inline CopyWay parallel_copy(void *dst, const void *src, size_t n, int threads) {
    size_t parts = n / kMinSlice;
    if (parts > (size_t)threads) parts = threads;
    if (parts <= 1) {
        std::memcpy(dst, src, n);
        return kCopyOne;
    }
    const size_t slice = (n / parts + 63) & ~size_t(63);    // cache-line aligned slices; (parts-1)*slice < n
    CopyPool *pool = CopyPool::of_this_process();
    if (pool != nullptr && pool->copy((char *)dst, (const char *)src, n, parts, slice)) return kCopyPool;
    std::vector<std::thread> workers;                        // the pool is busy: threads for this fill
    size_t done = 0;                                         // bytes handed out so far
    try {
        workers.reserve(parts - 1);
        for (size_t k = 0; k + 1 < parts && done + slice < n; ++k, done += slice)
            workers.emplace_back([=] { std::memcpy((char *)dst + done, (const char *)src + done, slice); });
    } catch (const std::system_error &) {   // no thread to be had: the rest is copied here
    } catch (const std::bad_alloc &) {
    }
    std::memcpy((char *)dst + done, (const char *)src + done, n - done);
    for (auto &w : workers) w.join();
    return kCopySpawn;
}

inline int copy_threads() {
    const unsigned hw = std::thread::hardware_concurrency();    // 0 when unknown
    const int half = hw >= 2 ? (int)(hw / 2) : 1;                // leave the other half to the caller's process
    return half < 4 ? half : 4;                                  // 4 outrun the DMA already
}
}  // namespace cydnn
