"""cydnn.onnx_builder, said exactly: every refusal's whole message (file, node index, name, op,
the attribute and its value), each accepted form at the edge of a rule compared with onnx's own
reference evaluator, and the names the layers get.  Written to kill the mutants that
tools/mutation.py left alive in the builder."""
import numpy as np
import pytest

import cydnn
from cydnn import nn, ops
from cydnn.onnx_builder import SUPPORTED_OPS
from cydnn.onnx_checks import OnnxImportError

onnx = pytest.importorskip("onnx")
from onnx import AttributeProto, TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

RNG = np.random.default_rng(7)
W = RNG.standard_normal((3, 4)).astype(np.float32)      # Gemm weight (out, in), transB=1
B = RNG.standard_normal(3).astype(np.float32)
CW = RNG.standard_normal((3, 2, 3, 3)).astype(np.float32)
CB = RNG.standard_normal(3).astype(np.float32)


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def write(tmp_path, nodes, inits=None, shape=("N", 4), out="y", name="g.onnx", inputs=None):
    inits = inits or {}
    tensors = [v if isinstance(v, TensorProto) else numpy_helper.from_array(np.asarray(v), k)
               for k, v in inits.items()]
    graph = helper.make_graph(nodes, "g", inputs if inputs is not None else [vi("x", list(shape))],
                              [vi(out, None)], initializer=tensors)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    return path


def refused(path):
    with pytest.raises(OnnxImportError) as info:
        cydnn.load_onnx(path)
    return str(info.value)


def run(model, x):
    model.eval()
    backend = ops.backend(model.device)
    return backend.to_numpy(model(backend.asarray(np.ascontiguousarray(x, dtype=np.float32))))


def agrees(path, x, atol=1e-5):
    model = cydnn.load_onnx(path)
    want = ReferenceEvaluator(path).run(None, {"x": x})[0]
    got = run(model, x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)
    return model


def names(model):
    return list(model._modules)


def node(op, inputs, outputs, name, **attrs):
    return helper.make_node(op, inputs, outputs, name=name, **attrs)


def gemm(inp="x", out="y", w="w", b="b", name="fc", **attrs):
    return node("Gemm", [inp, w, b] if b else [inp, w], [out], name, **{"transB": 1, **attrs})


def conv(inp="x", out="y", name="conv", w="cw", b="cb", **attrs):
    return node("Conv", [inp, w, b] if b else [inp, w], [out], name, **attrs)


X4 = RNG.standard_normal((2, 4)).astype(np.float32)
XI = RNG.standard_normal((2, 2, 6, 7)).astype(np.float32)
CONV = {"cw": CW, "cb": CB}


# ------------------------------------------------------------------ the graph's input
def test_one_input_one_output_lists_at_most_ten_names(tmp_path):
    inputs = [vi(f"i{k}", ["N", 4]) for k in range(12)]
    path = write(tmp_path, [gemm(inp="i0")], {"w": W, "b": B}, inputs=inputs)
    names = [f"i{k}" for k in range(10)]
    assert refused(path) == (f"{path}: a sequential network has one input and one output; this graph has "
                             f"inputs {names} and outputs ['y']")


def test_input_dimension_bounds(tmp_path):
    agrees(write(tmp_path, [gemm()], {"w": W, "b": B}, shape=(2**31 - 1, 4)), X4)
    path = write(tmp_path, [gemm()], {"w": W, "b": B}, shape=(2**31, 4), name="big.onnx")
    assert refused(path) == (f"{path}: graph input 'x' has dimensions [2147483648, 4]: each must lie in "
                             f"[1, 2147483648)")
    agrees(write(tmp_path, [gemm()], {"w": W, "b": B}, shape=(1, 4), name="one.onnx"), X4[:1])


def test_an_input_without_a_shape_is_not_rank_1(tmp_path):
    path = write(tmp_path, [gemm()], {"w": W, "b": B}, inputs=[vi("x", None)])
    assert refused(path) == f"{path}: node 0 ('fc', Gemm): Gemm needs (N, features) input, got a per-sample shape ()"


# ------------------------------------------------------------------ attributes
def test_unreadable_attribute(tmp_path):
    n = gemm()
    n.attribute.append(AttributeProto(name="alpha", type=AttributeProto.FLOAT, ref_attr_name="a"))
    path = write(tmp_path, [n], {"w": W, "b": B})
    msg = refused(path)      # onnx's get_attribute_value refuses a reference attribute outside a function
    assert msg.startswith(f"{path}: node 0 ('fc', Gemm): cannot read its attributes (ValueError: Cannot get value "
                          f"of reference attribute: "), msg


@pytest.mark.parametrize("attrs,problem", [
    ({"strides": [0, 0]}, "strides=[0, 0] must be 2 integers >= 1"),
    ({"strides": [1, 1, 1]}, "strides=[1, 1, 1] must be 2 integers >= 1"),
    ({"strides": 2}, "strides=2 must be 2 integers >= 1"),
    ({"kernel_shape": [3, 0]}, "kernel_shape=[3, 0] must be 2 integers >= 1"),
    ({"pads": [1, -1, 1, -1]}, "pads=[1, -1, 1, -1] must be 4 integers >= 0"),
    ({"pads": [1, 1]}, "pads=[1, 1] must be 4 integers >= 0"),
    ({"dilations": [0, 1]}, "dilations=[0, 1] must be 2 integers >= 1"),
    ({"strides": [1.0, 1.0]}, "strides=[1.0, 1.0] must be 2 integers >= 1"),
    ({"strides": list(range(1, 60))}, "strides=" + repr(list(range(1, 60)))[:100] + " must be 2 integers >= 1"),
    ({"dilations": [2, 1]}, "dilations [2, 1] are not supported (only 1)"),
    ({"dilations": [1, 2]}, "dilations [1, 2] are not supported (only 1)"),
    ({"auto_pad": "SAME_UPPER"}, "auto_pad=b'SAME_UPPER' is not supported (use explicit pads)"),
    ({"pads": [1, 0, 0, 0]}, "pads [1, 0, 0, 0] are not symmetric (begin == end on each axis is needed)"),
    ({"pads": [0, 1, 0, 0]}, "pads [0, 1, 0, 0] are not symmetric (begin == end on each axis is needed)"),
    ({"group": 3}, "group=3 is not supported (only [1])"),
    ({"group": 1.0}, "group=1.0 is not supported (only [1])"),
    ({"kernel_shape": [2, 2]}, "weight (3, 2, 3, 3) does not fit kernel_shape [2, 2] and input (2, 6, 7)"),
])
def test_conv_attribute_refusals(tmp_path, attrs, problem):
    path = write(tmp_path, [conv(**attrs)], CONV, shape=("N", 2, 6, 7))
    assert refused(path) == f"{path}: node 0 ('conv', Conv): {problem}"


