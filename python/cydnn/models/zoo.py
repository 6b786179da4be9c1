"""The model zoo beyond LeNet-5: :class:`MLP` and :class:`SmallCNN`.

Both are saved and loaded by config as LeNet5 is.  A config may come from a
file (a hostile one, even): every argument is checked here, and the size of
the network is bounded (``MAX_PARAMETERS``) BEFORE any weight is allocated.
``tools/torch_zoo.py`` has a PyTorch twin of each, with identical state_dict keys.
"""
import math
import numbers
from collections import OrderedDict

import numpy as np

from .. import nn
from . import register
from .classifier import ImageClassifier, check_input_shape

__all__ = ["MLP", "SmallCNN", "MAX_PARAMETERS"]

#: Largest number of weights (and BatchNorm statistics) a zoo model may have: 2**27 floats, 512 MB.
MAX_PARAMETERS = 1 << 27
#: Bounds on the other arguments (a config from a file cannot ask for more).
MAX_LAYERS = 64
MAX_WIDTH = 1 << 16
MAX_SIDE = 4096

#: MLP activations: config name -> layer.
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


def _int(value, name, owner, lo, hi):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{owner}: {name} must lie in [{lo}, {hi}], got {value}")
    return int(value)


def _ints(values, name, owner, lo, hi, min_len, max_len):
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{owner}: {name} must be a list of ints, got {values!r}")
    if not min_len <= len(values) <= max_len:
        raise ValueError(f"{owner}: {name} must hold {min_len} to {max_len} ints, got {len(values)}: {values!r}")
    return tuple(_int(v, f"{name}[{i}]", owner, lo, hi) for i, v in enumerate(values))


def _check_size(owner, count):
    if count > MAX_PARAMETERS:
        raise ValueError(f"{owner}: these arguments make {count:,} parameters, more than "
                         f"MAX_PARAMETERS = {MAX_PARAMETERS:,}")


def _config_value(value):
    """A mean/std as JSON: a float, or a list of floats."""
    return list(value) if isinstance(value, tuple) else value


def _layer(name, owner):
    layer = getattr(nn, name, None)
    if layer is None:
        raise NotImplementedError(f"{owner} needs cydnn.nn.{name}, which this build of cydnn lacks")
    return layer


