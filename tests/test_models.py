"""Tests of cydnn.models: LeNet5's shapes and config, predict's inputs, batching and errors."""
import json

import numpy as np
import pytest

from cydnn import models, nn, ops


# "cuda" runs only where tests/conftest.py finds a usable GPU; elsewhere it is
# skipped with the reason (every test marked gpu is).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def host(a):
    return ops.backend_of(a).to_numpy(a)


def digits(n, seed=0):
    """n random uint8 28x28 "images" (noise over a bright square, so they are not all alike)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 80, (n, 28, 28))
    for img in x:
        r, c = rng.integers(4, 16, 2)
        img[r:r + 8, c:c + 8] += 175
    return x.astype(np.uint8)


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("classic,side,shapes", [
    (False, 28, [(6, 24, 24), (6, 24, 24), (6, 12, 12), (16, 8, 8), (16, 8, 8), (16, 4, 4),
                 (256,), (120,), (120,), (84,), (84,), (10,)]),
    (True, 32, [(6, 28, 28), (6, 28, 28), (6, 14, 14), (16, 10, 10), (16, 10, 10), (16, 5, 5),
                (400,), (120,), (120,), (84,), (84,), (10,)]),
], ids=["modern", "classic"])
def test_lenet5_layer_by_layer_shapes(device, classic, side, shapes):
    model = models.LeNet5(classic=classic).to(device)
    act, pool = (nn.Tanh, nn.AvgPool2d) if classic else (nn.ReLU, nn.MaxPool2d)
    kinds = [nn.Conv2d, act, pool, nn.Conv2d, act, pool, nn.Flatten, nn.Linear, act, nn.Linear, act, nn.Linear]
    assert [type(m) for m in model] == kinds
    assert model.input_pad == (2 if classic else 0) and model.input_size == 28
    assert model.input_shape == (1, 28, 28) and model.in_channels == 1
    x = ops.backend(device).asarray(np.zeros((3, 1, side, side), np.float32))
    for layer, shape in zip(model, shapes):
        x = layer(x)
        assert tuple(x.shape) == (3,) + shape, type(layer).__name__
    y = model(ops.backend(device).asarray(np.zeros((2, 1, side, side), np.float32)))
    assert tuple(y.shape) == (2, 10)


def test_num_classes_and_config():
    model = models.LeNet5(classic=True, num_classes=7, seed=5, mean=0.5, std=0.25)
    assert model.fc3.weight.shape == (7, 84)
    config = model.config()
    assert config == {"arch": "LeNet5", "classic": True, "num_classes": 7, "seed": 5, "mean": 0.5, "std": 0.25}
    assert json.loads(json.dumps(config)) == config
    rebuilt = models.build(config)
    assert isinstance(rebuilt, models.LeNet5) and rebuilt.config() == config
    for a, b in zip(rebuilt.state_dict().values(), model.state_dict().values()):
        np.testing.assert_array_equal(a, b)                     # same seed, same weights
    with pytest.raises(KeyError, match="unknown architecture"):
        models.build({"arch": "ResNet50"})


def test_default_preprocessing_is_mnist_and_repr_shows_it():
    model = models.LeNet5()
    assert (model.mean, model.std) == (0.1307, 0.3081)
    assert type(model.mean) is float and type(model.std) is float      # the fused kernels take scalars
    assert repr(model).startswith("LeNet5(modern, input_shape=(1, 28, 28), input_pad=0, mean=0.1307, std=0.3081, "
                                  "num_classes=10\n  (conv1): Conv2d(1, 6")
    assert models.LeNet5(mean=[0.5], std=np.float32(0.25)).config()["mean"] == 0.5    # one channel: a float


def test_the_old_import_paths_still_work():
    from cydnn.models import ARCHITECTURES, ImageClassifier, LeNet5, build, register  # noqa: F401
    import cydnn
    assert cydnn.models.LeNet5 is LeNet5 and issubclass(LeNet5, ImageClassifier)
    assert ARCHITECTURES["LeNet5"] is LeNet5 and register(LeNet5) is LeNet5


# ---------------------------------------------------------------- predict
@pytest.mark.parametrize("classic", [False, True], ids=["modern", "classic"])
def test_preprocess_equals_gather_batch(classic):
    """predict prepares images exactly as the training batches are made."""
    model = models.LeNet5(classic=classic)
    images = digits(5)
    x, _ = ops.backend("cpu").gather_batch(images, None, np.arange(5, dtype=np.int32),
                                          model.mean, model.std, pad=model.input_pad)
    np.testing.assert_array_equal(model.preprocess(images), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("classic", [False, True], ids=["modern", "classic"])
def test_predict_accepts_every_input_form(device, classic):
    model = models.LeNet5(classic=classic, seed=1).to(device)
    images = digits(4)
    reference = model.predict(images)
    assert reference.shape == (4, 10) and reference.dtype == np.float32
    np.testing.assert_allclose(reference.sum(axis=1), 1.0, rtol=1e-5)
    assert np.all(reference >= 0)
    assert len({tuple(row) for row in reference}) == 4                 # the images differ, so do rows

    as_float32 = images.astype(np.float32) / 255
    forms = {
        "N,1,28,28 uint8": images[:, None],
        "N,28,28 float32": as_float32,
        "N,1,28,28 float32": as_float32[:, None],
        "N,28,28 float64": images / 255.0,
    }
    for name, x in forms.items():
        np.testing.assert_array_equal(model.predict(x), reference, err_msg=name)
    # One image alone: the same preprocessing, but a batch of 1 may take another BLAS path.
    for i in range(4):
        single = model.predict(images[i])
        assert single.shape == (1, 10)
        np.testing.assert_allclose(single, reference[i:i + 1], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(model.predict(as_float32[i]), single)
    np.testing.assert_array_equal(model.predict_classes(images), reference.argmax(axis=1))
    assert model.predict_classes(images).dtype == np.int64


def test_predict_equals_a_manual_forward():
    model = models.LeNet5(seed=2)
    images = digits(3)
    x = ((images.astype(np.float32) / np.float32(255) - np.float32(0.1307)) / np.float32(0.3081))[:, None]
    logits = model(x)
    expected = np.exp(logits - logits.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(model.predict(images), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_predict_in_batches_equals_one_batch(device):
    model = models.LeNet5(seed=3).to(device)
    images = digits(37, seed=1)
    whole = model.predict(images, batch_size=1024)
    for batch_size in (1, 5, 36):
        np.testing.assert_allclose(model.predict(images, batch_size=batch_size), whole, rtol=1e-6, atol=1e-7)


def test_predict_empty_batch():
    assert models.LeNet5().predict(np.zeros((0, 28, 28), np.uint8)).shape == (0, 10)


def test_predict_uses_eval_mode_and_restores_the_mode():
    model = models.LeNet5()
    seen = []
    original = model.fc1.forward
    model.fc1.forward = lambda x: (seen.append(model.fc1.training), original(x))[1]
    model.train()
    model.predict(digits(2))
    assert seen == [False] and model.training and all(m.training for m in model.modules())
    model.eval()
    model.predict(digits(2))
    assert not model.training


@pytest.mark.parametrize("x,error,match", [
    (np.zeros((28, 28), np.int64), TypeError, "uint8"),
    (np.zeros((2, 28, 28), bool), TypeError, "uint8"),
    ([[0] * 28] * 28, TypeError, "numpy array"),
    (np.zeros((2, 3, 28, 28), np.uint8), ValueError, r"\(N, 1, 28, 28\)"),
    (np.zeros((2, 32, 32), np.uint8), ValueError, "got \\(2, 32, 32\\)"),
    (np.zeros((28,), np.uint8), ValueError, "shape"),
    (np.zeros((1, 1, 1, 28, 28), np.float32), ValueError, "shape"),
    (np.full((1, 28, 28), 255.0, np.float32), ValueError, r"\[0, 1\]"),
    (np.full((1, 28, 28), -0.5, np.float32), ValueError, r"\[0, 1\]"),
    (np.full((1, 28, 28), np.nan, np.float32), ValueError, r"\[0, 1\]"),
], ids=["int64", "bool", "list", "3-channels", "32x32", "1-d", "5-d", "float-255", "negative", "nan"])
def test_predict_rejects_bad_input(x, error, match):
    with pytest.raises(error, match=match):
        models.LeNet5().predict(x)


def test_predict_rejects_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        models.LeNet5().predict(digits(1), batch_size=0)


@pytest.mark.gpu
def test_predict_on_cuda_matches_cpu():
    images = digits(10)
    cpu_probs = models.LeNet5(seed=4).predict(images)
    cuda_probs = models.LeNet5(seed=4).to("cuda").predict(images)
    np.testing.assert_allclose(cuda_probs, cpu_probs, rtol=1e-4, atol=1e-6)
