"""The parts of ops/cpu that mutation testing found unchecked (docs/mutation/ops-cpu-rest.md):
gather_batch_chw's refusals word for word, the batch builders' defaults and their random flips
and shifts against a pure-Python SplitMix64, the kernel selection (set_kernels, $CYDNN_CPU_KERNELS),
and the thread policy of ``_threads`` (environment thresholds, available cores, BLAS and OpenMP
thread counts, BlasThreads' save and restore) with the libraries and the machine stood in for."""
import sys

import numpy as np
import pytest

from cydnn.ops import cpu
from cydnn.ops.cpu import _threads, data, kernels

M64 = (1 << 64) - 1


def splitmix64(z):
    """The reference SplitMix64 finaliser, in Python integers."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_shift_flip(seed, batch, max_shift):
    """(sy, sx, flip) per row, as the docstrings of shifts and flips define them."""
    out = []
    for b in range(batch):
        r = splitmix64(seed ^ splitmix64(b))
        span = 2 * max_shift + 1
        out.append(((r >> 32) % span - max_shift, (r & 0xFFFFFFFF) % span - max_shift, splitmix64(r) >> 63 == 1))
    return out


def ref_batch_chw(images, indices, mean, std, pad, max_shift, flip, seed):
    """gather_batch_chw by its docstring, one image and one pixel at a time."""
    n, c, h, w = images.shape
    x = np.zeros((len(indices), c, h + 2 * pad, w + 2 * pad), np.float32)
    for b, (sy, sx, mirrored) in enumerate(ref_shift_flip(seed, len(indices), max_shift)):
        img = images[indices[b]]
        if flip and mirrored:
            img = img[..., ::-1]
        for i in range(h):
            for j in range(w):
                if 0 <= i - sy < h and 0 <= j - sx < w:
                    x[b, :, pad + i, pad + j] = img[:, i - sy, j - sx]
    mean = np.broadcast_to(np.asarray(mean, np.float32), (c,))
    std = np.broadcast_to(np.asarray(std, np.float32), (c,))
    return (x / np.float32(255) - mean[None, :, None, None]) / std[None, :, None, None]


@pytest.fixture
def images():
    return np.random.default_rng(0).integers(0, 256, (5, 3, 6, 7), dtype=np.uint8)


# ------------------------------------------------------------------------ batches
def test_flips_and_shifts_follow_splitmix64():
    for seed in (0, 1, 2**64 - 1):
        ref = ref_shift_flip(seed, 16, 3)
        sy, sx = data.shifts(seed, 16, 3)
        assert sy.tolist() == [r[0] for r in ref] and sx.tolist() == [r[1] for r in ref]
        assert data.flips(seed, 16).tolist() == [r[2] for r in ref]
    assert 0 < sum(data.flips(7, 64)) < 64


@pytest.mark.parametrize("pad, max_shift, flip, seed", [(0, 2, True, 0), (1, 3, True, 5), (2, 0, False, 1)])
def test_gather_batch_chw_against_the_pixel_loop(images, pad, max_shift, flip, seed):
    idx = np.array([4, 0, 2, 2, 1, 3], np.int64)
    mean, std = [0.1, 0.2, 0.3], [0.5, 1.0, 2.0]
    x, y = data.gather_batch_chw(images, np.arange(5), idx, mean, std, pad, max_shift, flip, seed)
    np.testing.assert_array_equal(x, ref_batch_chw(images, idx, mean, std, pad, max_shift, flip, seed))
    assert y.dtype == np.int32 and y.tolist() == idx.tolist()


def test_defaults_are_no_pad_no_shift_no_flip_seed_0(images):
    idx = np.array([1, 3], np.int64)
    x, y = data.gather_batch_chw(images, None, idx, 0.5, 0.25)
    assert y is None and x.shape == (2, 3, 6, 7)
    np.testing.assert_array_equal(x, ref_batch_chw(images, idx, 0.5, 0.25, 0, 0, False, 0))
    np.testing.assert_array_equal(data.gather_batch_chw(images, None, idx, 0.5, 0.25, max_shift=2, flip=True)[0],
                                  ref_batch_chw(images, idx, 0.5, 0.25, 0, 2, True, 0))
    gray = images[:, 0]
    x, _ = data.gather_batch(gray, None, idx, 0.5, 0.25)
    np.testing.assert_array_equal(x, ref_batch_chw(images[:, :1], idx, 0.5, 0.25, 0, 0, False, 0))
    np.testing.assert_array_equal(data.gather_batch(gray, None, idx, 0.5, 0.25, max_shift=2)[0],
                                  ref_batch_chw(images[:, :1], idx, 0.5, 0.25, 0, 2, False, 0))


@pytest.mark.parametrize("sy, sx", [([0, 2, -7, 1], [0, -1, 3, 9]),      # both ways, past the frame
                                    ([0, 1, -1, 0], [0, 0, 0, 0]),      # vertical only, by one
                                    ([0, 0, 0, 0], [1, 0, -1, 0]),      # horizontal only, by one
                                    ([0, 0, 0, 0], [0, 0, 0, 0])])      # none
def test_shifted_moves_uint8_pixels(sy, sx):
    frames = np.random.default_rng(1).integers(1, 256, (4, 5, 6), dtype=np.uint8)
    sy, sx = np.array(sy), np.array(sx)
    out = data._shifted(frames, sy, sx)
    assert out.dtype == np.uint8 and out.shape == frames.shape
    for b in range(4):
        for i in range(5):
            for j in range(6):
                inside = 0 <= i - sy[b] < 5 and 0 <= j - sx[b] < 6
                assert out[b, i, j] == (frames[b, i - sy[b], j - sx[b]] if inside else 0)


def test_the_statistics_come_back_one_per_channel(images):
    idx = np.array([0], np.int64)
    shape, mean, std, seed = data.check_gather_batch_chw(images, None, idx, 0.5, [1, 2, 3], 1, 0, False, 9)
    assert shape == (1, 3, 8, 9) and seed == 9
    assert mean.dtype == std.dtype == np.float32 and mean.tolist() == [0.5] * 3 and std.tolist() == [1, 2, 3]
    two = images[:, :2]
    x, _ = data.gather_batch_chw(two, None, idx, [0.0, 1.0], [1.0, 2.0])
    np.testing.assert_array_equal(x, ref_batch_chw(two, idx, [0.0, 1.0], [1.0, 2.0], 0, 0, False, 0))


def chw(images, labels=None, indices=np.array([0]), mean=0.5, std=0.5, pad=0, max_shift=0, flip=False, seed=0):
    """``"<Error>: <message>"`` of gather_batch_chw on these arguments, or "accepted"."""
    try:
        data.gather_batch_chw(images, labels, indices, mean, std, pad, max_shift, flip, seed)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_gather_batch_chw_refusals_word_for_word(images):
    idx = np.array([0], np.int64)
    assert chw(images[:, 0]) == ("ValueError: gather_batch_chw: images must have rank 4 (n_images, channels, h, w), "
                                 "got rank 3 (images (5, 6, 7))")
    wide = np.zeros((1, 65, 1, 1), np.uint8)
    assert chw(wide) == "ValueError: gather_batch_chw: images must have 1 to 64 channels, got 65 (images (1, 65, 1, 1))"
    assert chw(wide[:, :64]) == "accepted"
    assert chw(images, np.zeros(5)) == (
        "TypeError: gather_batch_chw: labels must have an integer dtype, got float64 (labels (5,))")
    assert chw(images, np.zeros((5, 1), np.int64)) == (
        "ValueError: gather_batch_chw: labels must have rank 1, got rank 2 (labels (5, 1))")
    assert chw(images, np.zeros(3, np.int64)) == (
        "ValueError: gather_batch_chw: labels has 3 entries but images has 5 (images (5, 3, 6, 7), labels (3,))")
    assert chw(images, None, np.zeros(1)) == (
        "TypeError: gather_batch_chw: indices must have an integer dtype, got float64 (indices (1,))")
    assert chw(images, None, np.zeros((1, 1), np.int64)) == (
        "ValueError: gather_batch_chw: indices must have rank 1, got rank 2 (indices (1, 1))")
    assert chw(images, None, np.array([0, 5])) == (
        "ValueError: gather_batch_chw: indices[1] = 5 is out of range [0, 5) (images (5, 3, 6, 7), indices (2,))")
    assert chw(images, None, idx, [0.1, 0.2]) == (
        "ValueError: gather_batch_chw: mean must be a number or 3 numbers (one per channel), got [0.1, 0.2]")
    assert chw(images, None, idx, 0.5, [1.0] * 4) == (
        "ValueError: gather_batch_chw: std must be a number or 3 numbers (one per channel), got [1.0, 1.0, 1.0, 1.0]")
    assert chw(images, None, idx, [0.5, 0.5, "x"]) == (
        "TypeError: gather_batch_chw: mean[2] must be a real number, got str 'x'")
    assert chw(images, None, idx, [True, 0.5, 0.5]) == (
        "TypeError: gather_batch_chw: mean[0] must be a real number, got bool True")
    assert chw(images, None, idx, 0.5, [1.0, float("inf"), 1.0]) == (
        "ValueError: gather_batch_chw: std[1] must be finite, got inf")
    assert chw(images, None, idx, 0.5, [1.0, 0.0, 1.0]) == (
        "ValueError: gather_batch_chw: std must be > 0 in every channel, got [1.0, 0.0, 1.0]")
    assert chw(images, pad=-1) == "ValueError: gather_batch_chw: pad must be >= 0, got -1"
    assert chw(images, pad=1.5) == "TypeError: gather_batch_chw: pad must be an int, got float 1.5"
    assert chw(images, max_shift=-2) == "ValueError: gather_batch_chw: max_shift must be >= 0, got -2"
    assert chw(images, max_shift="1") == "TypeError: gather_batch_chw: max_shift must be an int, got str '1'"
    assert chw(images, flip=1) == "TypeError: gather_batch_chw: flip must be a bool, got 1"
    assert chw(images, seed=-1) == "ValueError: gather_batch_chw: seed must be >= 0, got -1"


def test_gather_batch_refusals_name_the_arrays(images):
    gray = images[:, 0]
    with pytest.raises(ValueError) as info:
        data.gather_batch(gray, np.zeros(4, np.int64), np.array([0]), 0.5, 0.5)
    assert str(info.value) == "gather_batch: labels has 4 entries but images has 5 (images (5, 6, 7), labels (4,))"
    with pytest.raises(ValueError) as info:
        data.gather_batch(gray, None, np.array([-1, 0]), 0.5, 0.5)
    assert str(info.value) == "gather_batch: indices[0] = -1 is out of range [0, 5) (images (5, 6, 7), indices (2,))"


# ------------------------------------------------------------------------ kernel selection
@pytest.fixture
def restore_kernels():
    before = kernels.get_kernels()
    yield
    kernels.set_kernels(before)


def _built():
    try:
        import cydnn.ops.cpu._kernels  # noqa: F401
    except ImportError:
        return False
    return True


def test_kernels_available_says_whether_the_extension_imports():
    available, why = kernels.kernels_available()
    assert available == _built()
    assert (why is None) == available


def test_set_kernels(restore_kernels):
    with pytest.raises(ValueError) as info:
        kernels.set_kernels("fortran")
    assert str(info.value) == "set_kernels: name must be one of 'numpy', 'cython', 'auto', got 'fortran'"
    kernels.set_kernels("numpy")
    assert kernels.get_kernels() == "numpy" and kernels.active() is None
    if _built():
        kernels.set_kernels("cython")
        assert kernels.get_kernels() == "cython" and kernels.active() is kernels._compiled
        kernels.set_kernels("numpy")
        kernels.set_kernels("auto")
        assert kernels.get_kernels() == "cython" and kernels.active() is kernels._compiled


def test_set_kernels_without_the_extension(restore_kernels, monkeypatch):
    monkeypatch.setattr(kernels, "_compiled", None)
    monkeypatch.setattr(kernels, "_missing", "No module named 'x'")
    with pytest.raises(ImportError) as info:
        kernels.set_kernels("cython")
    assert str(info.value) == ("set_kernels('cython'): the compiled CPU kernels (cydnn.ops.cpu._kernels) are not built "
                               "(No module named 'x'); run `pip install -e .` or `python setup.py build_ext --inplace`, "
                               "or use set_kernels('numpy')")
    kernels.set_kernels("auto")
    assert kernels.get_kernels() == "numpy"
    kernels.set_kernels("numpy")
    assert kernels.active() is None


@pytest.mark.skipif(not _built(), reason="the compiled kernels are not built here")
def test_the_environment_variable(restore_kernels, monkeypatch):
    for value, want in ((" NumPy ", "numpy"), ("cython", "cython"), ("", "cython"), ("  ", "cython"), (None, "cython")):
        kernels.set_kernels("numpy" if want == "cython" else "cython")
        if value is None:
            monkeypatch.delenv("CYDNN_CPU_KERNELS", raising=False)
        else:
            monkeypatch.setenv("CYDNN_CPU_KERNELS", value)
        kernels._from_env()
        assert kernels.get_kernels() == want, value
    monkeypatch.setenv("CYDNN_CPU_KERNELS", "fast")
    with pytest.raises(ValueError) as info:
        kernels._from_env()
    assert str(info.value) == "$CYDNN_CPU_KERNELS must be one of numpy, cython, auto, got 'fast'"


# ------------------------------------------------------------------------ thread policy
def test_env_int(monkeypatch):
    name = "CYDNN_TEST_MUT_THRESHOLD"
    monkeypatch.delenv(name, raising=False)
    assert _threads._env_int(name, 17) == 17
    for value, want in (("", 17), ("  ", 17), ("12", 12), (" 7 ", 7), ("0", 0)):
        monkeypatch.setenv(name, value)
        assert _threads._env_int(name, 17) == want, value
    monkeypatch.setenv(name, "-1")
    with pytest.raises(ValueError) as info:
        _threads._env_int(name, 17)
    assert str(info.value) == f"${name} must be >= 0, got -1"
    monkeypatch.setenv(name, "many")
    with pytest.raises(ValueError) as info:
        _threads._env_int(name, 17)
    assert str(info.value) == f"${name} must be an integer, got 'many'"


def test_available_cores(monkeypatch):
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert _threads.available_cores() == 1
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert _threads.available_cores() == 3

    def refused(pid):
        raise OSError("not allowed")
    monkeypatch.setattr(_threads.os, "sched_getaffinity", refused, raising=False)
    for count, want in ((6, 6), (1, 1), (None, 1)):
        monkeypatch.setattr(_threads.os, "cpu_count", lambda: count)
        assert _threads.available_cores() == want, count


def test_blas_threads_for(monkeypatch):
    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 1000)
    monkeypatch.setattr(_threads, "available_cores", lambda: 4)
    assert _threads.blas_threads_for(999, 8) == 1
    assert [_threads.blas_threads_for(1000, c) for c in (8, 3, 1, 0)] == [4, 3, 1, 1]


def test_omp_threads(monkeypatch):
    monkeypatch.setattr(_threads, "_FORKED", False)   # the policy of an unforked process (also in mutmut's workers)
    monkeypatch.setattr(_threads, "PARALLEL_ELEMENTS", 100)
    monkeypatch.setattr(_threads, "available_cores", lambda: 8)
    for env, want in ((None, 8), ("3,2", 3), (" 2 ", 2), ("16", 8), ("0", 8), ("1", 1), ("abc", 8)):
        monkeypatch.setattr(_threads, "_OMP_CAP", None)
        if env is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", env)
        assert _threads.omp_threads(99) == 1
        assert _threads.omp_threads(100) == want, env
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert _threads.omp_threads(100) == 8            # computed once: a later change is not seen


def test_blas_controllers(monkeypatch):
    pytest.importorskip("threadpoolctl")
    monkeypatch.setattr(_threads, "_blas_libs", None)
    libs = _threads._blas()
    assert libs and all(lib.user_api == "blas" for lib in libs)
    assert _threads._blas() is libs
    monkeypatch.setattr(_threads, "_blas_libs", None)
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    assert _threads._blas() == []


class FakeBlas:
    def __init__(self, threads):
        self.threads, self.calls = threads, []

    def get_num_threads(self):
        return self.threads

    def set_num_threads(self, n):
        self.calls.append(n)
        self.threads = n


def test_blas_threads_sets_and_restores(monkeypatch):
    libs = [FakeBlas(4), FakeBlas(1)]
    monkeypatch.setattr(_threads, "_blas", lambda: libs)
    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 1000)
    monkeypatch.setattr(_threads, "available_cores", lambda: 2)
    with _threads.BlasThreads(10):
        assert [lib.threads for lib in libs] == [1, 1]
    assert [lib.calls for lib in libs] == [[1, 4], []]            # only what differed, then restored
    with pytest.raises(KeyError):
        with _threads.BlasThreads(5000):
            assert [lib.threads for lib in libs] == [2, 1]
            raise KeyError("inside")                               # not swallowed
    assert [lib.threads for lib in libs] == [4, 1]


def test_matmul_counts_2mkn_flops(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, flops):
            seen.append(flops)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(_threads, "BlasThreads", Recorder)
    a, b = np.arange(6.0).reshape(2, 3), np.arange(15.0).reshape(3, 5)
    np.testing.assert_array_equal(_threads.matmul(a, b), a @ b)
    assert seen == [2 * 2 * 3 * 5]


def test_relu_through_the_compiled_kernel_matches_the_twin(restore_kernels):
    if not _built():
        pytest.skip("the compiled kernels are not built here")
    x = np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32)
    with cpu.use_kernels("numpy"):
        y0, c0 = cpu.relu_forward(x)
        dx0 = cpu.relu_backward(x, c0)
    with cpu.use_kernels("cython"):
        y1, c1 = cpu.relu_forward(x)
        dx1 = cpu.relu_backward(x, c1)
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_array_equal(dx1, dx0)
