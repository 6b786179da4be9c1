"""Tests of the model zoo and of ImageClassifier on images (C, H, W): predict on every accepted shape
against numpy references written out by hand, the errors and their messages, the configs, and the
save/load round trip of every zoo model.

SmallCNN needs ``nn.AdaptiveAvgPool2d`` (and, with ``batch_norm=True``, ``nn.BatchNorm2d``); where
this cydnn lacks them, its tests are skipped saying so.
"""
import json
import time
from collections import OrderedDict

import numpy as np
import pytest

import cydnn
from cydnn import models, nn, ops, serialization
from cydnn.serialization import CheckpointError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
needs_gap = pytest.mark.skipif(not hasattr(cydnn.nn, "AdaptiveAvgPool2d"), reason="needs nn.AdaptiveAvgPool2d")
needs_bn = pytest.mark.skipif(not hasattr(cydnn.nn, "BatchNorm2d"), reason="needs nn.BatchNorm2d")


def images(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.uint8)


def softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def normalised(x, mean, std, pad=0):
    """The documented preprocessing, in float64: /255 for uint8, zero padding, then per channel."""
    v = x.astype(np.float64) / (255 if x.dtype == np.uint8 else 1)
    v = np.pad(v, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    c = v.shape[1]
    return (v - np.broadcast_to(mean, (c,))[:, None, None]) / np.broadcast_to(std, (c,))[:, None, None]


def mlp_reference(model, x):
    """MLP logits by hand from its state_dict: x (N, C, H, W) raw."""
    s = model.state_dict()
    h = normalised(x, model.mean, model.std).reshape(len(x), -1)
    act = {"relu": lambda v: np.maximum(v, 0), "tanh": np.tanh, "sigmoid": lambda v: 1 / (1 + np.exp(-v))}
    k = len(model.sizes) - 1
    for i in range(1, k + 1):
        h = h @ s[f"fc{i}.weight"].astype(np.float64).T + s[f"fc{i}.bias"]
        if i < k:
            h = act[model.activation](h)
    return h


def conv_reference(x, w, b, pad):
    """Cross-correlation, stride 1, in float64, by windows."""
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    windows = np.lib.stride_tricks.sliding_window_view(x, w.shape[2:], axis=(2, 3))   # N C H W kh kw
    y = np.einsum("nchwij,kcij->nkhw", windows, w.astype(np.float64))
    return y if b is None else y + b[None, :, None, None]


# ------------------------------------------------------------- ImageClassifier
def custom_classifier(seed=0):
    """Conv 2->3 (3x3) - ReLU - flatten - Linear: on (2, 5, 6) images padded by 1, per-channel stats."""
    rng = np.random.default_rng(seed)
    layers = OrderedDict(conv=nn.Conv2d(2, 3, 3, rng=rng), relu=nn.ReLU(), flatten=nn.Flatten(),
                         fc=nn.Linear(3 * 5 * 6, 4, rng=rng))
    return models.ImageClassifier(layers, num_classes=4, mean=(0.2, 0.7), std=(0.5, 0.25), input_pad=1,
                                  input_shape=(2, 5, 6))


def custom_reference(model, x):
    s = model.state_dict()
    h = np.maximum(conv_reference(normalised(x, (0.2, 0.7), (0.5, 0.25), pad=1), s["conv.weight"],
                                  s["conv.bias"], 0), 0)
    return softmax(h.reshape(len(x), -1) @ s["fc.weight"].astype(np.float64).T + s["fc.bias"])


@pytest.mark.parametrize("device", DEVICES)
def test_multichannel_predict_on_every_shape_equals_the_hand_computed_reference(device):
    model = custom_classifier().to(device)
    x = images((5, 2, 5, 6))
    expected = custom_reference(model, x)
    np.testing.assert_allclose(model.predict(x), expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.predict(x / 255.0), expected, rtol=1e-4, atol=1e-6)           # float64
    np.testing.assert_allclose(model.predict((x / 255).astype(np.float32)), expected, rtol=1e-4, atol=1e-6)
    for i in range(len(x)):                                                                        # (C, H, W)
        one = model.predict(x[i])
        assert one.shape == (1, 4)
        np.testing.assert_allclose(one, expected[i:i + 1], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(model.predict_classes(x), model.predict(x).argmax(1))
    assert model.predict(np.zeros((0, 2, 5, 6), np.uint8)).shape == (0, 4)


def test_preprocess_pads_then_normalises_per_channel():
    model = custom_classifier()
    x = images((3, 2, 5, 6))
    got = model.preprocess(x)
    assert got.shape == (3, 2, 7, 8) and got.dtype == np.float32
    np.testing.assert_allclose(got, normalised(x, (0.2, 0.7), (0.5, 0.25), pad=1), rtol=1e-6, atol=1e-6)
    # The border is the padding, normalised: -mean[c] / std[c].
    np.testing.assert_allclose(got[:, 0, 0, :], -0.2 / 0.5, rtol=1e-6)
    np.testing.assert_allclose(got[:, 1, :, 0], -0.7 / 0.25, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_single_channel_model_takes_every_form(device):
    model = models.MLP(sizes=(30, 7, 3), input_shape=(1, 6, 5), mean=0.3, std=0.2, seed=4).to(device)
    x = images((4, 6, 5))
    expected = softmax(mlp_reference(model, x[:, None]))
    forms = {"N,H,W": x, "N,1,H,W": x[:, None], "N,H,W float": x / 255.0, "N,1,H,W float32": (x / 255.0)[:, None]
             .astype(np.float32)}
    for name, form in forms.items():
        np.testing.assert_allclose(model.predict(form), expected, rtol=1e-4, atol=1e-6, err_msg=name)
    for i in range(4):
        for one in (x[i], x[i][None], x[i][None, None]):          # (H, W), (1, H, W), (1, 1, H, W)
            np.testing.assert_allclose(model.predict(one), expected[i:i + 1], rtol=1e-4, atol=1e-6)


def test_mean_and_std_may_be_reassigned_and_are_checked_at_use():
    model = custom_classifier()
    x = images((2, 2, 5, 6))
    model.mean, model.std = 0.0, 1.0                                  # a network trained on raw [0, 1] pixels
    np.testing.assert_allclose(model.preprocess(x), np.pad(x / 255.0, ((0, 0), (0, 0), (1, 1), (1, 1))),
                               rtol=1e-6, atol=1e-7)
    model.std = (1.0, 0.0)
    with pytest.raises(ValueError, match="std must be finite and > 0"):
        model.predict(x)
    model.std = (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"std must be a number or 2 numbers \(one per channel\), got 3"):
        model.predict(x)


@pytest.mark.parametrize("x, error, match", [
    (images((2, 5, 6)), ValueError, r"expects images of shape \(2, 5, 6\) or \(N, 2, 5, 6\), got \(2, 5, 6\)$"),
    (images((4, 5, 6)), ValueError, r"got \(4, 5, 6\) \(this model takes 2-channel images\)"),
    (images((3, 5, 6, 2)), ValueError, r"got \(3, 5, 6, 2\) \(channels last\? pass x.transpose\(0, 3, 1, 2\)"),
    (images((3, 2, 6, 5)), ValueError, r"got \(3, 2, 6, 5\)"),
    (images((1, 1, 2, 5, 6)), ValueError, r"got \(1, 1, 2, 5, 6\)"),
    (np.full((1, 2, 5, 6), 1.5), ValueError, r"float images must hold values in \[0, 1\], got the range"),
    (np.zeros((1, 2, 5, 6), np.int32), TypeError, "got dtype int32"),
    ([[0.0]], TypeError, "predict expects a numpy array, got list"),
], ids=["C,H,W-wrong-C", "grey", "channels-last", "H-W-swapped", "5-d", "float-range", "int32", "list"])
def test_multichannel_predict_errors(x, error, match):
    model = custom_classifier()
    if x is not None and isinstance(x, np.ndarray) and x.shape == (2, 5, 6):
        x = images((2, 6, 5))                               # (C, W, H): not the model's shape
        match = match.replace(r"got \(2, 5, 6\)", r"got \(2, 6, 5\)")
    with pytest.raises(error, match=match):
        model.predict(x)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mean=(0.1, 0.2, 0.3)), ValueError, r"mean must be a number or 2 numbers \(one per channel\), got 3"),
    (dict(std=(0.5, 0.0)), ValueError, "std must be finite and > 0"),
    (dict(std=-1.0), ValueError, "std must be finite and > 0"),
    (dict(mean=float("nan")), ValueError, "mean must be finite"),
    (dict(mean="0.5"), TypeError, "mean must be a number or a sequence of 2 numbers, got str"),
    (dict(mean=(True, 0.1)), TypeError, "mean must hold numbers"),
    (dict(input_shape=(5, 6)), TypeError, r"input_shape must be three ints \(C, H, W\)"),
    (dict(input_shape=(0, 5, 6)), ValueError, "input_shape"),
    (dict(input_shape=None), TypeError, "input_shape"),
    (dict(num_classes=0), ValueError, "num_classes must be an int >= 1"),
    (dict(input_pad=-1), ValueError, "input_pad"),
])
def test_image_classifier_argument_errors(kwargs, error, match):
    args = dict(num_classes=4, mean=0.5, std=0.5, input_pad=0, input_shape=(2, 5, 6))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        models.ImageClassifier(OrderedDict(flatten=nn.Flatten()), **args)


