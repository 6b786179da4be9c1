"""What the GPU tests of the compiler's own kernels (test_conv_igemm.py, test_conv_wgrad.py, test_gemm_skinny.py)
share: a small CNN that takes every convolution path, and the compiled path checked against the per-op one -- the
inference of a batch, and one training step's loss and gradients (SGD with lr 0: the weights stay)."""
import numpy as np
import pytest

import cydnn
from cydnn import nn, ops, optim


def small_cnn(rng=0):
    """Stride 1 and 2, padding, ReLU / leaky / tanh after the convolutions, max pooling, a linear head."""
    return nn.Sequential(nn.Conv2d(3, 24, 3, padding=1, rng=rng), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(24, 48, 3, padding=1, rng=rng), nn.LeakyReLU(0.1), nn.MaxPool2d(2),
                         nn.Conv2d(48, 40, 3, stride=2, padding=1, rng=rng), nn.Tanh(), nn.Flatten(),
                         nn.Linear(640, 10, rng=rng))


def inference_against_the_per_op_path(make, x, rtol, atol):
    """``cydnn.compile`` of ``make()`` (the fused network off) on ``x`` against the model's own forward; returns
    the compiled inference (its plans and printout)."""
    model = make().to("cuda").eval()
    want = ops.cuda.to_numpy(model(ops.cuda.asarray(x)))
    infer = cydnn.compile(model, input_shape=x.shape[1:], fused_net="off")
    np.testing.assert_allclose(infer(x), want, rtol=rtol, atol=atol)
    return infer


def one_step_against_the_per_op_path(make, x, y):
    """One compiled training step (the fused step off) of ``make()`` on (x, y): its loss within 1e-5 of the per-op
    path's and every parameter's gradient within 1e-5 of the largest; returns the step (its printout)."""
    ref = make().to("cuda")
    loss_fn = nn.CrossEntropyLoss()
    want = float(ops.cuda.to_numpy(loss_fn(ref(ops.cuda.asarray(x)), y)))
    ref.backward(loss_fn.backward(), input_grad=False)
    model = make().to("cuda")
    step = cydnn.compile(model, optim.SGD(model.parameters(), lr=0.0), batch_size=x.shape[0], fused=False)
    assert float(step(x, y)) == pytest.approx(want, rel=1e-5)
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        got, exp = a.grad.numpy(), b.grad.numpy()
        np.testing.assert_allclose(got, exp, rtol=0, atol=1e-5 * np.abs(exp).max(), err_msg=name)
    return step
