"""Issue 15: docs/architecture.md's "adding an op" recipe, followed for LeakyReLU(0.1), gave
dx = 0.01 dy instead of 0.1 dy where x < 0, because the layer passes its arguments to the
forward op only.  The rule now: the forward's cache carries everything the backward needs,
backward ops take exactly (dy, cache), and a layer refuses a backward op that wants more."""
import inspect

import numpy as np
import pytest

from cydnn import nn, ops
from cydnn.nn.layers import _CachedOp
from cydnn.ops import cpu


def numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = f()
        x[i] = old - eps
        down = f()
        x[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


class RecipeLeakyReLU(_CachedOp):
    """Step 7 of the recipe, word for word."""
    op = "leaky_relu"

    def __init__(self, negative_slope=0.01):
        super().__init__(negative_slope=negative_slope)


@pytest.mark.parametrize("layer_class", [RecipeLeakyReLU, nn.LeakyReLU])
@pytest.mark.parametrize("slope", [0.1, 0.3, 0.0])
def test_recipe_layer_gets_the_gradient_of_its_own_slope(layer_class, slope):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 6))
    x[np.abs(x) < 1e-3] = -0.5
    layer = layer_class(slope)
    r = rng.standard_normal(x.shape)
    layer(x)
    dx = layer.backward(r)
    np.testing.assert_array_equal(dx[x < 0], slope * r[x < 0])      # not 0.01 * r
    np.testing.assert_array_equal(dx[x > 0], r[x > 0])
    np.testing.assert_allclose(dx, numeric_grad(lambda: float(np.sum(r * layer(x))), x), rtol=1e-7, atol=1e-9)


def test_recipe_for_a_new_op_gives_the_right_gradient(monkeypatch):
    """Follow the recipe's Python steps for a new op with an argument (y = x + a x^2): the cache
    carries a, so the layer's backward uses the layer's a."""

    def square_forward(x, a=1.0):
        return x + a * x * x, (x, float(a))

    def square_backward(dy, cache):
        x, a = cache
        return dy * (1 + 2 * a * x)

    monkeypatch.setattr(cpu, "square_forward", square_forward, raising=False)
    monkeypatch.setattr(cpu, "square_backward", square_backward, raising=False)

    class Square(_CachedOp):
        op = "square"

        def __init__(self, a=1.0):
            super().__init__(a=a)

    rng = np.random.default_rng(1)
    x, r = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    layer = Square(a=-2.5)
    layer(x)
    np.testing.assert_allclose(layer.backward(r), numeric_grad(lambda: float(np.sum(r * layer(x))), x),
                               rtol=1e-7, atol=1e-9)


def test_the_old_recipe_backward_is_refused_not_silently_wrong(monkeypatch):
    """The old recipe's shape: a backward with its own default for the layer's argument."""

    def old_forward(x, a=0.01):
        return np.where(x > 0, x, a * x), x

    def old_backward(dy, cache, a=0.01):
        return np.where(cache > 0, dy, a * dy)

    monkeypatch.setattr(cpu, "oldleaky_forward", old_forward, raising=False)
    monkeypatch.setattr(cpu, "oldleaky_backward", old_backward, raising=False)

    class OldLeaky(_CachedOp):
        op = "oldleaky"

        def __init__(self, a=0.01):
            super().__init__(a=a)

    layer = OldLeaky(0.1)
    layer(-np.ones(3))
    with pytest.raises(TypeError, match=r"oldleaky_backward takes a besides \(dy, cache\), which a layer cannot "
                                        r"pass: make the forward's cache carry them"):
        layer.backward(np.ones(3))


def _backward_ops(module):
    return [name for name in module.__all__ if name.endswith("_backward")]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_backward_op_takes_only_dy_and_cache(device):
    """The rule, checked on every backward op of both backends (need_dx only skips work)."""
    try:
        backend = ops.backend(device)
    except ImportError as e:          # the extension is not built: nothing to check there
        pytest.skip(f"ops.{device} cannot be imported: {e}")
    names = _backward_ops(backend)
    assert "leaky_relu_backward" in names and "batch_norm_backward" in names
    for name in names:
        params = list(inspect.signature(getattr(backend, name)).parameters)
        assert params[:2] == ["dy", "cache"], (name, params)
        assert set(params[2:]) <= {"need_dx"}, (name, params)


def test_leaky_relu_cache_carries_the_slope():
    y, cache = cpu.leaky_relu_forward(np.array([-1.0, 2.0], np.float32), negative_slope=0.1)
    np.testing.assert_array_equal(cpu.leaky_relu_backward(np.ones(2, np.float32), cache),
                                  np.array([0.1, 1.0], np.float32))
