"""Issue 15's silent wrong results and escapes, and issue 17.4's preprocessing, in-process:
a Gemm bias broadcast as ONNX does (against onnx's reference evaluator), layer names that
would shadow Module attributes, exports that cannot write outside their folder, a full disk
during an export, configs with lists, and normalize= on both importers."""
import errno
import os
import re
from collections import OrderedDict

import numpy as np
import pytest

import cydnn
from cydnn import interop, models, nn, ops, serialization
from cydnn.checkpoint_checks import check_config
from cydnn.interop import WeightsError
from cydnn.serialization import CheckpointError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "pytorch_lenet")


def run(model, x):
    model.eval()
    return ops.backend(model.device).to_numpy(model(np.ascontiguousarray(x, dtype=np.float32)))


# ------------------------------------------------------------ Gemm's C
def gemm_file(tmp_path, c, batch, name="g.onnx"):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 5)).astype(np.float32)          # B, (K=3, N=5): transB=0
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="fc", alpha=0.5, beta=2.0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(c.astype(np.float32), "c")])
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def reference(path, x):
    from onnx.reference import ReferenceEvaluator
    return ReferenceEvaluator(path).run(None, {"x": x})[0]


@pytest.mark.parametrize("shape", [(), (1,), (5,), (1, 1), (1, 5)])
def test_gemm_bias_shapes_that_are_one_bias_per_output_match_the_reference(tmp_path, shape):
    c = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    path = gemm_file(tmp_path, c, batch=5)
    x = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(run(cydnn.load_onnx(path), x), reference(path, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 1), (5, 5)])
def test_gemm_bias_per_batch_row_is_refused_not_misread(tmp_path, shape):
    """C of shape (M, 1) adds C[m] to row m (ONNX unidirectional broadcasting); with M = N = 5 the old
    importer took it as a per-output bias. The reference shows that reading is wrong; cydnn refuses."""
    c = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * 10
    path = gemm_file(tmp_path, c, batch=5)
    x = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    if shape == (5, 1):
        per_output = 0.5 * x @ w + 2.0 * c.reshape(5)            # the old reading: one value per column
        assert np.abs(reference(path, x) - per_output).max() > 1
        np.testing.assert_allclose(reference(path, x), 0.5 * x @ w + 2.0 * c, rtol=1e-5)   # per row
    with pytest.raises(cydnn.onnx_import.OnnxImportError,
                       match=rf"node 0 \('fc', Gemm\).*{re.escape(str(shape))}.*batch row"):
        cydnn.load_onnx(path)


@pytest.mark.parametrize("shape", [(5, 1), (2, 5), (1, 1, 5)])
def test_matmul_add_bias_of_other_shapes_is_refused(tmp_path, shape):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"), helper.make_node("Add", ["m", "b"], ["y"], name="add")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.ones((3, 5), np.float32), "w"),
                     numpy_helper.from_array(np.ones(shape, np.float32), "b")])
    path = str(tmp_path / "mm.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(cydnn.onnx_import.OnnxImportError, match=r"node 1 \('add', Add\).*one bias per output"):
        cydnn.load_onnx(path)


# ---------------------------------------------------------------- names
@pytest.mark.parametrize("name", ["training", "forward", "_modules", "_parameters", "eval", "to", "__class__",
                                  "a..b", ".a", "a.", "", "a/b", "a\\b", "a b", "a\x00b", "é", "x" * 600,
                                  ".".join(["a"] * 40)])
def test_check_name_refuses(name):
    from cydnn._names import check_name
    with pytest.raises(WeightsError, match="f.npz"):
        check_name(name, WeightsError, "f.npz")


@pytest.mark.parametrize("name", ["conv1.weight", "0.bias", "features.10.weight", "_orig_mod.fc.bias",
                                  "bn.running_mean", "layer1.0.conv2.weight"])
def test_check_name_accepts_pytorch_names(name):
    from cydnn._names import check_name
    assert check_name(name, WeightsError, "f.npz") == name


@pytest.mark.parametrize("fmt", ["txt", "bin", "npz", "safetensors"])
@pytest.mark.parametrize("bad", ["../../x", "/tmp/abs", "training"])
def test_export_never_writes_outside_its_folder(tmp_path, fmt, bad):
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    module = nn.Sequential(OrderedDict([(bad, nn.Linear(2, 3, rng=0))]))
    target = tmp_path / "out" / "weights"
    target.parent.mkdir()
    before = set(tmp_path.rglob("*"))
    with pytest.raises(WeightsError, match=r"export to .*weights"):
        cydnn.export_weights(module, target, fmt)
    assert set(tmp_path.rglob("*")) == before           # nothing written anywhere, no temporary left
    assert not os.path.exists("/tmp/abs.weight.txt")


@pytest.mark.parametrize("fmt", interop.FORMATS)
def test_full_disk_during_export_is_an_oserror_naming_the_path(tmp_path, fmt, monkeypatch):
    """write(2) failing with ENOSPC (no file name in the OSError) becomes OSError(ENOSPC, ..., path);
    nothing partial is left, the old file stays."""
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    target = tmp_path / "w"
    cydnn.export_weights(models.LeNet5(seed=1), target, fmt)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FullFile(f) if "w" in mode or "x" in mode else f

    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(OSError) as info:
        cydnn.export_weights(models.LeNet5(seed=2), target, fmt)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target), info.value
    assert type(info.value) is OSError                  # not SafetensorError, not a WeightsError
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    same = cydnn.load_pytorch_weights(models.LeNet5(seed=3), target)
    np.testing.assert_array_equal(same.fc3.bias.data, models.LeNet5(seed=1).fc3.bias.data)


