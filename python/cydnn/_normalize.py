"""``normalize=`` of the importers: the input normalisation a loaded model applies.

A PyTorch state_dict or an ONNX graph holds no preprocessing; a cydnn image
model computes ``(x - mean) / std`` on its raw input before the first layer.
``normalize=(mean, std)`` sets those, ``None`` means the input is already
normalised (mean 0, std 1), and :data:`KEEP` (leaving the argument out) keeps
the model's own.  Used by :func:`cydnn.load_pytorch_weights` and
:func:`cydnn.load_onnx`.
"""
import math
import numbers

__all__ = ["KEEP", "check_normalize", "apply_normalize"]

#: The default of ``normalize=``: keep the model's own mean and std.
KEEP = object()


def _values(value, name, where, error, positive):
    """A float, or a tuple of floats (one per channel), all finite (and > 0 when ``positive``)."""
    single = isinstance(value, numbers.Real) and not isinstance(value, bool)
    values = [value] if single else value
    if not single and (not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 256):
        raise error(f"{where}: normalize {name} must be a number or a list of 1 to 256 numbers, got {value!r:.100}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or (positive and not v > 0):
            raise error(f"{where}: normalize=(mean, std) needs finite numbers{' > 0' if positive else ''} "
                        f"for the {name}, got {value!r:.100}")
        out.append(float(v))
    return out[0] if single else tuple(out)


def check_normalize(normalize, error, where):
    """``(mean, std)`` from ``normalize``: each a number or one per channel, finite, std > 0;
    ``None`` gives ``(0.0, 1.0)``."""
    if normalize is None:
        return 0.0, 1.0
    if not isinstance(normalize, (list, tuple)) or len(normalize) != 2:
        raise error(f"{where}: normalize must be (mean, std) or None, got {normalize!r:.100}")
    return _values(normalize[0], "mean", where, error, False), _values(normalize[1], "std", where, error, True)


def apply_normalize(model, normalize, error, where):
    """Set the model's input normalisation ``(v - mean) / std`` from ``normalize`` (see check_normalize)."""
    if normalize is KEEP:
        return model
    mean, std = check_normalize(normalize, error, where)
    if not (hasattr(model, "mean") and hasattr(model, "std")):
        raise error(f"{where}: normalize applies to a model that normalises its input (mean, std), such as "
                    f"cydnn.models.LeNet5; {type(model).__name__} takes its input as it is")
    shape = getattr(model, "input_shape", None)
    channels = shape[0] if isinstance(shape, tuple) and shape else None
    for name, value in (("mean", mean), ("std", std)):
        if isinstance(value, tuple) and len(value) not in (1, channels):
            raise error(f"{where}: normalize {name} has {len(value)} values; {type(model).__name__} takes "
                        f"{channels} channels (give one number, or one per channel)")
    model.mean, model.std = mean, std
    return model
