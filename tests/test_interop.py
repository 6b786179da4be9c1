"""Weights from and for PyTorch (cydnn.interop), without torch.

The fixtures in tests/fixtures/pytorch_lenet/ were written by PyTorch itself
(tools/make_interop_fixtures.py): a LeNet-5's state_dict as .npz, .safetensors,
a folder of .txt and one of .bin, and its ONNX export, with torch's logits for
8 inputs.  Tests that need the optional packages skip without them.
"""
import os
import zipfile

import numpy as np
import pytest

import cydnn
from cydnn import interop, models, nn, ops
from cydnn.interop import WeightsError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "pytorch_lenet")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FORMS = ["modern.npz", "modern.safetensors", "modern_txt", "modern_bin"]


def fixture(name):
    return os.path.join(FIXTURES, name)


@pytest.fixture(scope="module")
def expected():
    with np.load(fixture("expected.npz")) as f:
        return dict(f)


def logits(model, inputs):
    model.eval()
    backend = ops.backend(model.device)
    return backend.to_numpy(model(backend.asarray(inputs)))


def same_state(a, b):
    """Equal state dicts; ``a`` and ``b`` are modules or state dicts."""
    sa, sb = (x if isinstance(x, dict) else x.state_dict() for x in (a, b))
    assert list(sa) == list(sb)
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


def torch_state(classic=False):
    with np.load(fixture("classic.npz" if classic else "modern.npz")) as f:
        return dict(f)


def write_npz(path, arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


# ------------------------------------------------------ import: every form
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
def test_each_form_reproduces_torch_logits(expected, form, device):
    if form.endswith(".safetensors"):
        pytest.importorskip("safetensors")
    model = models.LeNet5(seed=7).to(device)
    assert cydnn.load_pytorch_weights(model, fixture(form)) is model
    assert model.device == device
    np.testing.assert_allclose(logits(model, expected["inputs_modern"]), expected["logits_modern"],
                               rtol=0, atol=1e-4)
    # predict (cydnn's preprocessing of the raw images) gives torch's softmax
    np.testing.assert_allclose(model.predict(expected["images"]),
                               ops.cpu.softmax(expected["logits_modern"].astype(np.float64)), rtol=0, atol=1e-5)


def test_all_forms_load_the_same_values():
    models_ = []
    for form in FORMS:
        if form.endswith(".safetensors") and not _has("safetensors"):
            continue
        models_.append(cydnn.load_pytorch_weights(models.LeNet5(seed=1), fixture(form)))
    for other in models_[1:]:
        same_state(models_[0], other)


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def test_classic_npz(expected):
    model = cydnn.load_pytorch_weights(models.LeNet5(classic=True, seed=1), fixture("classic.npz"))
    np.testing.assert_allclose(logits(model, expected["inputs_classic"]), expected["logits_classic"],
                               rtol=0, atol=1e-4)


def test_float64_model_and_float64_file(tmp_path):
    state = {k: v.astype(np.float64) for k, v in torch_state().items()}
    model = cydnn.load_pytorch_weights(models.LeNet5().double(), write_npz(tmp_path / "w.npz", state))
    assert model.dtype == np.float64
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], state["fc1.weight"])


def test_nan_loads_as_is(tmp_path):
    state = torch_state()
    state["fc3.bias"][0] = np.nan
    model = cydnn.load_pytorch_weights(models.LeNet5(), write_npz(tmp_path / "w.npz", state))
    assert np.isnan(model.state_dict()["fc3.bias"][0])


def test_not_strict_allows_missing_and_extra(tmp_path):
    state = torch_state()
    del state["fc3.bias"]
    state["extra.weight"] = np.zeros(3, np.float32)
    model = models.LeNet5(seed=4)
    before = model.state_dict()["fc3.bias"]
    cydnn.load_pytorch_weights(model, write_npz(tmp_path / "w.npz", state), strict=False)
    np.testing.assert_array_equal(model.state_dict()["fc3.bias"], before)
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], state["fc1.weight"])


# ----------------------------------------------------- import: bad weights
def check_refused(model, path, *needles):
    before = model.state_dict()
    with pytest.raises(WeightsError) as info:
        cydnn.load_pytorch_weights(model, path)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    same_state(model, before)          # nothing changed
    return info.value


def test_wrong_shape_names_parameter_and_both_shapes(tmp_path):
    state = torch_state(classic=True)          # fc1 is (120, 400), modern wants (120, 256)
    check_refused(models.LeNet5(), write_npz(tmp_path / "w.npz", state),
                  "'fc1.weight'", "(120, 256)", "(120, 400)")


def test_missing_and_unexpected_are_listed(tmp_path):
    state = torch_state()
    del state["fc3.bias"], state["conv1.weight"]
    state["fc4.weight"] = np.zeros((2, 2), np.float32)
    check_refused(models.LeNet5(), write_npz(tmp_path / "w.npz", state),
                  "missing parameters ['conv1.weight', 'fc3.bias']", "unexpected parameters ['fc4.weight']")