def test_repr_shows_the_preprocessing():
    text = repr(custom_classifier())
    assert text.startswith("ImageClassifier(input_shape=(2, 5, 6), input_pad=1, mean=(0.2, 0.7), std=(0.5, 0.25)")
    lenet = repr(models.LeNet5(classic=True))
    assert lenet.startswith("LeNet5(classic, input_shape=(1, 28, 28), input_pad=2, mean=0.1307, std=0.3081")


def test_a_classifier_built_from_layers_has_no_config():
    with pytest.raises(NotImplementedError, match="cannot be saved by config"):
        custom_classifier().config()


# ------------------------------------------------------------------------ MLP
def test_mlp_layers_names_and_shapes():
    model = models.MLP(sizes=(784, 64, 32, 10), activation="tanh", dropout=0.25, seed=1)
    assert list(model._modules) == ["flatten", "fc1", "act1", "drop1", "fc2", "act2", "drop2", "fc3"]
    assert [type(m) for m in model] == [nn.Flatten, nn.Linear, nn.Tanh, nn.Dropout, nn.Linear, nn.Tanh,
                                        nn.Dropout, nn.Linear]
    assert list(model.state_dict()) == [f"fc{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")]
    assert model.fc2.weight.shape == (32, 64) and model.num_classes == 10 and model.input_shape == (1, 28, 28)
    assert model.drop1.p == 0.25
    plain = models.MLP()
    assert list(plain._modules) == ["flatten", "fc1", "act1", "fc2"] and isinstance(plain.act1, nn.ReLU)


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
def test_mlp_predict_equals_the_hand_computed_reference(activation):
    model = models.MLP(sizes=(3 * 4 * 4, 9, 8, 5), activation=activation, dropout=0.5, input_shape=(3, 4, 4),
                       mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.25), seed=2)
    x = images((6, 3, 4, 4), seed=1)
    model.train()                                   # predict runs in eval mode: dropout is the identity
    np.testing.assert_allclose(model.predict(x), softmax(mlp_reference(model, x)), rtol=1e-4, atol=1e-6)
    assert model.training


