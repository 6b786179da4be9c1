"""cydnn.onnx_checks and cydnn.load_onnx, said exactly: each refusal's whole message (the file,
the node, the tensor, the rule), the bounds at their edge (a limit accepted, one past it
refused), and what load_onnx returns around them.  Results of accepted graphs are compared with
onnx's own reference evaluator.  Written to kill the mutants tools/mutation.py left alive."""
import os

import numpy as np
import pytest

import cydnn
from cydnn import nn, ops, onnx_checks
from cydnn.onnx_checks import OnnxImportError

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

W = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)     # Gemm weight (out, in), transB=1
B = np.random.default_rng(1).standard_normal(3).astype(np.float32)
X = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def write(tmp_path, nodes, inits=(), inputs=None, outputs=None, opsets=(("", 17),), name="g.onnx"):
    """A model file; ``inits`` are TensorProtos or (name, array) pairs; input x (N, 4), output y."""
    tensors = [t if isinstance(t, TensorProto) else numpy_helper.from_array(np.asarray(t[1]), t[0])
               for t in inits]
    graph = helper.make_graph(nodes, "g", inputs if inputs is not None else [vi("x", ["N", 4])],
                              outputs if outputs is not None else [vi("y", None)], initializer=tensors)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    path = str(tmp_path / name)
    with open(path, "wb") as f:                 # the bytes as they are (onnx.save would check them)
        f.write(proto.SerializeToString())
    return path


def gemm(inp="x", out="y", w="w", b="b", name="fc", **attrs):
    return helper.make_node("Gemm", [inp, w, b], [out], name=name, transB=1, **attrs)


WB = (("w", W), ("b", B))


def refused(path, **kw):
    with pytest.raises(OnnxImportError) as info:
        cydnn.load_onnx(path, **kw)
    return str(info.value)


def run(model, x):
    model.eval()
    backend = ops.backend(model.device)
    return backend.to_numpy(model(backend.asarray(np.ascontiguousarray(x, dtype=np.float32))))


def reference(path, x):
    ev = ReferenceEvaluator(path)
    return ev.run(None, {ev.input_names[0]: x})[0]


def agrees(path, x=X):
    model = cydnn.load_onnx(path)
    np.testing.assert_allclose(run(model, x), reference(path, x), rtol=1e-5, atol=1e-5)
    return model


# ------------------------------------------------------------------ check_file
def test_file_size_limit_is_protobufs_and_checked_before_reading(tmp_path, monkeypatch):
    assert onnx_checks.MAX_ONNX_BYTES == 2**31 - 1
    path = write(tmp_path, [gemm()], WB)
    size = os.path.getsize(path)
    monkeypatch.setattr(onnx_checks, "MAX_ONNX_BYTES", size)          # exactly the limit: read
    agrees(path)
    monkeypatch.setattr(onnx_checks, "MAX_ONNX_BYTES", size - 1)      # one byte over: refused
    assert refused(path) == (f"{path}: {size} bytes, over protobuf's 2 GiB limit for one message "
                             f"(MAX_ONNX_BYTES); models that large keep their weights as external data, "
                             f"which cydnn does not load")


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        cydnn.load_onnx(str(tmp_path / "nope.onnx"))


# ------------------------------------------------------------------ check_opset
@pytest.mark.parametrize("opsets", [(("", 7),), (("", 22),), (("ai.onnx", 13),), (("", 13), ("com.x", 99))])
def test_opsets_in_range_are_read(tmp_path, opsets):
    model = cydnn.load_onnx(write(tmp_path, [gemm()], WB, opsets=opsets))
    np.testing.assert_allclose(run(model, X), X @ W.T + B, rtol=1e-5, atol=1e-5)     # Gemm, transB=1


@pytest.mark.parametrize("opsets,version,problem", [
    ((("", 23),), 23, "is newer than this importer knows (at most 22); export with opset_version=22 or lower"),
    ((("", 6),), 6, "is older than this importer reads (at least 7); export with a newer opset"),
    ((("", 17), ("ai.onnx", 23)), 23, "is newer than this importer knows (at most 22); "
                                      "export with opset_version=22 or lower"),
    ((("", 17), ("ai.onnx", 5)), 5, "is older than this importer reads (at least 7); export with a newer opset"),
])
def test_opsets_out_of_range_are_refused(tmp_path, opsets, version, problem):
    path = write(tmp_path, [gemm()], WB, opsets=opsets)
    assert refused(path) == f"{path}: opset {version} {problem}"


