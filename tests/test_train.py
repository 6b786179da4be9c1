"""The training command end to end on the CPU (and on the GPU where there is one)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cydnn
from cydnn import train

MNIST = Path(os.environ.get("CYDNN_TEST_MNIST", Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
pytestmark = pytest.mark.skipif(not (MNIST / "t10k-labels-idx1-ubyte.gz").exists(),
                                reason=f"real MNIST not found in {MNIST} (set CYDNN_TEST_MNIST)")


def run(tmp_path, *extra):
    args = ["--mirror", str(MNIST), "--data-dir", str(tmp_path / "data"), "--epochs", "1",
            "--limit-train", "2000", "--no-progress", "--json", *extra]
    out = subprocess.run([sys.executable, "-m", "cydnn.train", *args], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_train_json_checkpoint_and_inference(tmp_path, device):
    ckpt = tmp_path / "lenet.npz"
    out = run(tmp_path, "--device", device, "--save", str(ckpt))
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("epoch  1/1  loss ")
    summary = json.loads(lines[-1])
    assert summary["device"] == device and summary["epochs"] == 1 and summary["train_images"] == 2000
    assert summary["train_seconds"] > 0
    assert 0.5 <= summary["test_accuracy"] <= 1.0   # 2000 images, one epoch: far above chance (0.1)
    # The checkpoint predicts the same accuracy the run reported.
    model = cydnn.load(str(ckpt), device=device)
    test = cydnn.datasets.MNIST(root=tmp_path / "data", train=False, download=False)
    acc = float((model.predict_classes(test.images) == test.labels).mean())
    assert abs(acc - summary["test_accuracy"]) < 2e-3
    assert cydnn.serialization.load_metadata(str(ckpt))["test_accuracy"] == summary["test_accuracy"]


def test_auto_device_says_once_when_on_cpu(tmp_path):
    if cydnn.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = run(tmp_path, "--device", "auto", "--limit-train", "500")
    assert out.stderr.count("training on the CPU") == 1
    assert json.loads(out.stdout.strip().splitlines()[-1])["device"] == "cpu"


def test_seeded_runs_repeat_exactly(tmp_path):
    a = json.loads(run(tmp_path, "--device", "cpu", "--limit-train", "500").stdout.splitlines()[-1])
    b = json.loads(run(tmp_path, "--device", "cpu", "--limit-train", "500").stdout.splitlines()[-1])
    assert a["test_accuracy"] == b["test_accuracy"]


def test_plot_or_clear_message(tmp_path):
    png = tmp_path / "curves.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        out = subprocess.run([sys.executable, "-m", "cydnn.train", "--mirror", str(MNIST), "--data-dir",
                              str(tmp_path / "data"), "--epochs", "1", "--limit-train", "300", "--device", "cpu",
                              "--no-progress", "--plot", str(png)], capture_output=True, text=True, timeout=600)
        assert out.returncode != 0 and "--plot needs matplotlib" in out.stderr
        return
    run(tmp_path, "--device", "cpu", "--limit-train", "300", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        train.main(["--epochs", "0"])
    with pytest.raises(SystemExit):
        train.main(["--dataset", "cifar"])