@pytest.mark.parametrize("attrs", [{}, {"auto_pad": "NOTSET"}, {"auto_pad": "VALID"}, {"dilations": [1, 1]},
                                   {"kernel_shape": [3, 3], "strides": [2, 1]}, {"pads": [2, 0, 2, 0]},
                                   {"pads": [0, 1, 0, 1], "strides": [1, 3]}])
def test_conv_forms_match_the_reference(tmp_path, attrs):
    model = agrees(write(tmp_path, [conv(**attrs)], CONV, shape=("N", 2, 6, 7)), XI)
    assert [type(m) for m in model] == [nn.Conv2d] and model[0].bias is not None


def test_conv_without_bias_and_symbolic_input(tmp_path):
    model = agrees(write(tmp_path, [conv(b=None, pads=[1, 1, 1, 1])], {"cw": CW}, shape=("N", "C", "H", "W")), XI)
    assert model[0].bias is None


@pytest.mark.parametrize("shape,problem", [
    ((3, 2, 3), "needs a 4-D weight without empty axes, got (3, 2, 3)"),
    ((0, 2, 3, 3), "needs a 4-D weight without empty axes, got (0, 2, 3, 3)"),
    ((3, 2, 3, 3, 1), "needs a 4-D weight without empty axes, got (3, 2, 3, 3, 1)"),
])
def test_conv_weight_shape_refusals(tmp_path, shape, problem):
    path = write(tmp_path, [conv(b=None)], {"cw": np.ones(shape, np.float32)}, shape=("N", 2, 6, 7))
    assert refused(path) == f"{path}: node 0 ('conv', Conv): {problem}"


def test_conv_without_weight_and_bias_of_wrong_shape(tmp_path):
    path = write(tmp_path, [node("Conv", ["x"], ["y"], "conv")], {}, shape=("N", 2, 6, 7))
    assert refused(path) == f"{path}: node 0 ('conv', Conv): needs a 4-D weight without empty axes, got None"
    for bshape, shown in [((4,), (4,)), ((3, 1), (3, 1)), ((), ())]:
        path = write(tmp_path, [conv()], {"cw": CW, "cb": np.ones(bshape, np.float32)}, shape=("N", 2, 6, 7),
                     name="b.onnx")
        assert refused(path) == (f"{path}: node 0 ('conv', Conv): bias of shape {shown} does not fit 3 output "
                                 f"channels (it must be 1-D)")


def test_conv_channels_must_match(tmp_path):
    path = write(tmp_path, [conv()], CONV, shape=("N", 3, 6, 7))
    assert refused(path) == (f"{path}: node 0 ('conv', Conv): weight (3, 2, 3, 3) does not fit kernel_shape [3, 3] "
                             f"and input (3, 6, 7)")


@pytest.mark.parametrize("hw,pads,axis,size,pad", [((2, 7), [0, 0, 0, 0], "height", 2, 0),
                                                   ((6, 2), [0, 0, 0, 0], "width", 2, 0),
                                                   ((1, 7), [0, 1, 0, 1], "height", 1, 0)])
def test_kernel_that_does_not_fit(tmp_path, hw, pads, axis, size, pad):
    path = write(tmp_path, [conv(pads=pads)], CONV, shape=("N", 2, *hw))
    assert refused(path) == (f"{path}: node 0 ('conv', Conv): the kernel [3, 3] does not fit the input of {axis} "
                             f"{size} padded by {pad} (per-sample input (2, {hw[0]}, {hw[1]}))")


def test_kernel_that_just_fits(tmp_path):
    x = RNG.standard_normal((2, 2, 1, 3)).astype(np.float32)
    agrees(write(tmp_path, [conv(pads=[1, 0, 1, 0])], CONV, shape=("N", 2, 1, 3)), x)


@pytest.mark.parametrize("shape", [(4,), (2, 6, 7, 1)])
def test_conv_needs_an_image(tmp_path, shape):
    path = write(tmp_path, [conv()], CONV, shape=("N", *shape))
    assert refused(path) == (f"{path}: node 0 ('conv', Conv): Conv needs (N, C, H, W) input, got a per-sample "
                             f"shape {shape}")


# ------------------------------------------------------------------ pooling
@pytest.mark.parametrize("op,attrs,problem", [
    ("MaxPool", {"kernel_shape": [2, 2], "ceil_mode": 1}, "ceil_mode=1 is not supported (only [0])"),
    ("MaxPool", {"kernel_shape": [2, 2], "storage_order": 1}, "storage_order=1 is not supported (only [0])"),
    ("MaxPool", {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]}, "pads [2, 2, 2, 2] must be at most half the kernel [3, 3]"),
    ("MaxPool", {"kernel_shape": [3, 2], "pads": [1, 2, 1, 2]}, "pads [1, 2, 1, 2] must be at most half the kernel [3, 2]"),
    ("MaxPool", {}, "kernel_shape=None must be 2 integers >= 1"),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
     "count_include_pad=0 with padding is not supported: cydnn's average pooling counts the padding "
     "(count_include_pad=1)"),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [0, 1, 0, 1], "count_include_pad": 0},
     "count_include_pad=0 with padding is not supported: cydnn's average pooling counts the padding "
     "(count_include_pad=1)"),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 0, 1, 0], "count_include_pad": 2},
     "count_include_pad=0 with padding is not supported: cydnn's average pooling counts the padding "
     "(count_include_pad=1)"),
])
def test_pool_refusals(tmp_path, op, attrs, problem):
    path = write(tmp_path, [node(op, ["x"], ["y"], "pool", **attrs)], {}, shape=("N", 2, 6, 7))
    assert refused(path) == f"{path}: node 0 ('pool', {op}): {problem}"


def test_pool_needs_an_image(tmp_path):
    path = write(tmp_path, [node("AveragePool", ["x"], ["y"], "pool", kernel_shape=[2, 2])], {})
    assert refused(path) == (f"{path}: node 0 ('pool', AveragePool): AveragePool needs (N, C, H, W) input, "
                             f"got a per-sample shape (4,)")


@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    ("MaxPool", {"kernel_shape": [3, 2], "pads": [1, 1, 1, 1], "strides": [2, 1]}),
    ("MaxPool", {"kernel_shape": [2, 2], "ceil_mode": 0, "storage_order": 0}),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [0, 1, 0, 1], "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [2, 3], "strides": [1, 2], "count_include_pad": 0}),
])
def test_pool_forms_match_the_reference(tmp_path, op, attrs):
    nodes = [node(op, ["x"], ["p"], "pool", **attrs), node("Flatten", ["p"], ["y"], "flat")]
    model = agrees(write(tmp_path, nodes, {}, shape=("N", 2, 6, 7)), XI)
    assert [type(m) for m in model] == [nn.MaxPool2d if op == "MaxPool" else nn.AvgPool2d, nn.Flatten]