def test_mlp_seed_decides_the_weights_and_config_round_trips():
    a, b = models.MLP(seed=3), models.MLP(seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        np.testing.assert_array_equal(va, vb)
    assert not np.array_equal(models.MLP(seed=4).fc1.weight.data, a.fc1.weight.data)
    config = models.MLP(sizes=[12, 5, 2], input_shape=[3, 2, 2], mean=[0.1, 0.2, 0.3], std=0.5, dropout=0.1,
                        activation="sigmoid", seed=9).config()
    assert config == {"arch": "MLP", "sizes": [12, 5, 2], "activation": "sigmoid", "dropout": 0.1,
                      "input_shape": [3, 2, 2], "mean": [0.1, 0.2, 0.3], "std": 0.5, "seed": 9}
    assert json.loads(json.dumps(config)) == config
    assert models.build(config).config() == config
    assert models.ARCHITECTURES["MLP"] is models.MLP and models.ARCHITECTURES["SmallCNN"] is models.SmallCNN


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sizes=(784,)), ValueError, "sizes must hold 2 to 64 ints, got 1"),
    (dict(sizes=(100, 10)), ValueError, r"sizes\[0\] = 100 must be C\*H\*W = 784 of input_shape \(1, 28, 28\)"),
    (dict(sizes=(784, 0, 10)), ValueError, r"sizes\[1\] must lie in \[1, 65536\], got 0"),
    (dict(sizes=(784, 12.5, 10)), TypeError, r"sizes\[1\] must be an int, got 12.5"),
    (dict(sizes=(784, True, 10)), TypeError, r"sizes\[1\] must be an int"),
    (dict(sizes="784,10"), TypeError, "sizes must be a list of ints"),
    (dict(sizes=(784, 65536, 65536, 10)), ValueError, "more than MAX_PARAMETERS"),
    (dict(activation="gelu"), ValueError, r"activation must be one of \['relu', 'sigmoid', 'tanh'\], got 'gelu'"),
    (dict(dropout=1.0), ValueError, r"dropout must be a number in \[0, 1\), got 1.0"),
    (dict(dropout="0.5"), ValueError, "dropout must be a number"),
    (dict(seed=-1), ValueError, "seed must lie in"),
    (dict(input_shape=(1, 28, 28, 1)), TypeError, "input_shape must be three ints"),
    (dict(mean=(0.1, 0.2)), ValueError, "mean must be a number or 1 numbers"),
])
def test_mlp_argument_errors(kwargs, error, match):
    start = time.monotonic()
    with pytest.raises(error, match="MLP: .*" + match):
        models.MLP(**kwargs)
    assert time.monotonic() - start < 1                 # refused before any weight is drawn


