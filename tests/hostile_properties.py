"""Property-based hostile files, one family per reader (run by test_hostile_properties.py in a
child process whose address space is capped at its size after the imports + 512 MiB; each
example has a 5 s deadline).

Each strategy builds a valid file, then corrupts, truncates, duplicates, inflates or renames
parts of it.  The property, for every reader: the load either succeeds with exactly the values
written (bit for bit), or raises the package's own error naming the file.  Anything else -- a
MemoryError under the cap, a RecursionError, a raw ValueError, a SafetensorError, a hang -- fails.
"""
import io
import json
import os
import resource
import tempfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cydnn import interop, models, serialization
from cydnn.interop import WeightsError
from cydnn.serialization import CheckpointError
from hostilekit import deflate_bomb, npy, npy_header, safetensors_bytes, write_zip

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from cydnn.onnx_import import OnnxImportError, load_onnx  # noqa: E402


def _cap():
    """Cap the address space at what this process uses now + HOSTILE_CAP_MIB (set by the driver)."""
    extra = os.environ.get("HOSTILE_CAP_MIB")
    if not extra:
        return
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + int(extra) * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))


models.LeNet5()             # what a first model costs, before the cap
_cap()

EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=5000, derandomize=not os.environ.get("HOSTILE_RANDOM"), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STATE = {k: v.astype(np.float32) for k, v in models.LeNet5(seed=3).state_dict().items()}
NAMES = sorted(STATE)

# -------------------------------------------------------------- mutations
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=40),
                  st.sampled_from(["../../x.weight", "/abs.weight", "training", "forward", "_modules",
                                   "a..b", "fc1.weight/", "fc1\x00.weight", "fc1.weight.npy", ""]))
shapes = st.lists(st.integers(0, 1 << 40), max_size=4).map(tuple)
dtypes = st.sampled_from(["<f4", "<f8", ">f4", "<i8", "<i4", "|u1", "<c8", "|b1", "<U8", "|V16", "|O"])


def member_edits():
    """A list of edits to the members (name, bytes) of an archive."""
    edit = st.one_of(
        st.tuples(st.just("duplicate"), st.integers(0, 100)),
        st.tuples(st.just("rename"), st.integers(0, 100), names),
        st.tuples(st.just("drop"), st.integers(0, 100)),
        st.tuples(st.just("header"), st.integers(0, 100), shapes, dtypes),
        st.tuples(st.just("inflate"), st.integers(0, 100), st.integers(1, 2047)),
        st.tuples(st.just("lie"), st.integers(0, 100), st.integers(0, (1 << 32) - 1)),
    )
    return st.lists(edit, max_size=3)


def apply_member_edits(members, edits):
    members = list(members)
    for e in edits:
        i = e[1] % len(members)
        name, data = members[i]
        if e[0] == "duplicate":
            members.append((name, data))
        elif e[0] == "rename":
            members[i] = (e[2] + ".npy", data)
        elif e[0] == "drop" and len(members) > 1:
            del members[i]
        elif e[0] == "header":
            members[i] = (name, npy_header(e[2], e[3]) + (data[128:] if isinstance(data, bytes) else b""))
        elif e[0] == "inflate":           # a small stream inflating to e[2] MiB, declared as such
            members[i] = (name, (deflate_bomb(npy_header((e[2] << 18,)), e[2]), 128 + (e[2] << 20), 0))
        elif e[0] == "lie" and isinstance(data, bytes):     # declared size != the bytes stored
            members[i] = (name, (zlib.compress(data)[2:-4], e[2], zlib.crc32(data)))
    return members


byte_edits = st.lists(st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=16)),
), max_size=2)


def apply_byte_edits(data, edits):
    data = bytearray(data)
    for e in edits:
        at = min(int(e[1] * len(data)), max(len(data) - 1, 0))
        if e[0] == "truncate":
            del data[at:]
        elif e[0] == "flip" and data:
            data[at] ^= e[2]
        elif e[0] == "insert":
            data[at:at] = e[2]
    return bytes(data)


def check_outcome(load, path, error, expected=None):
    """``load()`` returns a model whose values are exactly ``expected`` (name -> array), or raises
    ``error`` naming ``path``."""
    try:
        model = load()
    except error as e:
        assert str(path) in str(e), e
        return None
    if expected is not None:
        state = model.state_dict()
        for k, v in expected.items():
            np.testing.assert_array_equal(state[k], v.astype(np.float32), err_msg=k)
    return model


