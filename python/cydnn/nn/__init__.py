"""Layers: modules with an explicit forward and backward.

cydnn has no autograd tape.  Each layer's ``forward`` keeps what its backward
will need (the *cache* returned by the op), and ``backward(dy)`` turns the
gradient of the loss with respect to the layer's output into the gradient with
respect to its input, setting the gradients of the layer's parameters on the
way.  A network is run backward by calling the layers' backwards in reverse
order, which is what :class:`Sequential` does::

    model = Sequential(Linear(4, 8, rng=0), ReLU(), Linear(8, 3, rng=1))
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(model(x), labels)      # forward
    model.backward(loss_fn.backward())    # backward: sets every p.grad

Gradients are **set, not accumulated**: each backward overwrites ``p.grad``
with the gradient of the last forward.  (PyTorch adds to ``.grad``; here
two backwards in a row leave the gradient of the second.)

Arrays and devices
------------------
A parameter's ``data`` lives on the module's device: a numpy array on
``"cpu"``, a ``DeviceArray`` on ``"cuda"``.  Every layer dispatches on the kind
of its input, ``cydnn.ops.backend_of(x)``; layers with parameters check that
the input is on their own device.  Parameters are created on the CPU in
float32 and moved with :meth:`Module.to`.  On the CPU a model can be turned to
float64 with :meth:`Module.double` (for gradient checks); CUDA is float32 only.

Buffers
-------
State that is not trained, such as BatchNorm's running statistics, lives in
*buffers* (:meth:`Module.register_buffer`): saved and loaded by
``state_dict`` / ``load_state_dict`` and moved by ``.to()``, but not
parameters, so optimizers never update them.

The package's modules: ``module.py`` (Parameter, Module), ``sequential.py``
(Sequential), ``layers.py`` (the other layers and the loss) and ``norm.py``
(BatchNorm1d, BatchNorm2d).
"""
from .layers import (AdaptiveAvgPool2d, AvgPool2d, Conv2d, CrossEntropyLoss, Dropout, Flatten, GlobalAvgPool2d,
                     LeakyReLU, Linear, MaxPool2d, ReLU, Sigmoid, Tanh)
from .module import DEVICES, Module, Parameter
from .norm import BatchNorm1d, BatchNorm2d
from .sequential import Sequential

__all__ = [
    "Parameter", "Module", "Sequential",
    "Conv2d", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "GlobalAvgPool2d", "Linear",
    "BatchNorm1d", "BatchNorm2d",
    "ReLU", "LeakyReLU", "Tanh", "Sigmoid", "Flatten", "Dropout",
    "CrossEntropyLoss",
]

