# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c
"""Compiled twins of the hot loops of ``cydnn.ops.cpu`` (OpenMP, the GIL released).

Every function writes into arrays its caller allocated and validated (the ops
in conv.py, pool.py, elementwise.py and updates.py check shapes and dtypes
first, with the same messages as the numpy twin); nothing here allocates,
checks or raises.  ``real`` is float32 or float64, the dtype of the op.
``nthreads`` is the OpenMP thread count of the call, chosen by the caller from
the size of the work (``_threads.omp_threads``).

Each loop computes what the numpy twin computes, with the same operations in
the same order where that is cheap (the elementwise ops, the optimizer
updates, the adds of col2im and pooling backward), so most results are equal
bit for bit; the tests compare every kernel with the twin on many shapes.

Layouts, as in conv.py: ``cols`` is (c*kh*kw, n*oh*ow), rows ordered (c, p, q),
columns ordered (b, i, j) or, when ``batch_inner``, (i, j, b).

    _kernels_conv.pxi    im2col / col2im, the layout changes of convolution
    _kernels_pool.pxi    ReLU, max and average pooling
    _kernels_update.pxi  SGD, Adam / AdamW
    _kernels_direct.pxi  float32 kernels in C with runtime ISA dispatch (_kernels_isa.h): direct
                         convolution (_kernels_direct.h), the row-by-row input gradient
                         (_kernels_rows.h), 2 x 2 / 2 max pooling (_kernels_pool.h)
"""
from cython.parallel cimport prange
from libc.math cimport INFINITY, sqrt, sqrtf
from libc.string cimport memcpy, memset

ctypedef fused real:
    float
    double


cdef inline Py_ssize_t _first_inside(Py_ssize_t size, Py_ssize_t n_out, Py_ssize_t stride,
                                     Py_ssize_t offset) noexcept nogil:
    """The first output o whose input o*stride + offset is >= 0 (n_out if none)."""
    cdef Py_ssize_t lo = 0
    while lo < n_out and lo * stride + offset < 0:
        lo += 1
    return lo


cdef inline Py_ssize_t _end_inside(Py_ssize_t size, Py_ssize_t n_out, Py_ssize_t stride,
                                   Py_ssize_t offset, Py_ssize_t first) noexcept nogil:
    """One past the last output o >= first whose input o*stride + offset is < size.

    With :func:`_first_inside`: the outputs in [first, end) read inside [0, size).  (Two
    functions returning values, not one writing through pointers: inside a prange, Cython makes
    a variable thread-private only where it sees it assigned.)"""
    cdef Py_ssize_t hi = n_out
    while hi > first and (hi - 1) * stride + offset >= size:
        hi -= 1
    return hi


include "_kernels_conv.pxi"
include "_kernels_pool.pxi"
include "_kernels_update.pxi"
include "_kernels_direct.pxi"
