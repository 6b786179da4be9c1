"""The softmax cross-entropy of a batch of at most 2,048 rows in one block (cpp/loss.cu's cross_entropy_block_kernel)
with the bias gradient of the layer that made the logits in the same launch, as the compiler's plans run it
(passes.fuse_backward): its loss and gradient are the plain op's bits, its bias gradient the columns' sums; bad
labels; its refusals; where the pass fuses it (CPU)."""
import re
from pathlib import Path

import numpy as np
import pytest

import cydnn
from cydnn import nn
from cydnn.compiler import passes
from cydnn.compiler.compiled import _build_plan

gpu = pytest.mark.gpu
LOSS_CU = (Path(__file__).resolve().parents[1] / "cpp" / "loss.cu").read_text()


@gpu
@pytest.mark.parametrize("n, c", [(1, 10), (64, 10), (100, 33), (2048, 10), (7, 1000)])
def test_the_fused_bias_gradient_beside_the_plain_loss(n, c):
    from cydnn import _C
    rng = np.random.default_rng(n + c)
    logits = (rng.standard_normal((n, c)) * 3).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32)
    xd, ld = cydnn.to_device(logits), cydnn.to_device(labels)
    loss, d, db = _C.empty(()), _C.empty((n, c)), _C.empty((c,))
    _C.softmax_cross_entropy_bias(xd, ld, loss, d, db)
    loss_ref, d_ref = _C.empty(()), _C.empty((n, c))
    _C.softmax_cross_entropy(xd, ld, loss_ref, d_ref, None)
    assert np.array_equal(loss.numpy(), loss_ref.numpy()) and np.array_equal(d.numpy(), d_ref.numpy())
    col = d_ref.numpy().astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(db.numpy(), col, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(d_ref.numpy()).sum(0).max()))
    # and against float64 numpy: loss = mean(logsumexp - x[label]), d = (softmax - onehot) / n
    x64 = logits.astype(np.float64)
    m = x64.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x64 - m).sum(axis=1))
    np.testing.assert_allclose(loss.numpy(), np.mean(lse - x64[np.arange(n), labels]), rtol=1e-5)


@gpu
def test_a_bad_label_makes_its_row_and_the_sums_nan():
    from cydnn import _C
    logits = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    loss, d, db = _C.empty(()), _C.empty((4, 5)), _C.empty((5,))
    _C.softmax_cross_entropy_bias(cydnn.to_device(logits), cydnn.to_device(np.array([0, 5, 1, 2], np.int32)),
                                  loss, d, db)
    assert np.isnan(loss.numpy()) and np.isnan(d.numpy()[1]).all() and np.isfinite(d.numpy()[[0, 2, 3]]).all()
    assert np.isnan(db.numpy()).all()


@gpu
def test_the_fused_loss_refuses_what_it_cannot_compute():
    from cydnn import _C
    x, lab = _C.empty((2049, 3)), cydnn.to_device(np.zeros(2049, np.int32))
    with pytest.raises(cydnn.CydnnError, match="one block takes at most 2048 rows, got 2049"):
        _C.softmax_cross_entropy_bias(x, lab, _C.empty(()), _C.empty((2049, 3)), _C.empty((3,)))
    with pytest.raises(ValueError, match=r"softmax_cross_entropy_bias: labels must be \(4,\)"):
        _C.softmax_cross_entropy_bias(_C.empty((4, 3)), cydnn.to_device(np.zeros(5, np.int32)), _C.empty(()),
                                      _C.empty((4, 3)), _C.empty((3,)))
    with pytest.raises(ValueError, match="logits and dlogits must be one"):
        _C.softmax_cross_entropy_bias(_C.empty((4, 3)), cydnn.to_device(np.zeros(4, np.int32)), _C.empty(()),
                                      _C.empty((4, 2)), _C.empty((3,)))


def test_the_pass_fuses_the_last_bias_only_without_an_activation_and_for_one_blocks_batch():
    """CPU: Linear -> loss fuses (batch 64 and 2,048); a batch of 2,049 keeps two kernels and the bias step; a
    Linear without bias has no bias step to take; fuse=False leaves both steps."""
    assert re.search(rf"kBlockRows = {passes.LOSS_BLOCK_ROWS};", LOSS_CU)

    def steps(model, batch, **options):
        plan = _build_plan(model, (1, 4, 4), batch, True, options)[0]
        return [(s.name, s.kernels) for s in plan.steps]
    net = lambda bias=True: nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3, bias=bias))  # noqa: E731
    for batch in (64, passes.LOSS_BLOCK_ROWS):
        got = steps(net(), batch)
        assert ("loss + 3 bias backward", ("cross_entropy_block_kernel",)) in got
        assert not any(name == "3 bias backward" for name, _ in got)
    big = steps(net(), passes.LOSS_BLOCK_ROWS + 1)
    assert ("loss", ("cross_entropy_rows_kernel", "mean_kernel")) in big and any(n == "3 bias backward" for n, _ in big)
    assert ("loss", ("cross_entropy_block_kernel",)) in steps(net(bias=False), 64)
    unfused = steps(net(), 64, fuse=False)
    assert ("loss", ("cross_entropy_block_kernel",)) in unfused and any(n == "3 bias backward" for n, _ in unfused)