def test_num_classes_mismatch(tmp_path):
    check_refused(models.LeNet5(num_classes=5), fixture("modern.npz"), "'fc3.weight'", "(5, 84)", "(10, 84)")


@pytest.mark.parametrize("dtype,word", [(np.complex64, "complex"), ("U3", "<U3"), (np.bool_, "bool")])
def test_wrong_dtype_is_refused(tmp_path, dtype, word):
    state = torch_state()
    state["conv1.bias"] = np.zeros(6, dtype=dtype)
    check_refused(models.LeNet5(), write_npz(tmp_path / "w.npz", state), "'conv1.bias'", word)


def test_object_array_is_never_unpickled(tmp_path):
    state = torch_state()
    state["conv1.bias"] = np.array([object()] * 6, dtype=object)
    check_refused(models.LeNet5(), write_npz(tmp_path / "w.npz", state), "'conv1.bias'", "object")


def test_torch_save_file_is_refused_with_a_hint(tmp_path):
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as z:       # the layout of a torch.save archive
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("archive/data/0", b"\0" * 16)
    check_refused(models.LeNet5(), path, "torch.save", "np.savez")


def test_not_a_weights_file(tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"hello world, not weights")
    check_refused(models.LeNet5(), tmp_path / "junk.bin", "neither an .npz")
    with pytest.raises(FileNotFoundError):
        cydnn.load_pytorch_weights(models.LeNet5(), tmp_path / "missing.npz")


def copy_folder(src, dst):
    os.makedirs(dst)
    for entry in os.listdir(src):
        with open(os.path.join(src, entry), "rb") as f, open(os.path.join(dst, entry), "wb") as g:
            g.write(f.read())
    return dst


def test_truncated_bin(tmp_path):
    folder = copy_folder(fixture("modern_bin"), tmp_path / "w")
    data = (folder / "fc2.weight.bin").read_bytes()
    (folder / "fc2.weight.bin").write_bytes(data[:-10])
    check_refused(models.LeNet5(), folder, "'fc2.weight'", "(84, 120)", "40320 bytes", "40310 bytes", "truncated")


def test_bad_txt(tmp_path):
    folder = copy_folder(fixture("modern_txt"), tmp_path / "w")
    (folder / "conv2.bias.txt").write_text("0.1\nzero point two\n")
    check_refused(models.LeNet5(), folder, "'conv2.bias'", "not a text file of numbers")


def test_txt_with_wrong_count_and_empty(tmp_path):
    folder = copy_folder(fixture("modern_txt"), tmp_path / "w")
    np.savetxt(folder / "conv1.bias.txt", np.zeros(5))
    check_refused(models.LeNet5(), folder, "'conv1.bias'", "(6,)", "6 values", "got 5 values")
    (folder / "conv1.bias.txt").write_text("")
    check_refused(models.LeNet5(), folder, "'conv1.bias'", "got 0 values")


def test_folder_missing_extra_and_duplicate(tmp_path):
    folder = copy_folder(fixture("modern_bin"), tmp_path / "w")
    os.unlink(folder / "fc1.bias.bin")
    (folder / "fc9.weight.bin").write_bytes(b"\0" * 8)
    (folder / "README.md").write_text("ignored")
    check_refused(models.LeNet5(), folder, "missing parameters ['fc1.bias']", "unexpected parameters ['fc9.weight']")
    os.unlink(folder / "fc9.weight.bin")
    np.savetxt(folder / "fc1.bias.txt", np.zeros(120))
    (folder / "fc1.bias.bin").write_bytes(b"\0" * 480)
    check_refused(models.LeNet5(), folder, "'fc1.bias'", "twice")


