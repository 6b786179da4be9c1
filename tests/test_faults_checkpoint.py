"""Checkpoints that go wrong: every bad file refused with a clear reason before anything large is
allocated, and a save killed midway never costs the checkpoint that was there."""
import errno
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from cydnn import models, serialization
from cydnn.serialization import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from faultkit import UNSHARE_AVAILABLE, UNSHARE_REASON, child_env, run_on_tmpfs  # noqa: E402


def npy(array):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), allow_pickle=True)
    return buf.getvalue()


def entries(model=None, **changes):
    """name -> .npy bytes of a good checkpoint, with ``changes`` (name -> array, or None to drop)."""
    model = model or models.LeNet5(seed=0)
    arrays = {"format_version": np.array(serialization.FORMAT_VERSION, np.int64),
              "config": np.array(json.dumps(model.config())),
              "metadata": np.array(json.dumps({"note": "handmade"}))}
    arrays.update({"param/" + k: v for k, v in model.state_dict().items()})
    for key, value in changes.items():
        key = key.replace("__", "/").replace("_dot_", ".")
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    return {k: npy(v) for k, v in arrays.items()}


def write_zip(path, members):
    """A zip of ``members`` (name -> bytes, or name -> (raw deflate data, declared size, crc))
    written by hand, so that a member's declared size can be anything."""
    out, central = bytearray(), bytearray()
    for name, data in members.items():
        name = (name + ".npy").encode()
        if isinstance(data, tuple):
            payload, size, crc, method = data[0], data[1], data[2], 8
        else:
            payload, size, crc, method = data, len(data), zlib.crc32(data), 0
        offset = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), size,
                           len(name), 0) + name + payload
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(payload),
                               size, len(name), 0, 0, 0, 0, 0, offset) + name
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(out), 0)
    Path(path).write_bytes(bytes(out + central + eocd))
    return path