# ------------------------------------------------------------------- SmallCNN
@needs_gap
def test_smallcnn_layers_names_and_shapes_without_batch_norm():
    model = models.SmallCNN(in_channels=3, num_classes=7, widths=(4, 8), convs_per_block=2, input_size=10,
                            batch_norm=False, mean=(0.5, 0.4, 0.3), std=0.25, seed=1)
    assert list(model._modules) == ["conv1_1", "relu1_1", "conv1_2", "relu1_2", "pool1",
                                    "conv2_1", "relu2_1", "conv2_2", "relu2_2", "pool2", "gap", "flatten", "fc"]
    assert model.conv1_1.weight.shape == (4, 3, 3, 3) and model.conv1_1.bias.shape == (4,)
    assert model.conv2_2.weight.shape == (8, 8, 3, 3) and model.fc.weight.shape == (7, 8)
    assert model.input_shape == (3, 10, 10) and model.input_pad == 0 and model.input_size == 10
    x = np.zeros((2, 3, 10, 10), np.float32)
    sides = [10, 10, 10, 10, 5, 5, 5, 5, 5, 2, 1]
    for layer, side in zip(model, sides):
        x = layer(x)
        assert x.shape[2:] == (side, side), type(layer).__name__
    assert model(np.zeros((2, 3, 10, 10), np.float32)).shape == (2, 7)


