"""cydnn.load_onnx: torch's LeNet-5 exports, and graphs built here with onnx.helper.

Hand-built graphs are checked against onnx's own reference evaluator
(``onnx.reference``), an implementation independent of cydnn's ops.
"""
import os

import numpy as np
import pytest

import cydnn
from cydnn import models, nn, ops
from cydnn.onnx_import import OnnxImportError, Softmax

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "pytorch_lenet")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def expected():
    with np.load(os.path.join(FIXTURES, "expected.npz")) as f:
        return dict(f)


def run(model, x):
    model.eval()
    backend = ops.backend(model.device)
    return backend.to_numpy(model(backend.asarray(np.ascontiguousarray(x, dtype=np.float32))))


def save(tmp_path, nodes, inits, in_shape, out="y", name="g.onnx", opset=17):
    """A model file: input ``x`` of (N, *in_shape) with a symbolic batch, output ``out``."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *in_shape])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.asarray(v, dtype=np.float32), k) for k, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = str(tmp_path / name)
    onnx.save(proto, path)
    return path


def reference(path, x):
    """onnx's own evaluation of the model at ``path`` on ``x``."""
    evaluator = ReferenceEvaluator(path)
    return evaluator.run(None, {evaluator.input_names[0]: x.astype(np.float32)})[0]


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------- torch's exports
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["modern", "classic"])
def test_torch_lenet_becomes_a_lenet5(expected, variant, device):
    model = cydnn.load_onnx(os.path.join(FIXTURES, f"{variant}.onnx"), device=device)
    assert isinstance(model, models.LeNet5) and model.classic == (variant == "classic")
    assert model.device == device and model.num_classes == 10
    assert (model.mean, model.std, model.input_pad) == (0.1307, 0.3081, 2 if variant == "classic" else 0)
    np.testing.assert_allclose(run(model, expected[f"inputs_{variant}"]), expected[f"logits_{variant}"],
                               rtol=0, atol=1e-4)
    probs = model.predict(expected["images"])       # raw images, cydnn's preprocessing
    np.testing.assert_allclose(probs, ops.cpu.softmax(expected[f"logits_{variant}"].astype(np.float64)),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["modern", "classic"])
def test_lenet_false_gives_a_sequential_with_torch_names(expected, variant):
    path = os.path.join(FIXTURES, f"{variant}.onnx")
    seq = cydnn.load_onnx(path, lenet=False)
    assert type(seq) is nn.Sequential and len(seq) == 12
    with np.load(os.path.join(FIXTURES, f"{variant}.npz")) as f:
        torch_state = dict(f)
    state = seq.state_dict()
    assert list(state) == list(torch_state)
    for k in state:
        np.testing.assert_array_equal(state[k], torch_state[k])
    np.testing.assert_allclose(run(seq, expected[f"inputs_{variant}"]), expected[f"logits_{variant}"],
                               rtol=0, atol=1e-4)
    np.testing.assert_allclose(run(seq, expected[f"inputs_{variant}"]),
                               reference(path, expected[f"inputs_{variant}"]), rtol=0, atol=1e-4)


def with_softmax(tmp_path, variant="modern"):
    proto = onnx.load(os.path.join(FIXTURES, f"{variant}.onnx"))
    g = proto.graph
    last = g.output[0].name
    g.node.append(helper.make_node("Softmax", [last], ["probs"], name="/Softmax", axis=1))
    g.output[0].name = "probs"
    path = str(tmp_path / "softmax.onnx")
    onnx.save(proto, path)
    return path


def test_trailing_softmax(tmp_path, expected):
    path = with_softmax(tmp_path)
    lenet = cydnn.load_onnx(path)                   # dropped: predict gives probabilities
    assert isinstance(lenet, models.LeNet5) and len(lenet) == 12
    seq = cydnn.load_onnx(path, lenet=False)        # kept as a layer
    assert isinstance(seq[-1], Softmax) and len(seq) == 13
    x = expected["inputs_modern"]
    probs = run(seq, x)
    np.testing.assert_allclose(probs, ops.cpu.softmax(expected["logits_modern"]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(probs, reference(path, x), rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="no backward"):
        seq.backward(np.ones_like(probs))


def test_other_num_classes_is_a_lenet5_other_structure_is_not(tmp_path, expected):
    proto = onnx.load(os.path.join(FIXTURES, "modern.onnx"))
    for init in proto.graph.initializer:
        if init.name in ("fc3.weight", "fc3.bias"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init)[:5].copy(), init.name))
    path = str(tmp_path / "five.onnx")
    onnx.save(proto, path)
    model = cydnn.load_onnx(path)
    assert isinstance(model, models.LeNet5) and model.num_classes == 5
    np.testing.assert_allclose(run(model, expected["inputs_modern"]), expected["logits_modern"][:, :5],
                               rtol=0, atol=1e-4)

    proto = onnx.load(os.path.join(FIXTURES, "modern.onnx"))
    relus = [n for n in proto.graph.node if n.op_type == "Relu"]
    relus[-1].op_type = "Sigmoid"            # ReLU, ..., ReLU, Sigmoid: not LeNet-5
    path = str(tmp_path / "sigmoid.onnx")
    onnx.save(proto, path)
    model = cydnn.load_onnx(path)
    assert type(model) is nn.Sequential and isinstance(model.sigmoid1, nn.Sigmoid)
    np.testing.assert_allclose(run(model, expected["inputs_modern"]), reference(path, expected["inputs_modern"]),
                               rtol=0, atol=1e-4)


