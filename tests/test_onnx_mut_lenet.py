"""cydnn.load_onnx's LeNet-5 recognition, said exactly: a graph built here layer by layer is a
``models.LeNet5`` only when every layer's type and hyperparameters are LeNet-5's (modern: 28 x 28,
ReLU, max pooling; classic: 32 x 32, tanh, average pooling), with the graph's weights loaded
whatever their names; one change (a padding, a bias, a pooling window, the input size, the
channels) gives the Sequential, which agrees with onnx's reference evaluator."""
import numpy as np
import pytest

import cydnn
from cydnn import models, nn, ops
from cydnn.onnx_import import Softmax

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402


def _out(size, k, s, p):
    return (size + 2 * p - k) // s + 1


def lenet_graph(tmp_path, classic=False, size=None, channels=1, conv_pads=0, conv_bias=True, fc_bias=True,
                act=None, pool=None, pool_k=2, pool_s=2, pool_p=0, classes=10, tail=(), batch="N",
                spatial=None, name="lenet.onnx", seed=0):
    """Conv(c->6, 5) act pool Conv(6->16, 5) act pool Flatten Gemm(->120) act Gemm(->84) act Gemm(->classes),
    weights named ``layer<k>.weight`` (not LeNet5's names); ``tail``: ops appended after the last Gemm."""
    rng = np.random.default_rng(seed)
    size = size or (32 if classic else 28)
    act = act or ("Tanh" if classic else "Relu")
    pool = pool or ("AveragePool" if classic else "MaxPool")
    h = size
    for _ in range(2):
        h = _out(_out(h, 5, 1, conv_pads if _ == 0 else 0), pool_k, pool_s, pool_p)
    feats = 16 * h * h
    inits, nodes = {}, []
    cur = "x"

    def add(op, inputs, **attrs):
        nonlocal cur
        out = f"v{len(nodes)}"
        nodes.append(helper.make_node(op, [cur, *inputs], [out], name=f"/{op}_{len(nodes)}", **attrs))
        cur = out

    def weights(k, wshape, bias):
        inits[f"layer{k}.weight"] = (rng.standard_normal(wshape) * 0.2).astype(np.float32)
        if bias:
            inits[f"layer{k}.bias"] = (rng.standard_normal(wshape[0]) * 0.1).astype(np.float32)
        return [f"layer{k}.weight"] + ([f"layer{k}.bias"] if bias else [])

    pool_attrs = {"kernel_shape": [pool_k, pool_k], "strides": [pool_s, pool_s], "pads": [pool_p] * 4}
    if pool == "AveragePool" and pool_p:
        pool_attrs["count_include_pad"] = 1
    add("Conv", weights(1, (6, channels, 5, 5), conv_bias), kernel_shape=[5, 5], pads=[conv_pads] * 4)
    add(act, [])
    add(pool, [], **pool_attrs)
    add("Conv", weights(2, (16, 6, 5, 5), True), kernel_shape=[5, 5])
    add(act, [])
    add(pool, [], **pool_attrs)
    add("Flatten", [], axis=1)
    add("Gemm", weights(3, (120, feats), fc_bias), transB=1)
    add(act, [])
    add("Gemm", weights(4, (84, 120), True), transB=1)
    add(act, [])
    add("Gemm", weights(5, (classes, 84), True), transB=1)
    for op in tail:
        add(op, [])
    spatial = spatial or [size, size]
    graph = helper.make_graph(nodes, "lenet", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             [batch, channels, *spatial])],
                              [helper.make_tensor_value_info(cur, TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = str(tmp_path / name)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path, inits


def run(model, x):
    model.eval()
    backend = ops.backend(model.device)
    return backend.to_numpy(model(backend.asarray(np.ascontiguousarray(x, dtype=np.float32))))


def reference(path, x):
    return ReferenceEvaluator(path).run(None, {"x": x})[0]


@pytest.mark.parametrize("classic", [False, True])
@pytest.mark.parametrize("batch,spatial", [("N", None), (3, None), (None, ["H", "W"])])
def test_lenet_graph_becomes_a_lenet5_with_its_weights(tmp_path, classic, batch, spatial):
    path, inits = lenet_graph(tmp_path, classic=classic, batch=batch, spatial=spatial)
    model = cydnn.load_onnx(path, normalize=None)
    assert type(model) is models.LeNet5 and model.classic == classic and model.num_classes == 10
    state = model.state_dict()
    for k, lname in enumerate(("conv1", "conv2", "fc1", "fc2", "fc3"), 1):
        np.testing.assert_array_equal(state[f"{lname}.weight"], inits[f"layer{k}.weight"])
        np.testing.assert_array_equal(state[f"{lname}.bias"], inits[f"layer{k}.bias"])
    assert (model.mean, model.std) == (0.0, 1.0) and model.training
    # predict takes the raw 28 x 28 image (classic pads it by 2); forward, the graph's input
    x = np.random.default_rng(1).uniform(0, 1, (3, 1, 28, 28)).astype(np.float32)
    graph_x = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2))) if classic else x
    np.testing.assert_allclose(model.preprocess(x), graph_x, rtol=0, atol=1e-7)
    np.testing.assert_allclose(run(model, graph_x), reference(path, graph_x), rtol=1e-4, atol=1e-4)


