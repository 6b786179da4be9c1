"""What the checkpoint reader and writer promise, to the letter (found by mutation testing,
docs/mutation/serialization.md): every refusal of ``check_config`` and its bounded-JSON check at
its exact bound, each message naming the file and the entry, the parts of the "weights do not fit"
message, what ``save`` writes besides the weights (version, UTC time, mode), and the hints naming
what a file that is not a checkpoint looks like."""
import datetime
import importlib.metadata
import inspect
import json
import os
import re
import types

import numpy as np
import pytest

import cydnn
from cydnn import checkpoint_checks, models, serialization
from cydnn.checkpoint_checks import MAX_CLASSES, CheckpointError, check_config


def write_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def entries(model=None, **changes):
    """The arrays of a good checkpoint of ``model`` (LeNet5 by default), with ``changes`` applied
    (a value of None drops the entry)."""
    model = model or models.LeNet5(seed=0)
    out = {"format_version": np.array(serialization.FORMAT_VERSION, np.int64),
           "config": np.array(json.dumps(model.config())),
           "metadata": np.array(json.dumps({"note": "handmade"}))}
    out.update({"param/" + k: v for k, v in model.state_dict().items()})
    for key, value in changes.items():
        key = key.replace("__", "/").replace("_dot_", ".")
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


def refused(path, fn=serialization.load):
    """The message of the CheckpointError ``fn(path)`` raises."""
    with pytest.raises(CheckpointError) as info:
        fn(path)
    return str(info.value)


# ------------------------------------------------------------------ check_config, directly
def ok(config):
    assert check_config(config, "f.ckpt", models) is None


def no(config):
    with pytest.raises(CheckpointError) as info:
        check_config(config, "f.ckpt", models)
    return str(info.value)


def test_config_must_be_an_object_with_a_string_arch():
    for config in ({}, [], {"num_classes": 10}):
        assert no(config) == f"f.ckpt: 'config' must be a JSON object with an 'arch' key, got {config!r}"
    assert no({"arch": 5}) == "f.ckpt: config 'arch' must be a string naming an architecture, got int 5"


def test_self_is_not_an_argument():
    takes = ["classic", "num_classes", "seed", "mean", "std"]
    assert no({"arch": "LeNet5", "self": 1}) == (
        f"f.ckpt: cannot build LeNet5: config has arguments ['self'] that LeNet5 does not take (it takes {takes})")


def test_num_classes_bounds_are_inclusive():
    ok({"arch": "LeNet5", "num_classes": 1})
    ok({"arch": "LeNet5", "num_classes": MAX_CLASSES})
    assert no({"arch": "LeNet5", "num_classes": MAX_CLASSES + 1}).endswith("must lie in [1, 100000] (MAX_CLASSES)")


def test_integer_arguments_below_2_to_63():
    ok({"arch": "LeNet5", "seed": 2**63 - 1})
    ok({"arch": "LeNet5", "seed": 200})
    assert no({"arch": "LeNet5", "seed": 2**63}) == (
        f"f.ckpt: cannot build LeNet5: config argument seed={2**63} is too large")


def test_per_channel_numbers():
    ok({"arch": "SmallCNN", "in_channels": 3, "mean": [0.1, 0.2, 0.3], "std": [1, 2, 3]})
    ok({"arch": "LeNet5", "mean": [0.5]})                          # one channel, as a list
    ok({"arch": "LeNet5", "mean": [0.5] * checkpoint_checks.MAX_LIST_LENGTH})
    for bad in ([], [0.5] * (checkpoint_checks.MAX_LIST_LENGTH + 1), [0.5, "x"], [[0.5]]):
        assert no({"arch": "LeNet5", "mean": bad}).endswith(
            "must be a finite number (or a list of them, one per channel)")
    assert no({"arch": "LeNet5", "std": [1.0, -1.0]}).endswith("must be > 0")


def test_plain_arguments_pass_within_bounds():
    ok({"arch": "MLP", "sizes": [784, 2**31 - 1, -(2**31 - 1), 10], "activation": "x" * 256,
        "input_shape": None, "dropout": 0.5})
    ok({"arch": "MLP", "sizes": [[1, 2], [True, None, 1.5]]})        # nested twice: the limit
    ok({"arch": "MLP", "activation": {"k" * 256: [1, 2]}})
    ok({"arch": "MLP", "sizes": [0] * 256})


