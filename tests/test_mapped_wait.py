"""Calls of a few images that wait for their outputs in mapped pinned memory instead of for the stream
(cpp/mapped_wait.h), on the GPU: the fused network's run_mapped.  Each call sets the output words to MAPPED_PENDING
and returns once the kernel overwrote them all, so a word of the call before must never pass for this call's: calls
one after another on other inputs are compared with the calls that synchronise the stream and with the staged path.
And the LeNet-5 predictor's small path, which waits the same way where the images fill their graph's bucket: each
small predict equals the reference path on its own images."""
import numpy as np
import pytest

from cydnn import _C
from cydnn.compiler import fused_net
from cydnn.compiler.trace import trace

from test_fast import _trained, mnist  # noqa: F401  (mnist: the fixture, real MNIST)
from test_fused_net import CASES

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("name", ["cnn32", "mlp"])
def test_a_mapped_call_that_waits_for_its_outputs_gives_the_synchronised_calls_bits(name):
    """run_mapped returns once every output word was overwritten (_C.MAPPED_PENDING), not after the stream's
    synchronisation: call after call on other inputs (no word of the call before may pass for this one's), as many
    images as the buffers hold, it gives the bits of the calls that synchronise (spin_ns=0) and of the staged path;
    and the words are pending again before each launch."""
    make, shape = CASES[name]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False, 64)
    rng = np.random.default_rng(11)
    net.run_host(rng.standard_normal((1,) + shape).astype(np.float32), 16)        # makes the mapped buffers
    xin, yout = net._mapped
    table = net.tables[16]
    for k in range(40):
        n = (1, 2, fused_net.MAPPED_ROWS)[k % 3]
        x = rng.standard_normal((n,) + shape).astype(np.float32) * (1 + k)
        spun, synced, staged = (np.empty((n,) + net.out_shape, np.float32) for _ in range(3))
        table.run_mapped(x, spun, xin, yout, 16)
        table.run_mapped(x, synced, xin, yout, 16, None, 0)
        table.run_host(x, staged, net._dx, net._dy, 16)
        np.testing.assert_array_equal(spun, synced)
        np.testing.assert_array_equal(spun, staged)
        assert not np.any(spun.view(np.uint32) == _C.MAPPED_PENDING)


@gpu
def test_small_predicts_one_after_another_give_each_its_own_probabilities(mnist):
    """The small path waits for its outputs in mapped memory where n fills its bucket (1, 2, 4, ..., 64:
    cpp/mapped_wait.h) and for the stream otherwise: call after call on other images, no word of the call before
    may pass for this one's -- every call equals the reference path on its own images."""
    model = _trained(False, mnist, steps=50)
    images = mnist[2]
    start = 0
    for n in (1, 1, 2, 3, 4, 1, 8, 5, 64, 1, 16, 2):
        x = images[start:start + n]
        start += n
        got = model.predict(x)
        assert np.abs(got - model.predict(x, fast=False)).max() <= 1e-5
        assert not np.any(got.view(np.uint32) == _C.MAPPED_PENDING)