def test_shapes_are_followed_through_the_layers(tmp_path):
    # conv (2 -> 3, 3x3, stride (2, 1), pads 1) on 6 x 7 gives 3 x 3 x 7; pool 2x2 stride 1 gives 3 x 2 x 6 = 36
    nodes = [conv(out="c", strides=[2, 1], pads=[1, 1, 1, 1]), node("MaxPool", ["c"], ["p"], "pool", kernel_shape=[2, 2]),
             node("Flatten", ["p"], ["f"], "flat"), gemm(inp="f", w="fw", b="fb")]
    inits = {**CONV, "fw": RNG.standard_normal((5, 36)).astype(np.float32), "fb": np.ones(5, np.float32)}
    agrees(write(tmp_path, nodes, inits, shape=("N", 2, 6, 7)), XI)
    inits["fw"] = np.ones((5, 35), np.float32)
    path = write(tmp_path, nodes, inits, shape=("N", 2, 6, 7), name="bad.onnx")
    assert refused(path) == f"{path}: node 3 ('fc', Gemm): weight for 35 input features, but the input has 36"


def test_global_pool_gives_channels_features(tmp_path):
    if not hasattr(nn, "AdaptiveAvgPool2d"):
        pytest.skip("nn.AdaptiveAvgPool2d is not in this cydnn")
    nodes = [conv(out="c"), node("GlobalAveragePool", ["c"], ["g"], "gap"), node("Flatten", ["g"], ["f"], "flat"),
             gemm(inp="f", w="fw", b="fb")]
    inits = {**CONV, "fw": np.ones((5, 4), np.float32), "fb": np.ones(5, np.float32)}
    path = write(tmp_path, nodes, inits, shape=("N", 2, 6, 7))
    assert refused(path) == f"{path}: node 3 ('fc', Gemm): weight for 4 input features, but the input has 3"
    path = write(tmp_path, [node("GlobalAveragePool", ["x"], ["y"], "gap")], {}, name="r.onnx")
    assert refused(path) == (f"{path}: node 0 ('gap', GlobalAveragePool): GlobalAveragePool needs (N, C, H, W) "
                             f"input, got a per-sample shape (4,)")


# ------------------------------------------------------------------ Flatten, Reshape
def test_flatten_axis_not_an_int(tmp_path):
    n = node("Flatten", ["x"], ["y"], "flat", axis=1.5)
    path = write(tmp_path, [n], {}, shape=("N", 2, 6, 7))
    assert refused(path) == f"{path}: node 0 ('flat', Flatten): axis=1.5 is not supported"


@pytest.mark.parametrize("axis", [-3, 1])
def test_flatten_axes_that_mean_one(tmp_path, axis):
    nodes = [node("Flatten", ["x"], ["f"], "flat", axis=axis), gemm(inp="f", w="fw", b=None)]
    agrees(write(tmp_path, nodes, {"fw": RNG.standard_normal((3, 84)).astype(np.float32)}, shape=("N", 2, 6, 7)), XI)


def test_flatten_axis_minus_two_on_an_image_is_refused(tmp_path):
    path = write(tmp_path, [node("Flatten", ["x"], ["y"], "flat", axis=-2)], {}, shape=("N", 2, 6, 7))
    assert refused(path) == (f"{path}: node 0 ('flat', Flatten): axis=-2 is not supported "
                             f"(only 1: (N, ...) -> (N, features))")


def reshape_path(tmp_path, target, shape=("N", 2, 6, 7), name="r.onnx", dtype=np.int64):
    nodes = [node("Reshape", ["x", "s"], ["y"], "view")]
    return write(tmp_path, nodes, {"s": np.array(target, dtype)}, shape=shape, name=name)


@pytest.mark.parametrize("target,shape", [([0, -1], ("N", 2, 6, 7)), ([-1, 84], ("N", 2, 6, 7)),
                                          ([0, 84], ("N", 2, 6, 7)), ([2, -1], (2, 2, 6, 7)),
                                          ([2, 84], (2, 2, 6, 7))])
def test_reshapes_to_n_features(tmp_path, target, shape):
    model = agrees(reshape_path(tmp_path, target, shape), XI)
    assert [type(m) for m in model] == [nn.Flatten]


def test_reshape_int32_target(tmp_path):
    agrees(reshape_path(tmp_path, [0, -1], dtype=np.int32), XI)


@pytest.mark.parametrize("target,shape,shown", [
    ([-1, -1], ("N", 2, 6, 7), "[-1, -1]"),
    ([3, -1], ("N", 2, 6, 7), "[3, -1]"),
    ([3, -1], (2, 2, 6, 7), "[3, -1]"),
    ([0, 85], ("N", 2, 6, 7), "[0, 85]"),
    ([0, 84], ("N", 2, "H", 7), "[0, 84]"),
    ([0, -1, 1, 1], ("N", 2, 6, 7), "[0, -1, 1]"),
    ([0, -1, 1], ("N", 2, 6, 7), "[0, -1, 1]"),
    ([-1], ("N", 2, 6, 7), "[-1]"),
    ([1, -1], ("N", 2, 6, 7), "[1, -1]"),
])
def test_reshape_refusals(tmp_path, target, shape, shown):
    path = reshape_path(tmp_path, target, shape)
    per = tuple(None if isinstance(d, str) else d for d in shape[1:])
    assert refused(path) == (f"{path}: node 0 ('view', Reshape): only a reshape to (N, features) is supported, "
                             f"got the shape {shown} for a per-sample input {per}")


def test_reshape_with_a_float_or_missing_target(tmp_path):
    path = reshape_path(tmp_path, [0, -1], dtype=np.float32)
    assert refused(path) == (f"{path}: node 0 ('view', Reshape): only a reshape to (N, features) is supported, "
                             f"got the shape float32 for a per-sample input (2, 6, 7)")
    path = write(tmp_path, [node("Reshape", ["x"], ["y"], "view")], {}, shape=("N", 2, 6, 7), name="m.onnx")
    assert refused(path) == (f"{path}: node 0 ('view', Reshape): only a reshape to (N, features) is supported, "
                             f"got the shape [] for a per-sample input (2, 6, 7)")
    path = write(tmp_path, [node("Reshape", ["x", "x"], ["y"], "view")], {}, shape=("N", 2, 6, 7), name="d.onnx")
    assert refused(path) == (f"{path}: node 0 ('view', Reshape): the shape ('x') must be a constant "
                             f"(an initializer or a Constant node)")


