"""cydnn.load_onnx: the graphs it refuses (each message names the file, the node and the rule) and
the nodes it passes through (Identity, Dropout at inference, Constant), on graphs built here with
onnx.helper.  Results are compared with onnx's own reference evaluator (``onnx.reference``)."""
import numpy as np
import pytest

import cydnn
from cydnn import nn, ops
from cydnn.onnx_import import OnnxImportError, Softmax

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402


def tensor(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def save(tmp_path, nodes, inits=None, inputs=None, outputs=None, name="g.onnx"):
    """A model file; by default input ``x`` (N, 4) and output ``y``."""
    inits = inits or {}
    graph = helper.make_graph(
        nodes, "g", inputs if inputs is not None else [tensor("x", ["N", 4])],
        outputs if outputs is not None else [tensor("y", None)],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / name)
    onnx.save(proto, path)
    return path


def refused(path):
    with pytest.raises(OnnxImportError) as info:
        cydnn.load_onnx(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: "), msg                  # every refusal names the file first
    return msg


def run(model, x):
    model.eval()
    backend = ops.backend(model.device)
    return backend.to_numpy(model(backend.asarray(x)))


def reference(path, x):
    return ReferenceEvaluator(path).run(None, {"x": x})[0]


W = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)     # Gemm weight (out, in), transB=1
B = np.random.default_rng(1).standard_normal(3).astype(np.float32)


def gemm(inp="x", out="y", **attrs):
    return helper.make_node("Gemm", [inp, "w", "b"], [out], name="fc", transB=1, **attrs)


# ------------------------------------------------------------ refusals
def test_dropout_in_training_mode_is_refused(tmp_path):
    nodes = [gemm(out="g"), helper.make_node("Dropout", ["g", "ratio", "train"], ["y"], name="drop")]
    path = save(tmp_path, nodes, {"w": W, "b": B, "ratio": np.array(0.5, np.float32), "train": np.array(True)})
    assert refused(path) == (f"{path}: node 1 ('drop', Dropout): training_mode=true: a Dropout that drops at "
                             f"inference is not supported")


def test_dropout_mode_from_the_data_is_refused(tmp_path):
    nodes = [gemm(out="g"), helper.make_node("Dropout", ["g", "", "mode"], ["y"], name="drop")]
    inputs = [tensor("x", ["N", 4]), helper.make_tensor_value_info("mode", TensorProto.BOOL, [])]
    path = save(tmp_path, nodes, {"w": W, "b": B}, inputs=inputs)
    assert "a sequential network has one input and one output" in refused(path)


@pytest.mark.parametrize("axis", [0, 2, -2])
def test_softmax_on_another_axis_is_refused(tmp_path, axis):
    nodes = [gemm(out="g"), helper.make_node("Softmax", ["g"], ["y"], name="sm", axis=axis)]
    path = save(tmp_path, nodes, {"w": W, "b": B})
    assert refused(path) == (f"{path}: node 1 ('sm', Softmax): axis={axis} is not supported "
                             f"(only the class axis, 1 or -1)")


def test_softmax_on_an_image_is_refused(tmp_path):
    nodes = [helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=1)]
    path = save(tmp_path, nodes, inputs=[tensor("x", ["N", 2, 3, 3])])
    assert refused(path) == (f"{path}: node 0 ('sm', Softmax): Softmax needs (N, features) input, "
                             f"got a per-sample shape (2, 3, 3)")


@pytest.mark.parametrize("axis", [0, 2, 3, -1, -2])
def test_flatten_on_another_axis_is_refused(tmp_path, axis):
    nodes = [helper.make_node("Flatten", ["x"], ["y"], name="flat", axis=axis)]
    path = save(tmp_path, nodes, inputs=[tensor("x", ["N", 2, 3, 3])])
    assert refused(path) == (f"{path}: node 0 ('flat', Flatten): axis={axis} is not supported "
                             f"(only 1: (N, ...) -> (N, features))")