def deflate_bomb(prefix, mib):
    """Raw deflate data that inflates to ``prefix`` + ``mib`` MiB of zeros (built in milliseconds)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return head + block * mib + c.flush()


class small_memory:
    """Asserts that the block allocates less than ``limit`` bytes at its peak (tracemalloc)."""

    def __init__(self, limit=32 << 20):
        self.limit = limit

    def __enter__(self):
        tracemalloc.start()

    def __exit__(self, *exc):
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if exc[0] is None:
            assert peak < self.limit, f"peak {peak:,} bytes"


def refused(path, match):
    with small_memory(), pytest.raises(CheckpointError, match=match) as info:
        serialization.load(path)
    return str(info.value)


# ---------------------------------------------------------------- contents
class _CreatesAFile:
    """Unpickling this creates a file: the proof that nothing was unpickled is that it is absent."""

    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("key", ["param__fc3_dot_bias", "metadata", "format_version", "extra"])
def test_object_members_are_refused_without_unpickling(tmp_path, key):
    _CreatesAFile.marker = tmp_path / "unpickled"
    obj = np.array([_CreatesAFile(), 1], dtype=object)
    path = write_zip(tmp_path / "m.npz", entries(**{key: obj}))
    name = key.replace("__", "/").replace("_dot_", ".")
    message = refused(path, f"entry '{name}' holds pickled Python objects")
    assert "nothing was unpickled" in message
    assert not _CreatesAFile.marker.exists()
    with pytest.raises(CheckpointError, match="pickled"):
        serialization.load_metadata(path)
    assert not _CreatesAFile.marker.exists()


def test_missing_extra_and_wrong_shaped_parameters_named_together(tmp_path):
    path = write_zip(tmp_path / "m.npz", entries(
        param__conv1_dot_bias=None, param__fc1_dot_weight=np.zeros((120, 400), np.float32),
        param__fc4_dot_weight=np.zeros((3, 3), np.float32)))
    message = refused(path, "weights do not fit LeNet5")
    assert "missing ['conv1.bias']" in message
    assert "unexpected ['fc4.weight']" in message
    assert "wrong shape: 'fc1.weight': expected (120, 256), got (120, 400)" in message


@pytest.mark.parametrize("config, match", [
    ({"arch": "ResNet50"}, r"unknown architecture 'ResNet50'; known: \[.*'LeNet5'"),
    ({"arch": None}, "must be a JSON object with an 'arch' string"),
    ([1, 2], "must be a JSON object"),
    ({"arch": "LeNet5", "depth": 50}, r"unknown argument 'depth' \(= 50\); LeNet5 takes \['classic', 'num_classes'"),
    ({"arch": "LeNet5", "num_classes": 10**12}, r"'num_classes' = 1000000000000 is out of the accepted range \[1, 100000\]"),
    ({"arch": "LeNet5", "num_classes": -3}, r"'num_classes' = -3 is out of the accepted range"),
    ({"arch": "LeNet5", "num_classes": 0}, r"'num_classes' = 0 is out of the accepted range"),
    ({"arch": "LeNet5", "num_classes": "10"}, r"'num_classes' = '10' must be an integer, not a str"),
    ({"arch": "LeNet5", "num_classes": 10.0}, r"'num_classes' = 10.0 must be an integer, not a float"),
    ({"arch": "LeNet5", "num_classes": True}, r"'num_classes' = True must be an integer, not a bool"),
    ({"arch": "LeNet5", "classic": "yes"}, r"'classic' = 'yes' must be true or false"),
    ({"arch": "LeNet5", "classic": [1]}, r"'classic' = \[1\] must be true or false, not a list"),
    ({"arch": "LeNet5", "seed": -1}, r"'seed' = -1 is out of the accepted range"),
    ({"arch": "LeNet5", "seed": 2**70}, r"'seed' = 1180591620717411303424 is out of the accepted range"),
    ({"arch": "LeNet5", "std": 0}, r"'std' = 0 is out of the accepted range"),
    ({"arch": "LeNet5", "std": float("nan")}, r"'std' = nan must be finite"),
    ({"arch": "LeNet5", "mean": float("inf")}, r"'mean' = inf must be finite"),
    ({"arch": "LeNet5", "mean": {"a": 1}}, r"'mean' = \{'a': 1\} must be a number, not a dict"),
])
def test_bad_configs_are_refused_before_building(tmp_path, config, match):
    path = write_zip(tmp_path / "m.npz", entries(config=np.array(json.dumps(config))))
    built = []
    real = models.build
    try:
        models.build = lambda c: built.append(c) or real(c)
        refused(path, match)
    finally:
        models.build = real
    assert built == []                           # refused from the config alone


def test_a_registered_architecture_without_rules_gets_the_generic_checks(tmp_path):
    @models.register
    class Tiny(models.LeNet5):
        def __init__(self, width=8, **kwargs):
            super().__init__(**kwargs)
            self.width = width
    try:
        for value, match in ((2**40, r"'width' = 1099511627776 is out of \[-2147483648, 2147483648\]"),
                             ([8], r"'width' = \[8\] is a list, not a JSON scalar"),
                             (float("inf"), r"'width' = inf is not finite")):
            with pytest.raises(CheckpointError, match=match):
                serialization.check_config({"arch": "Tiny", "width": value})
        assert serialization.check_config({"arch": "Tiny", "width": 16, "num_classes": 3}) is Tiny
    finally:
        del models.ARCHITECTURES["Tiny"]


# ---------------------------------------------------------------- zip bombs
def test_parameter_member_inflating_to_a_gigabyte(tmp_path):
    header = npy(np.zeros(0, np.float32))[:128]              # any header: refused before it is read
    members = entries()
    members["param/fc1.weight"] = (deflate_bomb(header, 1024), 128 + (1 << 30), 0)
    path = write_zip(tmp_path / "bomb.npz", members)
    assert path.stat().st_size < 2 << 20
    start = time.monotonic()
    message = refused(path, r"entry 'param/fc1.weight' inflates to 1,073,741,952 bytes")
    assert "a zip bomb?" in message and time.monotonic() - start < 2


def test_config_member_inflating_to_a_gigabyte(tmp_path):
    members = entries()
    members["config"] = (deflate_bomb(b"", 1024), 1 << 30, 0)
    path = write_zip(tmp_path / "bomb.npz", members)
    refused(path, r"entry 'config' inflates to 1,073,741,824 bytes, more than the 1,048,576")


def test_member_that_inflates_past_its_declared_size_is_read_only_that_far(tmp_path):
    """A member that lies (declares its right size, inflates to 256 MiB): zipfile inflates only the
    declared bytes, so it loads in little memory; with a wrong CRC it is refused as corrupt."""
    good = entries()
    data = good["param/fc3.bias"]
    good["param/fc3.bias"] = (deflate_bomb(data, 256), len(data), zlib.crc32(data))
    path = write_zip(tmp_path / "liar.npz", good)
    with small_memory():
        model = serialization.load(path)
    np.testing.assert_array_equal(model.fc3.bias.data, models.LeNet5(seed=0).fc3.bias.data)
    good["param/fc3.bias"] = (deflate_bomb(data, 256), len(data), zlib.crc32(data) ^ 1)
    refused(write_zip(tmp_path / "liar2.npz", good), r"entry 'param/fc3.bias' is truncated or corrupt \(Bad CRC-32")


# ---------------------------------------------------------------- files
def test_truncated_anywhere(tmp_path):
    path = tmp_path / "m.npz"
    models.LeNet5(seed=0).save(path)
    data = path.read_bytes()
    cuts = sorted(set([1, 3, 4, 10, 30, 100] + [len(data) * k // 40 for k in range(1, 40)]
                      + [len(data) - k for k in (1, 2, 10, 22, 23, 100)]))
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated or corrupt|not a complete|corrupt"):
            serialization.load(path)
    assert len(cuts) > 45


def test_a_directory_instead_of_a_file(tmp_path):
    (tmp_path / "ckpt.npz").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory, not a cydnn checkpoint file"):
        serialization.load(tmp_path / "ckpt.npz")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        serialization.load_metadata(tmp_path / "ckpt.npz")
    with pytest.raises(IsADirectoryError, match="cannot save a checkpoint to .*ckpt.npz: it is a directory"):
        models.LeNet5().save(tmp_path / "ckpt.npz")
    assert os.listdir(tmp_path / "ckpt.npz") == []


def test_saving_into_a_missing_folder(tmp_path):
    target = tmp_path / "runs" / "today" / "lenet.npz"
    with pytest.raises(FileNotFoundError, match=r"the folder .*runs/today does not exist \(create it first\)"):
        models.LeNet5().save(target)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- killed saves
SAVER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from cydnn import models, serialization
    path, marker, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "pause":              # stop inside the save, after the data is written, before the rename
        real_fsync = os.fsync
        def fsync(fd):
            real_fsync(fd)
            open(marker, "w").close()
            time.sleep(60)
        serialization.os.fsync = fsync
        models.LeNet5(seed=2).save(path)
    else:                            # save two models in turn as fast as it can
        a, b = models.LeNet5(seed=1), models.LeNet5(seed=2)
        open(marker, "w").close()
        while True:
            a.save(path)
            b.save(path)
""")