# ------------------------------------------------------------------ Gemm, MatMul, Add
@pytest.mark.parametrize("cshape", [(), (1,), (3,), (1, 1), (1, 3)])
def test_gemm_biases_that_broadcast_per_output(tmp_path, cshape):
    c = RNG.standard_normal(cshape).astype(np.float32)
    model = agrees(write(tmp_path, [gemm()], {"w": W, "b": c}), X4)
    assert model[0].bias.data.shape == (3,) and model[0].bias.data.dtype == np.float32


@pytest.mark.parametrize("cshape", [(2, 3), (2, 1), (3, 1), (1, 1, 3), (2,), (1, 4)])
def test_gemm_biases_that_do_not(tmp_path, cshape):
    path = write(tmp_path, [gemm()], {"w": W, "b": np.ones(cshape, np.float32)})
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): the bias (C) of shape {cshape} does not broadcast as "
                             f"one bias per output to (batch, 3) (ONNX broadcasting: a leading axis of size M adds "
                             f"a different value to each batch row); use shape (3,) or (1, 3)")


@pytest.mark.parametrize("attrs", [{"alpha": 2.0}, {"beta": 0.5}, {"alpha": 2.0, "beta": 2.0}, {"alpha": 1.0, "beta": 1.0},
                                   {"transB": 0}])
def test_gemm_scalings_match_the_reference(tmp_path, attrs):
    w = W.T.copy() if attrs.get("transB") == 0 else W
    agrees(write(tmp_path, [gemm(**attrs)], {"w": w, "b": B}), X4)


def test_gemm_beta_without_c_and_integer_alpha(tmp_path):
    n = gemm(b=None, beta=3.0)
    agrees(write(tmp_path, [n], {"w": W}), X4)
    n = gemm()
    n.attribute.append(helper.make_attribute("alpha", 2))           # an INT attribute: 2.0
    model = cydnn.load_onnx(write(tmp_path, [n], {"w": W, "b": B}, name="i.onnx"))
    np.testing.assert_allclose(run(model, X4), 2 * X4 @ W.T + B, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attrs,problem", [
    ({"transB": 2}, "transB=2 is not supported (only [0, 1])"),
    ({"transA": 1}, "transA=1 is not supported (only [0])"),
    ({"alpha": float("inf")}, "alpha=inf must be a finite number"),
    ({"beta": float("nan")}, "beta=nan must be a finite number"),
    ({"alpha": "two"}, "alpha=b'two' must be a finite number"),
])
def test_gemm_attribute_refusals(tmp_path, attrs, problem):
    path = write(tmp_path, [gemm(**attrs)], {"w": W, "b": B})
    assert refused(path) == f"{path}: node 0 ('fc', Gemm): {problem}"


@pytest.mark.parametrize("op,wshape,problem", [
    ("Gemm", (12,), "needs a 2-D weight, got (12,)"), ("Gemm", None, "needs a 2-D weight, got None"),
    ("Gemm", (1, 3, 4), "needs a 2-D weight, got (1, 3, 4)"),
    ("MatMul", (4,), "needs a constant 2-D weight, got (4,)"), ("MatMul", None, "needs a constant 2-D weight, got None"),
    ("MatMul", (1, 4, 3), "needs a constant 2-D weight, got (1, 4, 3)"),
    ("MatMul", (4, 0), "weight of shape (0, 4) has an empty axis"),
])
def test_linear_weight_shape_refusals(tmp_path, op, wshape, problem):
    inputs = ["x"] if wshape is None else ["x", "w"]
    inits = {} if wshape is None else {"w": np.ones(wshape, np.float32)}
    path = write(tmp_path, [node(op, inputs, ["y"], "fc")], inits)
    assert refused(path) == f"{path}: node 0 ('fc', {op}): {problem}"


def test_linear_needs_features(tmp_path):
    path = write(tmp_path, [node("MatMul", ["x", "w"], ["y"], "mm")], {"w": np.ones((4, 3), np.float32)},
                 shape=("N", 2, 2))
    assert refused(path) == (f"{path}: node 0 ('mm', MatMul): MatMul needs (N, features) input, got a per-sample "
                             f"shape (2, 2)")


def test_linear_with_unknown_features(tmp_path):
    agrees(write(tmp_path, [gemm()], {"w": W, "b": B}, shape=("N", "F")), X4)


@pytest.mark.parametrize("bshape", [(3,), (1, 3), ()])
def test_matmul_add_forms(tmp_path, bshape):
    b = RNG.standard_normal(bshape).astype(np.float32)
    nodes = [node("MatMul", ["x", "w"], ["m"], "mm"), node("Add", ["m", "b"], ["y"], "add")]
    model = agrees(write(tmp_path, nodes, {"w": W.T.copy(), "b": b}), X4)
    assert [type(m) for m in model] == [nn.Linear] and model[0].bias.data.shape == (3,)


def test_matmul_add_bias_from_a_constant_node(tmp_path):
    nodes = [node("MatMul", ["x", "w"], ["m"], "mm"),
             node("Constant", [], ["b"], "k", value=numpy_helper.from_array(B)), node("Add", ["b", "m"], ["y"], "add")]
    model = agrees(write(tmp_path, nodes, {"w": W.T.copy()}), X4)
    np.testing.assert_array_equal(model[0].bias.data, B)


@pytest.mark.parametrize("case", ["after_gemm", "after_relu", "second_add", "three_inputs", "not_current",
                                  "first_node", "add_of_itself"])
def test_add_refusals(tmp_path, case):
    mm = node("MatMul", ["x", "w"], ["m"], "mm")
    inits = {"w": W.T.copy(), "b": B}
    index = 1
    if case == "after_gemm":
        nodes, inits = [gemm(out="m", b=None), node("Add", ["m", "b"], ["y"], "add")], {"w": W, "b": B}
    elif case == "after_relu":
        nodes = [mm, node("Relu", ["m"], ["r"], "relu"), node("Add", ["r", "b"], ["y"], "add")]
        index = 2
    elif case == "second_add":
        nodes = [mm, node("Add", ["m", "b"], ["a"], "add0"), node("Add", ["a", "b"], ["y"], "add")]
        index = 2
    elif case == "three_inputs":
        nodes = [mm, node("Add", ["m", "b", "b"], ["y"], "add")]
    elif case == "not_current":
        nodes = [mm, node("Add", ["b", "b"], ["y"], "add")]
    elif case == "first_node":
        nodes, inits, index = [node("Add", ["x", "b"], ["y"], "add")], {"b": np.ones(4, np.float32)}, 0
    else:
        nodes = [mm, node("Add", ["m", "m"], ["y"], "add")]
    path = write(tmp_path, nodes, inits)
    if case == "add_of_itself":
        assert refused(path) == f"{path}: node 1 ('add', Add): the bias ('m') must be a constant"
    else:
        assert refused(path) == f"{path}: node {index} ('add', Add): Add is supported only as the bias right after a MatMul"


