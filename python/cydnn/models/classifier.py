"""ImageClassifier: a Sequential that classifies images (C, H, W) and knows their preprocessing.

Preprocessing of a raw image (C x H x W pixels, uint8 in 0..255 or float in
[0, 1]), exactly what ``ops.gather_batch`` does for training batches:

    v = pixel / 255 (uint8; floats are taken as they are)
    v = v surrounded by ``input_pad`` zero pixels on each side
    x[c] = (v[c] - mean[c]) / std[c]          (float32)

``mean`` and ``std`` are a float (the same for every channel) or C floats.
"""
import math
import numbers
import threading

import numpy as np

from .. import compiler, nn, ops

__all__ = ["ImageClassifier"]


def channel_values(value, name, channels, owner, positive=False):
    """``value`` (a number or a sequence of ``channels`` numbers, all finite; > 0 when ``positive``)
    as a float, or as a tuple of floats when it is a sequence of more than one number.

    A sequence of one number becomes that number, so single-channel configs hold plain floats.
    TypeError for something that is not a number, ValueError for a wrong length or value.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        values, single = [value], True
    elif isinstance(value, (list, tuple, np.ndarray)):
        values, single = (value.ravel().tolist() if isinstance(value, np.ndarray) else list(value)), False
        if len(values) not in (1, channels):
            raise ValueError(f"{owner}: {name} must be a number or {channels} numbers (one per channel), "
                             f"got {len(values)}: {value!r}")
    else:
        raise TypeError(f"{owner}: {name} must be a number or a sequence of {channels} numbers, "
                        f"got {type(value).__name__}")
    out = []
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            raise TypeError(f"{owner}: {name} must hold numbers, got {v!r} in {value!r}")
        v = float(v)
        if not math.isfinite(v) or (positive and not v > 0):
            raise ValueError(f"{owner}: {name} must be {'finite and > 0' if positive else 'finite'}, "
                             f"got {value!r}")
        out.append(v)
    return out[0] if single or len(out) == 1 else tuple(out)


def check_input_shape(value, owner, max_side=1 << 14, max_channels=1 << 12):
    """``value`` as a (C, H, W) tuple of positive ints (C <= max_channels, H, W <= max_side)."""
    try:
        shape = tuple(value)
    except TypeError:
        raise TypeError(f"{owner}: input_shape must be (C, H, W), got {value!r}") from None
    if len(shape) != 3 or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral)
                              for v in shape):
        raise TypeError(f"{owner}: input_shape must be three ints (C, H, W), got {value!r}")
    c, h, w = (int(v) for v in shape)
    if not (1 <= c <= max_channels and 1 <= h <= max_side and 1 <= w <= max_side):
        raise ValueError(f"{owner}: input_shape {shape} must have 1 <= C <= {max_channels} and "
                         f"1 <= H, W <= {max_side}")
    return c, h, w


class ImageClassifier(nn.Sequential):
    """A Sequential that classifies images of shape ``input_shape`` = (C, H, W).

    ``layers``: an OrderedDict name -> module (or modules), taking
    (N, C, H + 2 input_pad, W + 2 input_pad) and giving logits (N, num_classes).
    ``mean``, ``std``: a float, or C floats (per channel); ``std`` > 0.
    Preprocessing: see the module docstring; :meth:`preprocess` applies it.

    ``model.mean`` / ``model.std`` may be reassigned (e.g. ``0.0`` / ``1.0``
    for a network trained on raw [0, 1] pixels); they are checked at each use.
    Subclasses give ``config()``, from which :func:`cydnn.models.build` rebuilds them.
    """

    def __init__(self, layers, num_classes, mean=0.0, std=1.0, input_pad=0, input_shape=None):
        super().__init__(layers)
        owner = type(self).__name__
        if input_shape is None:
            raise TypeError(f"{owner}: input_shape (C, H, W) is required")
        self.input_shape = check_input_shape(input_shape, owner)
        if isinstance(num_classes, (bool, np.bool_)) or not isinstance(num_classes, numbers.Integral) \
                or num_classes < 1:
            raise ValueError(f"{owner}: num_classes must be an int >= 1, got {num_classes!r}")
        if isinstance(input_pad, (bool, np.bool_)) or not isinstance(input_pad, numbers.Integral) \
                or not 0 <= input_pad <= 1024:
            raise ValueError(f"{owner}: input_pad must be an int in [0, 1024], got {input_pad!r}")
        self.num_classes = int(num_classes)
        channels = self.input_shape[0]
        self.mean = channel_values(mean, "mean", channels, owner)
        self.std = channel_values(std, "std", channels, owner, positive=True)
        self.input_pad = int(input_pad)

    @property
    def input_size(self):
        """H for square inputs (H == W), else None (LeNet-5's 28; kept from single-channel days)."""
        _, h, w = self.input_shape
        return h if h == w else None

    @property
    def in_channels(self):
        return self.input_shape[0]

    def config(self):
        """Constructor arguments as a JSON-able dict, plus ``"arch"``: the class name."""
        raise NotImplementedError(f"{type(self).__name__} has no config: a model built from layers cannot be "
                                  f"saved by config (use a zoo model, or export_weights)")

    def extra_repr(self):
        return (f"input_shape={self.input_shape}, input_pad={self.input_pad}, mean={self.mean}, "
                f"std={self.std}, num_classes={self.num_classes}")

    # -- inference ------------------------------------------------------------
    def _check_images(self, x):
        """``x`` as an (N, C, H, W) view, after checking its type, shape and values."""
        c, h, w = self.input_shape
        if not isinstance(x, np.ndarray):
            raise TypeError(f"predict expects a numpy array, got {type(x).__name__}")
        if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"predict expects uint8 pixels in [0, 255] or floats in [0, 1], "
                            f"got dtype {x.dtype}")
        if c == 1:
            if x.shape == (h, w):
                x = x[None, None]
            elif x.ndim == 3 and x.shape[1:] == (h, w):
                x = x[:, None]
            elif not (x.ndim == 4 and x.shape[1:] == (1, h, w)):
                raise ValueError(f"predict expects images of shape ({h}, {w}), (N, {h}, {w}) "
                                 f"or (N, 1, {h}, {w}), got {x.shape}")
        elif x.shape == (c, h, w):
            x = x[None]
        elif not (x.ndim == 4 and x.shape[1:] == (c, h, w)):
            hint = ""
            if x.ndim in (3, 4) and x.shape[-3:] == (h, w, c):
                hint = " (channels last? pass x.transpose(0, 3, 1, 2), or (2, 0, 1) for one image)"
            elif x.ndim in (2, 3) and x.shape[-2:] == (h, w):
                hint = f" (this model takes {c}-channel images)"
            raise ValueError(f"predict expects images of shape ({c}, {h}, {w}) or (N, {c}, {h}, {w}), "
                             f"got {x.shape}{hint}")
        if x.dtype != np.uint8 and x.size:
            lo, hi = x.min(), x.max()
            if not (lo >= 0 and hi <= 1):       # also catches NaN
                raise ValueError(f"float images must hold values in [0, 1], got the range [{lo}, {hi}]"
                                 f" (pass uint8 for pixels in 0..255)")
        return x

    def _normalisation(self, dtype):
        """``mean`` and ``std`` as (C, 1, 1) arrays of ``dtype``, checked (they may have been reassigned)."""
        c = self.input_shape[0]
        owner = type(self).__name__
        mean = channel_values(self.mean, "mean", c, owner)
        std = channel_values(self.std, "std", c, owner, positive=True)
        return (np.broadcast_to(np.asarray(mean, dtype), (c,)).reshape(c, 1, 1),
                np.broadcast_to(np.asarray(std, dtype), (c,)).reshape(c, 1, 1))

    def preprocess(self, images):
        """Raw images -> network input (N, C, H + 2p, W + 2p), numpy, in the model's dtype.

        ``images``: any form :meth:`predict` takes (checked the same way).
        ``v = pixel / 255`` for uint8 (float images are taken as they are), then
        zero padding of ``input_pad`` pixels, then ``(v - mean[c]) / std[c]``.
        """
        return self._preprocess(self._check_images(images))

    def _preprocess(self, images):
        """:meth:`preprocess` of checked images (N, C, H, W)."""
        dtype = self.dtype
        v = images.astype(dtype)
        if images.dtype == np.uint8:
            v /= dtype.type(255)
        p = self.input_pad
        if p:
            v = np.pad(v, ((0, 0), (0, 0), (p, p), (p, p)))
        mean, std = self._normalisation(dtype)
        v -= mean
        v /= std
        return v

    PRECISIONS = ("fp32", "tf32", "fp16")

    def predict(self, x, batch_size=1024, fast=None, precision="fp32"):
        """Class probabilities (N, num_classes), float32 numpy, for raw images.

        ``x``: a numpy array of shape (N, C, H, W) or (C, H, W) (one image,
        N = 1), where (C, H, W) is ``input_shape``; for a single-channel model
        also (N, H, W) and (H, W).  dtype uint8 (pixels 0..255, divided by
        255) or a float dtype (pixels already in [0, 1]).  Anything else
        raises TypeError (type, dtype) or ValueError (shape, float values
        outside [0, 1]).  Runs in eval mode, ``batch_size`` images at a time,
        on the model's device, and restores the previous train/eval mode.

        Normalisation: each image is then padded by ``input_pad`` zero pixels
        and normalised with the MODEL's ``mean`` and ``std`` (per channel:
        ``(v - mean[c]) / std[c]``; ``repr(model)`` shows them).  A network
        trained on other statistics -- e.g. raw [0, 1] pixels, imported from
        elsewhere -- needs ``model.mean, model.std = 0.0, 1.0`` (or its own)
        first, or its probabilities are wrong without any error.

        ``fast``: on the GPU, predict goes through the compiler
        (:meth:`fast_predictor`: ``cydnn.compile(model, input_shape=...,
        softmax=True)``: a plan and CUDA graph per size bucket; a LeNet-5
        runs on its fused kernel, one C call; ``batch_size`` is then ignored).
        ``fast=False`` forces the reference per-layer path; ``fast=True``
        raises ValueError, with the reason, where the fast path cannot run
        (on the CPU, or a layer the compiler does not take).

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
            if cached is not None and cached[0] == self._preprocessing_key():
                try:
                    return cached[1](images)
                except compiler.Unsupported:                  # a layer was replaced by one it can't take
                    self.__dict__.pop("_fast_predictor", None)
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
            from .. import _C
            saved = _C.settings()
            _C.configure(allow_tf32=precision == "tf32", fp16=precision == "fp16")
            try:
                return self.predict(images, batch_size=batch_size, fast=False)
            finally:
                _C.configure(allow_tf32=saved["allow_tf32"], fp16=saved["fp16"])
        if fast is True and self.device != "cuda":
            raise ValueError(f"predict(fast=True): the fast path runs on 'cuda', the model is on {self.device!r}")
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
                    batch = backend.asarray(self._preprocess(images[start:start + batch_size]))
                    logits = self.forward(batch)
                    probs[start:start + batch_size] = backend.to_numpy(backend.softmax(logits))
            finally:
                self.train(was_training)
        return probs

    def _preprocessing_key(self):
        mean, std = self.mean, self.std          # floats or tuples (channel_values); an array if reassigned
        if isinstance(mean, np.ndarray) or isinstance(std, np.ndarray):
            mean, std = np.asarray(mean, np.float64).tobytes(), np.asarray(std, np.float64).tobytes()
        return (self.input_shape, self.input_pad, mean, std)

    def network_input_shape(self):
        """(C, H + 2 input_pad, W + 2 input_pad): what the first layer sees."""
        c, h, w = self.input_shape
        return (c, h + 2 * self.input_pad, w + 2 * self.input_pad)

    def fast_predictor(self, required=False):
        """The compiled inference :meth:`predict` uses on the GPU (made on first use, and again when the
        preprocessing changes), or None (ValueError when ``required``) where the compiler cannot run
        this model.  It re-plans by itself when a layer or parameter is replaced."""
        key = self._preprocessing_key()
        cached = self.__dict__.get("_fast_predictor")
        if cached is not None and cached[0] == key and self.device == "cuda" and \
                cached[1].unsupported_reason() is None:
            return cached[1]
        self.__dict__.pop("_fast_predictor", None)
        reason = None if self.device == "cuda" else f"the model is on {self.device!r}, not 'cuda'"
        predictor = None
        if reason is None:
            try:
                predictor = compiler.compile(self, input_shape=self.network_input_shape(), softmax=True,
                                             preprocess=(self.mean, self.std, self.input_pad), weak_model=True)
            except compiler.Unsupported as e:
                reason = str(e)
        if reason is not None:
            if required:
                raise ValueError(f"predict(fast=True): {reason}")
            return None
        self.__dict__["_fast_predictor"] = (key, predictor)
        return predictor

    def compile(self, optimizer, batch_size, loss_fn=None, cuda_graph=True, fused=True):
        """A compiled training step (``cydnn.compile(model, optimizer, batch_size)``, see
        :class:`cydnn.compiler.CompiledStep`): ``loss = step(x, y)``, ``step.train_epoch(loader,
        scheduler)``.  Falls back to the reference loop (``step.info()["reason"]`` says why) for a
        model or optimizer the compiler does not take."""
        return compiler.compile(self, optimizer, batch_size, loss_fn=loss_fn, cuda_graph=cuda_graph, fused=fused,
                                input_shape=self.network_input_shape())

    def predict_classes(self, x, batch_size=1024):
        """The most probable class of each image: int64 (N,).  Same input rules as :meth:`predict`."""
        return self.predict(x, batch_size=batch_size).argmax(axis=1).astype(np.int64)
