"""load_onnx for issue 16's layers: BatchNormalization, GlobalAveragePool, LeakyRelu and 3-channel
inputs, against onnx's reference evaluator.  The cydnn layers (nn.BatchNorm2d, AdaptiveAvgPool2d,
LeakyReLU) come with another change: until they are in this cydnn, these tests skip saying so."""
import numpy as np
import pytest

import cydnn
from cydnn import nn
from cydnn.onnx_import import OnnxImportError

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

HAVE = all(hasattr(nn, n) for n in ("BatchNorm2d", "AdaptiveAvgPool2d", "LeakyReLU"))
pytestmark = pytest.mark.skipif(not HAVE, reason="nn.BatchNorm2d / AdaptiveAvgPool2d / LeakyReLU are not in "
                                                 "this cydnn yet (issue 16's layers, written separately)")


def small_cnn(tmp_path, rng, bn_attrs=None, var=None, alpha=0.1, opset=17):
    """Conv(3->4) - BatchNormalization - LeakyRelu - GlobalAveragePool - Flatten - Gemm(->5), input (3, 8, 8)."""
    nodes = [helper.make_node("Conv", ["x", "conv1.weight", "conv1.bias"], ["c"], name="conv", kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "bn1.weight", "bn1.bias", "bn1.running_mean",
                                                     "bn1.running_var"], ["b"], name="bn", **(bn_attrs or {})),
             helper.make_node("LeakyRelu", ["b"], ["l"], name="leaky", alpha=alpha),
             helper.make_node("GlobalAveragePool", ["l"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat", axis=1),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1)]
    f32 = np.float32
    inits = {"conv1.weight": rng.standard_normal((4, 3, 3, 3)).astype(f32), "conv1.bias": rng.standard_normal(4).astype(f32),
             "bn1.weight": rng.uniform(0.5, 2, 4).astype(f32), "bn1.bias": rng.standard_normal(4).astype(f32),
             "bn1.running_mean": rng.standard_normal(4).astype(f32),
             "bn1.running_var": rng.uniform(0.5, 2, 4).astype(f32) if var is None else var,
             "fc.weight": rng.standard_normal((5, 4)).astype(f32), "fc.bias": rng.standard_normal(5).astype(f32)}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = str(tmp_path / "cnn.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def test_batchnorm_leakyrelu_global_pool_three_channels_match_the_reference(tmp_path, rng):
    path = small_cnn(tmp_path, rng, bn_attrs={"epsilon": 1e-3})
    model = cydnn.load_onnx(path)
    assert type(model) is nn.Sequential
    assert [type(m).__name__ for m in model] == ["Conv2d", "BatchNorm2d", "LeakyReLU", "AdaptiveAvgPool2d",
                                                 "Flatten", "Linear"]
    assert "bn1.running_var" in model.state_dict()             # torch's names, buffers included
    x = rng.standard_normal((6, 3, 8, 8)).astype(np.float32)
    model.eval()
    want = ReferenceEvaluator(path).run(None, {"x": x})[0]
    np.testing.assert_allclose(model(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    ({"bn_attrs": {"training_mode": 1}}, "training_mode"),
    ({"bn_attrs": {"epsilon": -1.0}}, "epsilon"),
    ({"var": -np.ones(4, np.float32)}, "negative"),
    ({"var": np.ones(3, np.float32)}, r"var must be a constant of shape \(channels,\) = \(4,\)"),
    ({"alpha": float("nan")}, "alpha"),
])
def test_bad_batchnorm_and_leakyrelu_are_refused_naming_the_node(tmp_path, rng, change, match):
    with pytest.raises(OnnxImportError, match=match):
        cydnn.load_onnx(small_cnn(tmp_path, rng, **change))


@pytest.mark.parametrize("fmt", ["npz", "safetensors", "txt", "bin"])
def test_pytorch_state_dict_with_batchnorm_buffers_loads(tmp_path, fmt):
    """load_pytorch_weights takes the buffers too (running statistics, num_batches_tracked as
    int64 the way PyTorch saves it), and a missing buffer is named."""
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    src = nn.Sequential(nn.Conv2d(3, 4, 3, rng=0), nn.BatchNorm2d(4))
    state = src.state_dict()
    state["1.running_mean"] = np.arange(4, dtype=np.float32)
    state["1.running_var"] = np.linspace(0.5, 2, 4).astype(np.float32)
    state["1.num_batches_tracked"] = np.array(7, np.int64)
    src.load_state_dict(state)
    path = cydnn.export_weights(src, tmp_path / f"w.{fmt}", fmt)
    dst = cydnn.load_pytorch_weights(nn.Sequential(nn.Conv2d(3, 4, 3, rng=1), nn.BatchNorm2d(4)), path)
    for k, v in state.items():
        np.testing.assert_array_equal(dst.state_dict()[k], v, err_msg=k)
    del state["1.running_var"]
    np.savez(tmp_path / "partial.npz", **state)
    with pytest.raises(cydnn.interop.WeightsError, match=r"missing parameters \['1.running_var'\]"):
        cydnn.load_pytorch_weights(nn.Sequential(nn.Conv2d(3, 4, 3, rng=1), nn.BatchNorm2d(4)),
                                   tmp_path / "partial.npz")