def saver(path, marker, mode):
    return subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(marker), mode], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc, marker, timeout=60):
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the child never got there"
        time.sleep(0.02)


def same_weights(model, seed):
    return all(np.array_equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     models.LeNet5(seed=seed).state_dict().values()))


def test_save_killed_after_writing_before_renaming_keeps_the_old_checkpoint(tmp_path):
    path, marker = tmp_path / "lenet.npz", tmp_path / "marker"
    models.LeNet5(seed=1).save(path)
    proc = saver(path, marker, "pause")
    try:
        wait_for(proc, marker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert same_weights(serialization.load(path), seed=1)          # the old one, whole
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".lenet.npz.") and n.endswith(".tmp")]
    assert len(leftovers) == 1                                     # the new one, hidden, never read
    models.LeNet5(seed=3).save(path)                               # and saving again works
    assert same_weights(serialization.load(path), seed=3)


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.31])
def test_save_killed_at_a_random_moment_leaves_a_complete_checkpoint(tmp_path, delay):
    path, marker = tmp_path / "lenet.npz", tmp_path / "marker"
    proc = saver(path, marker, "loop")
    try:
        wait_for(proc, marker)
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    model = serialization.load(path)
    assert same_weights(model, seed=1) or same_weights(model, seed=2)


ENOSPC_CHILD = textwrap.dedent("""
    import errno, os, sys
    import numpy as np
    from cydnn import models, serialization
    folder = sys.argv[1]
    small = models.LeNet5(seed=1)
    small.save(os.path.join(folder, "m.npz"))        # about 180 kB: fits in 256 kB
    try:
        models.LeNet5(seed=2, num_classes=1000).save(os.path.join(folder, "m.npz"))   # about 520 kB: does not
    except OSError as e:
        print("errno", e.errno, file=sys.stderr)
    loaded = serialization.load(os.path.join(folder, "m.npz"))
    same = all(np.array_equal(a, b) for a, b in zip(loaded.state_dict().values(), small.state_dict().values()))
    print("old intact:", same, "files:", sorted(os.listdir(folder)), file=sys.stderr)
""")


@pytest.mark.skipif(not UNSHARE_AVAILABLE, reason=UNSHARE_REASON)
def test_full_disk_during_save_keeps_the_old_checkpoint(tmp_path):
    (tmp_path / "mnt").mkdir()
    out = run_on_tmpfs(tmp_path / "mnt", "size=256k", ENOSPC_CHILD, tmp_path / "mnt")
    assert out.returncode == 0, out.stderr
    assert f"errno {errno.ENOSPC}" in out.stderr
    assert "old intact: True files: ['m.npz']" in out.stderr


def test_sizes_in_the_tests_are_what_they_claim():
    assert 128 + (1 << 30) == 1_073_741_952 and math.prod((120, 256)) == 30720