def test_no_default_opset_is_refused(tmp_path):
    path = write(tmp_path, [gemm()], WB, opsets=(("com.example", 1),))
    assert refused(path) == f"{path}: the model declares no opset for the default ONNX domain"


# ------------------------------------------------------------------ check_graph
def test_node_count_limit(tmp_path, monkeypatch):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="r"), gemm(inp="r")]
    path = write(tmp_path, nodes, WB)
    monkeypatch.setattr(onnx_checks, "MAX_NODES", 2)
    agrees(path)
    monkeypatch.setattr(onnx_checks, "MAX_NODES", 1)
    assert refused(path) == f"{path}: 2 nodes, more than MAX_NODES (1)"


def test_initializer_given_twice(tmp_path):
    path = write(tmp_path, [gemm()], (("w", W), ("b", B), ("w", W)))
    assert refused(path) == f"{path}: initializer 'w' is given twice"


def test_graph_input_declared_twice(tmp_path):
    path = write(tmp_path, [gemm()], WB, inputs=[vi("x", ["N", 4]), vi("x", ["N", 4])])
    assert refused(path) == f"{path}: graph input 'x' is declared twice"


def test_initializer_also_listed_as_input_is_a_weight(tmp_path):
    path = write(tmp_path, [gemm()], WB, inputs=[vi("x", ["N", 4]), vi("w", [3, 4]), vi("b", [3])])
    agrees(path)


def test_negative_input_dimension(tmp_path):
    path = write(tmp_path, [gemm()], WB, inputs=[vi("x", [2, -4])])
    assert refused(path) == f"{path}: graph input 'x' has a negative dimension [2, -4]"


def test_zero_input_dimension_is_refused_by_the_range_check(tmp_path):
    path = write(tmp_path, [gemm()], WB, inputs=[vi("x", [0, 4])])
    assert refused(path) == f"{path}: graph input 'x' has dimensions [0, 4]: each must lie in [1, 2147483648)"


def test_symbolic_and_fixed_dims(tmp_path):
    model = agrees(write(tmp_path, [gemm()], WB, inputs=[vi("x", [2, 4])]))
    assert type(model) is nn.Sequential and model[0].weight.shape == (3, 4)
    agrees(write(tmp_path, [gemm()], WB, inputs=[vi("x", ["batch", "feat"])], name="sym.onnx"))


def test_a_read_before_definition(tmp_path):
    nodes = [helper.make_node("Relu", ["later"], ["r"], name="early"), gemm(inp="r", out="later")]
    path = write(tmp_path, nodes, WB, outputs=[vi("later", None)])
    assert refused(path) == (f"{path}: node 0 ('early', Relu) reads 'later', which no earlier node, input or "
                             f"initializer defines (a cycle, or nodes out of order)")


@pytest.mark.parametrize("target,already", [("x", "a graph input"), ("w", "an initializer"),
                                            ("r", "the output of node 0")])
def test_a_value_defined_twice(tmp_path, target, already):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="first"),
             helper.make_node("Relu", ["r"], [target], name="again"), gemm(inp="r")]
    path = write(tmp_path, nodes, WB)
    assert refused(path) == (f"{path}: node 1 ('again', Relu) writes {target!r}, which is already {already}: "
                             f"each value must be defined once")


def test_empty_names_are_absent_optional_values(tmp_path):
    # Gemm without C (input ''), Dropout with an absent ratio and an unnamed mask output
    nodes = [helper.make_node("Gemm", ["x", "w", ""], ["g"], name="fc", transB=1),
             helper.make_node("Dropout", ["g", ""], ["y", ""], name="drop")]
    model = agrees(write(tmp_path, nodes, (("w", W),)))
    assert model[0].bias is None


def test_output_never_computed(tmp_path):
    path = write(tmp_path, [gemm()], WB, outputs=[vi("z", None)])
    assert refused(path) == f"{path}: the graph's output 'z' is never computed"