def test_load_onnx_errors_on_junk(tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07garbage that is not protobuf \xff\xff")
    with pytest.raises(OnnxImportError, match="not a readable ONNX model"):
        cydnn.load_onnx(tmp_path / "junk.onnx")
    with pytest.raises(FileNotFoundError):
        cydnn.load_onnx(tmp_path / "missing.onnx")


def test_missing_onnx_package_is_named(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "onnx", None)
    with pytest.raises(ImportError, match=r"pip install onnx.*cydnn\[onnx\]"):
        cydnn.load_onnx(os.path.join(FIXTURES, "modern.onnx"))


# -------------------------------------------------- hand-built graphs
def conv_net(rng, conv_attrs=None, pool="MaxPool", pool_attrs=None, act="Relu"):
    """Conv(2->3, 3x3) - act - pool - Flatten - Gemm(->4), input (2, 8, 8)."""
    conv_attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], **(conv_attrs or {})}
    pool_attrs = {"kernel_shape": [2, 2], "strides": [2, 2], **(pool_attrs or {})}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", **conv_attrs),
             helper.make_node(act, ["c"], ["a"], name="act"),
             helper.make_node(pool, ["a"], ["p"], name="pool", **pool_attrs),
             helper.make_node("Flatten", ["p"], ["f"], name="flat", axis=1)]
    inits = {"w": rand(rng, 3, 2, 3, 3), "b": rand(rng, 3)}
    return nodes, inits


@pytest.mark.parametrize("pool,pool_attrs", [
    ("MaxPool", {}), ("MaxPool", {"pads": [1, 1, 1, 1], "strides": [3, 3]}),
    ("AveragePool", {}), ("AveragePool", {"pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", {"count_include_pad": 0}),
])
@pytest.mark.parametrize("act", ["Relu", "Tanh", "Sigmoid"])
def test_conv_pool_gemm_matches_onnx_reference(tmp_path, rng, pool, pool_attrs, act):
    nodes, inits = conv_net(rng, conv_attrs={"strides": [1, 2], "pads": [1, 0, 1, 0]},
                            pool=pool, pool_attrs=pool_attrs, act=act)
    x = rand(rng, 5, 2, 8, 9)
    feats = ReferenceEvaluator(helper.make_model(helper.make_graph(
        nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("f", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()]))).run(None, {"x": x})[0].shape[1]
    nodes.append(helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1))
    inits.update(fw=rand(rng, 4, feats), fb=rand(rng, 4))
    path = save(tmp_path, nodes, inits, (2, 8, 9))
    model = cydnn.load_onnx(path)
    assert type(model) is nn.Sequential
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["gemm_transB0", "gemm_alpha_beta", "matmul_add", "matmul", "reshape"])
def test_linear_forms(tmp_path, rng, form):
    w, b = rand(rng, 6, 4), rand(rng, 4)     # (in, out) as MatMul and Gemm transB=0 take it
    x = rand(rng, 3, 6)
    if form == "gemm_transB0":
        nodes, inits = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc")], {"w": w, "b": b}
    elif form == "gemm_alpha_beta":
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1, alpha=0.5, beta=2.0)]
        inits = {"w": w.T.copy(), "b": b}
    elif form == "matmul_add":
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
                 helper.make_node("Add", ["b", "m"], ["y"], name="add")]
        inits = {"w": w, "b": b}
    elif form == "matmul":
        nodes, inits = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], {"w": w}
    else:
        x = rand(rng, 3, 1, 2, 3)
        nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="view"),
                 helper.make_node("Gemm", ["r", "w", "b"], ["y"], name="fc")]
        inits = {"w": w, "b": b}
    path = save(tmp_path, nodes, inits, x.shape[1:])
    if form == "reshape":       # the shape as an int64 Constant node, as the exporter writes it
        proto = onnx.load(path)
        proto.graph.node.insert(0, helper.make_node("Constant", [], ["shape"], name="c", value=numpy_helper.from_array(
            np.array([-1, 6], np.int64))))
        onnx.save(proto, path)
    model = cydnn.load_onnx(path)
    assert (model[-1].bias is None) == (form == "matmul")
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ refusals
def test_unsupported_op_named_with_its_position(tmp_path, rng):
    nodes, inits = conv_net(rng)
    nodes.insert(2, helper.make_node("Elu", ["a"], ["l"], name="/act/Elu", alpha=0.1))
    nodes[3].input[0] = "l"
    path = save(tmp_path, nodes, inits, (2, 8, 8), out="f")
    with pytest.raises(OnnxImportError) as info:
        cydnn.load_onnx(path)
    msg = str(info.value)
    assert "'Elu'" in msg and "node 2" in msg and "'/act/Elu'" in msg and "Conv" in msg