def test_add_bias_that_does_not_broadcast(tmp_path):
    nodes = [node("MatMul", ["x", "w"], ["m"], "mm"), node("Add", ["m", "b"], ["y"], "add")]
    path = write(tmp_path, nodes, {"w": W.T.copy(), "b": np.ones((2, 3), np.float32)})
    assert refused(path) == (f"{path}: node 1 ('add', Add): the bias of shape (2, 3) does not broadcast as one bias "
                             f"per output to (batch, 3) (ONNX broadcasting: a leading axis of size M adds a "
                             f"different value to each batch row); use shape (3,) or (1, 3)")


# ------------------------------------------------------------------ layer names
def test_layer_names(tmp_path):
    nodes = [gemm(out="a", w="fc1.weight", b="fc1.bias"), node("Relu", ["a"], ["r"], "r1"),
             gemm(inp="r", out="g", w="w2", b=None, name="f2"), node("Relu", ["g"], ["r2"], "r2"),
             node("Tanh", ["r2"], ["t"], "t"), node("Sigmoid", ["t"], ["s"], "s"),
             gemm(inp="s", out="h", w="fc1.weight", b=None, name="f3"), node("Softmax", ["h"], ["y"], "sm")]
    inits = {"fc1.weight": np.eye(4, dtype=np.float32), "fc1.bias": np.ones(4, np.float32),
             "w2": np.eye(4, dtype=np.float32)}
    model = agrees(write(tmp_path, nodes, inits), X4)
    assert names(model) == ["fc1", "relu1", "fc1_", "relu2", "tanh1", "sigmoid1",
                                                            "fc2", "softmax1"]


def test_layer_named_after_a_nested_initializer(tmp_path):
    model = agrees(write(tmp_path, [gemm(w="features.0.weight", b="features.0.bias")],
                         {"features.0.weight": W, "features.0.bias": B}), X4)
    assert list(model.state_dict()) == ["features.0.weight", "features.0.bias"]


def test_an_initializer_named_weight_alone(tmp_path):
    path = write(tmp_path, [gemm(w=".weight", b=None)], {".weight": W})
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): initializer '.weight': layer name '' must have 1 to "
                             f"512 characters")


def test_a_bad_layer_name_is_refused_naming_the_initializer(tmp_path):
    path = write(tmp_path, [gemm(w="training.weight", b=None)], {"training.weight": W})
    msg = refused(path)
    assert msg.startswith(f"{path}: node 0 ('fc', Gemm): initializer 'training.weight'"), msg


# ------------------------------------------------------------------ Softmax, LeakyRelu, BatchNorm
@pytest.mark.parametrize("axis", [1, -1, None])
def test_softmax_class_axis(tmp_path, axis):
    attrs = {} if axis is None else {"axis": axis}
    path = write(tmp_path, [gemm(out="g"), node("Softmax", ["g"], ["y"], "sm", **attrs)], {"w": W, "b": B})
    assert cydnn.load_onnx(path).training
    assert names(agrees(path, X4)) == ["fc1", "softmax1"]


def test_softmax_axis_not_an_int(tmp_path):
    path = write(tmp_path, [gemm(out="g"), node("Softmax", ["g"], ["y"], "sm", axis=1.0)], {"w": W, "b": B})
    assert refused(path) == f"{path}: node 1 ('sm', Softmax): axis=1.0 is not supported"


def test_leaky_relu_default_slope(tmp_path):
    if not hasattr(nn, "LeakyReLU"):
        pytest.skip("nn.LeakyReLU is not in this cydnn")
    model = agrees(write(tmp_path, [node("LeakyRelu", ["x"], ["y"], "l")], {}), X4 * 10)
    assert names(model) == ["leakyrelu1"]


def bn_path(tmp_path, attrs=None, values=None, shape=("N", 3, 4, 5), name="bn.onnx", inputs=None):
    v = {"s": np.array([0.5, 1.0, 2.0], np.float32), "bb": np.array([0.1, -0.2, 0.3], np.float32),
         "m": np.array([0.0, 1.0, -1.0], np.float32), "v": np.array([1.0, 0.25, 4.0], np.float32)}
    v.update(values or {})
    n = node("BatchNormalization", inputs or ["x", "s", "bb", "m", "v"], ["y"], "bn", **(attrs or {}))
    return write(tmp_path, [n], {k: a for k, a in v.items() if a is not None}, shape=shape, name=name)


XB = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)


@pytest.mark.parametrize("attrs", [{}, {"epsilon": 0.5, "momentum": 0.0}, {"momentum": 1.0}, {"momentum": 0.3},
                                   {"training_mode": 0, "epsilon": 1e-3}])
def test_batchnorm_forms(tmp_path, attrs):
    if not hasattr(nn, "BatchNorm2d"):
        pytest.skip("nn.BatchNorm2d is not in this cydnn")
    model = agrees(write_bn := bn_path(tmp_path, attrs), XB)
    layer = model[0]
    assert layer.eps == pytest.approx(attrs.get("epsilon", 1e-5))
    assert layer.momentum == pytest.approx(1.0 - attrs.get("momentum", 0.9))
    assert names(model) == ["bn1"] and write_bn


@pytest.mark.parametrize("attrs,values,problem", [
    ({"training_mode": 1}, None, "only inference batch norm (training_mode=0, spatial=1) is supported"),
    ({"spatial": 0}, None, "only inference batch norm (training_mode=0, spatial=1) is supported"),
    ({"epsilon": 0.0}, None, "epsilon=0.0 must be > 0 and momentum=0.9 in [0, 1]"),
    ({"momentum": 1.5}, None, "epsilon=1e-05 must be > 0 and momentum=1.5 in [0, 1]"),
    ({"momentum": -0.5}, None, "epsilon=1e-05 must be > 0 and momentum=-0.5 in [0, 1]"),
    ({"epsilon": float("inf")}, None, "epsilon=inf must be a finite number"),
    ({}, {"v": np.array([1.0, -0.5, 1.0], np.float32)}, "the running variance has negative values"),
    ({}, {"s": np.ones(4, np.float32)}, "the scale must be a constant of shape (channels,) = (3,), got (4,)"),
    ({}, {"bb": np.ones((3, 1), np.float32)}, "the bias (B) must be a constant of shape (channels,) = (3,), got (3, 1)"),
    ({}, {"m": np.ones(2, np.float32)}, "the mean must be a constant of shape (channels,) = (3,), got (2,)"),
    ({}, {"v": np.ones(4, np.float32)}, "the var must be a constant of shape (channels,) = (3,), got (4,)"),
])
def test_batchnorm_refusals(tmp_path, attrs, values, problem):
    if not hasattr(nn, "BatchNorm2d"):
        pytest.skip("nn.BatchNorm2d is not in this cydnn")
    path = bn_path(tmp_path, attrs, values)
    assert refused(path) == f"{path}: node 0 ('bn', BatchNormalization): {problem}"


