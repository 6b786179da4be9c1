"""PyTorch twins of cydnn's zoo models (MLP, SmallCNN), with cydnn's layer names.

Needs torch; the package never imports this file (tests load it by path, with
``pytest.importorskip("torch")``).  Each twin is an ``nn.Sequential`` whose
children carry cydnn's names, so ``twin.state_dict()`` has exactly the keys of
the cydnn model (``fc1.weight``, ``conv1_1.weight``, ``bn1_1.running_mean``, ...)
and a PyTorch-trained twin loads into cydnn with ``cydnn.load_pytorch_weights``
(and back with ``export_weights``).  Inputs are the preprocessed images
(``model.preprocess(raw)``), as cydnn's layers take them.

    twin = from_config(cydnn_model.config())
    load_state_dict_numpy(twin, cydnn_model.state_dict())
"""
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

__all__ = ["TorchMLP", "TorchSmallCNN", "from_config", "state_dict_numpy", "load_state_dict_numpy"]

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class TorchMLP(nn.Sequential):
    """cydnn.models.MLP: flatten, fc1, act1 [, drop1], ..., fcK."""

    def __init__(self, sizes=(784, 128, 10), activation="relu", dropout=0.0):
        layers = [("flatten", nn.Flatten())]
        k = len(sizes) - 1
        for i in range(1, k + 1):
            layers.append((f"fc{i}", nn.Linear(sizes[i - 1], sizes[i])))
            if i < k:
                layers.append((f"act{i}", ACTIVATIONS[activation]()))
                if dropout > 0:
                    layers.append((f"drop{i}", nn.Dropout(dropout)))
        super().__init__(OrderedDict(layers))


class TorchSmallCNN(nn.Sequential):
    """cydnn.models.SmallCNN: per block b, (conv{b}_{i} [bn{b}_{i}] relu{b}_{i}) x convs_per_block, pool{b};
    then gap, flatten, fc."""

    def __init__(self, in_channels=1, num_classes=10, widths=(32, 64, 128), convs_per_block=2, batch_norm=True):
        layers, prev = [], in_channels
        for b, width in enumerate(widths, 1):
            for i in range(1, convs_per_block + 1):
                layers.append((f"conv{b}_{i}", nn.Conv2d(prev, width, 3, padding=1, bias=not batch_norm)))
                if batch_norm:
                    layers.append((f"bn{b}_{i}", nn.BatchNorm2d(width, eps=1e-5, momentum=0.1)))
                layers.append((f"relu{b}_{i}", nn.ReLU()))
                prev = width
            layers.append((f"pool{b}", nn.MaxPool2d(2)))
        layers += [("gap", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()), ("fc", nn.Linear(prev, num_classes))]
        super().__init__(OrderedDict(layers))


def from_config(config):
    """The twin of the cydnn model whose ``config()`` is ``config`` (weights: PyTorch's own init)."""
    arch = config["arch"]
    if arch == "MLP":
        return TorchMLP(config["sizes"], config["activation"], config["dropout"])
    if arch == "SmallCNN":
        return TorchSmallCNN(config["in_channels"], config["num_classes"], config["widths"],
                             config["convs_per_block"], config["batch_norm"])
    if arch == "LeNet5":
        from torch_lenet import TorchLeNet5          # tools/ on sys.path
        return TorchLeNet5(config["classic"], config["num_classes"])
    raise ValueError(f"no PyTorch twin for {arch!r}")


def state_dict_numpy(model):
    """The state_dict as numpy arrays (float32, integer buffers such as num_batches_tracked as int64)."""
    return {k: v.detach().cpu().numpy().astype(np.float32 if v.is_floating_point() else np.int64)
            for k, v in model.state_dict().items()}


def load_state_dict_numpy(model, arrays):
    """``model.load_state_dict`` from numpy arrays, each cast to the torch entry's dtype; entries the
    arrays lack (e.g. ``num_batches_tracked`` when cydnn does not keep it) stay as they are."""
    ref = model.state_dict()
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(arrays[k]).reshape(ref[k].shape)).to(ref[k].dtype)
                           if k in arrays else ref[k] for k in ref})
    return model
