"""The training command's options: --help (defaults shown once and right, the program's name as it
was started), the checks made before any data is read, runs on small synthetic data through
--data (an .npz or an image folder this test writes), and the figure --plot draws (inspected as
matplotlib objects, not pixels).

Runs through --data need ``cydnn.datasets.from_npz`` (colour images also the loader's flips,
SmallCNN its layers); where this cydnn lacks them the tests are skipped saying so.
"""
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cydnn
from cydnn import datasets, train
from cydnn.train_cli import RECIPES, build_parser, check_args, check_model_input, program_name

needs_npz = pytest.mark.skipif(not hasattr(datasets, "from_npz"), reason="needs cydnn.datasets.from_npz")
needs_flip = pytest.mark.skipif("flip" not in inspect.signature(datasets.DataLoader).parameters,
                                reason="needs DataLoader(flip=) for colour images")
needs_smallcnn = pytest.mark.skipif(not (hasattr(cydnn.nn, "AdaptiveAvgPool2d") and hasattr(cydnn.nn, "BatchNorm2d")),
                                    reason="needs nn.AdaptiveAvgPool2d and nn.BatchNorm2d")

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(cydnn.__path__[0]),
                                                    os.environ.get("PYTHONPATH", "")])}


# ------------------------------------------------------------------- --help
def option_blocks(text):
    """``{"--epochs": "its help, on one line", ...}`` from argparse's help text."""
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(2)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return {k: re.sub(r"\s+", " ", v) for k, v in blocks.items()}


def test_help_shows_each_default_once_and_right():
    blocks = option_blocks(build_parser(prog="cydnn-train").format_help())
    for option, text in blocks.items():
        assert text.count("default") <= 1, f"{option}: {text}"
        assert "(default: None)" not in text and "(default: False)" not in text, f"{option}: {text}"
    expected = {
        "--model": "(default: lenet5)", "--dataset": "(default: mnist)", "--seed": "(default: 0)",
        "--device": "(default: auto)", "--optimizer": "(default: sgd)", "--momentum": "(default: 0.9)",
        "--schedule": "(default: cosine)", "--holdout": "(default: 0.1)",
        "--data-dir": "(default: $CYDNN_DATA or ./data)", "--cuda-graph": "(default: True)",
        "--epochs": "(default: 20 for lenet5 and mlp, 15 for smallcnn)",
        "--batch-size": "(default: 32 for lenet5, 64 for mlp, 128 for smallcnn)",
        "--weight-decay": "(default: 0.0005 for lenet5 and smallcnn, 0.0001 for mlp)",
        "--lr": "(default: with sgd 0.03 for lenet5, 0.05 for mlp and smallcnn; with adam 0.002 for lenet5 and "
                "smallcnn, 0.001 for mlp)",
    }
    for option, default in expected.items():
        assert default in blocks[option], f"{option}: {blocks[option]}"
    # The help's numbers are the recipes the run uses.
    for model in ("lenet5", "mlp"):
        args = check_args(build_parser().parse_args(["--model", model, "--device", "cpu"]))
        assert (args.epochs, args.batch_size, args.weight_decay) == tuple(
            RECIPES[model][k] for k in ("epochs", "batch_size", "weight_decay"))


def test_program_name_follows_how_the_command_was_started():
    assert program_name("/usr/local/bin/cydnn-train") == "cydnn-train"
    assert program_name(r"C:\env\Scripts\cydnn-train.exe".replace("\\", "/")) == "cydnn-train"
    assert program_name("/site-packages/cydnn/train.py") == "python -m cydnn.train"      # python -m
    assert program_name("-c") == "python -m cydnn.train"
    assert program_name("/usr/bin/pytest") == "python -m cydnn.train"


def test_help_of_the_module_and_of_the_script(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cydnn.train", "--help"], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m cydnn.train "), out.stdout[:200]
    # What pip's console-script wrapper does, under the script's own name.
    script = tmp_path / "cydnn-train"
    script.write_text("import sys\nfrom cydnn.train import main\nsys.exit(main())\n")
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=ENV,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: cydnn-train "), out.stdout[:200]
    out = subprocess.run([sys.executable, str(script), "--epochs", "x"], capture_output=True, text=True, env=ENV,
                         timeout=120)
    assert out.returncode == 2 and "cydnn-train: error: argument --epochs: invalid int value: 'x'" in out.stderr