@register
class MLP(ImageClassifier):
    """A multi-layer perceptron on flattened images.

    ``flatten - fc1 - act1 [- drop1] - fc2 - act2 ... - fcK``, where fc_i is
    ``Linear(sizes[i-1], sizes[i])``: K = len(sizes) - 1 linear layers, an
    activation (``"relu"``, ``"tanh"`` or ``"sigmoid"``) after each but the
    last, and, when ``dropout`` > 0, a Dropout(dropout) after each activation.
    ``sizes[0]`` must be C * H * W of ``input_shape``; ``sizes[-1]`` is the
    number of classes.  Weights are drawn from ``np.random.default_rng(seed)``
    (fc1, fc2, ... in order); dropout masks from a separate stream of ``seed``.
    """

    def __init__(self, sizes=(784, 128, 10), activation="relu", dropout=0.0, input_shape=(1, 28, 28),
                 mean=0.1307, std=0.3081, seed=0):
        owner = "MLP"
        sizes = _ints(sizes, "sizes", owner, 1, MAX_WIDTH, 2, MAX_LAYERS)
        shape = check_input_shape(input_shape, owner, max_side=MAX_SIDE)
        if math.prod(shape) != sizes[0]:
            raise ValueError(f"{owner}: sizes[0] = {sizes[0]} must be C*H*W = {math.prod(shape)} of input_shape "
                             f"{shape}")
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            raise ValueError(f"{owner}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
            raise ValueError(f"{owner}: dropout must be a number in [0, 1), got {dropout!r}")
        seed = _int(seed, "seed", owner, 0, 2**63 - 1)
        _check_size(owner, sum(a * b + b for a, b in zip(sizes, sizes[1:])))

        rng = np.random.default_rng(seed)
        drop_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
        layers = [("flatten", nn.Flatten())]
        k = len(sizes) - 1
        for i in range(1, k + 1):
            layers.append((f"fc{i}", nn.Linear(sizes[i - 1], sizes[i], rng=rng)))
            if i < k:
                layers.append((f"act{i}", ACTIVATIONS[activation]()))
                if dropout > 0:
                    layers.append((f"drop{i}", nn.Dropout(float(dropout), rng=drop_rng)))
        super().__init__(OrderedDict(layers), num_classes=sizes[-1], mean=mean, std=std, input_pad=0,
                         input_shape=shape)
        self.sizes, self.activation, self.dropout, self.seed = sizes, activation, float(dropout), seed

    def config(self):
        return {"arch": "MLP", "sizes": list(self.sizes), "activation": self.activation, "dropout": self.dropout,
                "input_shape": list(self.input_shape), "mean": _config_value(self.mean),
                "std": _config_value(self.std), "seed": self.seed}


@register
class SmallCNN(ImageClassifier):
    """A VGG-style CNN: blocks of 3x3 convolutions, max pooling, global average pooling, one linear layer.

    For each block b = 1 .. len(widths), with width w_b::

        (conv{b}_{i} 3x3 pad 1 -> w_b  [- bn{b}_{i} BatchNorm2d(w_b)] - relu{b}_{i}) for i = 1 .. convs_per_block
        pool{b}: MaxPool2d(2)

    then ``gap`` (AdaptiveAvgPool2d(1)), ``flatten``, ``fc`` (Linear(widths[-1], num_classes)).
    Input (in_channels, input_size, input_size); each pool halves the side (floor),
    so ``input_size`` >= 2 ** len(widths).  With ``batch_norm`` the convolutions
    have no bias (BatchNorm's beta is one), as in PyTorch's usual CNNs.
    Weights are drawn from ``np.random.default_rng(seed)``, layer by layer.
    ``mean``/``std``: a float or ``in_channels`` floats.  The names are those
    of ``tools/torch_zoo.py``'s ``TorchSmallCNN``, whose state_dict loads as it is.
    """

    def __init__(self, in_channels=1, num_classes=10, widths=(32, 64, 128), convs_per_block=2, input_size=28,
                 batch_norm=True, mean=0.1307, std=0.3081, seed=0):
        owner = "SmallCNN"
        in_channels = _int(in_channels, "in_channels", owner, 1, MAX_WIDTH)
        num_classes = _int(num_classes, "num_classes", owner, 1, MAX_WIDTH)
        widths = _ints(widths, "widths", owner, 1, MAX_WIDTH, 1, 16)
        convs_per_block = _int(convs_per_block, "convs_per_block", owner, 1, 16)
        input_size = _int(input_size, "input_size", owner, 1, MAX_SIDE)
        if input_size < 2 ** len(widths):
            raise ValueError(f"{owner}: input_size {input_size} is too small for {len(widths)} blocks "
                             f"(each halves the side): at least {2 ** len(widths)}")
        if not isinstance(batch_norm, (bool, np.bool_)):
            raise TypeError(f"{owner}: batch_norm must be true or false, got {batch_norm!r}")
        seed = _int(seed, "seed", owner, 0, 2**63 - 1)
        count, prev = 0, in_channels
        for w in widths:
            for _ in range(convs_per_block):
                count += prev * w * 9 + (4 * w if batch_norm else w)
                prev = w
        _check_size(owner, count + prev * num_classes + num_classes)
        gap = _layer("AdaptiveAvgPool2d", owner)
        bn = _layer("BatchNorm2d", owner) if batch_norm else None

        rng = np.random.default_rng(seed)
        layers, prev = [], in_channels
        for b, width in enumerate(widths, 1):
            for i in range(1, convs_per_block + 1):
                layers.append((f"conv{b}_{i}", nn.Conv2d(prev, width, 3, padding=1, bias=not batch_norm, rng=rng)))
                if batch_norm:
                    layers.append((f"bn{b}_{i}", bn(width)))
                layers.append((f"relu{b}_{i}", nn.ReLU()))
                prev = width
            layers.append((f"pool{b}", nn.MaxPool2d(2)))
        layers += [("gap", gap(1)), ("flatten", nn.Flatten()), ("fc", nn.Linear(prev, num_classes, rng=rng))]
        super().__init__(OrderedDict(layers), num_classes=num_classes, mean=mean, std=std, input_pad=0,
                         input_shape=(in_channels, input_size, input_size))
        self.widths, self.convs_per_block, self.batch_norm, self.seed = widths, convs_per_block, bool(batch_norm), seed

    def config(self):
        c, size, _ = self.input_shape
        return {"arch": "SmallCNN", "in_channels": c, "num_classes": self.num_classes, "widths": list(self.widths),
                "convs_per_block": self.convs_per_block, "input_size": size, "batch_norm": self.batch_norm,
                "mean": _config_value(self.mean), "std": _config_value(self.std), "seed": self.seed}

    def extra_repr(self):
        return (f"widths={self.widths}, convs_per_block={self.convs_per_block}, batch_norm={self.batch_norm}, "
                + super().extra_repr())
