"""The reference training loop: one epoch of per-op calls, the definition compiled steps are checked against.

It is what ``python -m cydnn.train --no-cuda-graph`` and every CPU run use, and what a
compiled step falls back to (with the reason logged) where it cannot run a model.
Nothing is read back until the epoch ends: losses and logits stay on the device.
"""
import numpy as np

from . import nn, ops

__all__ = ["reference_epoch"]


def reference_epoch(model, loss_fn, optimizer, loader, scheduler=None, steps=None, progress=None):
    """Train ``model`` on ``loader`` for one epoch (or its first ``steps`` batches).

    Returns ``(steps, images, mean loss, correct)``: the loss is the mean of the steps'
    mean losses, ``correct`` the training images whose argmax was the label.
    ``scheduler.step()`` runs after every optimizer step; ``progress`` wraps the batches.
    """
    model.train()
    losses, correct, images = [], [], 0
    batches = loader if progress is None else progress(loader)
    for i, (x, y) in enumerate(batches):
        if steps is not None and i >= steps:
            break
        logits = model(x)
        losses.append(loss_fn(logits, y))
        correct.append((logits, y))
        if isinstance(model, nn.Sequential):
            model.backward(loss_fn.backward(), input_grad=False)   # the input is data
        else:
            model.backward(loss_fn.backward())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        images += len(y)
    backend = ops.backend_of(losses[0]) if losses else None
    loss = float(np.mean([float(backend.to_numpy(l)) for l in losses])) if losses else float("nan")
    right = sum(int((backend.to_numpy(z).argmax(1) == backend.to_numpy(t)).sum()) for z, t in correct)
    return len(losses), images, loss, right