# --------------------------------------------------------------- configs
class _ListModels:
    """A stand-in for the models registry with list-taking architectures (MLP, SmallCNN) as the
    models package will have them."""

    class MLP:
        def __init__(self, sizes=None, num_classes=10, seed=0, mean=0.0, std=1.0):
            pass

    class SmallCNN:
        def __init__(self, widths=(32, 64, 128), batchnorm=True, num_classes=10, seed=0):
            pass

    ARCHITECTURES = {"MLP": MLP, "SmallCNN": SmallCNN}


def test_real_zoo_configs_with_lists_and_per_channel_statistics():
    for config in ({"arch": "MLP", "sizes": [784, 128, 10]},
                   {"arch": "MLP", "mean": [0.1, 0.2, 0.3], "std": [0.3, 0.2, 0.1]},
                   {"arch": "SmallCNN", "widths": [32, 64, 128], "in_channels": 3, "input_size": 32}):
        if config["arch"] in models.ARCHITECTURES:
            check_config(config, "c.npz", models)
    for config, match in (({"arch": "MLP", "std": [0.3, 0.0]}, "must be > 0"),
                          ({"arch": "MLP", "mean": [0.1, float("inf")]}, "finite number"),
                          ({"arch": "MLP", "mean": []}, "finite number"),
                          ({"arch": "MLP", "mean": [[0.1]]}, "finite number")):
        if config["arch"] in models.ARCHITECTURES:
            with pytest.raises(CheckpointError, match=match):
                check_config(config, "c.npz", models)


@pytest.mark.parametrize("config", [
    {"arch": "MLP", "sizes": [784, 128, 10]},
    {"arch": "SmallCNN", "widths": [32, 64, 128], "batchnorm": True, "num_classes": 10},
    {"arch": "SmallCNN", "widths": [[3, 3], [5, 5]]},
])
def test_configs_with_lists_are_accepted(config):
    check_config(config, "c.npz", _ListModels)


@pytest.mark.parametrize("config, match", [
    ({"arch": "MLP", "sizes": list(range(300))}, "list of 300 items"),
    ({"arch": "MLP", "sizes": [[[1]]]}, "nested deeper"),
    ({"arch": "MLP", "sizes": [784, {"a": [1]}]}, "nested deeper"),
    ({"arch": "MLP", "sizes": [784, {str(i): i for i in range(300)}]}, "dict of 300 items"),
    ({"arch": "MLP", "sizes": [2**40]}, "too large"),
    ({"arch": "MLP", "sizes": [float("nan")]}, "not a finite number"),
    ({"arch": "MLP", "sizes": ["x" * 1000]}, "string of 1000"),
    ({"arch": "SmallCNN", "widths": [1.5e300 * 1e300]}, "not a finite number"),
    ({"arch": {"x": 1}}, "'arch' must be a string"),
    ({"arch": None}, "'arch' must be a string"),
    (["MLP"], "JSON object"),
])
def test_configs_with_bad_lists_are_refused(config, match):
    with pytest.raises(CheckpointError, match=match):
        check_config(config, "c.npz", _ListModels)


# ------------------------------------------------------------ normalize
def test_load_pytorch_weights_normalize(tmp_path):
    path = os.path.join(FIXTURES, "modern.npz")
    model = cydnn.load_pytorch_weights(models.LeNet5(), path, normalize=(0.5, 0.25))
    assert (model.mean, model.std) == (0.5, 0.25)
    assert serialization.load(cydnn.save(model, tmp_path / "m.npz")).config()["mean"] == 0.5
    model = cydnn.load_pytorch_weights(models.LeNet5(), path, normalize=None)
    assert (model.mean, model.std) == (0.0, 1.0)
    model = cydnn.load_pytorch_weights(models.LeNet5(), path)
    assert (model.mean, model.std) == (0.1307, 0.3081)
    # What predict computes: softmax(network((pixels - mean) / std)), with the mean and std given.
    x = np.random.default_rng(0).random((3, 28, 28)).astype(np.float32)
    for normalize, (mean, std) in [((0.5, 0.25), (0.5, 0.25)), (None, (0.0, 1.0))]:
        m = cydnn.load_pytorch_weights(models.LeNet5(), path, normalize=normalize)
        want = ops.cpu.softmax(run(m, ((x - np.float32(mean)) / np.float32(std))[:, None]).astype(np.float64))
        np.testing.assert_allclose(m.predict(x), want, rtol=0, atol=1e-6)