# ------------------------------------------------------------------ tensor_array
def test_external_data_by_location_or_entries(tmp_path):
    for i, how in enumerate(("location", "entries")):
        t = numpy_helper.from_array(W, "w")
        if how == "location":
            t.data_location = TensorProto.EXTERNAL
        else:
            entry = t.external_data.add()
            entry.key, entry.value = "location", "w.bin"
        path = write(tmp_path, [gemm()], (t, ("b", B)), name=f"e{i}.onnx")
        assert refused(path) == (f"{path}: node 0 ('fc', Gemm): tensor 'w' keeps its data in an external file, "
                                 f"which cydnn never reads; save the model with its weights inside "
                                 f"(onnx.save(..., save_as_external_data=False))")


@pytest.mark.parametrize("data_type,kind", [(8, "string"), (14, "complex64"), (16, "bfloat16"),
                                            (99, "data type 99")])
def test_non_numeric_tensor_types(tmp_path, data_type, kind):
    t = TensorProto(name="w", data_type=data_type, dims=[3, 4])
    path = write(tmp_path, [gemm()], (t, ("b", B)))
    assert refused(path) == f"{path}: node 0 ('fc', Gemm): tensor 'w' is a {kind} tensor; only real numeric tensors are read"


def test_negative_tensor_dims(tmp_path):
    t = TensorProto(name="w", data_type=1, dims=[3, -4])
    path = write(tmp_path, [gemm()], (t, ("b", B)))
    assert refused(path) == f"{path}: node 0 ('fc', Gemm): tensor 'w' has a negative dimension in [3, -4]"


def test_tensor_element_limit(tmp_path, monkeypatch):
    path = write(tmp_path, [gemm()], WB)
    monkeypatch.setattr(onnx_checks, "MAX_TENSOR_ELEMENTS", 12)        # W has exactly 12 values
    agrees(path)
    monkeypatch.setattr(onnx_checks, "MAX_TENSOR_ELEMENTS", 11)
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): tensor 'w' declares [3, 4] = 12 values, "
                             f"more than MAX_TENSOR_ELEMENTS (11)")


@pytest.mark.parametrize("raw", [True, False])
def test_dims_that_disagree_with_the_data(tmp_path, raw):
    t = numpy_helper.from_array(W, "w")
    if raw:
        t.raw_data = W.tobytes()[:-2]           # 11.5 float32 values
        held = "11.5"
    else:
        t.ClearField("raw_data")
        t.float_data.extend(W.ravel()[:-1].tolist())
        held = "11"
    path = write(tmp_path, [gemm()], (t, ("b", B)))
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): tensor 'w': dims [3, 4] declare 12 values, "
                             f"but its data holds {held}")


@pytest.mark.parametrize("data_type,field,values", [
    (1, "float_data", W.ravel().tolist()), (11, "double_data", W.ravel().tolist()),
    (6, "int32_data", list(range(12))), (7, "int64_data", list(range(-6, 6))),
    (13, "uint64_data", list(range(12))), (5, "int32_data", list(range(-6, 6)))])
def test_tensors_in_their_typed_fields(tmp_path, data_type, field, values):
    t = TensorProto(name="w", data_type=data_type, dims=[3, 4])
    getattr(t, field).extend(values)
    path = write(tmp_path, [gemm()], (t, ("b", B)))
    model = cydnn.load_onnx(path)
    np.testing.assert_array_equal(model[0].weight.data, np.asarray(values, np.float64).reshape(3, 4).astype(np.float32))
    assert model[0].weight.data.dtype == np.float32


def test_weight_of_bools_is_refused(tmp_path):
    path = write(tmp_path, [gemm()], (("w", np.ones((3, 4), bool)), ("b", B)))
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): the weight (B) ('w') has dtype bool; "
                             f"a weight must be a real number array")


def test_integer_weight_float32_cannot_hold(tmp_path):
    w = np.full((3, 4), 2**24 + 1, np.int64)
    path = write(tmp_path, [gemm()], (("w", w), ("b", B)))
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): the weight (B) ('w'): int64 values such as "
                             f"16777217 are not exactly representable in float32; refusing a lossy cast")
    w[...] = 2**24                              # held exactly
    model = cydnn.load_onnx(write(tmp_path, [gemm()], (("w", w), ("b", B)), name="ok.onnx"))
    assert (model[0].weight.data == 2**24).all() and model[0].weight.data.dtype == np.float32


def test_float64_weight_becomes_float32_contiguous(tmp_path):
    w = np.asfortranarray(W.astype(np.float64))
    model = agrees(write(tmp_path, [gemm()], (("w", w), ("b", B.astype(np.float64)))))
    assert model[0].weight.data.dtype == np.float32 and model[0].weight.data.flags.c_contiguous