def test_plain_arguments_refused_past_bounds():
    where = "f.ckpt: cannot build MLP: config argument"
    assert no({"arch": "MLP", "sizes": [1, 2**31]}) == (
        f"{where} sizes=[1, 2147483648]: integer 2147483648 is too large (|v| < 2**31)")
    assert no({"arch": "MLP", "sizes": -(2**31)}).endswith("integer -2147483648 is too large (|v| < 2**31)")
    assert no({"arch": "MLP", "activation": "x" * 257}).endswith(": a string of 257 characters (at most 256)")
    assert no({"arch": "MLP", "sizes": [[[1]]]}) == f"{where} sizes=[[[1]]]: lists nested deeper than 2"
    assert no({"arch": "MLP", "sizes": [0] * 257}).endswith(": a list of 257 items (at most 256)")
    big = {str(i): i for i in range(257)}
    assert no({"arch": "MLP", "activation": big}).endswith(": a dict of 257 items (at most 256)")
    assert no({"arch": "MLP", "activation": {"a": 2**40}}).endswith(
        f": integer {2**40} is too large (|v| < 2**31)")                     # a dict's values are checked
    assert no({"arch": "MLP", "activation": {"k" * 257: 1}}).endswith(
        ": a string of 257 characters (at most 256)")                        # and its keys
    assert no({"arch": "MLP", "sizes": [1.0, float("inf")]}).endswith(": inf is not a finite number")
    assert no({"arch": "MLP", "sizes": (1, 2)}) == f"{where} sizes=(1, 2): a JSON tuple is not a valid argument"


class _Fake:
    """An architecture whose num_classes has no integer default (the generic branch)."""

    def __init__(self, num_classes, note=None):
        pass


FAKE = types.SimpleNamespace(ARCHITECTURES={"Fake": _Fake})


@pytest.mark.parametrize("value", [1, 7, MAX_CLASSES])
def test_num_classes_without_an_integer_default_accepted(value):
    assert check_config({"arch": "Fake", "num_classes": value, "note": "any"}, "f.ckpt", FAKE) is None


@pytest.mark.parametrize("value", [0, MAX_CLASSES + 1, "ten", True, 2.0])
def test_num_classes_without_an_integer_default_refused(value):
    with pytest.raises(CheckpointError) as info:
        check_config({"arch": "Fake", "num_classes": value}, "f.ckpt", FAKE)
    assert str(info.value) == (f"f.ckpt: cannot build Fake: config argument num_classes={value!r} "
                               f"must be an integer in [1, {MAX_CLASSES}] (MAX_CLASSES)")


def test_fake_architecture_matches_the_signature_rule():
    assert list(inspect.signature(_Fake.__init__).parameters)[1:] == ["num_classes", "note"]


# ------------------------------------------------------------------ messages name the file and entry
def test_config_problems_name_the_file(tmp_path):
    p = str(write_npz(tmp_path / "a.npz", **entries(config=np.array("{not json"))))
    assert refused(p).startswith(f"{p}: entry 'config': not valid JSON")
    p = str(write_npz(tmp_path / "b.npz", **entries(config=np.array(json.dumps({"arch": "LeNet5", "seed": -1})))))
    assert refused(p) == f"{p}: cannot build LeNet5: config argument seed=-1 must be >= 0"
    p = str(write_npz(tmp_path / "c.npz", **entries(config=np.array(["{}"]))))
    assert refused(p) == f"{p}: entry 'config' should be a unicode scalar (JSON), got dtype <U2, shape (1,)"


def test_model_that_cannot_be_built_is_named(tmp_path):
    config = {"arch": "MLP", "sizes": [784, -5, 10]}
    p = str(write_npz(tmp_path / "m.npz", **entries(models.MLP(), config=np.array(json.dumps(config)))))
    assert refused(p) == (f"{p}: cannot build MLP from config {config!r}: "
                          f"ValueError: MLP: sizes[1] must lie in [1, 65536], got -5")


def test_format_version_must_be_an_integer_scalar(tmp_path):
    p = str(write_npz(tmp_path / "f.npz", **entries(format_version=np.array(1.0))))
    assert refused(p) == f"{p}: 'format_version' should be an integer scalar, got dtype float64, shape ()"
    p = str(write_npz(tmp_path / "g.npz", **entries(format_version=np.array(99))))
    assert refused(p) == (f"{p}: checkpoint format 99 is newer than this cydnn reads "
                          f"({serialization.FORMAT_VERSION}); upgrade cydnn")
    assert refused(p, serialization.load_metadata).startswith(f"{p}: checkpoint format 99 is newer")


