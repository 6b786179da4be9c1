"""The container :class:`Sequential`: modules applied one after the other, backward in reverse."""
from collections import OrderedDict

from .module import Module


class Sequential(Module):
    """Modules applied one after the other; backward runs them in reverse.

    ``Sequential(a, b, c)`` names its children ``"0"``, ``"1"``, ``"2"`` (so
    parameters are ``0.weight``, ...); ``Sequential(OrderedDict(conv1=..., ...))``
    uses the dictionary's names.
    """

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            named = modules[0].items()
        else:
            named = ((str(i), module) for i, module in enumerate(modules))
        for name, module in named:
            if not isinstance(module, Module):
                raise TypeError(f"Sequential child {name!r} is not a Module: {type(module).__name__}")
            setattr(self, name, module)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        return list(self._modules.values())[index]

    def __setitem__(self, index, module):
        """``model[i] = layer``, as PyTorch's: the layer takes the i-th place (and name)."""
        if not isinstance(module, Module):
            raise TypeError(f"Sequential[{index}] = ...: expected a Module, got {type(module).__name__}")
        names = list(self._modules)
        setattr(self, names[index], module)          # IndexError for an index out of range

    def forward(self, x):
        for module in self._modules.values():
            x = module(x)
        return x

    def backward(self, dy, input_grad=True):
        """Run every child's backward in reverse; returns dLoss/d(input).

        ``input_grad=False`` (training, where the input is data) lets the first
        layer skip the gradient of its input -- for a first Conv2d that is the
        costliest part of its backward -- and returns None.
        """
        modules = list(self._modules.values())
        for i, module in enumerate(reversed(modules)):
            if i == len(modules) - 1 and not input_grad and module.can_skip_input_grad:
                return module.backward(dy, input_grad=False)
            dy = module.backward(dy)
        return dy