# ------------------------------------------------------------------ load_onnx
def test_unreadable_file_names_what_it_looks_like(tmp_path):
    np.savez(tmp_path / "w.npz", fc_weight=W)
    path = str(tmp_path / "w.npz")
    msg = refused(path)
    assert msg.startswith(f"{path}: not a readable ONNX model (")
    assert msg.endswith("; it looks like a bare state_dict (.npz of arrays 'fc_weight', no cydnn config): load it "
                        "into a model with cydnn.load_pytorch_weights(model, path)"), msg


def test_unreadable_onnx_looking_file_says_nothing_more(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\x08\x07garbage that is not protobuf \xff\xff")
    msg = refused(str(path))
    assert msg.startswith(f"{path}: not a readable ONNX model (DecodeError: "), msg
    assert "looks like" not in msg and msg.endswith(")")


def test_unreadable_file_that_looks_like_nothing(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\xff\xff\xff\xff\xff\xff\xff")
    msg = refused(str(path))
    assert msg.startswith(f"{path}: not a readable ONNX model (") and msg.endswith(")") and "looks" not in msg


def test_path_like_is_accepted(tmp_path):
    from pathlib import Path
    path = write(tmp_path, [gemm()], WB)
    model = cydnn.load_onnx(Path(path))
    np.testing.assert_allclose(run(model, X), reference(path, X), rtol=1e-5, atol=1e-5)
    msg = refused(Path(write(tmp_path, [gemm()], WB, outputs=[vi("z", None)], name="z.onnx")))
    assert msg == f"{tmp_path / 'z.onnx'}: the graph's output 'z' is never computed"


def test_normalize_with_a_sequential_is_refused(tmp_path):
    path = write(tmp_path, [gemm()], WB)
    with pytest.raises(ValueError) as info:
        cydnn.load_onnx(path, lenet=False, normalize=(0.5, 0.25))
    assert str(info.value) == ("load_onnx: normalize=(mean, std) applies to the LeNet5 it returns with lenet=True; "
                               "the Sequential takes the graph's input as it is (normalize=None)")
    with pytest.raises(ValueError) as info:
        cydnn.load_onnx(path, normalize=(0.5, 0.25))
    assert str(info.value) == (f"load_onnx: {path} is not a LeNet-5; normalize=(mean, std) applies only "
                               f"to a LeNet5 (the Sequential takes the graph's input as it is)")
    for lenet in (True, False):                 # normalize=None is fine with either
        model = cydnn.load_onnx(path, lenet=lenet, normalize=None)
        np.testing.assert_allclose(run(model, X), reference(path, X), rtol=1e-5, atol=1e-5)


def test_the_model_is_in_training_mode_on_the_cpu(tmp_path):
    model = cydnn.load_onnx(write(tmp_path, [gemm()], WB))
    assert model.training and model.device == "cpu"
    assert list(model.state_dict()) == ["fc1.weight", "fc1.bias"]    # "w" is no <layer>.weight name


# ------------------------------------------------------------------ second round
def test_negative_dimension_message_shows_symbolic_dims_as_none(tmp_path):
    path = write(tmp_path, [gemm()], WB, inputs=[vi("x", ["N", -4])])
    assert refused(path) == f"{path}: graph input 'x' has a negative dimension [None, -4]"


def test_a_tensor_onnx_cannot_convert(tmp_path):
    t = numpy_helper.from_array(W, "w")
    t.segment.begin, t.segment.end = 0, 12          # numpy_helper.to_array refuses segments
    path = write(tmp_path, [gemm()], (t, ("b", B)))
    assert refused(path) == (f"{path}: node 0 ('fc', Gemm): tensor 'w' cannot be read (ValueError: Currently not "
                             f"supporting loading segments.)")


def test_missing_onnx_package_message(monkeypatch, tmp_path):
    path = write(tmp_path, [gemm()], WB)
    monkeypatch.setitem(__import__("sys").modules, "onnx", None)
    with pytest.raises(ImportError) as info:
        cydnn.load_onnx(path)
    assert str(info.value) == ("cydnn.load_onnx needs the 'onnx' package: pip install onnx  "
                               "(or pip install 'cydnn[onnx]')")
    assert isinstance(info.value.__cause__, ImportError)
