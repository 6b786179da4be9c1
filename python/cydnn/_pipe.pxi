# _pipe.pxi -- the copy pipe (cpp/pipe.cu), included by _C.pyx: numpy chunks up and results down
# while the device computes the chunk before (CompiledInference uses it for inputs of many chunks).


cdef class Pipe:
    """Two slots of pinned buffers of ``in_bytes`` and ``out_bytes`` (cydnn_pipe_*); a slot is filled
    by ``threads`` host threads (0: half the cores, at most 4)."""
    cdef cydnnPipe *p
    cdef readonly size_t in_bytes, out_bytes

    def __cinit__(self, size_t in_bytes, size_t out_bytes, int threads=0):
        self.p = NULL
        self.in_bytes, self.out_bytes = in_bytes, out_bytes
        check(cydnn_pipe_create(ctx(), in_bytes, out_bytes, threads, &self.p), "pipe")

    @property
    def threads(self):
        """Host threads that fill a slot."""
        return cydnn_pipe_threads(self.p)

    def __dealloc__(self):
        if self.p != NULL:
            cydnn_pipe_destroy(self.p)
            self.p = NULL

    def upload(self, int slot, DeviceArray dst not None, cnp.ndarray src not None):
        """dst (device) <- src (host, C-contiguous, the same number of bytes), through slot's buffer."""
        if not src.flags.c_contiguous or <size_t>src.nbytes != dst.nbytes:
            raise ValueError(f"pipe.upload: src must be C-contiguous with {dst.nbytes} bytes, got {src.nbytes}")
        cdef void *d = dst.data()
        cdef const void *s = cnp.PyArray_DATA(src)
        cdef size_t n = src.nbytes
        cdef cydnnStatus_t st
        with nogil:                 # the copy takes milliseconds: other Python threads may run meanwhile
            st = cydnn_pipe_upload(self.p, slot, d, s, n)
        check(st, "pipe")

    def download(self, int slot, DeviceArray src not None):
        """Queue src (device) into slot's output buffer."""
        check(cydnn_pipe_download(self.p, slot, src.data(), src.nbytes), "pipe")

    def finish(self, int slot, cnp.ndarray dst not None):
        """Wait for slot's download and copy it into dst (host, C-contiguous, the downloaded bytes)."""
        if not dst.flags.c_contiguous:
            raise ValueError("pipe.finish: dst must be C-contiguous")
        check(cydnn_pipe_finish(self.p, slot, cnp.PyArray_DATA(dst), dst.nbytes), "pipe")


def host_copy(cnp.ndarray dst not None, cnp.ndarray src not None, int threads=0):
    """dst <- src (host arrays, C-contiguous, the same bytes) as a pipe fills a slot (cpp/host_copy.h): slices of
    1 MiB or more over up to ``threads`` threads (0: as a pipe).  Returns how: "one" memcpy, "pool" (the
    process's copy threads) or "spawn" (threads started for this copy: the pool was busy).  No device needed."""
    if not dst.flags.c_contiguous or not src.flags.c_contiguous or dst.nbytes != src.nbytes:
        raise ValueError(f"host_copy: dst and src must be C-contiguous with the same bytes, got {dst.nbytes} "
                         f"and {src.nbytes}")
    if not dst.flags.writeable:
        raise ValueError("host_copy: dst is read-only")
    if threads < 0:
        raise ValueError(f"host_copy: threads must be 0 (as a pipe) or more, got {threads}")
    cdef void *d = cnp.PyArray_DATA(dst)
    cdef const void *s = cnp.PyArray_DATA(src)
    cdef size_t n = src.nbytes
    if n and <size_t>d < <size_t>s + n and <size_t>s < <size_t>d + n:
        raise ValueError("host_copy: dst and src overlap")
    cdef int how
    with nogil:
        how = cydnn_host_copy(d, s, n, threads)
    return ("one", "pool", "spawn")[how]
