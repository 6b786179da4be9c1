"""The check of ``batch_norm_forward`` (see ``_check.py``, which re-exports it)."""
import math

import numpy as np

from ._check_base import _array, _number, _same_dtype, _shape, _shapes, _type_name


def check_batch_norm(x, gamma, beta, running_mean, running_var, training, momentum, eps, allowed_dtypes):
    """Validate ``batch_norm_forward``; return ``(c, count, momentum, eps)``.

    x (n, c), (n, c, l) or (n, c, h, w); gamma and beta both None (no affine
    transform) or both (c,); running_mean and running_var both None or both
    (c,); all of x's dtype.  ``training`` a bool; evaluation (``training``
    False) needs the running statistics; training needs ``count`` = the
    values per channel (n times the positions) > 1, as PyTorch, since the
    unbiased variance divides by count - 1.  ``momentum`` in [0, 1] and
    ``eps`` >= 0, finite, returned as Python floats.
    """
    op = "batch_norm_forward"
    _array(op, "x", x, allowed_dtypes)
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"{op}: x must have rank 2 (n, c), 3 (n, c, l) or 4 (n, c, h, w), got rank {x.ndim} "
                         f"(x {_shape(x)})")
    c = int(x.shape[1])
    for first, second in (("gamma", "beta"), ("running_mean", "running_var")):
        given = {"gamma": gamma, "beta": beta, "running_mean": running_mean, "running_var": running_var}
        if (given[first] is None) != (given[second] is None):
            missing, present = (first, second) if given[first] is None else (second, first)
            raise TypeError(f"{op}: {missing} is None but {present} is not: give both or neither (x {_shape(x)})")
        for name in (first, second):
            a = given[name]
            if a is None:
                continue
            _array(op, name, a, allowed_dtypes, 1, "(channels,)")
            _same_dtype(op, name, a, "x", x, x=x, **{name: a})
            if a.shape[0] != c:
                raise ValueError(f"{op}: {name} has {a.shape[0]} entries but x has {c} channels "
                                 f"{_shapes(x=x, **{name: a})}")
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"{op}: training must be a bool, got {_type_name(training)} {training!r}")
    momentum = _number(op, "momentum", momentum)
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"{op}: momentum must be in [0, 1], got {momentum}")
    eps = _number(op, "eps", eps)
    if eps < 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    count = math.prod(_shape(x)) // c
    if not training and running_mean is None:
        raise ValueError(f"{op}: evaluation (training=False) needs running_mean and running_var (x {_shape(x)})")
    if training and count < 2:
        raise ValueError(f"{op}: training needs more than 1 value per channel, got x {_shape(x)}")
    return c, count, momentum, eps
