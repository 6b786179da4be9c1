"""Models: networks that know their input format.

A model is a :class:`cydnn.nn.Sequential` whose children have names (so its
state_dict keys read ``conv1.weight``, ``fc3.bias``, as in PyTorch) and that
carries its preprocessing (``mean``, ``std``, ``input_pad``), so that
``predict`` takes raw images.  ``config()`` gives the constructor arguments,
from which :func:`cydnn.serialization.load` rebuilds the model.
"""
import threading
from collections import OrderedDict

import numpy as np

from . import nn, ops

__all__ = ["ImageClassifier", "LeNet5", "ARCHITECTURES", "register", "build"]

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


class ImageClassifier(nn.Sequential):
    """A Sequential that classifies single-channel square images.

    Preprocessing of a raw image (input_size x input_size pixels in [0, 1]):
    pad ``input_pad`` zero pixels on each side, then ``(v - mean) / std``.
    This is exactly what ``ops.gather_batch`` does for training batches.
    """

    input_size = 28

    def __init__(self, layers, num_classes, mean, std, input_pad):
        super().__init__(layers)
        self.num_classes = int(num_classes)
        self.mean, self.std = float(mean), float(std)
        self.input_pad = int(input_pad)

    def config(self):
        """Constructor arguments as a JSON-able dict, plus ``"arch"``: the class name."""
        raise NotImplementedError

    # -- inference ------------------------------------------------------------
    def _check_images(self, x):
        """``x`` as an (N, H, W) view, after checking its type, shape and values."""
        size = self.input_size
        if not isinstance(x, np.ndarray):
            raise TypeError(f"predict expects a numpy array, got {type(x).__name__}")
        if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"predict expects uint8 pixels in [0, 255] or floats in [0, 1], "
                            f"got dtype {x.dtype}")
        if x.shape == (size, size):
            x = x[None]
        elif x.ndim == 4 and x.shape[1:] == (1, size, size):
            x = x[:, 0]
        elif not (x.ndim == 3 and x.shape[1:] == (size, size)):
            raise ValueError(f"predict expects images of shape ({size}, {size}), (N, {size}, {size}) "
                             f"or (N, 1, {size}, {size}), got {x.shape}")
        if x.dtype != np.uint8 and x.size:
            lo, hi = x.min(), x.max()
            if not (lo >= 0 and hi <= 1):       # also catches NaN
                raise ValueError(f"float images must hold values in [0, 1], got the range [{lo}, {hi}]"
                                 f" (pass uint8 for pixels in 0..255)")
        return x

    def preprocess(self, images):
        """Raw images (N, H, W), uint8 or float in [0, 1] -> network input (N, 1, H+2p, W+2p), numpy.

        ``v = pixel / 255`` for uint8 (float images are taken as they are), then
        zero padding of ``input_pad`` pixels, then ``(v - mean) / std``, in float32.
        """
        dtype = self.dtype
        v = images.astype(dtype)
        if images.dtype == np.uint8:
            v /= dtype.type(255)
        p = self.input_pad
        v = np.pad(v, ((0, 0), (p, p), (p, p)))
        v = (v - dtype.type(self.mean)) / dtype.type(self.std)
        return v[:, None]

    PRECISIONS = ("fp32", "tf32", "fp16")

    def predict(self, x, batch_size=1024, fast=None, precision="fp32"):
        """Class probabilities (N, num_classes), float32 numpy, for raw images.

        ``x``: a numpy array of shape (28, 28) (one image, N = 1), (N, 28, 28)
        or (N, 1, 28, 28); dtype uint8 (pixels 0..255, divided by 255) or a
        float dtype (pixels already in [0, 1]).  Anything else raises
        TypeError (type, dtype) or ValueError (shape, float values outside
        [0, 1]).  Runs in eval mode, ``batch_size`` images at a time, on the
        model's device, and restores the previous train/eval mode.

        ``fast``: on the GPU, a model the fused kernels take (LeNet-5) goes
        through :class:`cydnn.fast.FastPredictor` (one C call: pinned copy
        up, one fused kernel, copy down; ``batch_size`` is then ignored).
        ``fast=False`` forces the reference per-layer path; ``fast=True``
        raises ValueError, with the reason, where the fast path cannot run.

        ``precision`` (GPU only): ``"fp32"`` (default), ``"tf32"`` (cuDNN and
        cuBLAS may use TF32 tensor cores) or ``"fp16"`` (convolutions and
        linear layers in float16 on tensor cores, float32 accumulation).  The
        reduced precisions run the per-layer path (the fused kernels are
        fp32); the settings are restored afterwards.

        Zero images give an empty (0, num_classes) array.  Images with NaN or
        weights with NaN/Inf give NaN probabilities for the images they reach.
        Threads: several threads may call ``predict`` on one model or on
        several; the calls on one model take turns (a lock), and every GPU
        call holds the GIL, so the library is never entered by two threads at
        once.  Training a model while another thread trains it or predicts
        with it is not supported.
        """
        images = self._check_images(x)
        if fast is not False and precision == "fp32" and self._device == "cuda" and batch_size >= 1:
            cached = self.__dict__.get("_fast_predictor")      # the common case, in few steps
            if cached is not None and cached[0] == tuple(self._modules.values()):
                return cached[1](images)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if precision not in self.PRECISIONS:
            raise ValueError(f"predict: precision must be one of {self.PRECISIONS}, got {precision!r}")
        if precision != "fp32":
            if self.device != "cuda":
                raise ValueError(f"predict: precision {precision!r} needs the model on 'cuda' (it is on "
                                 f"{self.device!r}); the CPU computes in float32")
            if fast is True:
                raise ValueError(f"predict: the fast path is float32 only, not {precision!r}")
            from . import _C
            saved = _C.settings()
            _C.configure(allow_tf32=precision == "tf32", fp16=precision == "fp16")
            try:
                return self.predict(images, batch_size=batch_size, fast=False)
            finally:
                _C.configure(allow_tf32=saved["allow_tf32"], fp16=saved["fp16"])
        if fast is not False and self.device == "cuda":
            predictor = self.fast_predictor(required=fast is True)
            if predictor is not None:
                return predictor(images)
        backend = ops.backend(self.device)
        probs = np.empty((len(images), self.num_classes), dtype=np.float32)
        # Calls on one model take turns: each switches the model to eval mode and back, and two
        # interleaved switches would leave a model that was training in eval mode.
        with self.__dict__.setdefault("_predict_lock", threading.RLock()):
            was_training = self.training
            self.eval()
            try:
                for start in range(0, len(images), batch_size):
                    batch = backend.asarray(self.preprocess(images[start:start + batch_size]))
                    logits = self.forward(batch)
                    probs[start:start + batch_size] = backend.to_numpy(backend.softmax(logits))
            finally:
                self.train(was_training)
        return probs

    def fast_predictor(self, required=False):
        """The model's :class:`cydnn.fast.FastPredictor` (made on first use), or None
        (ValueError when ``required``) where the fast path cannot run this model."""
        # The full check runs when the layers change; per call, one tuple compare.
        layers = tuple(self._modules.values())
        cached = self.__dict__.get("_fast_predictor")
        if cached is not None and cached[0] == layers and self.device == "cuda":
            return cached[1]
        from . import fast
        reason = fast.lenet_unsupported_reason(self)
        if reason is not None:
            if required:
                raise ValueError(f"predict(fast=True): {reason}")
            return None
        predictor = fast.FastPredictor(self)
        self.__dict__["_fast_predictor"] = (layers, predictor)
        return predictor

    def compile(self, optimizer, batch_size, loss_fn=None, cuda_graph=True, fused=True):
        """A compiled training step (:class:`cydnn.fast.CompiledStep`): checks once, static
        buffers, fused kernels, CUDA graphs; ``step.train_epoch(loader, scheduler)``.

        Falls back to the reference loop (``step.info()["reason"]`` says why) for a
        model or optimizer the fused kernels don't take."""
        from . import fast
        return fast.compile_training(self, optimizer, batch_size, loss_fn=loss_fn, cuda_graph=cuda_graph,
                                     fused=fused)

    def predict_classes(self, x, batch_size=1024):
        """The most probable class of each image: int64 (N,).  Same input rules as :meth:`predict`."""
        return self.predict(x, batch_size=batch_size).argmax(axis=1).astype(np.int64)

    def save(self, path, metadata=None):
        """Write a checkpoint; see :func:`cydnn.serialization.save`."""
        from . import serialization
        return serialization.save(self, path, metadata=metadata)

    def export_weights(self, path, format="npz"):
        """Write the weights for PyTorch's ``load_state_dict`` (``"npz"``, ``"safetensors"``,
        or a folder of ``"txt"`` / ``"bin"`` files); see :func:`cydnn.interop.export_weights`."""
        from . import interop
        return interop.export_weights(self, path, format=format)


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
                         input_pad=2 if classic else 0)
        self.classic = bool(classic)
        self.seed = seed

    def config(self):
        return {"arch": type(self).__name__, "classic": self.classic, "num_classes": self.num_classes,
                "seed": self.seed, "mean": self.mean, "std": self.std}

    def extra_repr(self):
        return "classic" if self.classic else "modern"
