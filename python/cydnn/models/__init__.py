"""Models: networks that know their input format.

A model is a :class:`cydnn.nn.Sequential` whose children have names (so its
state_dict keys read ``conv1.weight``, ``fc3.bias``, as in PyTorch) and that
carries its preprocessing (``input_shape``, ``mean``, ``std``, ``input_pad``),
so that ``predict`` takes raw images.  ``config()`` gives the constructor
arguments, from which :func:`cydnn.serialization.load` rebuilds the model.

The package has one module per kind of model:

- ``classifier.py``: :class:`ImageClassifier`, the base (checks, preprocessing, ``predict``);
- ``lenet.py``: :class:`LeNet5` (modern and classic);
- ``zoo.py``: :class:`MLP` and :class:`SmallCNN` (VGG-style blocks, global average pooling).

Every architecture is registered here by its class name (:func:`register`), and
:func:`build` makes one from a ``config()`` dict.
"""

__all__ = ["ImageClassifier", "LeNet5", "MLP", "SmallCNN", "ARCHITECTURES", "register", "build"]

#: name -> class, for rebuilding a model from its ``config()``.
ARCHITECTURES = {}


def register(cls):
    """Class decorator: make ``cls`` loadable by its name."""
    ARCHITECTURES[cls.__name__] = cls
    return cls


def build(config):
    """A new model from a ``config()`` dict: ``ARCHITECTURES[config["arch"]](**the rest)``.

    Raises ``KeyError`` for an unknown architecture.
    """
    args = dict(config)
    arch = args.pop("arch")
    if arch not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch](**args)


# The models register themselves on import: after the registry above exists.
from .classifier import ImageClassifier  # noqa: E402
from .lenet import LeNet5  # noqa: E402
from .zoo import MLP, SmallCNN  # noqa: E402
