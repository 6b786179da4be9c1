// memory.cuh -- the caching device allocator (internal).
#pragma once

#include <map>
#include <mutex>
#include <unordered_map>

#include "common.cuh"

namespace cydnn {

// A caching allocator for one device and one stream.
//
// cudaMalloc and cudaFree are slow and cudaFree synchronises the device, so
// freed blocks are kept and handed out again.  Requests are rounded up to a
// size class (512 B steps up to 1 MiB, 2 MiB steps above); a request is served
// by the smallest cached block of at least its class and at most twice it
// (best fit).  All work is on one stream, so a block freed by the host can be
// reused at once: kernels queued later run after the kernels that used it.
class MemoryPool {
public:
    MemoryPool(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
    ~MemoryPool() = default;  // the process exits with its context: nothing to free

    cydnnStatus_t allocate(size_t nbytes, void **ptr);
    cydnnStatus_t release(void *ptr);
    cydnnStatus_t empty_cache();
    cydnnMemoryStats stats();
    void reset_peak();
    void set_poison(bool on) { poison_ = on; }

    static size_t round_size(size_t nbytes);

private:
    struct Block {
        size_t size;       // rounded size, as obtained from cudaMalloc
        size_t requested;  // what the caller asked for
    };
    cydnnStatus_t empty_cache_locked();

    int device_;
    cudaStream_t stream_;
    bool poison_ = false;
    std::mutex mutex_;
    std::multimap<size_t, void *> cached_;       // free blocks by size
    std::unordered_map<void *, Block> blocks_;    // every block the pool owns (live or cached)
    std::unordered_map<void *, bool> live_;       // blocks handed out now
    cydnnMemoryStats stats_ = {};
};

}  // namespace cydnn