@needs_bn
@needs_gap
def test_smallcnn_with_batch_norm_names_and_no_conv_bias():
    model = models.SmallCNN(widths=(4, 8), convs_per_block=1, input_size=12)
    assert list(model._modules) == ["conv1_1", "bn1_1", "relu1_1", "pool1", "conv2_1", "bn2_1", "relu2_1", "pool2",
                                    "gap", "flatten", "fc"]
    assert model.conv1_1.bias is None and isinstance(model.bn1_1, nn.BatchNorm2d)
    keys = list(model.state_dict())
    assert "conv1_1.weight" in keys and "conv1_1.bias" not in keys
    assert {"bn1_1.weight", "bn1_1.bias", "bn1_1.running_mean", "bn1_1.running_var"} <= set(keys)


@needs_gap
@pytest.mark.parametrize("device", DEVICES)
def test_smallcnn_predict_equals_the_hand_computed_reference(device):
    model = models.SmallCNN(in_channels=2, num_classes=3, widths=(3, 5), convs_per_block=1, input_size=9,
                            batch_norm=False, mean=(0.3, 0.6), std=(0.2, 0.4), seed=5).to(device)
    x = images((4, 2, 9, 9), seed=3)
    s = model.state_dict()
    h = normalised(x, (0.3, 0.6), (0.2, 0.4))
    for b in (1, 2):
        h = np.maximum(conv_reference(h, s[f"conv{b}_1.weight"], s[f"conv{b}_1.bias"], 1), 0)
        n, c, hh, ww = h.shape
        h = h[:, :, :hh // 2 * 2, :ww // 2 * 2].reshape(n, c, hh // 2, 2, ww // 2, 2).max(axis=(3, 5))
    logits = h.mean(axis=(2, 3)) @ s["fc.weight"].astype(np.float64).T + s["fc.bias"]
    np.testing.assert_allclose(model.predict(x), softmax(logits), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.predict(x[0]), softmax(logits)[:1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(widths=(8, 8, 8, 8, 8), input_size=28), ValueError, "input_size 28 is too small for 5 blocks.*at least 32"),
    (dict(widths=()), ValueError, "widths must hold 1 to 16 ints, got 0"),
    (dict(widths=(32, -1)), ValueError, r"widths\[1\] must lie in"),
    (dict(convs_per_block=0), ValueError, "convs_per_block must lie in"),
    (dict(in_channels=0), ValueError, "in_channels must lie in"),
    (dict(num_classes=2.0), TypeError, "num_classes must be an int"),
    (dict(batch_norm="yes"), TypeError, "batch_norm must be true or false"),
    (dict(widths=(65536, 65536)), ValueError, "more than MAX_PARAMETERS"),
    (dict(input_size=10**9), ValueError, r"input_size must lie in \[1, 4096\]"),
])
def test_smallcnn_argument_errors(kwargs, error, match):
    start = time.monotonic()
    with pytest.raises(error, match="SmallCNN: .*" + match):
        models.SmallCNN(**kwargs)
    assert time.monotonic() - start < 1


@pytest.mark.skipif(hasattr(cydnn.nn, "AdaptiveAvgPool2d"), reason="this cydnn has nn.AdaptiveAvgPool2d")
def test_smallcnn_without_the_layers_says_what_is_missing():
    with pytest.raises(NotImplementedError, match="SmallCNN needs cydnn.nn.AdaptiveAvgPool2d"):
        models.SmallCNN(batch_norm=False)


# ------------------------------------------------------------ save and load
def train_a_little(model, x, labels, steps=3):
    """A few SGD steps (so the weights, and BatchNorm's running statistics, are not the initial ones)."""
    opt = cydnn.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    backend = ops.backend(model.device)
    batch = backend.asarray(model.preprocess(x))
    model.train()
    for _ in range(steps):
        loss_fn(model(batch), labels)
        model.backward(loss_fn.backward())
        opt.step()