def test_per_channel_normalize():
    model = models.SmallCNN(in_channels=3, input_size=32, widths=[4, 8, 8])
    from cydnn._normalize import apply_normalize
    apply_normalize(model, ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)), ValueError, "t")
    assert model.mean == (0.5, 0.4, 0.3) and model.std == (0.2, 0.25, 0.3)
    x = np.random.default_rng(0).random((2, 3, 32, 32)).astype(np.float32)
    want = (x - np.array([0.5, 0.4, 0.3], np.float32)[:, None, None]) / np.array([0.2, 0.25, 0.3], np.float32)[:, None, None]
    np.testing.assert_allclose(model.preprocess(x), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="takes 3 channels"):
        apply_normalize(model, ((0.5, 0.4), 1.0), ValueError, "t")
    # end to end: a state_dict loaded with per-channel statistics (CIFAR-10's)
    path = cydnn.export_weights(model, os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pc{os.getpid()}.npz"))
    try:
        fresh = models.SmallCNN(in_channels=3, input_size=32, widths=[4, 8, 8], seed=9)
        cydnn.load_pytorch_weights(fresh, path, normalize=((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)))
        assert fresh.mean == (0.4914, 0.4822, 0.4465) and fresh.config()["std"] == [0.247, 0.243, 0.261]
    finally:
        os.unlink(path)
    with pytest.raises(ValueError, match="> 0"):
        apply_normalize(model, (0.5, (1.0, 0.0, 1.0)), ValueError, "t")


@pytest.mark.parametrize("bad", [(0.0, 0.0), (float("nan"), 1.0), (1.0,), "ab", 3, ([], 1.0), (0.1, [1.0, [2.0]])])
def test_bad_normalize_is_refused_before_anything_changes(bad):
    model = models.LeNet5(seed=5)
    before = model.state_dict()
    with pytest.raises(WeightsError, match="normalize"):
        cydnn.load_pytorch_weights(model, os.path.join(FIXTURES, "modern.npz"), normalize=bad)
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], before["fc1.weight"])
    with pytest.raises(WeightsError, match="takes its input as it is"):
        cydnn.load_pytorch_weights(nn.Sequential(nn.Linear(2, 3)), os.path.join(FIXTURES, "modern.npz"),
                                   strict=False, normalize=(0, 1))


def test_load_onnx_normalize(expected_onnx=os.path.join(FIXTURES, "modern.onnx")):
    pytest.importorskip("onnx")
    assert (cydnn.load_onnx(expected_onnx).mean, cydnn.load_onnx(expected_onnx).std) == (0.1307, 0.3081)
    model = cydnn.load_onnx(expected_onnx, normalize=None)
    assert (model.mean, model.std) == (0.0, 1.0)
    with np.load(os.path.join(FIXTURES, "expected.npz")) as f:
        images, inputs = f["images"], f["inputs_modern"]
    # normalize=None: the network's input is the image as it is; the default: MNIST's normalisation,
    # which is what the exporter's inputs were.
    np.testing.assert_array_equal(model.preprocess(images), images[:, None].astype(np.float32))
    np.testing.assert_allclose(cydnn.load_onnx(expected_onnx).preprocess(images), inputs, rtol=0, atol=1e-6)
    assert cydnn.load_onnx(expected_onnx, normalize=(0.5, 0.5)).mean == 0.5
    with pytest.raises(ValueError, match="normalize"):
        cydnn.load_onnx(expected_onnx, lenet=False, normalize=(0.5, 0.5))
    assert type(cydnn.load_onnx(expected_onnx, lenet=False, normalize=None)) is nn.Sequential


def test_each_loader_names_what_a_wrong_file_looks_like(tmp_path):
    """Given another loader's file, each loader says what the file is and which function loads it."""
    ckpt = cydnn.save(models.LeNet5(), tmp_path / "m.npz")
    with pytest.raises(cydnn.onnx_import.OnnxImportError, match="load_pytorch_weights"):
        cydnn.load_onnx(os.path.join(FIXTURES, "modern.safetensors"))
    (tmp_path / "legacy.pt").write_bytes(b"\x80\x02}q\x00.")         # a protocol-2 pickle
    with pytest.raises(WeightsError, match="pickle.*never unpickles"):
        cydnn.load_pytorch_weights(models.LeNet5(), tmp_path / "legacy.pt")
    with pytest.raises(WeightsError, match="load_onnx"):
        cydnn.load_pytorch_weights(models.LeNet5(), os.path.join(FIXTURES, "modern.onnx"))
    with pytest.raises(CheckpointError, match="pickle.*never unpickles"):
        cydnn.load(tmp_path / "legacy.pt")
    assert cydnn.load(ckpt).num_classes == 10
