"""Tests of cydnn.serialization: round trips, atomic writes, and every kind of bad file."""
import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest

import cydnn
from cydnn import models, serialization
from cydnn.serialization import CheckpointError


# "cuda" runs only where tests/conftest.py finds a usable GPU; elsewhere it is
# skipped with the reason (every test marked gpu is).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def digits(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 28, 28)).astype(np.uint8)


def write_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def valid_entries(model=None):
    """The arrays of a good checkpoint, to break one at a time."""
    model = model or models.LeNet5(seed=0)
    entries = {"format_version": np.array(serialization.FORMAT_VERSION),
               "config": np.array(json.dumps(model.config())),
               "metadata": np.array(json.dumps({"note": "handmade"}))}
    entries.update({"param/" + k: v for k, v in model.state_dict().items()})
    return entries


def only_file(directory):
    return sorted(os.listdir(directory))


# ------------------------------------------------------------- round trip
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("classic", [False, True], ids=["modern", "classic"])
def test_round_trip_gives_identical_state_and_predictions(tmp_path, device, classic):
    model = models.LeNet5(classic=classic, num_classes=10, seed=3, mean=0.2, std=0.4)
    path = tmp_path / "lenet.ckpt"
    assert cydnn.save(model, path, metadata={"accuracy": np.float32(0.9875), "epochs": np.int64(3)}) == str(path)
    assert only_file(tmp_path) == ["lenet.ckpt"]           # exactly this name; no .npz added, no temp left

    loaded = serialization.load(path, device=device)
    assert isinstance(loaded, models.LeNet5) and loaded.device == device
    assert loaded.config() == model.config()
    assert (loaded.mean, loaded.std, loaded.input_pad) == (0.2, 0.4, 2 if classic else 0)
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    images = digits(6)
    if device == "cpu":
        np.testing.assert_array_equal(loaded.predict(images), model.predict(images))
    else:
        np.testing.assert_allclose(loaded.predict(images), model.predict(images), rtol=1e-4, atol=1e-6)


def test_trained_weights_survive_not_the_seed(tmp_path):
    """The file holds the weights themselves: a changed weight comes back, not the seed's."""
    model = models.LeNet5(seed=0)
    model.fc3.bias.data[:] = np.arange(10, dtype=np.float32)
    cydnn.save(model, tmp_path / "m.npz")
    np.testing.assert_array_equal(serialization.load(tmp_path / "m.npz").fc3.bias.data, np.arange(10))