# ------------------------------------------------------------- .npz weights
@SETTINGS
@given(edits=member_edits(), raw=byte_edits)
def test_npz_weights(edits, raw):
    members = apply_member_edits([(k + ".npy", npy(v)) for k, v in STATE.items()], edits)
    with tempfile.TemporaryDirectory() as d:
        path = write_zip(os.path.join(d, "w.npz"), members)
        with open(path, "rb") as f:
            data = apply_byte_edits(f.read(), raw)
        with open(path, "wb") as f:
            f.write(data)
        model = check_outcome(lambda: interop.load_pytorch_weights(models.LeNet5(), path), path, WeightsError,
                              STATE if not edits and not raw else None)
    if model is not None and not raw:
        check_members_loaded(model, members, prefix="")


def check_members_loaded(model, members, prefix):
    """A load that succeeded took each parameter from its one member, exactly as that member reads."""
    keys = [n[:-4] if n.endswith(".npy") else n for n, _ in members]
    assert len(keys) == len(set(keys)), f"accepted a duplicate member: {keys}"
    state = model.state_dict()
    for key, (_, data) in zip(keys, members):
        name = key[len(prefix):]
        if key.startswith(prefix) and name in state:
            if isinstance(data, tuple):         # a deflated member: what zipfile gives, its declared size
                data = zlib.decompressobj(-15).decompress(data[0], data[1])
            value = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
            np.testing.assert_array_equal(state[name], value.astype(np.float32), err_msg=name)


def test_npz_weights_valid_is_bit_exact():
    with tempfile.TemporaryDirectory() as d:
        path = write_zip(os.path.join(d, "w.npz"), [(k + ".npy", npy(v)) for k, v in STATE.items()])
        assert check_outcome(lambda: interop.load_pytorch_weights(models.LeNet5(), path), path, WeightsError,
                             STATE) is not None


# ------------------------------------------------------------ safetensors
def safetensors_file(state):
    header, data, offset = {}, b"", 0
    for k, v in state.items():
        raw = np.ascontiguousarray(v, "<f4").tobytes()
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    return header, data


header_edits = st.lists(st.one_of(
    st.tuples(st.just("rename"), st.integers(0, 100), names),
    st.tuples(st.just("duplicate"), st.integers(0, 100)),
    st.tuples(st.just("shape"), st.integers(0, 100), st.lists(st.integers(-2, 1 << 40), max_size=4)),
    st.tuples(st.just("dtype"), st.integers(0, 100), st.sampled_from(["F32", "F64", "BF16", "I64", "U8", "X", 3])),
    st.tuples(st.just("offsets"), st.integers(0, 100), st.lists(st.integers(-5, 1 << 45), max_size=3)),
    st.tuples(st.just("deep"), st.integers(1, 50_000)),
), max_size=3)


@SETTINGS
@given(edits=header_edits, raw=byte_edits, length=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)))
def test_safetensors_weights(edits, raw, length):
    header, data = safetensors_file(STATE)
    items = [[k, v] for k, v in header.items()]
    deep = None
    for e in edits:
        if e[0] == "deep":
            deep = e[1]
            continue
        item = items[e[1] % len(items)]
        if e[0] == "rename":
            item[0] = e[2]
        elif e[0] == "duplicate":
            items.append([item[0], dict(item[1])])
        elif e[0] in ("shape", "dtype", "offsets"):
            item[1] = dict(item[1], **{{"shape": "shape", "dtype": "dtype", "offsets": "data_offsets"}[e[0]]: e[2]})
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items) + "}"
    if deep:
        text = text[:-1] + ', "__metadata__": ' + "[" * deep + "]" * deep + "}"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.safetensors")
        with open(path, "wb") as f:
            f.write(apply_byte_edits(safetensors_bytes(text, data, length), raw))
        intact = not edits and not raw and length is None
        model = check_outcome(lambda: interop.load_pytorch_weights(models.LeNet5(), path), path, WeightsError,
                              STATE if intact else None)
    if model is not None and not raw:
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), f"accepted a name given twice: {keys}"


# ---------------------------------------------------------------- folders
@SETTINGS
@given(files=st.lists(st.tuples(names, st.sampled_from([".txt", ".bin"]),
                                st.one_of(st.binary(max_size=64), st.integers(0, 1 << 33))), max_size=4))
def test_weight_folders(files):
    with tempfile.TemporaryDirectory() as d:
        folder = os.path.join(d, "w")
        os.mkdir(folder)
        for k, v in STATE.items():
            v.astype("<f4").tofile(os.path.join(folder, k + ".bin"))
        for name, ext, content in files:
            if not name or "/" in name or "\x00" in name or name in (".", ".."):
                continue                # not a file name the file system takes
            file = os.path.join(folder, name + ext)
            try:
                with open(file, "wb") as f:
                    if isinstance(content, int):
                        f.truncate(content)         # sparse: a huge file that costs no disk
                    else:
                        f.write(content)
            except OSError:
                continue
        check_outcome(lambda: interop.load_pytorch_weights(models.LeNet5(), folder), folder, WeightsError,
                      STATE if not files else None)