# ------------------------------------------------------- checked before anything runs
@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """Fail if the command gets as far as reading data; run in an empty folder."""
    def refuse(*a, **k):
        raise AssertionError("the data were read before the arguments were checked")
    monkeypatch.setattr(train, "load_data", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--mirror", "/nonexistent-mirror"], "--mirror /nonexistent-mirror: the folder does not exist"),
    (["--mirror", "ftp://example.org/mnist"], "--mirror ftp://example.org/mnist: unsupported URL scheme 'ftp'"),
    (["--data", "/nonexistent.npz"], "--data /nonexistent.npz: no such file or folder"),
    (["--test-data", "t.npz"], "--test-data goes with --data"),
    (["--model", "mlp", "--classic"], "--classic is LeNet-5's; it cannot go with --model mlp"),
    (["--holdout", "0"], "--holdout must be a fraction in (0, 1), got 0.0"),
    (["--holdout", "nan"], "--holdout must be a fraction in (0, 1), got nan"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--epochs", "0", "--model", "smallcnn"], "--epochs must be >= 1, got 0"),
])
def test_bad_options_fail_before_any_data_is_read(no_training, argv, message):
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    assert str(info.value).startswith(message), info.value
    assert os.listdir(no_training) == []


def test_a_file_as_mirror_is_refused(no_training):
    (no_training / "m").write_text("")
    with pytest.raises(SystemExit, match="--mirror m: the folder is a file, not a folder"):
        train.main(["--mirror", "m"])


def test_dataset_and_data_are_exclusive(no_training, capsys):
    with pytest.raises(SystemExit) as info:
        train.main(["--dataset", "mnist", "--data", "x.npz"])
    assert info.value.code == 2 and "argument --data: not allowed with argument --dataset" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_training(no_training, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)          # import raises ImportError
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib: pip install 'cydnn\[plot\]'"):
        train.main(["--plot", "curves.png"])


@needs_npz
def test_mirror_with_data_is_refused(no_training):
    (no_training / "d.npz").write_bytes(b"")
    with pytest.raises(SystemExit, match="--mirror is for --dataset downloads"):
        train.main(["--data", "d.npz", "--mirror", "."])


def test_models_that_cannot_take_the_images_are_refused():
    with pytest.raises(SystemExit, match="--model lenet5 takes 1x28x28 images; cifar10 has 3x32x32"):
        check_model_input("lenet5", (3, 32, 32), "cifar10")
    with pytest.raises(SystemExit, match="--model lenet5-classic takes 1x28x28 images; x.npz has 1x32x32"):
        check_model_input("lenet5-classic", (1, 32, 32), "x.npz")
    with pytest.raises(SystemExit, match="--model smallcnn takes square images of at least 8x8; f has 3x32x16"):
        check_model_input("smallcnn", (3, 32, 16), "f")
    check_model_input("mlp", (3, 32, 16), "f")                 # an MLP takes any shape


@pytest.mark.skipif(not hasattr(datasets, "CIFAR10"), reason="needs cydnn.datasets.CIFAR10")
def test_lenet_on_cifar_is_refused_before_the_download(no_training):
    with pytest.raises(SystemExit, match="--model lenet5 takes 1x28x28 images; cifar10 has 3x32x32"):
        train.main(["--dataset", "cifar10"])


@pytest.mark.skipif(hasattr(cydnn.nn, "AdaptiveAvgPool2d") and hasattr(cydnn.nn, "BatchNorm2d"),
                    reason="this cydnn has SmallCNN's layers")
def test_smallcnn_without_its_layers_is_refused_before_training(no_training):
    with pytest.raises(SystemExit, match="--model smallcnn needs cydnn.nn."):
        train.main(["--model", "smallcnn"])


def test_the_recipe_fills_what_was_not_given():
    args = check_args(build_parser().parse_args(["--model", "mlp", "--epochs", "3"]))
    assert (args.epochs, args.batch_size, args.weight_decay, args.dataset) == (3, 64, 1e-4, "mnist")
    assert check_args(build_parser().parse_args(["--classic"])).model == "lenet5-classic"


