"""numpy in, numpy out: LeNet-5 inference in one C call.

``FastPredictor(model)(images)`` does, in ``cydnn_predictor_run``
(cpp/fastpath.cu): copy the raw images into pinned memory, one asynchronous
copy up, the fused forward kernel (padding, scaling, normalisation, both
convolutions, pools, the three linear layers and softmax in one launch),
one copy down, one wait.  For up to 64 images that sequence is a CUDA graph
captured once per size bucket (1, 2, 4, ..., 64), so a call is one graph
launch; larger inputs stream through two pinned buffers in chunks of 4096.

Per call, Python does: one type/shape check (the same rules and messages as
the reference ``predict``, done by the caller), the ten weight pointers, one
output allocation.  ``model.predict`` uses this automatically on the GPU;
``model.predict(x, fast=False)`` is the reference path.
"""
import threading

import numpy as np

from .. import _C
from .support import lenet_parameters, lenet_unsupported_reason

__all__ = ["FastPredictor"]


class FastPredictor:
    """The fast predict path of one LeNet-5 on the GPU (see the module docstring)."""

    def __init__(self, model, use_graphs=True):
        reason = lenet_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastPredictor: {reason}")
        self.num_classes = model.num_classes
        self._params = lenet_parameters(model)
        self._p = _C.Predictor(model.classic, model.num_classes, model.mean, model.std, use_graphs)
        # The C predictor's pinned buffers and graphs are shared by its calls, and the call releases
        # the GIL: two threads predicting with one model take turns here.
        self._lock = threading.Lock()

    @property
    def graph_count(self):
        """CUDA graphs captured so far (one per size bucket and input dtype used)."""
        return self._p.graph_count

    def __call__(self, images):
        """Probabilities (N, classes) float32 for checked images (N, 28, 28), uint8 or float in [0, 1]."""
        if images.dtype != np.uint8 and images.dtype != np.float32:
            images = images.astype(np.float32)
        if not images.flags.c_contiguous:
            images = np.ascontiguousarray(images)
        if not images.shape[0]:
            return np.empty((0, self.num_classes), np.float32)
        with self._lock:
            return self._p(self._params, images)