def test_float64_model_is_saved_as_float32(tmp_path):
    model = models.LeNet5(seed=0).double()
    cydnn.save(model, tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz", allow_pickle=False) as npz:
        assert all(npz[k].dtype == np.float32 for k in npz.files if k.startswith("param/"))
    assert serialization.load(tmp_path / "m.npz").dtype == np.float32


def test_metadata(tmp_path):
    cydnn.save(models.LeNet5(), tmp_path / "m.npz", metadata={"accuracy": 0.99, "epochs": 5, "tags": ["a"]})
    meta = serialization.load_metadata(tmp_path / "m.npz")
    assert meta["accuracy"] == 0.99 and meta["epochs"] == 5 and meta["tags"] == ["a"]
    assert "cydnn_version" in meta and meta["created"][:2] == "20"
    cydnn.save(models.LeNet5(), tmp_path / "n.npz")
    assert set(serialization.load_metadata(tmp_path / "n.npz")) == {"cydnn_version", "created"}


def test_file_layout_is_plain_arrays(tmp_path):
    cydnn.save(models.LeNet5(), tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz", allow_pickle=False) as npz:
        assert set(npz.files) == {"format_version", "config", "metadata"} | {
            "param/" + k for k in models.LeNet5().state_dict()}
        assert json.loads(str(npz["config"]))["arch"] == "LeNet5"
        assert int(npz["format_version"]) == serialization.FORMAT_VERSION


# -------------------------------------------------------------- atomicity
def test_failing_write_leaves_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.npz"
    cydnn.save(models.LeNet5(seed=1), path)
    old_bytes = path.read_bytes()

    def broken_savez(file, **arrays):
        file.write(b"PK\x03\x04 half a zip")                 # something reached the disk, then:
        raise OSError("disk full")

    monkeypatch.setattr(serialization.np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        cydnn.save(models.LeNet5(seed=2), path)
    assert path.read_bytes() == old_bytes
    assert only_file(tmp_path) == ["model.npz"]


def test_failing_rename_leaves_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.npz"
    cydnn.save(models.LeNet5(seed=1), path)
    old_bytes = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(serialization.os, "replace", broken_replace)
    with pytest.raises(OSError, match="rename failed"):
        cydnn.save(models.LeNet5(seed=2), path)
    assert path.read_bytes() == old_bytes
    assert only_file(tmp_path) == ["model.npz"]


def test_unserialisable_metadata_fails_before_writing(tmp_path):
    with pytest.raises(TypeError, match="JSON"):
        cydnn.save(models.LeNet5(), tmp_path / "m.npz", metadata={"model": object()})
    assert only_file(tmp_path) == []


def test_overwrite_replaces_and_keeps_mode(tmp_path):
    path = tmp_path / "m.npz"
    cydnn.save(models.LeNet5(seed=1), path)
    os.chmod(path, 0o640)
    cydnn.save(models.LeNet5(seed=2), path)
    assert os.stat(path).st_mode & 0o777 == 0o640
    np.testing.assert_array_equal(serialization.load(path).fc3.bias.data, models.LeNet5(seed=2).fc3.bias.data)


# --------------------------------------------------------------- bad files
def test_truncated_file(tmp_path):
    path = tmp_path / "m.npz"
    cydnn.save(models.LeNet5(), path)
    data = path.read_bytes()
    for size in (len(data) // 2, len(data) - 10, 100):
        path.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            serialization.load(path)


def test_random_bytes_and_empty_file(tmp_path):
    path = tmp_path / "noise.npz"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint8).tobytes())
    with pytest.raises(CheckpointError, match="not an .npz"):
        serialization.load(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        serialization.load(path)
    np.save(tmp_path / "plain.npy", np.zeros(3))              # a .npy is not a checkpoint either
    with pytest.raises(CheckpointError, match="not an .npz"):
        serialization.load(tmp_path / "plain.npy")


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        serialization.load(tmp_path / "absent.npz")


def test_corrupted_member_is_detected(tmp_path):
    path = tmp_path / "m.npz"
    cydnn.save(models.LeNet5(), path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("param/fc1.weight.npy")
    # Flip bytes inside the stored (uncompressed) weights: the CRC check must catch it.
    start = info.header_offset + 30 + len(info.filename) + 200
    data[start:start + 8] = bytes(255 - b for b in data[start:start + 8])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fc1.weight"):
        serialization.load(path)


@pytest.mark.parametrize("drop", ["config", "format_version", "param/conv2.bias"])
def test_missing_entry(tmp_path, drop):
    entries = valid_entries()
    del entries[drop]
    write_npz(tmp_path / "m.npz", **entries)
    with pytest.raises(CheckpointError, match=drop.split("/")[-1]):
        serialization.load(tmp_path / "m.npz")


def test_missing_metadata_only_matters_to_load_metadata(tmp_path):
    entries = valid_entries()
    del entries["metadata"]
    write_npz(tmp_path / "m.npz", **entries)
    assert isinstance(serialization.load(tmp_path / "m.npz"), models.LeNet5)
    with pytest.raises(CheckpointError, match="missing entry 'metadata'"):
        serialization.load_metadata(tmp_path / "m.npz")


def test_unexpected_parameter(tmp_path):
    entries = valid_entries()
    entries["param/fc4.weight"] = np.zeros((3, 3), np.float32)
    write_npz(tmp_path / "m.npz", **entries)
    with pytest.raises(CheckpointError, match="fc4.weight"):
        serialization.load(tmp_path / "m.npz")


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    entries = valid_entries()
    entries["param/fc1.weight"] = np.zeros((120, 400), np.float32)
    write_npz(tmp_path / "m.npz", **entries)
    with pytest.raises(CheckpointError, match=r"fc1\.weight.*expected \(120, 256\).*got \(120, 400\)"):
        serialization.load(tmp_path / "m.npz")


def test_unknown_architecture_and_bad_config(tmp_path):
    entries = valid_entries()
    entries["config"] = np.array(json.dumps({"arch": "VGG16"}))
    write_npz(tmp_path / "a.npz", **entries)
    with pytest.raises(CheckpointError, match="unknown architecture 'VGG16'.*LeNet5"):
        serialization.load(tmp_path / "a.npz")
    entries["config"] = np.array(json.dumps({"arch": "LeNet5", "layers": 7}))
    write_npz(tmp_path / "b.npz", **entries)
    with pytest.raises(CheckpointError, match="cannot build LeNet5"):
        serialization.load(tmp_path / "b.npz")
    entries["config"] = np.array("{not json")
    write_npz(tmp_path / "c.npz", **entries)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        serialization.load(tmp_path / "c.npz")
    entries["config"] = np.zeros(3)
    write_npz(tmp_path / "d.npz", **entries)
    with pytest.raises(CheckpointError, match="unicode scalar"):
        serialization.load(tmp_path / "d.npz")


def test_newer_format_is_refused(tmp_path):
    entries = valid_entries()
    entries["format_version"] = np.array(serialization.FORMAT_VERSION + 1)
    write_npz(tmp_path / "m.npz", **entries)
    with pytest.raises(CheckpointError, match="newer"):
        serialization.load(tmp_path / "m.npz")


def test_non_float_parameter_is_refused(tmp_path):
    entries = valid_entries()
    entries["param/fc3.bias"] = np.array(["1"] * 10)
    write_npz(tmp_path / "m.npz", **entries)
    with pytest.raises(CheckpointError, match="fc3.bias.*dtype"):
        serialization.load(tmp_path / "m.npz")


class _Boom:
    """Unpickling this would run code; allow_pickle=False must stop it first."""

    def __reduce__(self):
        return (os.system, ("echo pickle-was-loaded > /dev/null",))


@pytest.mark.parametrize("key", ["param/fc3.bias", "config", "smuggled"])
def test_pickled_object_array_is_refused(tmp_path, key, monkeypatch):
    entries = valid_entries()
    entries[key] = np.array([_Boom(), 1], dtype=object)
    write_npz(tmp_path / "m.npz", **entries)             # np.savez pickles object arrays
    called = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: called.append(1))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: called.append(1))
    with pytest.raises(CheckpointError, match=f"{key!r} holds pickled"):
        serialization.load(tmp_path / "m.npz")
    assert called == []


def test_load_never_unpickles_nor_calls_np_load(tmp_path, monkeypatch):
    # The checkpoint reader parses each member's .npy header itself (to bound what it allocates)
    # and refuses object dtypes from the header: neither np.load nor pickle is ever reached.
    cydnn.save(models.LeNet5(), tmp_path / "m.npz")
    seen = []
    monkeypatch.setattr(serialization.np, "load", lambda *a, **k: seen.append("np.load"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: seen.append("pickle.loads"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: seen.append("pickle.load"))
    assert serialization.load(tmp_path / "m.npz").num_classes == 10
    assert "cydnn_version" in serialization.load_metadata(tmp_path / "m.npz")
    assert seen == []


def test_a_zip_that_is_not_an_npz(tmp_path):
    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(CheckpointError, match="not a numpy array"):
        serialization.load(path)
    write_npz(path, data=np.zeros(3))
    with pytest.raises(CheckpointError, match="not a complete cydnn checkpoint: missing entry 'format_version'"):
        serialization.load(path)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)
    buf = io.BytesIO()                                   # sanity: the helper writes real npz files
    np.savez(buf, a=np.zeros(1))
    assert buf.getvalue()[:4] == b"PK\x03\x04"


def _counters(model):
    return {k: v for k, v in model.state_dict().items() if k.endswith("num_batches_tracked")}


def test_batch_counters_above_2_to_the_24_survive_a_round_trip(tmp_path):
    """Format 1 stored num_batches_tracked as float32: 2**24 + 1 came back as 2**24 (found by mutation
    testing).  Format 2 keeps integer entries as int64."""
    model = models.SmallCNN(widths=(4, 8), convs_per_block=1)
    for m in model.modules():
        if getattr(m, "num_batches_tracked", None) is not None:
            m.num_batches_tracked = np.array(2 ** 24 + 1, np.int64)
    path = cydnn.save(model, tmp_path / "bn.npz")
    with np.load(path) as npz:
        stored = {k: npz[k] for k in npz.files if k.endswith("num_batches_tracked")}
        assert int(npz["format_version"]) == 2
    assert stored and all(v.dtype == np.int64 for v in stored.values())
    loaded = serialization.load(path)
    assert all(int(v) == 2 ** 24 + 1 for v in _counters(loaded).values()) and _counters(loaded)


def test_a_format_1_checkpoint_with_float_counters_still_loads(tmp_path):
    model = models.SmallCNN(widths=(4, 8), convs_per_block=1)
    path = cydnn.save(model, tmp_path / "new.npz")
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["format_version"] = np.array(1, np.int64)
    for k in arrays:
        if k.endswith("num_batches_tracked"):
            arrays[k] = np.array(7, np.float32)
    old = tmp_path / "old.npz"
    np.savez(old, **arrays)
    assert all(int(v) == 7 for v in _counters(serialization.load(old)).values())


def test_an_integer_array_where_a_weight_belongs_is_refused(tmp_path):
    model = models.SmallCNN(widths=(4, 8), convs_per_block=1)
    path = cydnn.save(model, tmp_path / "m.npz")
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    name = next(k for k in arrays if k.endswith(".weight"))
    arrays[name] = arrays[name].astype(np.int64)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    with pytest.raises(CheckpointError, match=r"parameter '.*weight' has dtype int64, expected float32"):
        serialization.load(bad)