# ------------------------------------------------------------ checkpoints
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=20)
configs = st.one_of(
    st.fixed_dictionaries({"arch": st.one_of(st.just("LeNet5"), json_values)},
                          optional={"classic": json_values, "num_classes": json_values, "seed": json_values,
                                    "mean": json_values, "std": json_values, "extra": json_values}),
    json_values,
    st.integers(1, 100_000).map(lambda n: '{"arch": "LeNet5", "x": ' + "[" * n + "]" * n + "}"),
)


@SETTINGS
@given(edits=member_edits(), raw=byte_edits, config=st.one_of(st.none(), configs))
def test_checkpoints(edits, raw, config):
    model = models.LeNet5(seed=3)
    cfg = model.config() if config is None else config
    members = [("format_version.npy", npy(np.array(serialization.FORMAT_VERSION, np.int64))),
               ("config.npy", npy(np.array(cfg if isinstance(cfg, str) else json.dumps(cfg)))),
               ("metadata.npy", npy(np.array(json.dumps({"note": "property"}))))]
    members += [("param/" + k + ".npy", npy(v)) for k, v in STATE.items()]
    members = apply_member_edits(members, edits)
    with tempfile.TemporaryDirectory() as d:
        path = write_zip(os.path.join(d, "c.npz"), members)
        with open(path, "rb") as f:
            data = apply_byte_edits(f.read(), raw)
        with open(path, "wb") as f:
            f.write(data)
        intact = not edits and not raw and config is None
        model = check_outcome(lambda: serialization.load(path), path, CheckpointError, STATE if intact else None)
        if model is not None and not raw:
            check_members_loaded(model, members, prefix="param/")
        try:
            serialization.load_metadata(path)
        except CheckpointError as e:
            assert path in str(e)


# ------------------------------------------------------------------- ONNX
def onnx_model(conv, gemm, names_, opset):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    fw = rng.standard_normal((4, 3 * 4 * 4)).astype(np.float32)
    inits = {names_[0]: w, "conv.bias": np.zeros(3, np.float32), names_[1]: fw,
             "fc.bias": rng.standard_normal(gemm.pop("bias_shape")).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", names_[0], "conv.bias"], ["c"], name="conv", **conv),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Flatten", ["r"], ["f"], name="flat", axis=1),
             helper.make_node("Gemm", ["f", names_[1], "fc.bias"], ["y"], name="fc", **gemm)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


small_ints = st.lists(st.integers(-2, 9), min_size=1, max_size=5)


@SETTINGS
@given(conv=st.fixed_dictionaries({}, optional={"kernel_shape": small_ints, "strides": small_ints,
                                                 "pads": small_ints, "dilations": small_ints,
                                                 "group": st.integers(-1, 3)}),
       gemm=st.fixed_dictionaries({"bias_shape": st.sampled_from([(4,), (1, 4), (4, 1), (), (1,), (5,), (2, 4)])},
                                  optional={"transB": st.integers(0, 2), "alpha": st.floats(allow_nan=True),
                                            "transA": st.integers(0, 1)}),
       names_=st.tuples(st.one_of(st.just("conv.weight"), names), st.one_of(st.just("fc.weight"), names)),
       opset=st.integers(1, 30), raw=byte_edits)
def test_onnx(conv, gemm, names_, opset, raw):
    if names_[0] == names_[1] or {"conv.bias", "fc.bias"} & set(names_):
        names_ = ("conv.weight", "fc.weight")
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], **conv}
    gemm = {"transB": 1, **gemm}
    proto = onnx_model(conv, gemm, names_, opset)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.onnx")
        with open(path, "wb") as f:
            f.write(apply_byte_edits(proto.SerializeToString(), raw))
        model = check_outcome(lambda: load_onnx(path, lenet=False), path, OnnxImportError)
        if model is None or raw:
            return
        # Loaded: it must compute what onnx's reference evaluator computes.
        from onnx.reference import ReferenceEvaluator
        x = np.random.default_rng(1).standard_normal((4, 2, 4, 4)).astype(np.float32)
        want = ReferenceEvaluator(proto).run(None, {"x": x})[0]
        model.eval()
        np.testing.assert_allclose(model(x), want, rtol=1e-4, atol=1e-4)


def test_onnx_valid_matches_reference():
    proto = onnx_model({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, {"transB": 1, "bias_shape": (4,)},
                       ("conv.weight", "fc.weight"), 17)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.onnx")
        onnx.save(proto, path)
        model = load_onnx(path, lenet=False).eval()
    from onnx.reference import ReferenceEvaluator
    x = np.random.default_rng(1).standard_normal((4, 2, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(model(x), ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_the_cap_is_on():
    if os.environ.get("HOSTILE_CAP_MIB"):
        with pytest.raises(MemoryError):
            np.ones(1 << 30, np.uint8)


