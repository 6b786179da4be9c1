"""Which models the fused LeNet-5 kernels (cpp/fused_lenet.cu) can run.

The kernels hard-code LeNet-5's geometry, so a model qualifies only if it is
exactly that network: :func:`lenet_unsupported_reason` returns None for one
that is, else a sentence saying why not (the fast paths log it when they fall
back to the reference path).
"""
from .. import nn

MAX_CLASSES = 32


def _layers(classic, num_classes):
    act, pool = (nn.Tanh, nn.AvgPool2d) if classic else (nn.ReLU, nn.MaxPool2d)
    flat = 400 if classic else 256
    return [("conv1", nn.Conv2d, (6, 1, 5, 5)), ("act1", act, None), ("pool1", pool, None),
            ("conv2", nn.Conv2d, (16, 6, 5, 5)), ("act2", act, None), ("pool2", pool, None),
            ("flatten", nn.Flatten, None),
            ("fc1", nn.Linear, (120, flat)), ("act3", act, None),
            ("fc2", nn.Linear, (84, 120)), ("act4", act, None),
            ("fc3", nn.Linear, (num_classes, 84))]


def lenet_unsupported_reason(model):
    """None when ``model`` can run on the fused LeNet-5 kernels, else the reason."""
    from ..models import LeNet5
    if not isinstance(model, LeNet5):
        return f"the fused kernels run LeNet-5 only, not {type(model).__name__}"
    if model.device != "cuda":
        return f"the model is on {model.device!r}, not 'cuda'"
    if not 1 <= model.num_classes <= MAX_CLASSES:
        return f"num_classes {model.num_classes} is outside [1, {MAX_CLASSES}]"
    if model.input_size != 28 or model.input_pad != (2 if model.classic else 0):
        return f"input size {model.input_size} with pad {model.input_pad} is not LeNet-5's"
    children = list(model._modules.items())
    expected = _layers(model.classic, model.num_classes)
    if [name for name, _ in children] != [name for name, _, _ in expected]:
        return "the layers were changed after construction"
    for (name, layer), (_, cls, wshape) in zip(children, expected):
        if type(layer) is not cls:
            return f"layer {name} is a {type(layer).__name__}, not a {cls.__name__}"
        if wshape is not None:
            if layer.bias is None or layer.weight.shape != wshape:
                return f"layer {name} has weight {layer.weight.shape} (want {wshape}) or no bias"
            if cls is nn.Conv2d and (layer.stride not in (1, (1, 1)) or layer.padding not in (0, (0, 0))):
                return f"layer {name} has stride {layer.stride} / padding {layer.padding}"
            if str(layer.weight.data.dtype) != "float32":
                return f"layer {name} is {layer.weight.data.dtype}, not float32"
        if cls in (nn.MaxPool2d, nn.AvgPool2d):
            kw = layer._kwargs
            if kw["kernel"] not in (2, (2, 2)) or kw["stride"] not in (None, 2, (2, 2)) or \
                    kw["padding"] not in (0, (0, 0)):
                return f"layer {name} is not a 2x2 pool with stride 2 and no padding"
    return None


def lenet_params(model):
    """The ten parameter arrays in the kernels' order (conv1.w, conv1.b, ..., fc3.b)."""
    return tuple(p.data for p in lenet_parameters(model))


def lenet_parameters(model):
    m = model._modules
    return (m["conv1"].weight, m["conv1"].bias, m["conv2"].weight, m["conv2"].bias,
            m["fc1"].weight, m["fc1"].bias, m["fc2"].weight, m["fc2"].bias,
            m["fc3"].weight, m["fc3"].bias)