ZOO = {
    "mlp": lambda: models.MLP(sizes=(48, 10, 4), input_shape=(3, 4, 4), mean=0.4, std=0.3, dropout=0.2, seed=2),
    "mlp-grey": lambda: models.MLP(sizes=(36, 6, 3), activation="tanh", input_shape=(1, 6, 6), seed=1),
    "smallcnn": pytest.param(lambda: models.SmallCNN(in_channels=3, num_classes=4, widths=(4, 6), input_size=8,
                                                     batch_norm=False, mean=0.45, std=0.25, seed=3),
                             marks=needs_gap),
    "smallcnn-bn": pytest.param(lambda: models.SmallCNN(in_channels=1, num_classes=4, widths=(4, 6), input_size=8,
                                                        convs_per_block=2, seed=3),
                                marks=[needs_gap, needs_bn]),
    "mlp-per-channel": lambda: models.MLP(sizes=(48, 10, 4), input_shape=(3, 4, 4), mean=(0.1, 0.2, 0.3),
                                          std=(0.3, 0.2, 0.1)),
}


@pytest.mark.parametrize("make", list(ZOO.values()), ids=list(ZOO))
@pytest.mark.parametrize("device", DEVICES)
def test_zoo_round_trip_gives_the_same_predictions(tmp_path, make, device):
    model = make().to(device)
    c, h, w = model.input_shape
    x = images((6, c, h, w), seed=7)
    train_a_little(model, x, np.arange(6) % model.num_classes)     # the model is left in training mode
    before = model.predict(x)
    cydnn.save(model, tmp_path / "m.npz", metadata={"note": "zoo"})
    loaded = serialization.load(tmp_path / "m.npz", device=device)
    assert type(loaded) is type(model) and loaded.config() == model.config()
    assert loaded.input_shape == model.input_shape and (loaded.mean, loaded.std) == (model.mean, model.std)
    assert list(loaded.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[key], value, err_msg=key)
    after = loaded.predict(x)
    if device == "cuda" and _kernels_chosen(loaded) != _kernels_chosen(model):
        # each compiled inference times the fused network against the plan on its own first call: the two may
        # run different kernels, whose sums round apart (the fused network agrees with the plan within 1e-5)
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(after, before)


def _kernels_chosen(model):
    """What the model's compiled inference runs per size bucket: the plan (None) or the fused network's cluster."""
    fused = model.__dict__["_fast_predictor"][1].info()["fused_net"]
    return None if fused is None else dict(fused.get("clusters") or {})


@pytest.mark.gpu
@pytest.mark.parametrize("make", list(ZOO.values()), ids=list(ZOO))
def test_zoo_predict_on_cuda_matches_the_cpu(make):
    """On the GPU, predict goes through the compiler (BatchNorm folded in eval plans) unless fast=False;
    both give the CPU's probabilities, for a model trained a little (running statistics not 0 / 1)."""
    model = make()
    c, h, w = model.input_shape
    x = images((37, c, h, w), seed=8)
    train_a_little(model, x[:6], np.arange(6) % model.num_classes)
    expected = model.predict(x)
    on_gpu = make().to("cuda")
    on_gpu.load_state_dict(model.state_dict())
    for fast in (None, False):
        np.testing.assert_allclose(on_gpu.predict(x, fast=fast), expected, rtol=1e-4, atol=1e-5,
                                   err_msg=f"fast={fast}")
    np.testing.assert_allclose(on_gpu.predict(x[0]), expected[:1], rtol=1e-4, atol=1e-5)


def hostile(tmp_path, model, **config):
    """A checkpoint of ``model`` whose config entry is replaced by ``config`` (over model.config())."""
    path = cydnn.save(model, tmp_path / "good.npz")
    with np.load(path, allow_pickle=False) as z:
        entries = {k: z[k] for k in z.files}
    entries["config"] = np.array(json.dumps({**model.config(), **config}))
    bad = tmp_path / "bad.npz"
    with open(bad, "wb") as f:
        np.savez(f, **entries)
    return bad


