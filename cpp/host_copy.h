// host_copy.h -- a host-to-host copy of megabytes split over a few threads (internal, host code only).
//
// One core's memcpy into pinned memory (6-10 GB/s) is slower than the DMA that follows it (20+ GB/s on
// PCIe 5): the numpy-in paths that stage many images in pinned memory (pipe.cu's slots, fastpath.cu's
// LeNet-5 chunks) split the fill over up to `threads` threads, each copying a contiguous slice of at least
// kMinSlice bytes.  Threads are started per fill (tens of us against the milliseconds of a fill); if the
// system refuses a thread, the caller copies that slice itself, so a fill never fails for want of threads.
#pragma once

#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

namespace cydnn {

constexpr size_t kMinSlice = size_t(1) << 20;      // below 1 MiB a slice costs more to start than to copy

// dst <- src (n bytes) with up to `threads` threads, the calling thread taking the last slice.
inline void parallel_copy(void *dst, const void *src, size_t n, int threads) {
    size_t parts = n / kMinSlice;
    if (parts > (size_t)threads) parts = threads;
    if (parts <= 1) {
        std::memcpy(dst, src, n);
        return;
    }
    const size_t slice = (n / parts + 63) & ~size_t(63);    // cache-line aligned slices
    std::vector<std::thread> workers;
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
}

inline int copy_threads() {
    const unsigned hw = std::thread::hardware_concurrency();    // 0 when unknown
    const int half = hw >= 2 ? (int)(hw / 2) : 1;                // leave the other half to the caller's process
    return half < 4 ? half : 4;                                  // 4 outrun the DMA already
}
}  // namespace cydnn
