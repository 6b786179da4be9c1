"""Programmatic dependent launch's rule, checked on the C sources (CPU): a kernel launched by CYDNN_LAUNCH or
launch_pdl (cpp/launch.cuh) may start while the kernel before it on the stream still runs, so its first statement
must be ``cydnn::pdl_wait()`` -- a kernel that touched memory before it would race with its predecessor, and
nothing else would show it."""
import pathlib
import re

import pytest

CPP = pathlib.Path(__file__).resolve().parents[1] / "cpp"
SOURCES = {p.name: p.read_text() for p in sorted(CPP.glob("*.cu")) + sorted(CPP.glob("*.cuh"))}


def _close(text, i):
    """The index just past the parenthesis that closes the one opened at text[i - 1]."""
    depth = 1
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return i


def _bodies(text):
    """{kernel name: the first statement of its body} of every __global__ function in ``text``."""
    out = {}
    for m in re.finditer(r"__global__\s+", text):
        i = m.end()
        head = re.match(r"(?:void\s+)?(?:__launch_bounds__\s*\()?", text[i:])
        i += head.end()
        if head.group(0).rstrip().endswith("("):      # __launch_bounds__(...), parentheses nested
            i = _close(text, i)
        name = re.match(r"\s*(?:void\s+)?(\w+)\s*\(", text[i:])
        i = _close(text, i + name.end())
        brace = text.index("{", i)
        out[name.group(1)] = text[brace + 1:].lstrip().split(";", 1)[0]
    return out


KERNELS = {name: first for text in SOURCES.values() for name, first in _bodies(text).items()}
LAUNCHED = sorted({(f, m.group(1).split("<")[0].split(".")[-1])
                   for f, text in SOURCES.items() if f != "launch.cuh"          # (the macro's definition)
                   for m in re.finditer(r"\bCYDNN_LAUNCH\(\s*([\w:.]+(?:<[\w\s,]*>)?)\s*,", text)})


# ``t.kernel``: a tile table's pointer, which holds the instances of one kernel template in these files
TILE_KERNELS = {"conv_igemm.cu": ["igemm_conv_kernel"], "conv_wgrad.cu": ["wgrad_kernel"]}


def _kernels_of(file, name):
    """The kernels a launch names (a tile table's pointer: TILE_KERNELS; a new one fails here until named)."""
    if name != "kernel":
        return [name]
    assert file in TILE_KERNELS, f"{file} launches a tile table's kernel: name its template in TILE_KERNELS"
    return TILE_KERNELS[file]


def test_the_sources_launch_kernels_through_cydnn_launch():
    assert len(LAUNCHED) >= 20, LAUNCHED            # the conv, pooling, loss, optimizer and compiler kernels


@pytest.mark.parametrize("file,name", LAUNCHED, ids=[f"{f}:{n}" for f, n in LAUNCHED])
def test_a_kernel_launched_as_a_dependent_launch_waits_first(file, name):
    for kernel in _kernels_of(file, name):
        assert kernel in KERNELS, (file, kernel)
        assert KERNELS[kernel].replace(" ", "") == "cydnn::pdl_wait()", (file, kernel, KERNELS[kernel][:80])


def test_the_skinny_gemm_waits_first_too():
    """Its cluster launch passes the attribute through launch_pdl (gemm_skinny.cu)."""
    assert "launch_pdl(t.kernel" in SOURCES["gemm_skinny.cu"]
    assert KERNELS["skinny_gemm_kernel"].replace(" ", "") == "cydnn::pdl_wait()"


def test_the_check_catches_a_kernel_that_does_not_wait():
    """A probe: the rule's parser finds a kernel whose first statement is a load."""
    text = "__global__ void bad_kernel(const float *x, float *y) {\n    y[0] = x[0];\n}\n"
    assert _bodies(text)["bad_kernel"].replace(" ", "") != "cydnn::pdl_wait()"
    good = "template <int N>\n__global__ void __launch_bounds__(N) good_kernel(int a) {\n    cydnn::pdl_wait();\n}\n"
    assert _bodies(good)["good_kernel"].replace(" ", "") == "cydnn::pdl_wait()"
