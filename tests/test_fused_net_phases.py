"""benchmarks/fused_net_phases.py's instrumentation of a generated kernel (CPU: the source and NVRTC; the timing
itself runs on the GPU machine): a stamp before and after the input's load, after every layer's cluster barrier and
after the output, in order, and the stamped source still compiles."""
import os
import sys

import pytest

from cydnn.compiler import fused_net, fused_net_gen
from cydnn.compiler.trace import trace

from test_fused_net import CASES
from test_fused_net_gen import needs_nvrtc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import fused_net_phases  # noqa: E402


def _source(name, ranks=16):
    make, shape = CASES[name]
    nodes = trace(make(), shape, 1)
    bound = [fused_net.FusedNetwork._bind(layer, ranks) for layer in fused_net.describe(nodes)]
    text = fused_net_gen.source(bound, ranks, 0, 4096, 784, 10, True)
    return bound, text


@pytest.mark.parametrize("name", ["mlp", "lenet_widths"])
def test_a_stamp_after_the_load_every_barrier_and_the_output(name):
    bound, text = _source(name)
    stamped, k = fused_net_phases.instrument(text)
    assert k == len(bound) + 3
    lines = [line.strip() for line in stamped.splitlines()]
    stamps = [i for i, line in enumerate(lines) if line.startswith("STAMP(")]
    assert [lines[i] for i in stamps] == [f"STAMP({j});" for j in range(k)]
    assert lines[stamps[0] + 1].startswith("load_input(") and lines[stamps[1] - 1].startswith("load_input(")
    barriers = [i for i, line in enumerate(lines) if line == "cluster.sync();"]
    assert [i + 1 for i in barriers] == stamps[2:-1]
    assert lines[stamps[-1] - 1].startswith("if (rank == 0) write_output")
    assert stamped.replace(fused_net_phases.STAMP, "", 1).replace("\n", "") != text.replace("\n", "")


@needs_nvrtc
def test_the_stamped_source_compiles():
    _, text = _source("mlp")
    assert fused_net_gen.compile_cubin(fused_net_phases.instrument(text)[0])[:4] == b"\x7fELF"


def _copy_of_cpp(tmp_path):
    """A copy of the headers the generated source includes (fused_net_gen.headers: installed or cpp/)."""
    folder = tmp_path / "cpp"
    folder.mkdir()
    for name, text in fused_net_gen.headers().items():
        if name in fused_net_gen._HEADERS:
            (folder / name).write_text(text)
    return folder


def test_another_folders_headers_are_read_and_checked(tmp_path):
    """--headers DIR: DIR's layer code is used; a DIR whose cydnn.h differs (the tables' layout) or that lacks a
    header is refused with the reason."""
    folder = _copy_of_cpp(tmp_path)
    assert fused_net_gen.headers(folder) == fused_net_gen.headers()
    with open(folder / "fused_net_wsplit.cuh", "a") as f:
        f.write("\n// changed\n")
    assert fused_net_gen.headers(folder)["fused_net_wsplit.cuh"].endswith("// changed\n")
    assert fused_net_gen.headers(folder)["cydnn.h"] == fused_net_gen.headers()["cydnn.h"]
    with open(folder / "cydnn.h", "a") as f:
        f.write("\n// changed\n")
    with pytest.raises(fused_net_gen.GenerationError, match="cydnn.h differs from the installed library's"):
        fused_net_gen.headers(folder)
    (folder / "cydnn.h").unlink()
    with pytest.raises(fused_net_gen.GenerationError, match="lacks the fused network's headers cydnn.h"):
        fused_net_gen.headers(folder)


@needs_nvrtc
def test_a_source_compiles_with_another_folders_headers(tmp_path):
    """The A/B's second variant: the same source compiled with a changed copy of the headers -- here one that
    breaks the layer code, so that the compile is seen to read the copy."""
    _, text = _source("mlp")
    folder = _copy_of_cpp(tmp_path)
    assert fused_net_gen.compile_cubin(text, header_dir=folder)[:4] == b"\x7fELF"
    with open(folder / "fused_net_layers.cuh", "a") as f:
        f.write("\nthis is not C++;\n")
    with pytest.raises(fused_net_gen.GenerationError):
        fused_net_gen.compile_cubin(text, header_dir=folder)
    assert fused_net_gen.compile_cubin(text)[:4] == b"\x7fELF"       # the installed headers, untouched
