"""The training command end to end on the CPU (and on the GPU where there is one).

The tests marked ``needs_mnist`` train on real MNIST (skipped where it is not found); the others
train in-process on a small synthetic Fashion-MNIST-shaped dataset made here, so that the
command's options (--schedule, --optimizer, --classic, --dataset) are tested everywhere.
"""
import gzip
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cydnn
from cydnn import datasets, train

MNIST = Path(os.environ.get("CYDNN_TEST_MNIST", Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
needs_mnist = pytest.mark.skipif(not (MNIST / "t10k-labels-idx1-ubyte.gz").exists(),
                                 reason=f"real MNIST not found in {MNIST} (set CYDNN_TEST_MNIST)")


def run(tmp_path, *extra):
    args = ["--mirror", str(MNIST), "--data-dir", str(tmp_path / "data"), "--epochs", "1",
            "--limit-train", "2000", "--no-progress", "--json", *extra]
    out = subprocess.run([sys.executable, "-m", "cydnn.train", *args], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@needs_mnist
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_train_json_checkpoint_and_inference(tmp_path, device):
    ckpt = tmp_path / "lenet.npz"
    started = time.monotonic()
    out = run(tmp_path, "--device", device, "--save", str(ckpt))
    wall = time.monotonic() - started
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("epoch  1/1  loss ")
    summary = json.loads(lines[-1])
    assert summary["device"] == device and summary["epochs"] == 1 and summary["train_images"] == 2000
    assert summary["dataset"] == "mnist" and summary["optimizer"] == "sgd" and summary["lr"] == 0.03
    # The time reported is the epoch's (the epoch line prints it to 0.01 s, and its img/s from it),
    # inside the process's own wall time.
    fields = lines[0].split()
    epoch_seconds, images_per_second = float(fields[-2]), float(fields[-4].replace(",", ""))
    assert 0 < summary["train_seconds"] < wall
    assert abs(summary["train_seconds"] - epoch_seconds) <= 0.0051
    assert summary["seconds_per_epoch"] == summary["train_seconds"]
    assert abs(images_per_second - 2000 / summary["train_seconds"]) <= 0.5 + 1e-6 * images_per_second
    assert 0.5 <= summary["test_accuracy"] <= 1.0   # 2000 images, one epoch: far above chance (0.1)
    assert f"test acc {summary['test_accuracy']:.2%}" in lines[0]
    # The checkpoint, evaluated here by another path (predict_classes, not the DataLoader loop the
    # command uses), gives the accuracy the run reported.
    model = cydnn.load(str(ckpt), device=device)
    test = datasets.MNIST(root=tmp_path / "data", train=False, download=False)
    acc = float((model.predict_classes(test.images) == test.labels).mean())
    assert abs(acc - summary["test_accuracy"]) <= (2e-4 if device == "cpu" else 1e-3)
    assert cydnn.serialization.load_metadata(str(ckpt))["test_accuracy"] == summary["test_accuracy"]


@needs_mnist
def test_auto_device_says_once_when_on_cpu(tmp_path):
    if cydnn.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = run(tmp_path, "--device", "auto", "--limit-train", "500")
    assert out.stderr.count("training on the CPU") == 1
    assert json.loads(out.stdout.strip().splitlines()[-1])["device"] == "cpu"


@needs_mnist
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


@pytest.mark.parametrize("argv, code, message", [
    (["--epochs", "0"], None, "--epochs must be >= 1, got 0"),
    (["--batch-size", "-3"], None, "--batch-size must be >= 1, got -3"),
    (["--lr", "nan"], None, "--lr must be a finite number > 0, got nan"),
    (["--dataset", "cifar"], 2, "argument --dataset: invalid choice: 'cifar'"),
    (["--schedule", "linear"], 2, "argument --schedule: invalid choice: 'linear'"),
    (["--optimizer", "rmsprop"], 2, "argument --optimizer: invalid choice: 'rmsprop'"),
    (["--epochs", "two"], 2, "argument --epochs: invalid int value: 'two'"),
])
def test_bad_arguments_are_refused(argv, code, message, capsys):
    """Values argparse refuses exit with status 2 and its message on stderr; values the command's
    own checks refuse exit with the one-line message as the SystemExit code (printed, status 1)."""
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    if code is None:
        assert e.value.code == message
    else:
        assert e.value.code == code
        assert message in capsys.readouterr().err


# ------------------------------------------------- a synthetic Fashion-MNIST
N_TRAIN, N_TEST = 256, 200


def _idx(array):
    import struct
    return b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


@pytest.fixture
def fashion(tmp_path, monkeypatch):
    """A mirror folder of Fashion-MNIST-shaped files (256 train, 200 test images: each label a
    bright square at its own place, so that a few steps learn it), published through
    ``FashionMNIST.files`` as the real table publishes the real files; returns the argv that
    trains on it."""
    rng = np.random.default_rng(7)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    table = {}
    for split, n in (("train", N_TRAIN), ("t10k", N_TEST)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            r, col = divmod(int(c), 5)
            images[i, 4 + 10 * r:12 + 10 * r, 1 + 5 * col:5 + 5 * col] = 250
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            raw = _idx(array)
            name = f"{split}-{kind}-ubyte"
            (mirror / f"{name}.gz").write_bytes(gzip.compress(raw, mtime=0))
            table[name] = datasets.download._FileInfo(len(raw), hashlib.sha256(raw).hexdigest())
    monkeypatch.setattr(datasets.FashionMNIST, "files", table)
    return ["--dataset", "fashion-mnist", "--mirror", str(mirror), "--data-dir", str(tmp_path / "data"),
            "--device", "cpu", "--no-progress", "--batch-size", "32"]


def train_here(argv, monkeypatch=None, evaluate=True):
    """Parse ``argv`` as the command does and train in this process; (summary, log lines)."""
    args = train.build_parser().parse_args(argv)
    train.check_args(args)
    if not evaluate:      # the test looks at the schedule, not at accuracy: skip the test-set passes
        monkeypatch.setattr(train, "evaluate", lambda model, loader, n: (0.0, np.zeros((n, n), np.int64)))
    log = []
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return train.train(args, log=log.append), log


def _values(history):
    """A history without its timings (the only entries two identical runs may differ in)."""
    return [{k: v for k, v in h.items() if k not in ("seconds", "images_per_second")} for h in history]


def _saved_arrays(path):
    model = cydnn.load(str(path))
    return {k: np.asarray(v) for k, v in model.state_dict().items()}


def test_seeded_runs_repeat_exactly_whatever_threads_the_load_leaves(fashion, tmp_path, monkeypatch):
    """The CPU kernels' thread counts follow the machine's load (ops/cpu/_threads.py's LoadProbe): runs with 1, 2
    and 3 threads give the same bits (the direct weight gradient once grouped its sums by thread: two seeded
    runs on the 16-core GPU machine differed in conv1.weight's last bits)."""
    from cydnn.ops.cpu import _threads
    weights = []
    for k in (1, 2, 3):
        monkeypatch.setattr(_threads, "kernel_threads", lambda e, k=k: k if e >= _threads.KERNEL_PARALLEL_ELEMENTS else 1)
        monkeypatch.setattr(_threads, "omp_threads", lambda e, k=k: k if e >= _threads.PARALLEL_ELEMENTS else 1)
        ckpt = tmp_path / f"threads{k}.npz"
        train_here(fashion + ["--epochs", "2", "--limit-train", "96", "--seed", "3", "--save", str(ckpt)])
        weights.append(_saved_arrays(ckpt))
    for other in weights[1:]:
        for name in weights[0]:
            assert weights[0][name].tobytes() == other[name].tobytes(), name


def test_seeded_runs_repeat_exactly_through_the_history_and_the_weights(fashion, tmp_path):
    runs = []
    for k, seed in enumerate((3, 3, 4)):
        ckpt = tmp_path / f"run{k}.npz"
        summary, _ = train_here(fashion + ["--epochs", "2", "--limit-train", "96", "--seed", str(seed),
                                          "--save", str(ckpt)])
        runs.append((summary, _saved_arrays(ckpt)))
    (a, wa), (b, wb), (c, wc) = runs
    assert len(a["history"]) == 2 and [h["epoch"] for h in a["history"]] == [1, 2]
    assert _values(a["history"]) == _values(b["history"])                  # every loss, accuracy, lr: equal
    assert wa.keys() == wb.keys() and len(wa) == 10
    for name in wa:
        assert wa[name].tobytes() == wb[name].tobytes(), name              # bit-exact
    assert any(wa[n].tobytes() != wc[n].tobytes() for n in wa)            # another seed: other weights
    assert _values(a["history"]) != _values(c["history"])


def test_fashion_mnist_trains_and_reports_what_its_checkpoint_scores(fashion, tmp_path):
    ckpt = tmp_path / "fashion.npz"
    summary, log = train_here(fashion + ["--epochs", "3", "--lr", "0.05", "--schedule", "none",
                                          "--save", str(ckpt)])
    assert summary["dataset"] == "fashion-mnist" and summary["train_images"] == N_TRAIN
    assert any(f"on fashion-mnist ({N_TRAIN} train / {N_TEST} test images) on cpu" in m for m in log)
    history = summary["history"]
    assert len(history) == 3 and summary["test_accuracy"] == history[-1]["test_accuracy"]
    assert summary["train_seconds"] == pytest.approx(sum(h["seconds"] for h in history), rel=1e-12)
    assert all(h["images_per_second"] == pytest.approx(N_TRAIN / h["seconds"]) for h in history)
    assert history[-1]["loss"] < history[0]["loss"]
    # An independent evaluation of the saved model on the test files, read back here.
    model = cydnn.load(str(ckpt))
    test = datasets.FashionMNIST(root=tmp_path / "data", train=False, download=False)
    assert len(test) == N_TEST
    acc = float((model.predict_classes(test.images) == test.labels).mean())
    assert acc == pytest.approx(summary["test_accuracy"], abs=1 / N_TEST + 1e-12)
    assert acc > 0.8                                   # the squares are learnt (92.5%): chance is 0.1
    # The model normalises with Fashion-MNIST's statistics, not MNIST's, and says what it learnt on.
    assert (model.mean, model.std) == (0.2860, 0.3530)
    assert cydnn.serialization.load_metadata(str(ckpt))["dataset"] == "fashion-mnist"


def test_schedule_step_decays_tenfold_each_third_of_the_epochs(fashion, monkeypatch):
    summary, _ = train_here(fashion + ["--epochs", "3", "--schedule", "step"], monkeypatch, evaluate=False)
    # StepLR(step_size=ceil(3/3)=1, gamma=0.1), stepped after each epoch; lr recorded after the step.
    assert [h["lr"] for h in summary["history"]] == pytest.approx([0.03 * 0.1, 0.03 * 0.01, 0.03 * 0.001],
                                                                   rel=1e-12)
    summary, _ = train_here(fashion + ["--epochs", "6", "--limit-train", "32", "--schedule", "step"],
                            monkeypatch, evaluate=False)
    assert [h["lr"] for h in summary["history"]] == pytest.approx([0.03, 0.003, 0.003, 0.0003, 0.0003, 3e-5],
                                                                   rel=1e-12)


def test_schedule_none_keeps_the_learning_rate_and_cosine_ends_at_zero(fashion, monkeypatch):
    summary, _ = train_here(fashion + ["--epochs", "2", "--schedule", "none", "--lr", "0.01"],
                            monkeypatch, evaluate=False)
    assert [h["lr"] for h in summary["history"]] == [0.01, 0.01] and summary["lr"] == 0.01
    summary, _ = train_here(fashion + ["--epochs", "2", "--schedule", "cosine"], monkeypatch, evaluate=False)
    # Cosine over every step (256 / 32 = 8 a epoch): half way at the end of epoch 1, zero at the end.
    lrs = [h["lr"] for h in summary["history"]]
    assert lrs[0] == pytest.approx(0.03 / 2, rel=1e-12) and lrs[1] == pytest.approx(0.0, abs=1e-17)


def test_optimizer_adam_is_used_with_its_defaults(fashion, monkeypatch):
    from cydnn import optim
    made = []

    def spy(cls):
        class Spy(cls):
            def __init__(self, params, **kwargs):
                made.append((cls.__name__, kwargs))
                super().__init__(params, **kwargs)
        return Spy
    monkeypatch.setattr(optim, "Adam", spy(optim.Adam))
    monkeypatch.setattr(optim, "SGD", spy(optim.SGD))
    summary, log = train_here(fashion + ["--epochs", "1", "--optimizer", "adam"], monkeypatch, evaluate=False)
    assert made == [("Adam", {"lr": 2e-3, "weight_decay": 5e-4})]
    assert summary["optimizer"] == "adam" and summary["lr"] == 2e-3
    assert any(": adam lr 0.002, batch 32, 1 epochs, seed 0" in m for m in log)
    made.clear()
    train_here(fashion + ["--epochs", "1", "--momentum", "0"], monkeypatch, evaluate=False)
    assert made == [("SGD", {"lr": 0.03, "momentum": 0.0, "nesterov": False, "weight_decay": 5e-4})]


def test_classic_trains_lecuns_lenet_on_padded_images(fashion, tmp_path):
    ckpt = tmp_path / "classic.npz"
    summary, log = train_here(fashion + ["--epochs", "1", "--classic", "--save", str(ckpt)])
    assert summary["model"] == "LeNet5(classic)"
    assert any("training LeNet-5 (classic) on fashion-mnist" in m for m in log)
    model = cydnn.load(str(ckpt))
    assert model.classic and model.input_pad == 2          # 28x28 images padded to LeCun's 32x32
    test = datasets.FashionMNIST(root=tmp_path / "data", train=False, download=False)
    acc = float((model.predict_classes(test.images) == test.labels).mean())
    assert acc == pytest.approx(summary["test_accuracy"], abs=1 / N_TEST + 1e-12)


def test_an_empty_data_loader_is_refused_and_drop_last_can_leave_no_batch():
    with pytest.raises(ValueError, match="^DataLoader: the dataset is empty$"):
        datasets.DataLoader(np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.uint8))
    loader = datasets.DataLoader(np.zeros((5, 28, 28), np.uint8), np.arange(5, dtype=np.uint8),
                                 batch_size=8, drop_last=True)
    assert len(loader) == 0 and list(loader) == []
    loader = datasets.DataLoader(np.zeros((5, 28, 28), np.uint8), np.arange(5, dtype=np.uint8), batch_size=8)
    assert len(loader) == 1 and [len(y) for _, y in loader] == [5]
