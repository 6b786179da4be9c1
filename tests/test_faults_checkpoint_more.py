"""More checkpoint faults (beside test_faults_checkpoint.py): members that inflate past what the model
needs, members that lie about their size, truncation anywhere, saves killed at random moments, and a
full file system during a save."""
import errno
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

import cydnn
import hostilekit
from cydnn import models, serialization
from cydnn.serialization import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from faultkit import UNSHARE_AVAILABLE, UNSHARE_REASON, child_env, run_on_tmpfs  # noqa: E402


def npy(array):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def members(model=None):
    """name -> .npy bytes of a good checkpoint."""
    model = model or models.LeNet5(seed=0)
    arrays = {"format_version": np.array(serialization.FORMAT_VERSION, np.int64),
              "config": np.array(json.dumps(model.config())),
              "metadata": np.array(json.dumps({"note": "handmade"}))}
    arrays.update({"param/" + k: v for k, v in model.state_dict().items()})
    return {k: npy(v) for k, v in arrays.items()}


def write_zip(path, entries):
    """A zip written by hand: ``entries`` maps a name (".npy" is appended) to bytes (stored), or to
    (raw deflate data, declared size, crc) so that a member can declare any size."""
    return hostilekit.write_zip(path, [(name + ".npy", data) for name, data in entries.items()])


deflate_bomb = hostilekit.deflate_bomb


def peak_bytes(fn):
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_parameter_member_declaring_more_than_the_model_needs_is_refused_unread(tmp_path):
    """512 MiB declared (under MAX_MEMBER_BYTES) for fc1.weight, which needs 122,880 bytes: refused from
    the declared size, after the config, before anything is inflated."""
    good = members()
    header = npy(np.zeros(128 << 20, np.float32))[:128]
    good["param/fc1.weight"] = (deflate_bomb(header, 512), 128 + (512 << 20), 0)
    path = write_zip(tmp_path / "bomb.npz", good)
    assert path.stat().st_size < 1 << 20

    def load():
        with pytest.raises(CheckpointError, match=r"entry 'param/fc1.weight' declares 536871040 bytes "
                                                  r"uncompressed, more than the 246784 it can need"):
            serialization.load(path)
    assert peak_bytes(load) < 16 << 20


def test_three_gigabytes_of_non_parameter_members_are_refused_unread(tmp_path):
    good = members()
    for i in range(3):        # 3 x (1 GiB - 1): under MAX_MEMBER_BYTES each and MAX_TOTAL_BYTES in all
        good[f"junk{i}"] = (deflate_bomb(b"", 1023), (1 << 30) - 1, 0)
    path = write_zip(tmp_path / "junk.npz", good)
    with pytest.raises(CheckpointError, match="entry .junk0. declares 1073741823 bytes uncompressed, more than the 1048576"):
        serialization.load(path)


def test_member_inflating_past_its_declared_size_is_read_only_that_far(tmp_path):
    """A member that lies (declares its real size, its stream inflates to 256 MiB): zipfile stops at
    the declared size, so it loads in little memory; with a wrong CRC it is refused as corrupt."""
    good = members()
    data = good["param/fc3.bias"]
    good["param/fc3.bias"] = (deflate_bomb(data, 256), len(data), zlib.crc32(data))
    path = write_zip(tmp_path / "liar.npz", good)
    loaded = []
    assert peak_bytes(lambda: loaded.append(serialization.load(path))) < 16 << 20
    np.testing.assert_array_equal(loaded[0].fc3.bias.data, models.LeNet5(seed=0).fc3.bias.data)
    good["param/fc3.bias"] = (deflate_bomb(data, 256), len(data), zlib.crc32(data) ^ 1)
    with pytest.raises(CheckpointError, match=r"'param/fc3.bias' is truncated or corrupt \(Bad CRC-32"):
        serialization.load(write_zip(tmp_path / "liar2.npz", good))


def test_truncated_anywhere(tmp_path):
    path = tmp_path / "m.npz"
    cydnn.save(models.LeNet5(seed=0), path)
    data = path.read_bytes()
    cuts = sorted(set([4, 10, 30, 100] + [len(data) * k // 40 for k in range(1, 40)]
                      + [len(data) - k for k in (1, 2, 10, 22, 23, 100)]))
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError):
            serialization.load(path)
    assert len(cuts) > 45


SAVER = textwrap.dedent("""
    import sys
    import cydnn
    from cydnn import models
    path, marker = sys.argv[1], sys.argv[2]
    a, b = models.LeNet5(seed=1), models.LeNet5(seed=2)
    open(marker, "w").close()
    while True:                      # save two models in turn, as fast as it can
        cydnn.save(a, path)
        cydnn.save(b, path)
""")


def same_weights(model, seed):
    return all(np.array_equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     models.LeNet5(seed=seed).state_dict().values()))


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.31])
def test_save_killed_at_a_random_moment_leaves_a_complete_checkpoint(tmp_path, delay):
    path, marker = tmp_path / "lenet.npz", tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(marker)], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not path.exists():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the child never saved"
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    model = serialization.load(path)
    assert same_weights(model, seed=1) or same_weights(model, seed=2)
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(leftovers) <= 1 and all(n.startswith(".lenet.npz.") for n in leftovers)


ENOSPC_CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    import cydnn
    from cydnn import models, serialization
    folder = sys.argv[1]
    small = models.LeNet5(seed=1)
    cydnn.save(small, os.path.join(folder, "m.npz"))        # about 180 kB: fits in 256 kB
    try:
        cydnn.save(models.LeNet5(seed=2, num_classes=1000), os.path.join(folder, "m.npz"))   # about 520 kB: does not
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