def test_batchnorm_missing_input_and_unknown_channels(tmp_path):
    if not hasattr(nn, "BatchNorm2d"):
        pytest.skip("nn.BatchNorm2d is not in this cydnn")
    path = bn_path(tmp_path, inputs=["x", "s", "bb", "m"])
    assert refused(path) == (f"{path}: node 0 ('bn', BatchNormalization): the var must be a constant of shape "
                             f"(channels,) = (3,), got None")
    agrees(bn_path(tmp_path, shape=("N", "C", 4, 5), name="c.onnx"), XB)
    path = bn_path(tmp_path, values={"m": np.ones(4, np.float32)}, shape=("N", "C", 4, 5), name="d.onnx")
    assert refused(path) == (f"{path}: node 0 ('bn', BatchNormalization): the mean must be a constant of shape "
                             f"(channels,) = (None,), got (4,)")
    path = bn_path(tmp_path, shape=("N", 3), name="r.onnx")
    assert refused(path) == (f"{path}: node 0 ('bn', BatchNormalization): BatchNormalization needs (N, C, H, W) "
                             f"input, got a per-sample shape (3,)")


# ------------------------------------------------------------------ pass-through, Constant, the walk
@pytest.mark.parametrize("mode", [np.array(False), np.array([False]), None])
def test_dropout_at_inference(tmp_path, mode):
    inputs = ["g", "", "t"] if mode is not None else ["g"]
    inits = {"w": W, "b": B, **({"t": mode} if mode is not None else {})}
    model = agrees(write(tmp_path, [gemm(out="g"), node("Dropout", inputs, ["y"], "drop")], inits), X4)
    assert [type(m) for m in model] == [nn.Linear]


@pytest.mark.parametrize("mode", [np.array([False, False]), np.array([True]), np.array(1.0, np.float32)])
def test_dropout_modes_refused(tmp_path, mode):
    path = write(tmp_path, [gemm(out="g"), node("Dropout", ["g", "", "t"], ["y"], "drop")], {"w": W, "b": B, "t": mode})
    assert refused(path) == (f"{path}: node 1 ('drop', Dropout): training_mode=true: a Dropout that drops at "
                             f"inference is not supported")


def test_constant_node_with_another_attribute_or_form(tmp_path):
    n = node("Constant", [], ["k"], "k", value=numpy_helper.from_array(W))
    n.attribute.append(helper.make_attribute("extra", 1))
    path = write(tmp_path, [n, gemm(w="k", b=None)], {})
    assert refused(path) == f"{path}: node 0 ('k', Constant): only Constant nodes with a tensor 'value' are supported"
    path = write(tmp_path, [node("Constant", [], ["k"], "k", value_float=1.0), gemm(w="k", b=None)], {}, name="f.onnx")
    assert refused(path) == f"{path}: node 0 ('k', Constant): only Constant nodes with a tensor 'value' are supported"


def test_constant_node_weight_used_twice_is_read_once(tmp_path):
    nodes = [node("Constant", [], ["k"], "k", value=numpy_helper.from_array(np.eye(4, dtype=np.float32), "other")),
             gemm(out="a", w="k", b=None), gemm(inp="a", w="k", b=None, name="fc2")]
    model = agrees(write(tmp_path, nodes, {}), X4)
    assert names(model) == ["fc1", "fc2"]


def test_constant_node_bad_tensor_names_the_node(tmp_path):
    t = TensorProto(name="t", data_type=1, dims=[3, 4])          # no data
    path = write(tmp_path, [node("Constant", [], ["k"], "k", value=t), gemm(w="k", b=None)], {})
    assert refused(path) == (f"{path}: node 0 ('k', Constant): tensor 'k': dims [3, 4] declare 12 values, but its "
                             f"data holds 0")


def test_unsupported_op_message_lists_the_supported_ones(tmp_path):
    path = write(tmp_path, [node("Elu", ["x"], ["y"], "e")], {})
    assert refused(path) == (f"{path}: unsupported op 'Elu' at node 0 ('e'); cydnn.load_onnx supports "
                             + ", ".join(SUPPORTED_OPS))
    model = cydnn.load_onnx(write(tmp_path, [gemm(out="g"), node("Relu", ["g"], ["y"], "r", domain="ai.onnx")],
                                  {"w": W, "b": B}, name="d.onnx"))
    np.testing.assert_allclose(run(model, X4), np.maximum(X4 @ W.T + B, 0), rtol=1e-5, atol=1e-5)
    path = write(tmp_path, [node("Relu", ["x"], ["y"], "r", domain="x" * 200)], {}, name="long.onnx")
    assert refused(path) == (f"{path}: unsupported op 'Relu' (domain {repr('x' * 200)[:100]}) at node 0 ('r'); "
                             f"cydnn.load_onnx supports " + ", ".join(SUPPORTED_OPS))
    path = write(tmp_path, [node("E" * 200, ["x"], ["y"], "n" * 200)], {}, name="longop.onnx")
    assert refused(path) == (f"{path}: unsupported op {repr('E' * 200)[:100]} at node 0 ({repr('n' * 200)[:100]}); "
                             f"cydnn.load_onnx supports " + ", ".join(SUPPORTED_OPS))


def test_supported_ops(tmp_path):
    assert SUPPORTED_OPS[:15] == ("Conv", "Relu", "Tanh", "Sigmoid", "MaxPool", "AveragePool", "Flatten", "Reshape",
                                  "Gemm", "MatMul", "Add", "Softmax", "Identity", "Dropout", "Constant")


def test_a_node_reading_nothing_or_something_else(tmp_path):
    path = write(tmp_path, [gemm(out="g"), node("Relu", [], ["y"], "r")], {"w": W, "b": B})
    assert refused(path) == (f"{path}: node 1 ('r', Relu): reads [], not the previous node's output 'g': only a "
                             f"chain of layers is supported")
    path = write(tmp_path, [gemm(out="g"), node("Relu", ["x", "g"], ["y"], "r")], {"w": W, "b": B}, name="b.onnx")
    assert refused(path) == (f"{path}: node 1 ('r', Relu): reads ['x'], not the previous node's output 'g': only a "
                             f"chain of layers is supported")


