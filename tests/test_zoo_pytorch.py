"""A SmallCNN with batch norm trained in PyTorch, imported both ways (state_dict and ONNX), gives PyTorch's
logits on cydnn's reference path and through the compiler (batch norm folded), on the GPU (issue 16 item 5).

Needs torch (and onnx for the ONNX half); the GPU machine has both."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import cydnn
from cydnn import models, ops

gpu = pytest.mark.gpu


def _torch_zoo():
    spec = importlib.util.spec_from_file_location("torch_zoo", Path(__file__).resolve().parents[1] / "tools" /
                                                  "torch_zoo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trained_twin(torch, zoo, config, x, steps=30):
    """The PyTorch twin trained a few steps (running statistics move away from 0 and 1), in eval mode."""
    torch.manual_seed(0)
    twin = zoo.from_config(config).cuda()
    opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    y = torch.randint(0, config["num_classes"], (x.shape[0],), device="cuda")
    xt = torch.from_numpy(x).cuda()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(twin(xt), y).backward()
        opt.step()
    return twin.eval()


@gpu
def test_pytorch_trained_smallcnn_with_batch_norm_gives_pytorch_logits_both_ways(tmp_path):
    torch = pytest.importorskip("torch")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    zoo = _torch_zoo()
    model = models.SmallCNN(in_channels=3, num_classes=10, widths=(16, 32), convs_per_block=2, input_size=32,
                            mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    x = np.random.default_rng(0).standard_normal((64, 3, 32, 32)).astype(np.float32)
    twin = _trained_twin(torch, zoo, model.config(), x)
    with torch.no_grad():
        want = twin(torch.from_numpy(x).cuda()).cpu().numpy()
    assert float(twin.state_dict()["bn1_1.running_var"].std()) > 0     # trained statistics, not 1s

    np.savez(tmp_path / "sd.npz", **zoo.state_dict_numpy(twin))
    cydnn.load_pytorch_weights(model, tmp_path / "sd.npz")
    model.to("cuda").eval()
    ref = ops.cuda.to_numpy(model(ops.cuda.asarray(x)))
    np.testing.assert_allclose(ref, want, rtol=1e-4, atol=1e-4)
    compiled = cydnn.compile(model, input_shape=(3, 32, 32))(x)        # batch norm folded into the convs
    np.testing.assert_allclose(compiled, want, rtol=1e-4, atol=1e-4)
    assert "fold:" in cydnn.compile(model, input_shape=(3, 32, 32)).explain()

    pytest.importorskip("onnx")
    path = tmp_path / "smallcnn.onnx"
    try:
        torch.onnx.export(twin, torch.from_numpy(x[:1]).cuda(), str(path), input_names=["x"],
                          output_names=["logits"], dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}},
                          opset_version=17, dynamo=False)
    except Exception as e:  # noqa: BLE001 -- an exporter this machine lacks is a skip, with its reason
        pytest.skip(f"torch.onnx.export failed here: {type(e).__name__}: {e}")
    net = cydnn.load_onnx(path, device="cuda", lenet=False).eval()
    got = ops.cuda.to_numpy(net(ops.cuda.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cydnn.compile(net, input_shape=(3, 32, 32))(x), want, rtol=1e-4, atol=1e-4)