def test_custom_domain_is_refused(tmp_path, rng):
    nodes, inits = conv_net(rng)
    nodes[1] = helper.make_node("Relu", ["c"], ["a"], name="r", domain="com.example")
    path = save(tmp_path, nodes, inits, (2, 8, 8), out="f")
    proto = onnx.load(path)
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(proto, path)
    with pytest.raises(OnnxImportError, match=r"unsupported op 'Relu' \(domain 'com.example'\) at node 1"):
        cydnn.load_onnx(path)


@pytest.mark.parametrize("target,attrs,match", [
    ("conv", {"group": 2}, "group=2"),
    ("conv", {"dilations": [2, 2]}, "dilations"),
    ("conv", {"pads": [1, 1, 0, 0]}, "not symmetric"),
    ("conv", {"auto_pad": "SAME_UPPER", "pads": None}, "auto_pad"),
    ("pool", {"ceil_mode": 1}, "ceil_mode"),
    ("avgpool", {"pads": [1, 1, 1, 1], "count_include_pad": 0}, "count_include_pad"),
])
def test_unsupported_attributes(tmp_path, rng, target, attrs, match):
    conv_attrs = {k: v for k, v in attrs.items() if target == "conv"}
    pool_attrs = {k: v for k, v in attrs.items() if target != "conv"}
    nodes, inits = conv_net(rng, conv_attrs=conv_attrs, pool_attrs=pool_attrs,
                            pool="AveragePool" if target == "avgpool" else "MaxPool")
    for node in nodes:                       # drop attributes set to None
        keep = [a for a in node.attribute if not (a.name in attrs and attrs[a.name] is None)]
        del node.attribute[:]
        node.attribute.extend(keep)
    if target == "conv" and attrs.get("group") == 2:
        inits["w"] = rand(rng, 4, 1, 3, 3)
        inits["b"] = rand(rng, 4)
    path = save(tmp_path, nodes, inits, (2, 8, 8), out="f")
    index = 0 if target == "conv" else 2
    with pytest.raises(OnnxImportError, match=rf"node {index} .*{match}"):
        cydnn.load_onnx(path)


def test_branch_is_refused(tmp_path, rng):
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r"),
             helper.make_node("Tanh", ["a"], ["t"], name="t"),
             helper.make_node("Add", ["a", "t"], ["y"], name="residual")]
    path = save(tmp_path, nodes, {}, (4,))
    with pytest.raises(OnnxImportError, match=r"node 2 \('residual', Add\).*bias right after a MatMul"):
        cydnn.load_onnx(path)
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r"),
             helper.make_node("Tanh", ["x"], ["y"], name="t")]
    path = save(tmp_path, nodes, {}, (4,))
    with pytest.raises(OnnxImportError, match=r"node 1 .*only a chain of layers"):
        cydnn.load_onnx(path)


def test_bad_reshape_and_weight_from_data(tmp_path, rng):
    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"], name="view")]
    path = save(tmp_path, nodes, {"s": np.array([0, 3, -1])}, (6,))
    proto = onnx.load(path)
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array([0, 3, -1], np.int64), "s"))
    onnx.save(proto, path)
    with pytest.raises(OnnxImportError, match="only a reshape to"):
        cydnn.load_onnx(path)
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r"), helper.make_node("MatMul", ["a", "a"], ["y"], name="mm")]
    with pytest.raises(OnnxImportError, match="must be a constant"):
        cydnn.load_onnx(save(tmp_path, nodes, {}, (4,)))