def test_flatten_axis_minus_rank_plus_one_is_axis_one(tmp_path):
    """For a rank-4 input, axis=-3 is axis 1: accepted, and the same as onnx's result."""
    nodes = [helper.make_node("Flatten", ["x"], ["f"], name="flat", axis=-3), gemm("f", "y")]
    w = np.random.default_rng(2).standard_normal((3, 18)).astype(np.float32)
    path = save(tmp_path, nodes, {"w": w, "b": B}, inputs=[tensor("x", ["N", 2, 3, 3])])
    x = np.random.default_rng(3).standard_normal((5, 2, 3, 3)).astype(np.float32)
    np.testing.assert_allclose(run(cydnn.load_onnx(path), x), reference(path, x), rtol=1e-5, atol=1e-6)


def test_gemm_with_trans_a_is_refused(tmp_path):
    path = save(tmp_path, [gemm(transA=1)], {"w": W, "b": B})
    assert refused(path) == f"{path}: node 0 ('fc', Gemm): transA=1 is not supported (only [0])"


def test_gemm_with_a_weight_from_the_data_is_refused(tmp_path):
    nodes = [helper.make_node("Gemm", ["x", "x"], ["y"], name="fc")]
    path = save(tmp_path, nodes)
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): the weight (B) ('x') must be a constant "
                             f"(an initializer or a Constant node)")


def test_gemm_weight_that_does_not_fit_the_input_is_refused(tmp_path):
    w = np.zeros((3, 5), np.float32)
    path = save(tmp_path, [gemm()], {"w": w, "b": B})
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): weight for 5 input features, "
                             f"but the input has 4")
    path = save(tmp_path, [gemm()], {"w": W, "b": np.zeros(4, np.float32)}, name="bias.onnx")
    assert refused(path).startswith(f"{path}: node 0 ('fc', Gemm): the bias (C) of shape (4,) does not broadcast "
                                    f"as one bias per output to (batch, 3)")


def test_several_inputs_are_refused(tmp_path):
    nodes = [gemm()]
    path = save(tmp_path, nodes, {"w": W, "b": B}, inputs=[tensor("x", ["N", 4]), tensor("z", ["N", 4])])
    assert refused(path) == (f"{path}: a sequential network has one input and one output; this graph has "
                             f"inputs ['x', 'z'] and outputs ['y']")


def test_several_outputs_are_refused(tmp_path):
    nodes = [gemm(out="g"), helper.make_node("Relu", ["g"], ["y"], name="r")]
    path = save(tmp_path, nodes, {"w": W, "b": B}, outputs=[tensor("g", None), tensor("y", None)])
    assert refused(path) == (f"{path}: a sequential network has one input and one output; this graph has "
                             f"inputs ['x'] and outputs ['g', 'y']")


def test_no_output_is_refused(tmp_path):
    path = save(tmp_path, [gemm()], {"w": W, "b": B}, outputs=[])
    assert refused(path) == (f"{path}: a sequential network has one input and one output; this graph has "
                             f"inputs ['x'] and outputs []")


def test_initializers_listed_as_inputs_are_not_inputs(tmp_path):
    """Old exporters list the weights among the graph inputs: they are constants, not inputs."""
    inputs = [tensor("x", ["N", 4]), tensor("w", [3, 4]), tensor("b", [3])]
    path = save(tmp_path, [gemm()], {"w": W, "b": B}, inputs=inputs)
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(run(cydnn.load_onnx(path), x), x @ W.T + B, rtol=1e-5, atol=1e-6)


def test_an_empty_graph_is_refused(tmp_path):
    path = save(tmp_path, [], outputs=[tensor("x", None)])
    assert refused(path) == f"{path}: the graph has no layers"


def test_a_graph_of_pass_through_nodes_only_has_no_layers(tmp_path):
    nodes = [helper.make_node("Identity", ["x"], ["i"], name="id"),
             helper.make_node("Dropout", ["i"], ["y"], name="drop")]
    path = save(tmp_path, nodes)
    assert refused(path) == f"{path}: the graph has no layers"


def test_an_output_that_is_not_the_last_layers_is_refused(tmp_path):
    nodes = [gemm(out="g"), helper.make_node("Relu", ["g"], ["r"], name="relu")]
    path = save(tmp_path, nodes, {"w": W, "b": B}, outputs=[tensor("g", None)])
    assert refused(path) == f"{path}: the graph's output 'g' is not the last layer's output 'r'"


