"""Every hostile file of issue 15, for every reader: weights (.npz, .safetensors, folders),
checkpoints and ONNX.  Each ends in the package's own error (or an OSError naming the path)
naming the file and the problem, in under 5 s and 512 MiB of extra memory: all the files are
built here, then loaded one after the other in a child process whose address space is capped
(tests/hostilekit.py).  Valid files built the same way load (the controls)."""
import json
import os

import numpy as np
import pytest

from hostilekit import (assert_refused, deflate_bomb, npy, npy_header, run_cases, safetensors_bytes,
                        write_zip)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "pytorch_lenet")
WEIGHTS = "cydnn.interop.WeightsError"
CHECKPOINT = "cydnn.checkpoint_checks.CheckpointError"
ONNX = "cydnn.onnx_checks.OnnxImportError"


def torch_state():
    with np.load(os.path.join(FIXTURES, "modern.npz")) as f:
        return dict(f)


def state_members(state, skip=()):
    return [(k + ".npy", npy(v)) for k, v in state.items() if k not in skip]


# ---------------------------------------------------------------- weights
def weights_cases(d):
    state = torch_state()
    c = {}
    fc1 = state["fc1.weight"]
    # A 1.5 MB file declaring 1.5 GiB for fc1.weight (over MAX_MEMBER_BYTES).
    c["npz_bomb_over_member_limit"] = write_zip(d / "bomb.npz", state_members(state, {"fc1.weight"}) + [
        ("fc1.weight.npy", (deflate_bomb(npy_header((3 << 28,)), 1536), 128 + (1536 << 20), 0))])
    # 900 MiB declared (under the limit) whose header claims fc1.weight's shape: refused from the header.
    c["npz_bomb_forged_header"] = write_zip(d / "forged.npz", state_members(state, {"fc1.weight"}) + [
        ("fc1.weight.npy", (deflate_bomb(npy_header(fc1.shape), 900), 128 + (900 << 20), 0))])
    # An .npy header declaring 1 TiB in a member of a few bytes.
    c["npy_header_1tib"] = write_zip(d / "tib.npz", state_members(state, {"fc1.weight"}) + [
        ("fc1.weight.npy", npy_header((1 << 38,)) + bytes(16))])
    c["npy_header_1tib_right_shape_wrong_dtype"] = write_zip(d / "tib2.npz", state_members(state, {"fc1.weight"}) + [
        ("fc1.weight.npy", npy_header(fc1.shape, "V34952533") + bytes(16))])
    c["npz_duplicate_member"] = write_zip(d / "dup.npz", state_members(state) + [
        ("fc3.bias.npy", npy(np.zeros(10, np.float32)))])
    c["npz_duplicate_npy_suffix"] = write_zip(d / "dup2.npz", state_members(state) + [
        ("fc3.bias", npy(np.zeros(10, np.float32)))])
    c["npz_name_traversal"] = write_zip(d / "trav.npz", state_members(state) + [
        ("../../x.weight.npy", npy(np.zeros(3, np.float32)))])
    c["npz_name_shadows_training"] = write_zip(d / "training.npz", state_members(state) + [
        ("training.npy", npy(np.zeros(3, np.float32)))])
    lossy = dict(state, **{"fc3.bias": np.full(10, 2**53 + 1, np.int64)})
    c["npz_int64_lossy"] = write_zip(d / "lossy.npz", state_members(lossy))
    c["npz_truncated"] = d / "cut.npz"
    c["npz_truncated"].write_bytes(open(os.path.join(FIXTURES, "modern.npz"), "rb").read()[:5000])
    # safetensors
    good = open(os.path.join(FIXTURES, "modern.safetensors"), "rb").read()
    n = int.from_bytes(good[:8], "little")
    header, data = json.loads(good[8:8 + n]), good[8 + n:]
    entry = json.dumps(header["fc3.bias"])
    text = json.dumps(header)[:-1] + f', "fc3.bias": {entry}}}'        # fc3.bias named twice
    c["st_duplicate_name"] = d / "dup.safetensors"
    c["st_duplicate_name"].write_bytes(safetensors_bytes(text, data))
    c["st_header_length_huge"] = d / "huge.safetensors"
    c["st_header_length_huge"].write_bytes(safetensors_bytes("{}", length=(1 << 63) + 5))
    c["st_deep_json"] = d / "deep.safetensors"
    c["st_deep_json"].write_bytes(safetensors_bytes("[" * 100_000 + "]" * 100_000))
    c["st_offsets_outside"] = d / "off.safetensors"
    c["st_offsets_outside"].write_bytes(safetensors_bytes(json.dumps(
        {"fc3.bias": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}), bytes(64)))
    c["st_name_traversal"] = d / "trav.safetensors"
    c["st_name_traversal"].write_bytes(safetensors_bytes(json.dumps(
        {"../x.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), bytes(4)))
    c["st_name_nul"] = d / "nul.safetensors"
    c["st_name_nul"].write_bytes(safetensors_bytes(json.dumps(
        {"fc\u00001.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), bytes(4)))
    # folders
    folder = d / "folder_shadow"
    folder.mkdir()
    (folder / "forward.txt").write_text("1\n")
    c["folder_name_shadows_forward"] = folder
    folder = d / "folder_sparse"
    folder.mkdir()
    with open(folder / "fc1.weight.txt", "wb") as f:       # 4 GiB of (sparse) text for 30,720 values
        f.truncate(4 << 30)
    c["folder_text_too_large"] = folder
    return {k: ("weights", v) for k, v in c.items()}


WEIGHT_NEEDLES = {
    "npz_bomb_over_member_limit": ["fc1.weight.npy", "MAX_MEMBER_BYTES"],
    "npz_bomb_forged_header": ["fc1.weight", "member holds"],
    "npy_header_1tib": ["fc1.weight", "(274877906944,)"],
    "npy_header_1tib_right_shape_wrong_dtype": ["fc1.weight"],
    "npz_duplicate_member": ["fc3.bias", "twice"],
    "npz_duplicate_npy_suffix": ["fc3.bias", "twice"],
    "npz_name_traversal": ["../../x.weight", "empty part"],
    "npz_name_shadows_training": ["training", "attribute of nn.Module"],
    "st_name_nul": ["neither an identifier"],
    "npz_int64_lossy": ["fc3.bias", "not exactly representable"],
    "npz_truncated": ["cut.npz"],
    "st_duplicate_name": ["fc3.bias", "twice"],
    "st_header_length_huge": ["header declares"],
    "st_deep_json": ["nested"],
    "st_offsets_outside": ["fc3.bias", "data_offsets"],
    "st_name_traversal": ["../x.weight"],
    "folder_name_shadows_forward": ["forward", "attribute of nn.Module"],
    "folder_text_too_large": ["fc1.weight", "refusing to parse"],
}


# ------------------------------------------------------------ checkpoints
def checkpoint_cases(d):
    from cydnn import models, serialization
    model = models.LeNet5(seed=0)
    base = {"format_version": npy(np.array(serialization.FORMAT_VERSION, np.int64)),
            "config": npy(np.array(json.dumps(model.config()))),
            "metadata": npy(np.array(json.dumps({"note": "handmade"})))}
    params = [("param/" + k + ".npy", npy(v)) for k, v in model.state_dict().items()]

    def ckpt(name, config=None, extra=(), skip=()):
        members = [(k + ".npy", v) for k, v in base.items()]
        if config is not None:
            members[1] = ("config.npy", npy(np.array(config)))
        members += [(k, v) for k, v in params if k not in skip] + list(extra)
        return write_zip(d / name, members)

    c = {
        "ck_config_100000_deep": ckpt("deep.npz", '{"arch": "LeNet5", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "ck_int_5000_digits": ckpt("digits.npz", '{"arch": "LeNet5", "num_classes": ' + "9" * 5000 + "}"),
        "ck_arch_is_a_list": ckpt("archlist.npz", '{"arch": ["LeNet5"]}'),
        "ck_config_duplicate_key": ckpt("dupkey.npz", '{"arch": "LeNet5", "num_classes": 10, "num_classes": 7}'),
        "ck_duplicate_member": ckpt("dup.npz", extra=[("param/fc3.bias.npy", npy(np.zeros(10, np.float32)))]),
        "ck_npy_header_1tib": ckpt("tib.npz", skip={"param/fc1.weight.npy"},
                                   extra=[("param/fc1.weight.npy", npy_header((1 << 38,)) + bytes(16))]),
        "ck_name_traversal": ckpt("trav.npz", extra=[("param/../../x.npy", npy(np.zeros(3, np.float32)))]),
        "ck_name_shadows": ckpt("shadow.npz", extra=[("param/_modules.npy", npy(np.zeros(3, np.float32)))]),
        "ck_metadata_deep": ckpt("metadeep.npz"),
    }
    members = [(k + ".npy", v) for k, v in base.items()]
    members[2] = ("metadata.npy", npy(np.array("[" * 100_000 + "]" * 100_000)))
    write_zip(d / "metadeep.npz", members + params)
    cases = {k: ("checkpoint", v) for k, v in c.items()}
    cases["ck_metadata_deep"] = ("metadata", c["ck_metadata_deep"])
    # Files that are not checkpoints: named as what they are, with what loads them.
    torch_zip = write_zip(d / "torch.pt", [("archive/data.pkl", b"\x80\x02}q\x00."), ("archive/version", b"3")])
    for key, path in {"not_ck_state_dict": os.path.join(FIXTURES, "modern.npz"),
                      "not_ck_safetensors": os.path.join(FIXTURES, "modern.safetensors"),
                      "not_ck_onnx": os.path.join(FIXTURES, "modern.onnx"),
                      "not_ck_torch_save": torch_zip}.items():
        cases[key] = ("checkpoint", path)
    return cases


CHECKPOINT_NEEDLES = {
    "ck_config_100000_deep": ["'config'", "nested"],
    "ck_int_5000_digits": ["'config'", "5000 digits"],
    "ck_arch_is_a_list": ["'arch' must be a string"],
    "ck_config_duplicate_key": ["num_classes", "twice"],
    "ck_duplicate_member": ["param/fc3.bias", "twice"],
    "ck_npy_header_1tib": ["param/fc1.weight", "(274877906944,)"],
    "ck_name_traversal": ["../../x", "empty part"],
    "ck_name_shadows": ["_modules", "attribute of nn.Module"],
    "ck_metadata_deep": ["'metadata'", "nested"],
    "not_ck_state_dict": ["bare state_dict", "cydnn.load_pytorch_weights(model, path)"],
    "not_ck_safetensors": [".safetensors", "cydnn.load_pytorch_weights(model, path)"],
    "not_ck_onnx": ["ONNX", "cydnn.load_onnx(path)"],
    "not_ck_torch_save": ["torch.save", "never unpickles"],
}


# ------------------------------------------------------------------- ONNX
def onnx_cases(d):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)

    def model_file(name, nodes, inits, in_shape=(6,), opset=17, raw_inits=()):
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *in_shape])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()] + list(raw_inits))
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        path = d / name
        path.write_bytes(proto.SerializeToString())
        return path

    w, b = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    gemm = [helper.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1)]

    def gemm_with(name, weight_name="fc.weight", **inits):
        nodes = [helper.make_node("Gemm", ["x", weight_name, "fc.bias"], ["y"], name="fc", transB=1)]
        return model_file(name, nodes, {weight_name: w, "fc.bias": b, **inits})

    def conv(name, conv_attrs, wshape=(3, 2, 3, 3), bshape=(3,), in_shape=(2, 8, 8), pool=None):
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if pool else "y"], name="conv", **conv_attrs)]
        if pool:
            nodes.append(helper.make_node("MaxPool", ["c"], ["y"], name="pool", **pool))
        return model_file(name, nodes, {"w": rng.standard_normal(wshape).astype(np.float32),
                                        "b": np.zeros(bshape, np.float32)}, in_shape)

    c = {}
    big = d / "big.onnx"
    with open(big, "wb") as f:
        f.truncate((2 << 30) + 1)           # sparse: no disk used
    c["onnx_over_2gib"] = big
    c["onnx_training_weight"] = gemm_with("training.onnx", "training.weight")
    c["onnx_forward_weight"] = gemm_with("forward.onnx", "forward.weight")
    c["onnx_traversal_name"] = gemm_with("trav.onnx", "../../../x.weight")
    c["onnx_absolute_name"] = gemm_with("abs.onnx", "/tmp/x.weight")
    bad = numpy_helper.from_array(w, "fc.weight")
    bad.dims[:] = [40, 60]                  # dims that disagree with the data
    c["onnx_dims_disagree"] = model_file("dims.onnx", gemm, {"fc.bias": b}, raw_inits=[bad])
    huge = numpy_helper.from_array(w, "fc.weight")
    huge.dims[:] = [1 << 20, 1 << 20]
    c["onnx_dims_huge"] = model_file("hugedims.onnx", gemm, {"fc.bias": b}, raw_inits=[huge])
    neg = numpy_helper.from_array(w, "fc.weight")
    neg.dims[:] = [-4, -6]
    c["onnx_negative_dims"] = model_file("neg.onnx", gemm, {"fc.bias": b}, raw_inits=[neg])
    text = helper.make_tensor("fc.weight", TensorProto.STRING, [4, 6], [b"x"] * 24)
    c["onnx_string_weight"] = model_file("string.onnx", gemm, {"fc.bias": b}, raw_inits=[text])
    c["onnx_int64_lossy"] = model_file("lossy.onnx", gemm, {"fc.weight": np.full((4, 6), 2**53 + 1, np.int64),
                                                             "fc.bias": b})
    c["onnx_gemm_bias_wrong_length"] = model_file("blen.onnx", gemm, {"fc.weight": w, "fc.bias": np.zeros(5, np.float32)})
    c["onnx_gemm_bias_per_row"] = model_file("bn1.onnx", gemm, {"fc.weight": w, "fc.bias": np.zeros((4, 1), np.float32)})
    c["onnx_conv_bias_wrong_length"] = conv("cblen.onnx", {"kernel_shape": [3, 3]}, bshape=(5,))
    c["onnx_stride_0"] = conv("stride0.onnx", {"kernel_shape": [3, 3], "strides": [0, 0]})
    c["onnx_kernel_too_big"] = conv("kbig.onnx", {"kernel_shape": [9, 9]}, wshape=(3, 2, 9, 9))
    c["onnx_pool_pad_too_big"] = conv("ppad.onnx", {"kernel_shape": [3, 3]},
                                      pool={"kernel_shape": [2, 2], "pads": [2, 2, 2, 2]})
    c["onnx_pool_kernel_too_big"] = conv("pbig.onnx", {"kernel_shape": [3, 3]}, pool={"kernel_shape": [7, 7]})
    c["onnx_negative_input_dim"] = model_file("negin.onnx", gemm, {"fc.weight": w, "fc.bias": b}, in_shape=(-6,))
    c["onnx_opset_too_new"] = model_file("opset.onnx", gemm, {"fc.weight": w, "fc.bias": b}, opset=99)
    cycle = [helper.make_node("Relu", ["x", "t"], ["r"], name="r"), helper.make_node("Tanh", ["r"], ["t"], name="t"),
             helper.make_node("Gemm", ["t", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1)]
    c["onnx_cycle"] = model_file("cycle.onnx", cycle, {"fc.weight": w, "fc.bias": b})
    redefine = [helper.make_node("Relu", ["x"], ["x"], name="r"),
                helper.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1)]
    c["onnx_value_defined_twice"] = model_file("redef.onnx", redefine, {"fc.weight": w, "fc.bias": b})
    c["onnx_initializer_twice"] = model_file("dupinit.onnx", gemm, {"fc.weight": w, "fc.bias": b},
                                             raw_inits=[numpy_helper.from_array(b, "fc.bias")])
    ext = numpy_helper.from_array(w, "fc.weight")
    ext.ClearField("raw_data")
    ext.data_location = TensorProto.EXTERNAL
    ext.external_data.add(key="location", value="../../../../etc/passwd")
    c["onnx_external_data"] = model_file("ext.onnx", gemm, {"fc.bias": b}, raw_inits=[ext])
    cases = {k: ("onnx_sequential", v) for k, v in c.items()}
    cases["onnx_fixture_is_a_lenet_control"] = ("onnx", os.path.join(FIXTURES, "modern.onnx"))
    return cases


ONNX_NEEDLES = {
    "onnx_over_2gib": ["2 GiB"],
    "onnx_training_weight": ["'training.weight'", "attribute of nn.Module"],
    "onnx_forward_weight": ["'forward.weight'", "attribute of nn.Module"],
    "onnx_traversal_name": ["../../../x.weight", "empty part"],
    "onnx_absolute_name": ["/tmp/x.weight"],
    "onnx_dims_disagree": ["'fc.weight'", "declare 2400 values", "holds 24"],
    "onnx_dims_huge": ["'fc.weight'", "MAX_TENSOR_ELEMENTS"],
    "onnx_negative_dims": ["'fc.weight'", "negative dimension"],
    "onnx_string_weight": ["'fc.weight'", "string tensor"],
    "onnx_int64_lossy": ["fc.weight", "not exactly representable"],
    "onnx_gemm_bias_wrong_length": ["node 0 ('fc', Gemm)", "(5,)"],
    "onnx_gemm_bias_per_row": ["node 0 ('fc', Gemm)", "(4, 1)", "batch row"],
    "onnx_conv_bias_wrong_length": ["node 0 ('conv', Conv)", "(5,)"],
    "onnx_stride_0": ["node 0 ('conv', Conv)", "strides"],
    "onnx_kernel_too_big": ["node 0 ('conv', Conv)", "does not fit"],
    "onnx_pool_pad_too_big": ["node 1 ('pool', MaxPool)", "at most half"],
    "onnx_pool_kernel_too_big": ["node 1 ('pool', MaxPool)", "does not fit"],
    "onnx_negative_input_dim": ["negative dimension"],
    "onnx_opset_too_new": ["opset 99", "newer"],
    "onnx_cycle": ["node 0 ('r', Relu)", "'t'", "cycle"],
    "onnx_value_defined_twice": ["node 0 ('r', Relu)", "'x'", "defined once"],
    "onnx_initializer_twice": ["'fc.bias'", "twice"],
    "onnx_external_data": ["'fc.weight'", "external"],
}


# ------------------------------------------------------------------ the run
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    for sub in ("weights", "checkpoints", "onnx"):
        (d / sub).mkdir()
    cases = {**weights_cases(d / "weights"), **checkpoint_cases(d / "checkpoints")}
    try:
        cases.update(onnx_cases(d / "onnx"))
    except pytest.skip.Exception:
        pass
    # Controls: valid files load in the same capped child.
    cases["weights_fixture_control"] = ("weights", os.path.join(FIXTURES, "modern.npz"))
    cases["safetensors_fixture_control"] = ("weights", os.path.join(FIXTURES, "modern.safetensors"))
    cases["allocate_64_mib"] = ("allocate", 64 << 20)
    cases["allocate_1_gib"] = ("allocate", 1 << 30)
    out = run_cases([{"id": k, "loader": loader, "path": p} for k, (loader, p) in cases.items()])
    return {k: (out[k], cases[k][1]) for k in out}


@pytest.mark.parametrize("case", sorted(WEIGHT_NEEDLES))
def test_weights_refused(results, case):
    result, path = results[case]
    assert_refused(result, [WEIGHTS], str(path), *WEIGHT_NEEDLES[case])


@pytest.mark.parametrize("case", sorted(CHECKPOINT_NEEDLES))
def test_checkpoint_refused(results, case):
    result, path = results[case]
    assert_refused(result, [CHECKPOINT], str(path), *CHECKPOINT_NEEDLES[case])


@pytest.mark.parametrize("case", sorted(ONNX_NEEDLES))
def test_onnx_refused(results, case):
    if case not in results:
        pytest.skip("needs the onnx package")
    result, path = results[case]
    assert_refused(result, [ONNX], str(path), *ONNX_NEEDLES[case])


@pytest.mark.parametrize("case", ["weights_fixture_control", "safetensors_fixture_control",
                                  "onnx_fixture_is_a_lenet_control"])
def test_valid_files_load_under_the_same_bounds(results, case):
    if case not in results:
        pytest.skip("needs the onnx package")
    result, _ = results[case]
    assert result["type"] is None, result
    assert result["seconds"] < 5


def test_the_memory_cap_bites(results):
    """The bound is real: in the same child, 64 MiB can be allocated and 1 GiB cannot."""
    assert results["allocate_64_mib"][0]["type"] is None
    assert results["allocate_1_gib"][0]["memoryerror"], results["allocate_1_gib"][0]