def test_unused_second_output_is_fine(tmp_path):
    nodes = [gemm(out="g"), node("Dropout", ["g"], ["y", "mask"], "drop")]
    agrees(write(tmp_path, nodes, {"w": W, "b": B}), X4)
    nodes = [gemm(out="g"), node("Dropout", ["g"], ["d", "mask"], "drop"), node("Relu", ["d"], ["y"], "r")]
    agrees(write(tmp_path, nodes, {"w": W, "b": B}, name="b.onnx"), X4)


def test_softmax_layer_has_no_backward():
    from cydnn.onnx_builder import Softmax
    with pytest.raises(RuntimeError) as info:
        Softmax().backward(np.ones((2, 3), np.float32))
    assert str(info.value) == ("Softmax is an inference layer (imported from ONNX) and has no backward; drop it and "
                               "train the logits with nn.CrossEntropyLoss")
    x = X4
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(Softmax()(x), e / e.sum(axis=1, keepdims=True), rtol=1e-6, atol=1e-7)


def test_conv_1x1_with_padding_wider_than_half_the_kernel(tmp_path):
    # a pooling window may pad at most half the kernel; a convolution may pad more
    w = RNG.standard_normal((3, 2, 1, 1)).astype(np.float32)
    model = agrees(write(tmp_path, [conv(pads=[1, 2, 1, 2])], {"cw": w, "cb": CB}, shape=("N", 2, 6, 7)), XI)
    assert model[0].kernel_size == (1, 1)