def test_corrupt_safetensors(tmp_path):
    pytest.importorskip("safetensors")
    data = open(fixture("modern.safetensors"), "rb").read()
    (tmp_path / "w.safetensors").write_bytes(data[:len(data) // 2])
    check_refused(models.LeNet5(), tmp_path / "w.safetensors", "cannot read it as .safetensors")


def test_missing_safetensors_package_is_named(monkeypatch, tmp_path, expected):
    # Reading uses cydnn's own checked header parser (no package needed); writing needs it.
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)
    monkeypatch.setitem(__import__("sys").modules, "safetensors.numpy", None)
    model = cydnn.load_pytorch_weights(models.LeNet5(), fixture("modern.safetensors"))
    np.testing.assert_allclose(logits(model, expected["inputs_modern"]), expected["logits_modern"],
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ImportError, match=r"cydnn\[safetensors\]"):
        cydnn.export_weights(models.LeNet5(), tmp_path / "w.safetensors", format="safetensors")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- export
@pytest.mark.parametrize("fmt", interop.FORMATS)
@pytest.mark.parametrize("classic", [False, True], ids=["modern", "classic"])
def test_export_reimport_is_exact(tmp_path, fmt, classic):
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    model = models.LeNet5(classic=classic, seed=3)
    path = tmp_path / f"w.{fmt}"
    assert cydnn.export_weights(model, path, format=fmt) == str(path)
    assert os.listdir(tmp_path) == [f"w.{fmt}"]                  # no temporary left beside it
    same_state(cydnn.load_pytorch_weights(models.LeNet5(classic=classic, seed=9), path), model)
    # again over the first export: replaced, not merged
    other = models.LeNet5(classic=classic, seed=4)
    cydnn.export_weights(other, path, format=fmt)
    assert os.listdir(tmp_path) == [f"w.{fmt}"]
    same_state(cydnn.load_pytorch_weights(models.LeNet5(classic=classic), path), other)


def test_export_matches_torch_layout(tmp_path):
    """What cydnn writes is what PyTorch wrote: same names, shapes and float32 values."""
    model = cydnn.load_pytorch_weights(models.LeNet5(), fixture("modern.npz"))
    cydnn.export_weights(model, tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as ours, np.load(fixture("modern.npz")) as theirs:
        assert sorted(ours.files) == sorted(theirs.files)
        for k in theirs.files:
            assert ours[k].dtype == np.float32
            np.testing.assert_array_equal(ours[k], theirs[k])
    cydnn.export_weights(model, tmp_path / "bin", format="bin")
    for entry in os.listdir(fixture("modern_bin")):
        assert (tmp_path / "bin" / entry).read_bytes() == open(fixture("modern_bin/" + entry), "rb").read()
    cydnn.export_weights(model, tmp_path / "txt", format="txt")
    assert sorted(os.listdir(tmp_path / "txt")) == sorted(os.listdir(fixture("modern_txt")))


def test_export_float64_model_writes_float32(tmp_path):
    model = models.LeNet5(seed=2).double()
    interop.export_weights(model, tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as f:
        assert {f[k].dtype for k in f.files} == {np.dtype(np.float32)}


def test_export_plain_module(tmp_path):
    seq = nn.Sequential(nn.Linear(3, 2, rng=0), nn.ReLU())
    cydnn.export_weights(seq, tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as f:
        assert sorted(f.files) == ["0.bias", "0.weight"]


def test_export_failure_keeps_the_old_file(tmp_path, monkeypatch):
    model = models.LeNet5(seed=1)
    path = tmp_path / "w.npz"
    cydnn.export_weights(model, path)
    old = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        cydnn.export_weights(models.LeNet5(seed=2), path)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["w.npz"]


def test_export_folder_failure_keeps_the_old_folder(tmp_path, monkeypatch):
    model = models.LeNet5(seed=1)
    cydnn.export_weights(model, tmp_path / "w", format="txt")
    before = sorted(os.listdir(tmp_path / "w"))
    monkeypatch.setattr(np, "savetxt", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        cydnn.export_weights(models.LeNet5(seed=2), tmp_path / "w", format="txt")
    assert os.listdir(tmp_path) == ["w"] and sorted(os.listdir(tmp_path / "w")) == before
    same_state(cydnn.load_pytorch_weights(models.LeNet5(), tmp_path / "w"), model)


def test_export_refuses_to_replace_a_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("keep me")
    with pytest.raises(FileExistsError, match="other than"):
        cydnn.export_weights(models.LeNet5(), tmp_path / "mine", format="bin")
    assert os.listdir(tmp_path / "mine") == ["notes.md"]
    assert sorted(os.listdir(tmp_path)) == ["mine"]
    os.symlink(tmp_path / "mine", tmp_path / "link")
    with pytest.raises(FileExistsError, match="is a link"):
        cydnn.export_weights(models.LeNet5(), tmp_path / "link", format="txt")
    assert sorted(os.listdir(tmp_path)) == ["link", "mine"]
    with pytest.raises(ValueError, match="unknown format"):
        cydnn.export_weights(models.LeNet5(), tmp_path / "x", format="pt")


@pytest.mark.parametrize("fmt", ["npz", "safetensors", "txt"])
def test_exported_batch_counters_stay_exact_above_2_to_the_24(tmp_path, fmt):
    """num_batches_tracked is int64 in PyTorch; exported as float32 it rounded 2**24 + 1 to 2**24."""
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    model = models.SmallCNN(widths=(4, 8), convs_per_block=1)
    bns = [m for m in model.modules() if getattr(m, "num_batches_tracked", None) is not None]
    for m in bns:
        m.num_batches_tracked = np.array(2 ** 24 + 1, np.int64)
    path = cydnn.export_weights(model, tmp_path / f"w.{fmt}", format=fmt)
    fresh = models.SmallCNN(widths=(4, 8), convs_per_block=1)
    cydnn.load_pytorch_weights(fresh, path)
    counters = [int(m.num_batches_tracked) for m in fresh.modules() if getattr(m, "num_batches_tracked", None) is not None]
    assert counters == [2 ** 24 + 1] * len(bns) and bns
