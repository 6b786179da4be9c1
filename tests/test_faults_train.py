"""The train command under odd arguments and Ctrl-C (real subprocesses, on the CPU)."""
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cydnn

from faultkit import interruptible  # noqa: E402
from mnist_data import FOLDER as MNIST, real_mnist  # noqa: E402,F401  (the one MNIST lookup: tests/mnist_data.py)
pytestmark = pytest.mark.usefixtures("real_mnist")


def cmd(tmp_path, *extra):
    return [sys.executable, "-m", "cydnn.train", "--device", "cpu", "--mirror", str(MNIST), "--data-dir",
            str(tmp_path / "data"), "--no-progress", *extra]


def run(tmp_path, *extra):
    return subprocess.run(cmd(tmp_path, *extra), capture_output=True, text=True, timeout=300)


def test_divergence_is_one_line_with_the_epoch(tmp_path):
    r = run(tmp_path, "--limit-train", "500", "--epochs", "2", "--lr", "1e6")
    assert r.returncode != 0
    assert "training diverged at epoch 1" in r.stderr and "Traceback" not in r.stderr
    assert "RuntimeWarning" not in r.stderr


def test_batch_larger_than_the_dataset_is_one_batch(tmp_path):
    r = run(tmp_path, "--limit-train", "100", "--batch-size", "1000", "--epochs", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert '"train_images": 100' in r.stdout


def test_limit_larger_than_the_dataset_says_so(tmp_path):
    r = run(tmp_path, "--limit-train", "100000", "--epochs", "0")
    assert r.returncode != 0 and "--epochs must be >= 1" in r.stderr      # arguments checked first
    r = subprocess.run(cmd(tmp_path, "--limit-train", "100000", "--epochs", "1", "--json", "--batch-size", "512"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "more than the 60000 training images: using all of them" in r.stderr


@pytest.mark.parametrize("previous", [False, True])
def test_ctrl_c_stops_quickly_and_leaves_no_partial_checkpoint(tmp_path, previous):
    target = tmp_path / "model.npz"
    if previous:
        cydnn.save(cydnn.models.LeNet5(seed=7), target)
        before = target.read_bytes()
    proc = subprocess.Popen(cmd(tmp_path, "--limit-train", "5000", "--epochs", "50", "--save", str(target)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    try:
        line = proc.stdout.readline()                    # the first epoch finished: training is under way
        assert line.startswith("epoch"), line + proc.stderr.read()
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    # Generous on purpose (an idle machine exits in well under a second; a run that ignored the
    # signal would train 50 epochs of 5000 images, minutes): the bounded-work checks follow.
    assert elapsed < 60, elapsed
    assert "Traceback" not in err
    epochs_done = [ln for ln in (line + out).splitlines() if ln.startswith("epoch ")]
    stopped = int(err.split("during epoch ")[1].split("/")[0])
    assert len(epochs_done) == stopped - 1 >= 1              # it stopped inside the epoch it names
    assert f"interrupted (Ctrl-C) during epoch {stopped}/50: training stopped" in err
    if previous:
        assert target.read_bytes() == before                               # the old checkpoint, intact
        assert cydnn.load(target).predict(np.zeros((1, 28, 28), np.uint8)).shape == (1, 10)
    else:
        assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("model.npz") and p != target]  # no temp left