def test_missing_metadata_names_the_file(tmp_path):
    p = str(write_npz(tmp_path / "m.npz", **entries(metadata=None)))
    assert refused(p, serialization.load_metadata).startswith(
        f"{p} is not a complete cydnn checkpoint: missing entry 'metadata'")


def test_missing_format_version_lists_ten_entries_and_what_the_file_looks_like(tmp_path):
    p = str(write_npz(tmp_path / "sd.npz", **{name: np.zeros(2, np.float32) for name in "abcdefghijkl"}))
    message = refused(p)
    assert message.startswith(f"{p} is not a complete cydnn checkpoint: missing entry 'format_version'; "
                              f"present: {list('abcdefghij')}; it looks like a bare state_dict")
    assert "load_pytorch_weights(model, path)" in message
    # A zip whose names say nothing: no "looks like" at all.
    p = str(write_npz(tmp_path / "q.npz", **entries(format_version=None)))
    assert re.fullmatch(re.escape(f"{p} is not a complete cydnn checkpoint: missing entry 'format_version'; "
                                  f"present: ['config', 'metadata']"), refused(p))


def test_what_a_non_zip_file_looks_like(tmp_path):
    p = tmp_path / "legacy.pt"
    p.write_bytes(b"\x80\x04\x95 legacy pickle")
    assert refused(str(p)) == (f"{p} is not a cydnn checkpoint: not an .npz (zip) archive (it starts with "
                               f"b'\\x80\\x04\\x95 '); it looks like a Python pickle (a legacy torch.save file?), "
                               f"which cydnn never unpickles")
    p = tmp_path / "noise.bin"
    p.write_bytes(b"nothing known")
    assert refused(str(p)) == f"{p} is not a cydnn checkpoint: not an .npz (zip) archive (it starts with b'noth')"


def test_bad_parameter_name_is_refused_naming_the_entry(tmp_path):
    p = str(write_npz(tmp_path / "m.npz", **entries(**{"param__training": np.zeros(1, np.float32)})))
    assert refused(p).startswith(f"{p}: entry 'param/training': parameter name 'training': part 'training' "
                                 f"is an attribute of nn.Module")


NOTE = "holds pickled Python objects, which a checkpoint never contains; refusing to load it"


def test_pickled_member_message(tmp_path):
    p = str(write_npz(tmp_path / "m.npz", **entries(config=np.array([1, None], object))))
    assert refused(p) == f"{p}: entry 'config' {NOTE}"
    # A parameter is refused from its header (the shape check reads it first), in the same words ...
    p = str(write_npz(tmp_path / "n.npz", **entries(param__fc3_dot_bias=np.array([1, None], object))))
    assert refused(p) == f"{p}: entry 'param/fc3.bias' {NOTE}"
    # ... and by the lazy read itself, should anything read it first.
    with serialization._open(p) as e:
        with pytest.raises(CheckpointError) as info:
            e["param/fc3.bias"]
    assert str(info.value) == f"{p}: entry 'param/fc3.bias' {NOTE}"


# ------------------------------------------------------------------ "weights do not fit"
def _fit_message(tmp_path, **changes):
    p = str(write_npz(tmp_path / "w.npz", **entries(**changes)))
    message = refused(p)
    assert message.startswith(f"{p}: weights do not fit LeNet5: ")
    return message[len(f"{p}: weights do not fit LeNet5: "):]


def test_weights_do_not_fit_lists_only_the_problems_found(tmp_path):
    assert _fit_message(tmp_path, param__fc2_dot_bias=None) == "missing parameters ['fc2.bias']"
    assert _fit_message(tmp_path, param__extra=np.zeros(1, np.float32)) == "unexpected parameters ['extra']"
    assert _fit_message(tmp_path, param__fc3_dot_bias=np.zeros(3, np.float32)) == (
        "wrong shapes: fc3.bias: expected (10,), got (3,)")
    assert _fit_message(tmp_path, param__fc3_dot_bias=np.zeros(3, np.float32),
                        param__fc2_dot_bias=np.zeros(2, np.float32)) == (
        "wrong shapes: fc2.bias: expected (84,), got (2,), fc3.bias: expected (10,), got (3,)")
    assert _fit_message(tmp_path, param__fc2_dot_bias=None, param__extra=np.zeros(1, np.float32)) == (
        "missing parameters ['fc2.bias']; unexpected parameters ['extra']")


