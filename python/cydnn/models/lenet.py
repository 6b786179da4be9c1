"""LeNet-5, modern and classic (LeCun et al. 1998), for 28 x 28 single-channel images."""
from collections import OrderedDict

import numpy as np

from .. import nn
from . import register
from .classifier import ImageClassifier

__all__ = ["LeNet5"]


@register
class LeNet5(ImageClassifier):
    """LeNet-5 for 28 x 28 digits, in two flavours.

    Modern (``classic=False``), 28 x 28 input::

        conv1 1->6 5x5 (24x24) - ReLU - maxpool 2 (12x12)
        conv2 6->16 5x5 (8x8)  - ReLU - maxpool 2 (4x4) - flatten (256)
        fc1 256->120 - ReLU - fc2 120->84 - ReLU - fc3 84->num_classes

    Classic (``classic=True``, LeCun et al. 1998), the digit padded by 2 to 32 x 32::

        conv1 1->6 5x5 (28x28) - tanh - avgpool 2 (14x14)
        conv2 6->16 5x5 (10x10) - tanh - avgpool 2 (5x5) - flatten (400)
        fc1 400->120 - tanh - fc2 120->84 - tanh - fc3 84->num_classes

    Layers with weights are ``conv1, conv2, fc1, fc2, fc3``; the others are
    ``act1..act4``, ``pool1, pool2`` and ``flatten``.  Weights are drawn from
    ``np.random.default_rng(seed)``, layer by layer in that order.
    ``input_shape`` is (1, 28, 28) (``input_size`` 28) and ``input_pad`` is 2
    for the classic network, 0 for the modern one; ``mean``/``std`` are floats.
    """

    def __init__(self, classic=False, num_classes=10, seed=0, mean=0.1307, std=0.3081):
        rng = np.random.default_rng(seed)
        act, pool = (nn.Tanh, nn.AvgPool2d) if classic else (nn.ReLU, nn.MaxPool2d)
        flat = 16 * 5 * 5 if classic else 16 * 4 * 4
        layers = OrderedDict([
            ("conv1", nn.Conv2d(1, 6, 5, rng=rng)), ("act1", act()), ("pool1", pool(2)),
            ("conv2", nn.Conv2d(6, 16, 5, rng=rng)), ("act2", act()), ("pool2", pool(2)),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(flat, 120, rng=rng)), ("act3", act()),
            ("fc2", nn.Linear(120, 84, rng=rng)), ("act4", act()),
            ("fc3", nn.Linear(84, num_classes, rng=rng)),
        ])
        super().__init__(layers, num_classes=num_classes, mean=mean, std=std,
                         input_pad=2 if classic else 0, input_shape=(1, 28, 28))
        self.classic = bool(classic)
        self.seed = seed

    def config(self):
        return {"arch": type(self).__name__, "classic": self.classic, "num_classes": self.num_classes,
                "seed": self.seed, "mean": self.mean, "std": self.std}

    def extra_repr(self):
        return ("classic, " if self.classic else "modern, ") + super().extra_repr()