def test_lenet5_keeps_cydnns_normalisation_or_takes_one(tmp_path):
    path, _ = lenet_graph(tmp_path)
    model = cydnn.load_onnx(path)
    assert (model.mean, model.std) == (0.1307, 0.3081)
    model = cydnn.load_onnx(path, normalize=(0.5, 0.25))
    assert (model.mean, model.std) == (0.5, 0.25)
    x = np.random.default_rng(1).uniform(0, 1, (2, 1, 28, 28)).astype(np.float32)
    np.testing.assert_allclose(model.preprocess(x), (x - 0.5) / 0.25, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(run(model, model.preprocess(x)), reference(path, (x - 0.5) / 0.25),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError) as info:
        cydnn.load_onnx(path, normalize=(0.5, 0.0))
    assert str(info.value) == (f"load_onnx({path!r}): normalize=(mean, std) needs finite numbers > 0 for the std, "
                               f"got 0.0")


def test_lenet_false_gives_the_sequential(tmp_path):
    path, _ = lenet_graph(tmp_path)
    seq = cydnn.load_onnx(path, lenet=False)
    assert type(seq) is nn.Sequential and len(seq) == 12
    x = np.random.default_rng(1).standard_normal((2, 1, 28, 28)).astype(np.float32)
    np.testing.assert_allclose(run(seq, x), reference(path, x), rtol=1e-4, atol=1e-4)


def test_other_class_counts_and_a_trailing_softmax(tmp_path):
    path, _ = lenet_graph(tmp_path, classes=3, tail=("Softmax",))
    model = cydnn.load_onnx(path)
    assert type(model) is models.LeNet5 and model.num_classes == 3 and len(model) == 12
    seq = cydnn.load_onnx(path, lenet=False)
    assert isinstance(seq[-1], Softmax) and len(seq) == 13


@pytest.mark.parametrize("change", [
    {"conv_pads": 2},                                   # same sizes as classic's, one padding more
    {"conv_bias": False}, {"fc_bias": False},
    {"pool_k": 3, "pool_p": 1},                         # same output sizes, another window
    {"size": 32},                                       # modern layers on 32 x 32
    {"classic": True, "size": 28},                      # classic layers on 28 x 28
    {"act": "Sigmoid"}, {"pool": "AveragePool"}, {"classic": True, "pool": "MaxPool"},
    {"classic": True, "act": "Relu"},
    {"channels": 3},
    {"spatial": [28, 30]},
    {"tail": ("Relu",)},
    {"tail": ("Softmax", "Softmax")},
])
def test_one_change_gives_the_sequential(tmp_path, change):
    path, _ = lenet_graph(tmp_path, **change)
    model = cydnn.load_onnx(path, normalize=None)
    assert type(model) is nn.Sequential
    size = change.get("size") or (32 if change.get("classic") else 28)
    spatial = change.get("spatial") or [size, size]
    x = np.random.default_rng(1).standard_normal((2, change.get("channels", 1), *spatial)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-4, atol=1e-4)


def test_a_lone_softmax_or_layers_without_a_linear_are_a_sequential(tmp_path):
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="sm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    path = str(tmp_path / "sm.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    model = cydnn.load_onnx(path)
    assert type(model) is nn.Sequential and [type(m) for m in model] == [Softmax]
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", [{"pool_s": 1}, {"conv_stride": 2}])
def test_a_stride_alone_tells_when_sizes_are_unknown(tmp_path, change):
    # with a symbolic height and width no size gives the change away: only the layers' signatures
    path, inits = lenet_graph(tmp_path, spatial=["H", "W"])
    proto = onnx.load(path)
    for n in proto.graph.node:
        if "pool_s" in change and n.op_type == "MaxPool":
            n.attribute.remove(next(a for a in n.attribute if a.name == "strides"))
            n.attribute.append(helper.make_attribute("strides", [1, 1]))
        if "conv_stride" in change and n.op_type == "Conv" and n.input[1] == "layer1.weight":
            n.attribute.append(helper.make_attribute("strides", [2, 2]))
    onnx.save(proto, path)
    model = cydnn.load_onnx(path, normalize=None)
    assert type(model) is nn.Sequential
    # the input size whose features the fc1 weight (256) takes
    side = 14 if "pool_s" in change else 56
    x = np.random.default_rng(1).standard_normal((2, 1, side, side)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-4, atol=1e-4)
