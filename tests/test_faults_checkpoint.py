"""Faults in checkpoints: each one gives one clear CheckpointError (or OSError) naming the cause."""
import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cydnn import serialization
from cydnn.models import LeNet5
from cydnn.serialization import CheckpointError


@pytest.fixture(scope="module")
def model():
    return LeNet5(seed=1)


@pytest.fixture
def good(tmp_path, model):
    return serialization.save(model, tmp_path / "good.npz")


def entries_of(path):
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def write_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


class Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_object_member_refused_without_unpickling(tmp_path, good, monkeypatch):
    monkeypatch.chdir(tmp_path)
    e = entries_of(good)
    e["param/fc1.weight"] = np.array([Boom()], dtype=object)
    bad = tmp_path / "pickled.npz"
    with open(bad, "wb") as f:
        np.savez(f, **e)
    called = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: called.append(1))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: called.append(1))
    with pytest.raises(CheckpointError, match="fc1.weight.*pickled"):
        serialization.load(bad)
    assert not called and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("change, match", [
    (lambda e: e.update({"param/extra.weight": np.zeros(3, np.float32)}), r"unexpected parameters \['extra.weight'\]"),
    (lambda e: e.pop("param/fc2.bias"), r"missing parameters \['fc2.bias'\]"),
    (lambda e: e.update({"param/fc3.weight": np.zeros((5, 5), np.float32)}), r"fc3.weight: expected .*got \(5, 5\)"),
])
def test_extra_missing_or_wrong_shaped_parameters_are_named(tmp_path, good, change, match):
    e = entries_of(good)
    change(e)
    with pytest.raises(CheckpointError, match=match):
        serialization.load(write_npz(tmp_path / "p.npz", **e))


@pytest.mark.parametrize("config, match", [
    ({"arch": "ResNet152"}, "unknown architecture 'ResNet152'"),
    ({"arch": "LeNet5", "num_classes": 10**9}, r"num_classes=1000000000 must lie in \[1, 100000\]"),
    ({"arch": "LeNet5", "num_classes": -1}, "num_classes=-1"),
    ({"arch": "LeNet5", "num_classes": 0}, "num_classes=0"),
    ({"arch": "LeNet5", "num_classes": 10.5}, "must be an integer"),
    ({"arch": "LeNet5", "classic": "yes"}, "classic='yes' must be true or false"),
    ({"arch": "LeNet5", "seed": -5}, "seed=-5 must be >= 0"),
    ({"arch": "LeNet5", "std": 0}, "std=0 must be > 0"),
    ({"arch": "LeNet5", "mean": "x"}, "must be a finite number"),
    ({"arch": "LeNet5", "width": 10**12}, r"arguments \['width'\]"),
])
def test_odd_configs_refused_before_allocating(tmp_path, good, config, match, monkeypatch):
    from cydnn import models
    built = []
    monkeypatch.setattr(models, "build", lambda c: built.append(c))
    e = entries_of(good)
    e["config"] = np.array(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        serialization.load(write_npz(tmp_path / "c.npz", **e))
    assert built == []          # refused before anything was built


def test_member_declaring_a_huge_size_is_refused_before_reading(tmp_path, good):
    bad = tmp_path / "bomb.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
    # Patch the declared uncompressed size (central directory and local header) to 8 GB - 1.
    data = bytearray(bad.read_bytes())
    for sig, offset in ((b"PK\x01\x02", 24), (b"PK\x03\x04", 22)):
        i = data.find(sig)
        assert i >= 0
        struct.pack_into("<I", data, i + offset, 0xFFFFFFFE)
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="declares 4294967294 bytes uncompressed.*MAX_MEMBER_BYTES"):
        serialization.load(bad)


def test_member_inflating_to_gigabytes_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(serialization, "MAX_MEMBER_BYTES", 1 << 20)
    bad = tmp_path / "inflate.npz"
    buf = io.BytesIO()
    np.save(buf, np.zeros(4 << 20, np.uint8))
    with zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("param/fc1.weight.npy", buf.getvalue())
    assert bad.stat().st_size < 100_000
    with pytest.raises(CheckpointError, match="param/fc1.weight.npy.*MAX_MEMBER_BYTES"):
        serialization.load(bad)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_truncated_file(tmp_path, good, keep):
    data = Path(good).read_bytes()
    bad = tmp_path / "cut.npz"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="cut.npz"):
        serialization.load(bad)


def test_directory_instead_of_a_file(tmp_path, model):
    with pytest.raises(CheckpointError, match="is a directory"):
        serialization.load(tmp_path)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        serialization.save(model, tmp_path)


def test_saving_into_a_missing_folder_names_it(tmp_path, model):
    target = tmp_path / "no" / "such" / "m.npz"
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "no" / "such")):
        serialization.save(model, target)
    assert not (tmp_path / "no").exists()


CHILD = r'''
import sys, numpy as np
from cydnn import serialization
from cydnn.models import LeNet5
real_savez = np.savez
def slow_savez(f, **arrays):
    real_savez(f, **arrays)
    f.flush()
    print("written", flush=True)
    import time; time.sleep(60)           # killed here: the temporary file is complete but not renamed
np.savez = slow_savez
serialization.np.savez = slow_savez
serialization.save(LeNet5(seed=2, num_classes=7), sys.argv[1])
'''


def test_save_killed_midway_keeps_the_previous_checkpoint(tmp_path, good, model):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(serialization.__file__).parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    before = Path(good).read_bytes()
    child = subprocess.Popen([sys.executable, "-c", CHILD, good], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
        assert list(tmp_path.glob(".good.npz.*.tmp"))          # the new file is being written beside it
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    assert Path(good).read_bytes() == before
    loaded = serialization.load(good)
    assert loaded.num_classes == 10
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v)