def test_a_used_second_output_is_refused(tmp_path):
    nodes = [gemm(out="g"), helper.make_node("Dropout", ["g"], ["d", "mask"], name="drop"),
             helper.make_node("Cast", ["mask"], ["m"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Relu", ["d"], ["y"], name="r")]
    path = save(tmp_path, nodes, {"w": W, "b": B})
    assert refused(path) == (f"{path}: node 1 ('drop', Dropout): its second output 'mask' is used; only the "
                             f"first output is supported")       # refused there, before the Cast
    nodes = [gemm(out="g"), helper.make_node("Dropout", ["g"], ["d", "mask"], name="drop")]
    path = save(tmp_path, nodes, {"w": W, "b": B}, outputs=[tensor("mask", None)], name="mask.onnx")
    assert refused(path) == (f"{path}: node 1 ('drop', Dropout): its second output 'mask' is used; only the "
                             f"first output is supported")


def test_a_constant_node_without_a_tensor_is_refused(tmp_path):
    nodes = [helper.make_node("Constant", [], ["c"], name="k", value_float=2.0), gemm()]
    path = save(tmp_path, nodes, {"w": W, "b": B})
    assert refused(path) == f"{path}: node 0 ('k', Constant): only Constant nodes with a tensor 'value' are supported"


# ------------------------------------------------------ pass-through nodes
def _chain_with(pass_nodes, tmp_path, inits=None):
    """x -> Gemm -> <pass_nodes from 'g' to 'p'> -> Relu -> y."""
    nodes = [gemm(out="g"), *pass_nodes, helper.make_node("Relu", ["p"], ["y"], name="relu")]
    return save(tmp_path, nodes, {"w": W, "b": B, **(inits or {})})


@pytest.mark.parametrize("case", ["identity", "dropout", "dropout-ratio", "dropout-mode-false",
                                  "dropout-mask-unused", "identity-identity"])
def test_pass_through_nodes_add_no_layer_and_change_nothing(tmp_path, case):
    inits = {}
    if case == "identity":
        nodes = [helper.make_node("Identity", ["g"], ["p"], name="id")]
    elif case == "dropout":
        nodes = [helper.make_node("Dropout", ["g"], ["p"], name="drop")]
    elif case == "dropout-ratio":
        nodes = [helper.make_node("Dropout", ["g", "ratio"], ["p"], name="drop")]
        inits = {"ratio": np.array(0.3, np.float32)}
    elif case == "dropout-mode-false":
        nodes = [helper.make_node("Dropout", ["g", "ratio", "mode"], ["p"], name="drop")]
        inits = {"ratio": np.array(0.3, np.float32), "mode": np.array(False)}
    elif case == "dropout-mask-unused":
        nodes = [helper.make_node("Dropout", ["g"], ["p", "mask"], name="drop")]
    else:
        nodes = [helper.make_node("Identity", ["g"], ["i"], name="id1"),
                 helper.make_node("Identity", ["i"], ["p"], name="id2")]
    path = _chain_with(nodes, tmp_path, inits)
    model = cydnn.load_onnx(path)
    assert isinstance(model, nn.Sequential)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU]          # no layer for the pass-through nodes
    x = np.random.default_rng(5).standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run(model, x), np.maximum(x @ W.T + B, 0), rtol=1e-5, atol=1e-6)


def test_a_constant_node_feeds_a_later_node(tmp_path):
    nodes = [helper.make_node("Constant", [], ["wc"], name="k", value=numpy_helper.from_array(W, "wc")),
             helper.make_node("Gemm", ["x", "wc", "b"], ["y"], name="fc", transB=1)]
    path = save(tmp_path, nodes, {"b": B})
    model = cydnn.load_onnx(path)
    assert [type(m) for m in model] == [nn.Linear]
    x = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-5, atol=1e-6)


def test_trailing_softmax_on_axis_minus_one_is_kept_as_an_inference_layer(tmp_path):
    nodes = [gemm(out="g"), helper.make_node("Softmax", ["g"], ["y"], name="sm", axis=-1)]
    path = save(tmp_path, nodes, {"w": W, "b": B})
    model = cydnn.load_onnx(path)
    assert [type(m) for m in model] == [nn.Linear, Softmax]
    x = np.random.default_rng(7).standard_normal((4, 4)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="Softmax is an inference layer"):
        model[1].backward(np.ones((4, 3), np.float32))
