"""The compiler: any ``nn.Sequential`` becomes a plan, a CUDA graph and fused kernels.

    step = cydnn.compile(model, optimizer, batch_size=64)     # training
    loss = step(x, y)                    # one step: forward, loss, backward, update -- one graph launch
    step.train_epoch(loader, scheduler)  # an epoch
    infer = cydnn.compile(model, input_shape=(1, 28, 28))     # inference
    logits = infer(x)                    # numpy in -> numpy out, DeviceArray in -> DeviceArray out
    print(step.explain((1, 28, 28)))     # the plan: steps, kernels, buffers, bytes

The stages, one module each, each printable:

1. :mod:`.trace`    -- the Sequential's layers and their shapes (checked once);
2. :mod:`.passes`   -- fusion (bias + activation into one epilogue kernel);
3. :mod:`.lower`    -- a :class:`~.ir.Plan`: steps (library calls) over named buffers;
4. :mod:`.passes`   -- memory planning (one arena, buffers reused by liveness);
5. :mod:`.executor` -- buffers bound, steps run through a dispatch table, the whole
   step captured into one CUDA graph (checked against a plain run, falling back to
   step-by-step launches with the reason logged).

Where a network is exactly LeNet-5, the planner picks the hand-fused kernels
(:mod:`.lenet`) for numpy inference and for whole epochs.  The compiler knows ``nn``
modules, never model classes.  Switches: ``fuse=False``, ``memory=False``,
``cuda_graph=False``, ``fused=False`` (no LeNet kernels); ``CYDNN_DEBUG=2`` runs each
step alone, synchronised, and prints its time.
"""
from .compiled import CompiledStep
from .inference import CompiledInference
from .ir import Plan
from .trace import Unsupported, trace

__all__ = ["compile", "CompiledStep", "CompiledInference", "Plan", "Unsupported", "trace"]


def compile(model, optimizer=None, batch_size=None, *, input_shape=None, loss_fn=None, softmax=False,
            preprocess=None, cuda_graph=True, fused=True, fuse=True, memory=True, weak_model=False,
            fused_net=None, resident_us=None):
    """A compiled training step (with ``optimizer``) or a compiled inference (with ``input_shape``).

    Training: ``compile(model, optimizer, batch_size=64)`` -> :class:`CompiledStep`
    (``loss_fn`` defaults to CrossEntropyLoss; ``input_shape`` optional: planned at the
    first batch otherwise).  Inference: ``compile(model, input_shape=(C, H, W))`` ->
    :class:`CompiledInference` (``softmax=True`` for probabilities).
    Bad arguments raise TypeError/ValueError before any GPU work; a network the compiler
    does not take raises :class:`Unsupported` for inference, and runs the reference loop
    (``info()["reason"]`` says why) for training.  ``preprocess=(mean, std, pad)``: inference takes
    raw images (uint8, or floats in [0, 1]) and normalises them; ``weak_model=True``: the result
    refers to the model weakly (for a model that caches it, as ``predict`` does).  ``fused_net``
    (inference): ``"auto"`` (default, or ``$CYDNN_FUSED_NET``) runs a batch on the whole-network kernel
    (compiler/fused_net.py) where it measures faster than the plan, ``"force"`` wherever it takes the
    network, ``"off"`` never.  ``resident_us`` (inference, default 0 or ``$CYDNN_RESIDENT_IDLE_US``): a
    one-image numpy call on the fused network is served by a kernel that stays on the GPU for that many
    microseconds after each call (no launch: ~2-3 us less a call), holding its SMs meanwhile; whatever
    waits for the whole device meanwhile (a cudaMalloc, cuDNN's first search for a shape) waits up to
    that long (docs/performance.md, "Session 18").
    """
    options = {"fuse": bool(fuse), "memory": bool(memory)}
    if optimizer is not None:
        if batch_size is None:
            raise ValueError("compile: a training step needs batch_size")
        if fused_net is not None or resident_us is not None:
            raise ValueError("compile: fused_net and resident_us are for inference (the fused network has no "
                             "backward)")
        return CompiledStep(model, optimizer, batch_size, loss_fn=loss_fn, input_shape=input_shape,
                            cuda_graph=cuda_graph, fused=fused, **options)
    if input_shape is None:
        raise ValueError("compile: give an optimizer (training) or input_shape (inference)")
    if batch_size is not None or loss_fn is not None:
        raise ValueError("compile: batch_size and loss_fn are for training steps (pass an optimizer)")
    return CompiledInference(model, input_shape, softmax=softmax, cuda_graph=cuda_graph, fused=fused,
                             preprocess=preprocess, weak_model=weak_model, fused_net=fused_net,
                             resident_us=resident_us, **options)