@pytest.mark.parametrize("config, match", [
    (dict(sizes=[784, 2**16, 2**16, 10]), "more than MAX_PARAMETERS"),
    (dict(sizes="784"), "sizes must be a list of ints"),
    # refused by the checkpoint reader's JSON rules (before the model's own checks): either names the argument
    (dict(sizes=[784, {"a": 1}, 10]), r"sizes.*(\[1\] must be an int|JSON dict is not a valid argument)"),
    (dict(input_shape=[3, 28, 28]), r"sizes\[0\] = 784 must be C\*H\*W = 2352"),
    (dict(input_shape=[1, 10**9, 1]), "input_shape"),
    (dict(activation=["relu"]), "activation.*(must be one of|must be a string)"),
    (dict(sizes=[784, 12.5, 10]), r"sizes\[1\] must be an int"),
    (dict(activation="gelu"), "activation must be one of"),
    (dict(sizes=[784] * 65 + [10]), "sizes must hold 2 to 64 ints"),
])
def test_hostile_mlp_configs_are_refused_before_allocating(tmp_path, config, match):
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="cannot build MLP.*" + match):
        serialization.load(hostile(tmp_path, models.MLP(), **config))
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("config, match", [
    (dict(widths=[4096] * 4), "more than MAX_PARAMETERS"),
    (dict(widths=[4, "8"]), r"widths\[1\] must be an int"),
    (dict(input_size=1), "input_size 1 is too small"),
])
def test_hostile_smallcnn_configs_are_refused_before_allocating(tmp_path, config, match, monkeypatch):
    # No SmallCNN can be built here without the layers: save a stand-in with SmallCNN's config.
    good = models.MLP()
    monkeypatch.setattr(good, "config", lambda: {"arch": "SmallCNN", "in_channels": 1, "num_classes": 10,
                                                "widths": [4, 8], "convs_per_block": 1, "input_size": 28,
                                                "batch_norm": False, "mean": 0.1, "std": 0.3, "seed": 0})
    with pytest.raises(CheckpointError, match="cannot build SmallCNN.*" + match):
        serialization.load(hostile(tmp_path, good, **config))


# --------------------------------------------------------- PyTorch twins
def torch_twin(model):
    """The PyTorch twin of ``model`` from tools/torch_zoo.py, holding the same weights."""
    torch = pytest.importorskip("torch")
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "torch_zoo.py"
    spec = importlib.util.spec_from_file_location("torch_zoo", path)
    torch_zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_zoo)
    twin = torch_zoo.from_config(model.config())
    ours = model.state_dict()
    assert set(twin.state_dict()) - {k for k in twin.state_dict() if k.endswith("num_batches_tracked")} \
        == set(ours) - {k for k in ours if k.endswith("num_batches_tracked")}
    torch_zoo.load_state_dict_numpy(twin, ours)
    return torch, twin.double().eval()


TWINS = {
    "mlp": lambda: models.MLP(sizes=(48, 10, 4), activation="sigmoid", input_shape=(3, 4, 4), seed=2),
    "smallcnn": pytest.param(lambda: models.SmallCNN(in_channels=3, widths=(4, 8, 8), input_size=16,
                                                     batch_norm=False, seed=3), marks=needs_gap),
    "smallcnn-bn": pytest.param(lambda: models.SmallCNN(widths=(4, 8), input_size=12, seed=3),
                                marks=[needs_gap, needs_bn]),
}


@pytest.mark.parametrize("make", list(TWINS.values()), ids=list(TWINS))
@pytest.mark.parametrize("device", DEVICES)
def test_the_pytorch_twin_gives_the_same_logits(make, device):
    model = make()
    c, h, w = model.input_shape
    x = images((5, c, h, w), seed=4)
    train_a_little(model, x, np.arange(5) % model.num_classes)     # BatchNorm statistics away from 0 / 1
    torch, twin = torch_twin(model)
    with torch.no_grad():
        expected = twin(torch.from_numpy(model.preprocess(x).astype(np.float64))).numpy()
    model.to(device).eval()
    got = ops.backend(device).to_numpy(model(ops.backend(device).asarray(model.preprocess(x))))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