def test_load_state_dict_refusal_is_wrapped(tmp_path, monkeypatch):
    p = str(write_npz(tmp_path / "m.npz", **entries()))

    def refuse(self, state, strict=True):
        raise ValueError("no room")
    monkeypatch.setattr(models.LeNet5, "load_state_dict", refuse)
    assert refused(p) == f"{p}: weights do not fit LeNet5: no room"


# ------------------------------------------------------------------ parameters over 1 MiB
def test_a_parameter_larger_than_a_small_entry_loads(tmp_path):
    """fc1.weight of this MLP is 3.2 MB: its bound is the model's size, not the 1 MiB of a small entry."""
    model = models.MLP(sizes=(784, 1024, 10), seed=1)
    assert model.fc1.weight.data.nbytes > serialization.MAX_SMALL_ENTRY_BYTES
    p = cydnn.save(model, tmp_path / "mlp.npz")
    np.testing.assert_array_equal(serialization.load(p).fc1.weight.data, model.fc1.weight.data)
    # Read without the model's bound (before load sets it), the same member is refused unread.
    with serialization._open(p) as e:
        with pytest.raises(CheckpointError, match=re.escape(
                f"{p}: entry 'param/fc1.weight' declares {784 * 1024 * 4 + 128} bytes uncompressed, more than "
                f"the {serialization.MAX_SMALL_ENTRY_BYTES + 1024} it can need")):
            e["param/fc1.weight"]
        with pytest.raises(KeyError, match="param/absent"):
            e["param/absent"]


# ------------------------------------------------------------------ what save writes
def test_save_records_version_utc_time_and_a_plain_mode(tmp_path):
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    p = cydnn.save(models.LeNet5(), tmp_path / "m.npz")
    meta = serialization.load_metadata(p)
    assert meta["cydnn_version"] == cydnn.__version__
    created = datetime.datetime.fromisoformat(meta["created"])
    assert created.tzinfo == datetime.timezone.utc
    assert before <= created <= datetime.datetime.now(datetime.timezone.utc)
    assert os.stat(p).st_mode & 0o777 == 0o666 & ~umask()      # as open() makes it, not the temp file's 0600


def umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_checkpoint_gets_the_mode_the_umask_gives(tmp_path, mask, mode):
    before = os.umask(mask)
    try:
        p = cydnn.save(models.LeNet5(), tmp_path / "m.npz")
    finally:
        os.umask(before)
    assert os.stat(p).st_mode & 0o777 == mode


def test_version_from_the_installed_distribution(tmp_path, monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.8.7" if name == "cydnn" else real(name))
    # The package's own __version__ first (the installed metadata may be of another copy) ...
    assert serialization.load_metadata(cydnn.save(models.LeNet5(), tmp_path / "o.npz"))["cydnn_version"] == \
        cydnn.__version__ != "9.8.7"
    # ... the distribution's without it ...
    monkeypatch.delattr(cydnn, "__version__")
    assert serialization.load_metadata(cydnn.save(models.LeNet5(), tmp_path / "a.npz"))["cydnn_version"] == "9.8.7"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)          # ... else None
    assert serialization.load_metadata(cydnn.save(models.LeNet5(), tmp_path / "b.npz"))["cydnn_version"] is None


def test_unserialisable_metadata_names_the_value_and_type(tmp_path):
    with pytest.raises(TypeError) as info:
        cydnn.save(models.LeNet5(), tmp_path / "m.npz", metadata={"x": {1, 2}})
    assert str(info.value) == "metadata value {1, 2} of type set is not JSON-serialisable"
    assert os.listdir(tmp_path) == []


def test_numpy_values_in_a_config_are_written(tmp_path):
    """save takes any object with config() and state_dict(); numpy scalars in either JSON entry are written."""
    model = types.SimpleNamespace(config=lambda: {"arch": "LeNet5", "num_classes": np.int64(7)},
                                  state_dict=lambda: {"w": np.ones(2, np.float64)})
    p = cydnn.save(model, tmp_path / "m.npz", metadata={"acc": np.float32(0.5)})
    with np.load(p) as z:
        assert json.loads(str(z["config"])) == {"arch": "LeNet5", "num_classes": 7}
        assert json.loads(str(z["metadata"]))["acc"] == 0.5
        assert z["param/w"].dtype == np.float32 and z["format_version"].dtype == np.int64