# ------------------------------------------------------------------ second round: the survivors of the first
def test_outputs_listed_at_most_ten(tmp_path):
    graph = helper.make_graph([gemm(out="o0")], "g", [vi("x", ["N", 4])], [vi(f"o{k}", None) for k in range(12)],
                              initializer=[numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b")]
                              + [numpy_helper.from_array(B, f"o{k}") for k in range(1, 12)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / "outs.onnx")
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    msg = refused(path)
    assert msg.endswith(f"outputs {[f'o{k}' for k in range(10)]}"), msg


def test_reshape_batch_is_the_first_dim(tmp_path):
    x = RNG.standard_normal((3, 2, 6, 7)).astype(np.float32)
    agrees(reshape_path(tmp_path, [3, -1], (3, 2, 6, 7)), x)
    path = reshape_path(tmp_path, [2, -1], (3, 2, 6, 7), name="b.onnx")
    assert refused(path) == (f"{path}: node 0 ('view', Reshape): only a reshape to (N, features) is supported, "
                             f"got the shape [2, -1] for a per-sample input (2, 6, 7)")


def test_layer_names_of_every_kind(tmp_path):
    nodes = [conv(out="c", w="c1.weight", b="c1.bias"), conv(inp="c", out="c2", w="cw2", b=None, name="conv2"),
             node("MaxPool", ["c2"], ["p"], "mp", kernel_shape=[2, 2]),
             node("AveragePool", ["p"], ["q"], "ap", kernel_shape=[1, 1]), node("Flatten", ["q"], ["f"], "flat"),
             node("MatMul", ["f", "mm.weight"], ["y"], "mm")]
    inits = {"c1.weight": CW, "c1.bias": CB, "cw2": RNG.standard_normal((2, 3, 1, 1)).astype(np.float32),
             "mm.weight": RNG.standard_normal((2 * 5 * 6, 4)).astype(np.float32)}
    model = agrees(write(tmp_path, nodes, inits, shape=("N", 2, 8, 9)),
                   RNG.standard_normal((2, 2, 8, 9)).astype(np.float32))
    assert names(model) == ["c1", "conv1", "maxpool1", "avgpool1", "flatten1", "mm"]


def test_global_pool_name(tmp_path):
    if not hasattr(nn, "AdaptiveAvgPool2d"):
        pytest.skip("nn.AdaptiveAvgPool2d is not in this cydnn")
    nodes = [node("GlobalAveragePool", ["x"], ["g"], "gap"), node("AveragePool", ["g"], ["y"], "ap", kernel_shape=[1, 1])]
    model = agrees(write(tmp_path, nodes, {}, shape=("N", 2, 6, 7)), XI)
    assert names(model) == ["avgpool1", "avgpool2"]


@pytest.mark.parametrize("op,inputs,inits,what", [
    ("Conv", ["x", "w"], {"w": np.ones((3, 2, 3, 3), bool)}, "the weight ('w')"),
    ("Conv", ["x", "cw", "b"], {"cw": CW, "b": np.ones(3, bool)}, "the bias ('b')"),
    ("Gemm", ["x", "w", "b"], {"w": W, "b": np.ones(3, bool)}, "the bias (C) ('b')"),
    ("MatMul", ["x", "w"], {"w": np.ones((4, 3), bool)}, "the weight ('w')"),
])
def test_weight_roles_named_in_refusals(tmp_path, op, inputs, inits, what):
    shape = ("N", 2, 6, 7) if op == "Conv" else ("N", 4)
    path = write(tmp_path, [node(op, inputs, ["y"], "n", **({"transB": 1} if op == "Gemm" else {}))], inits,
                 shape=shape)
    assert refused(path) == f"{path}: node 0 ('n', {op}): {what} has dtype bool; a weight must be a real number array"


def test_add_bias_role_named(tmp_path):
    nodes = [node("MatMul", ["x", "w"], ["m"], "mm"), node("Add", ["m", "b"], ["y"], "add")]
    path = write(tmp_path, nodes, {"w": W.T.copy(), "b": np.ones(3, bool)})
    assert refused(path) == (f"{path}: node 1 ('add', Add): the bias ('b') has dtype bool; a weight must be a real "
                             f"number array")


def test_dropout_mode_from_the_data_names_it(tmp_path):
    nodes = [gemm(out="g"), node("Dropout", ["g", "", "g"], ["y"], "drop")]
    path = write(tmp_path, nodes, {"w": W, "b": B})
    assert refused(path) == (f"{path}: node 1 ('drop', Dropout): the training_mode ('g') must be a constant "
                             f"(an initializer or a Constant node)")


def test_conv_channels_checked_when_height_is_unknown(tmp_path):
    path = write(tmp_path, [conv()], CONV, shape=("N", 3, "H", "W"))
    assert refused(path) == (f"{path}: node 0 ('conv', Conv): weight (3, 2, 3, 3) does not fit kernel_shape [3, 3] "
                             f"and input (3, None, None)")


def test_pool_window_height_and_width_apart(tmp_path):
    path = write(tmp_path, [node("MaxPool", ["x"], ["y"], "pool", kernel_shape=[3, 2])], {}, shape=("N", 2, 2, 7))
    assert refused(path) == (f"{path}: node 0 ('pool', MaxPool): the kernel [3, 2] does not fit the input of height 2 "
                             f"padded by 0 (per-sample input (2, 2, 7))")
    # kernel 1 x 3, width padded by 1: the output keeps the input's 4 x 5; the Gemm checks the 40 features
    nodes = [node("MaxPool", ["x"], ["p"], "pool", kernel_shape=[1, 3], pads=[0, 1, 0, 1]),
             node("Flatten", ["p"], ["f"], "flat"), gemm(inp="f", w="fw", b=None)]
    x = RNG.standard_normal((2, 2, 4, 5)).astype(np.float32)
    fw = RNG.standard_normal((3, 40)).astype(np.float32)
    model = cydnn.load_onnx(write(tmp_path, nodes, {"fw": fw}, shape=("N", 2, 4, 5), name="w.onnx"))
    padded = np.pad(x, ((0, 0), (0, 0), (0, 0), (1, 1)), constant_values=-np.inf)
    pooled = np.max([padded[..., j:j + 5] for j in range(3)], axis=0)     # onnx.reference fails on this one
    np.testing.assert_allclose(run(model, x), pooled.reshape(2, 40) @ fw.T, rtol=1e-5, atol=1e-5)
    x = RNG.standard_normal((2, 2, 4, 1)).astype(np.float32)       # a 1 x 3 kernel fits width 1 padded by 1
    w = RNG.standard_normal((3, 2, 1, 3)).astype(np.float32)
    agrees(write(tmp_path, [conv(pads=[0, 1, 0, 1])], {"cw": w, "cb": CB}, shape=("N", 2, 4, 1), name="w1.onnx"), x)


def test_kernel_larger_than_the_padded_input_by_one(tmp_path):
    w = RNG.standard_normal((3, 2, 4, 4)).astype(np.float32)
    path = write(tmp_path, [conv(pads=[1, 1, 1, 1])], {"cw": w, "cb": CB}, shape=("N", 2, 1, 1))
    assert refused(path) == (f"{path}: node 0 ('conv', Conv): the kernel [4, 4] does not fit the input of height 1 "
                             f"padded by 1 (per-sample input (2, 1, 1))")


def test_batchnorm_zero_variance_and_float64_constants(tmp_path):
    if not hasattr(nn, "BatchNorm2d"):
        pytest.skip("nn.BatchNorm2d is not in this cydnn")
    values = {k: v.astype(np.float64) for k, v in {"s": np.array([0.5, 1.0, 2.0]), "bb": np.array([0.1, -0.2, 0.3]),
                                                   "m": np.array([0.0, 1.0, -1.0]), "v": np.array([1.0, 0.0, 4.0])}.items()}
    model = agrees(bn_path(tmp_path, values=values), XB)
    layer = model[0]
    for arr in (layer.weight.data, layer.bias.data, layer.running_mean, layer.running_var):
        assert np.asarray(arr).dtype == np.float32


def test_batchnorm_channel_counts_when_channels_are_unknown(tmp_path):
    if not hasattr(nn, "BatchNorm2d"):
        pytest.skip("nn.BatchNorm2d is not in this cydnn")
    path = bn_path(tmp_path, values={"s": np.ones(4, np.float32)}, shape=("N", "C", 4, 5))
    assert refused(path) == (f"{path}: node 0 ('bn', BatchNormalization): the bias (B) must be a constant of shape "
                             f"(channels,) = (None,), got (3,)")
    path = bn_path(tmp_path, values={"s": np.ones((3,), bool)}, name="b.onnx")
    assert refused(path) == (f"{path}: node 0 ('bn', BatchNormalization): the scale ('s') has dtype bool; a weight "
                             f"must be a real number array")


def test_batchnorm_named_after_its_scale(tmp_path):
    if not hasattr(nn, "BatchNorm2d"):
        pytest.skip("nn.BatchNorm2d is not in this cydnn")
    n = node("BatchNormalization", ["x", "features.1.weight", "features.1.bias", "m", "v"], ["y"], "bn")
    inits = {"features.1.weight": np.ones(3, np.float32), "features.1.bias": np.zeros(3, np.float32),
             "m": np.zeros(3, np.float32), "v": np.ones(3, np.float32)}
    model = agrees(write(tmp_path, [n], inits, shape=("N", 3, 4, 5)), XB)
    assert names(model) == ["features.1"]


def test_a_scalar_where_onnx_wants_1d_is_refused_with_its_shape(tmp_path):
    # as_weight once made a 0-d tensor 1-D: a scalar Conv bias (or BatchNorm constant) of a 1-channel
    # layer passed the (channels,) checks, and the messages showed (1,) for the file's ()
    w = RNG.standard_normal((1, 2, 3, 3)).astype(np.float32)
    path = write(tmp_path, [conv()], {"cw": w, "cb": np.array(0.5, np.float32)}, shape=("N", 2, 6, 7))
    assert refused(path) == (f"{path}: node 0 ('conv', Conv): bias of shape () does not fit 1 output channels "
                             f"(it must be 1-D)")
    path = write(tmp_path, [gemm(b=None)], {"w": np.array(2.0, np.float32)}, name="g.onnx")
    assert refused(path) == f"{path}: node 0 ('fc', Gemm): needs a 2-D weight, got ()"
    if hasattr(nn, "BatchNorm2d"):
        values = {"s": np.array(1.0, np.float32), "bb": np.zeros(1, np.float32), "m": np.zeros(1, np.float32),
                  "v": np.ones(1, np.float32)}
        path = bn_path(tmp_path, values=values, shape=("N", 1, 4, 5), name="bn1.onnx")
        assert refused(path) == (f"{path}: node 0 ('bn', BatchNormalization): the scale must be a constant of shape "
                                 f"(channels,) = (1,), got ()")


def test_a_scalar_gemm_bias_is_one_bias_for_every_output(tmp_path):
    # ONNX broadcasts a scalar C to every output (unidirectional broadcasting)
    model = agrees(write(tmp_path, [gemm()], {"w": W, "b": np.array(0.75, np.float32)}), X4)
    np.testing.assert_array_equal(model[0].bias.data, np.full(3, 0.75, np.float32))
    nodes = [node("MatMul", ["x", "w"], ["m"], "mm"), node("Add", ["m", "b"], ["y"], "add")]
    model = agrees(write(tmp_path, nodes, {"w": W.T.copy(), "b": np.array(-1.5, np.float32)}, name="a.onnx"), X4)
    np.testing.assert_array_equal(model[0].bias.data, np.full(3, -1.5, np.float32))