# ----------------------------------------------------------------- runs on --data
def bars(n, channels, side, seed):
    """n images whose class (0, 1, 2) is where a bright bar is: learnable in an epoch or two."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    x = rng.integers(0, 60, (n, channels, side, side)).astype(np.uint8)
    for img, label in zip(x, labels):
        img[:, label * side // 3:(label + 1) * side // 3, 1:-1] = 230
    return (x[:, 0] if channels == 1 else x), labels


def write_npz(path, images, labels):
    np.savez(path, images=images, labels=labels)
    return str(path)


def run(capsys, *argv, device="cpu"):
    assert train.main(["--device", device, "--no-progress", "--json", *argv]) == 0
    out = capsys.readouterr()
    return json.loads(out.out.strip().splitlines()[-1]), out


@needs_npz
def test_mlp_on_an_npz_with_a_test_file_checkpoint_and_plot(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    images, labels = bars(240, 1, 12, seed=0)
    test_images, test_labels = bars(60, 1, 12, seed=1)
    figures = []
    import cydnn.train_plot as train_plot
    original = train_plot.make_figure
    monkeypatch.setattr(train_plot, "make_figure", lambda *a, **k: figures.append(original(*a, **k)) or figures[-1])
    summary, out = run(capsys, "--model", "mlp", "--data", write_npz(tmp_path / "train.npz", images, labels),
                       "--test-data", write_npz(tmp_path / "test.npz", test_images, test_labels),
                       "--epochs", "3", "--save", str(tmp_path / "m.npz"), "--plot", str(tmp_path / "p.png"))
    assert summary["model"] == "MLP" and summary["train_images"] == 240 and summary["epochs"] == 3
    assert summary["dataset"].endswith("train.npz") and summary["batch_size"] == RECIPES["mlp"]["batch_size"]
    assert summary["test_accuracy"] > 0.9
    assert [line.split()[1] for line in out.out.splitlines()[:-1]] == ["1/3", "2/3", "3/3"]
    model = cydnn.load(str(tmp_path / "m.npz"))
    assert isinstance(model, cydnn.models.MLP) and model.input_shape == (1, 12, 12)
    acc = float((model.predict_classes(test_images) == test_labels).mean())
    assert acc == pytest.approx(summary["test_accuracy"], abs=1e-9)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"final test accuracy {summary['test_accuracy']:.2%}" in figures[0]._suptitle.get_text()
    assert "MLP on " in figures[0]._suptitle.get_text()


@needs_npz
def test_holdout_split_and_quiet(tmp_path, capsys):
    images, labels = bars(200, 1, 10, seed=2)
    summary, out = run(capsys, "--model", "mlp", "--data", write_npz(tmp_path / "d.npz", images, labels),
                       "--holdout", "0.25", "--epochs", "1", "--quiet")
    assert summary["train_images"] == 150
    assert out.out.strip().splitlines() == [out.out.strip()] and out.err == ""      # only the JSON line
    again, _ = run(capsys, "--model", "mlp", "--data", str(tmp_path / "d.npz"), "--holdout", "0.25", "--epochs",
                   "1", "--quiet")
    assert again["test_accuracy"] == summary["test_accuracy"]                       # seeded split and run


@needs_npz
def test_lenet_refuses_colour_data_after_reading_it(tmp_path):
    images, labels = bars(30, 3, 12, seed=0)
    with pytest.raises(SystemExit, match=r"--model lenet5 takes 1x28x28 images; .*c.npz has 3x12x12"):
        train.main(["--device", "cpu", "--data", write_npz(tmp_path / "c.npz", images, labels)])


@needs_npz
@needs_flip
def test_mlp_on_colour_images(tmp_path, capsys):
    images, labels = bars(240, 3, 8, seed=3)
    summary, _ = run(capsys, "--model", "mlp", "--data", write_npz(tmp_path / "c.npz", images, labels),
                     "--epochs", "3", "--save", str(tmp_path / "m.npz"))
    model = cydnn.load(str(tmp_path / "m.npz"))
    assert model.input_shape == (3, 8, 8) and summary["test_accuracy"] > 0.8


@needs_npz
@needs_flip
@needs_smallcnn
def test_smallcnn_on_colour_images(tmp_path, capsys):
    images, labels = bars(120, 3, 8, seed=4)
    summary, _ = run(capsys, "--model", "smallcnn", "--data", write_npz(tmp_path / "c.npz", images, labels),
                     "--epochs", "2", "--batch-size", "32", "--save", str(tmp_path / "s.npz"))
    model = cydnn.load(str(tmp_path / "s.npz"))
    assert isinstance(model, cydnn.models.SmallCNN) and model.input_shape == (3, 8, 8)
    assert summary["model"] == "SmallCNN" and 0 <= summary["test_accuracy"] <= 1


@needs_npz
@needs_smallcnn
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_smallcnn_on_grey_images_checkpoint_predicts_the_reported_accuracy(tmp_path, capsys, device):
    images, labels = bars(96, 1, 8, seed=6)
    test_images, test_labels = bars(40, 1, 8, seed=7)
    summary, _ = run(capsys, "--model", "smallcnn", "--data", write_npz(tmp_path / "g.npz", images, labels),
                     "--test-data", write_npz(tmp_path / "t.npz", test_images, test_labels),
                     "--epochs", "2", "--batch-size", "32", "--save", str(tmp_path / "s.npz"), device=device)
    model = cydnn.load(str(tmp_path / "s.npz"), device=device)
    assert isinstance(model, cydnn.models.SmallCNN) and model.config()["batch_norm"] is True
    assert summary["device"] == device
    assert model.input_shape == (1, 8, 8) and summary["model"] == "SmallCNN" and summary["train_images"] == 96
    acc = float((model.predict_classes(test_images) == test_labels).mean())
    # Eval mode: BatchNorm's running statistics.  On the GPU the compiled predict (BatchNorm folded into the
    # convolutions) may round one near-tie differently from the run's per-layer evaluation.
    assert acc == pytest.approx(summary["test_accuracy"], abs=1e-9 if device == "cpu" else 1.5 / len(test_labels))


@needs_npz
def test_flip_on_grey_images_is_refused(tmp_path):
    images, labels = bars(30, 1, 8, seed=0)
    with pytest.raises(SystemExit, match="--flip is for colour images"):
        train.main(["--device", "cpu", "--model", "mlp", "--flip", "--data",
                    write_npz(tmp_path / "g.npz", images, labels)])


@pytest.mark.skipif(not hasattr(datasets, "ImageFolder"), reason="needs cydnn.datasets.ImageFolder")
def test_mlp_on_an_image_folder(tmp_path, capsys):
    Image = pytest.importorskip("PIL.Image")
    images, labels = bars(60, 1, 8, seed=5)
    for i, (img, label) in enumerate(zip(images, labels)):
        folder = tmp_path / "imgs" / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{i}.png")
    summary, _ = run(capsys, "--model", "mlp", "--data", str(tmp_path / "imgs"), "--epochs", "1")
    assert summary["train_images"] == 54 and summary["model"] == "MLP"


# -------------------------------------------------------------------- the figure
def history(epochs):
    return [{"epoch": e, "loss": 1 / e, "train_accuracy": 0.5 + e / 100, "test_accuracy": 0.6 + e / 200}
            for e in range(1, epochs + 1)]


@pytest.mark.parametrize("epochs", [1, 3, 7, 40])
def test_figure_has_integer_epoch_ticks_a_labelled_colour_bar_and_the_accuracy(epochs):
    pytest.importorskip("matplotlib")
    from cydnn.train_plot import make_figure
    confusion = np.array([[50, 2, 0], [3, 40, 1], [0, 0, 1000]])
    fig = make_figure(history(epochs), confusion, ["a", "b", "c"], title="MLP on x")
    loss_ax, acc_ax, matrix_ax, bar_ax = fig.axes
    for ax in (loss_ax, acc_ax):
        lo, hi = ax.get_xlim()
        visible = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert visible and all(float(t).is_integer() for t in visible), visible
        assert ax.get_xlabel() == "epoch"
    assert bar_ax.get_ylabel() == "test images (log scale)"
    ticks = [t.get_text() for t in bar_ax.get_yticklabels()]
    assert "0" in ticks and "1,000" in ticks
    final = history(epochs)[-1]["test_accuracy"]
    assert fig._suptitle.get_text() == f"MLP on x: final test accuracy {final:.2%}"
    assert [t.get_text() for t in matrix_ax.get_yticklabels()] == ["a", "b", "c"]
    cells = {t.get_text() for t in matrix_ax.texts}
    assert {"50", "2", "1000"} <= cells


def test_plot_writes_a_png_atomically(tmp_path):
    pytest.importorskip("matplotlib")
    from cydnn.train_plot import plot
    plot(history(2), np.eye(2, dtype=np.int64) * 5, ["0", "1"], str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["c.png"]


def test_the_plot_leaves_pyplot_and_the_backend_alone():
    pytest.importorskip("matplotlib")
    code = textwrap.dedent("""
        import matplotlib, os, sys, tempfile
        before = dict.__getitem__(matplotlib.rcParams, "backend")      # read without resolving it
        from cydnn.train_plot import plot
        plot([{"epoch": 1, "loss": 1.0, "train_accuracy": 0.5, "test_accuracy": 0.5}], None, [],
             os.path.join(tempfile.mkdtemp(), "c.png"))
        assert "matplotlib.pyplot" not in sys.modules
        assert dict.__getitem__(matplotlib.rcParams, "backend") == before
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
