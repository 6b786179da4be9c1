"""The fast path: the same model and formulas as the reference path, run with
plans built once, static buffers, fused kernels and CUDA graphs.

- :mod:`cydnn.fast.support`: which models the fused LeNet-5 kernels take, and why not.
- :mod:`cydnn.fast.predict`: ``FastPredictor``, numpy in / numpy out in one C call.
- :mod:`cydnn.fast.train`: ``CompiledStep``, an epoch of training as a few graph launches.
- ``fused_mlp_forward``: a chain of Linear + ReLU in one kernel (also in ``cydnn.ops.cuda``).

The reference path (per-op functions in :mod:`cydnn.ops.cuda`, checked
against the numpy twin) stays the definition: the tests compare every fast
path with it on real MNIST data, and every fast path falls back to it, with a
logged reason, where it cannot run.
"""
from .predict import FastPredictor
from .support import lenet_unsupported_reason
from .train import CompiledStep, compile_training

__all__ = ["FastPredictor", "CompiledStep", "compile_training", "lenet_unsupported_reason"]
