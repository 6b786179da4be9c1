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
