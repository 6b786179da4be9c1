"""The command line of ``cydnn-train`` / ``python -m cydnn.train``: the parser, the recipes
(each model's defaults), and the checks that run before any data is loaded or any step taken.

Every option that can fail is checked here, at once, in one line: numbers,
the --save and --plot folders, matplotlib for --plot, the mirrors, the --data
path, and whether the model can take the named dataset's images.
"""
import argparse
import math
import os
import sys
import urllib.parse

__all__ = ["build_parser", "check_args", "program_name", "MODELS", "DATASETS", "RECIPES"]

MODELS = ("lenet5", "lenet5-classic", "mlp", "smallcnn")

#: --dataset name -> the class in cydnn.datasets.
DATASETS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10"}
#: Image shape (C, H, W) of each named dataset, known before loading it.
DATASET_SHAPES = {"mnist": (1, 28, 28), "fashion-mnist": (1, 28, 28), "cifar10": (3, 32, 32)}

#: Each model's training recipe: what --epochs, --batch-size, --lr, --weight-decay and --max-shift
#: default to.  SGD is Nesterov with --momentum; both schedules as --schedule says.
#: smallcnn: BatchNorm lets a large step train fast; colour images also get flips and shifts of 4
#: (with zero padding: the usual CIFAR random crop).
RECIPES = {
    "lenet5": dict(epochs=20, batch_size=32, lr={"sgd": 0.03, "adam": 2e-3}, weight_decay=5e-4, max_shift=2),
    "mlp": dict(epochs=20, batch_size=64, lr={"sgd": 0.05, "adam": 1e-3}, weight_decay=1e-4, max_shift=0),
    "smallcnn": dict(epochs=15, batch_size=128, lr={"sgd": 0.05, "adam": 2e-3}, weight_decay=5e-4, max_shift=2,
                     colour_max_shift=4),
}
RECIPES["lenet5-classic"] = RECIPES["lenet5"]


def program_name(argv0=None):
    """How the command was started: ``cydnn-train`` (the installed script, by whatever name it
    was called) or ``python -m cydnn.train`` (anything else: -m, -c, a test runner)."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0 or "")
    if name.lower().endswith(".exe"):
        name = name[:-4]
    return name if name.startswith("cydnn") and not name.endswith(".py") else "python -m cydnn.train"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown once: not for options whose help says its own default (or has none to say)."""

    def _get_help_string(self, action):
        text = action.help or ""
        nothing = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if "%(default)" in text or "default:" in text or nothing:
            return text
        return text + " (default: %(default)s)"


def _recipe_help(key, fmt=str):
    values = {}
    for model in ("lenet5", "mlp", "smallcnn"):
        values.setdefault(fmt(RECIPES[model][key]), []).append(model)
    return ", ".join(f"{v} for {' and '.join(ms)}" for v, ms in values.items())


def build_parser(prog=None):
    p = argparse.ArgumentParser(prog=prog or program_name(), description=_DESCRIPTION,
                                formatter_class=_HelpFormatter)
    p.add_argument("--model", choices=MODELS, default="lenet5",
                   help="lenet5 (LeCun's network, modern: ReLU, max-pool), lenet5-classic (1998: tanh, avg-pool, "
                        "32x32), mlp (one hidden layer of 128), smallcnn (VGG-style blocks with BatchNorm, global "
                        "average pooling)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--dataset", choices=sorted(DATASETS), default=None,
                      help="a dataset downloaded and cached by cydnn (default: mnist)")
    data.add_argument("--data", default=None, metavar="PATH",
                      help="your own images: an .npz with 'images' (N, H, W) or (N, C, H, W) uint8 and 'labels', "
                           "or a folder with one sub-folder of images per class")
    p.add_argument("--test-data", default=None, metavar="PATH",
                   help="the test set for --data (same forms); without it, --holdout of --data is held out")
    p.add_argument("--holdout", type=float, default=0.1, metavar="FRACTION",
                   help="with --data and no --test-data: the fraction of the images kept for testing")
    p.add_argument("--data-dir", default=None, help="dataset cache (default: $CYDNN_DATA or ./data)")
    p.add_argument("--mirror", action="append", default=None, metavar="URL_OR_DIR",
                   help="where to download from, tried in order (repeatable; replaces the default mirrors)")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"passes over the training images (default: {_recipe_help('epochs')})")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"images per step (default: {_recipe_help('batch_size')})")
    sgd, adam = (_recipe_help("lr", lambda v, o=o: f"{v[o]:g}") for o in ("sgd", "adam"))
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: with sgd {sgd}; with adam {adam})")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="SGD is Nesterov with --momentum")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (Nesterov)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help=f"L2 penalty on the weights (default: {_recipe_help('weight_decay')})")
    p.add_argument("--schedule", choices=["cosine", "step", "none"], default="cosine",
                   help="cosine: to 0 over the run, per step; step: x0.1 every third of the epochs")
    p.add_argument("--max-shift", type=int, default=None,
                   help=f"random translation of training images, in pixels (default: {_recipe_help('max_shift')}; "
                        f"4 for smallcnn on colour images)")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                   help="random horizontal flips of colour training images (default: on for colour images, "
                        "which only they can have)")
    p.add_argument("--classic", action="store_true", help="the same as --model lenet5-classic")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: the GPU when one is usable, else the CPU")
    p.add_argument("--seed", type=int, default=0, help="weights, order, augmentation and --holdout split")
    p.add_argument("--limit-train", type=int, default=None, metavar="N", help="use the first N training images")
    p.add_argument("--save", default=None, metavar="PATH", help="write a checkpoint (.npz) at the end")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write loss/accuracy curves and a confusion matrix (PNG; needs matplotlib)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="on the GPU, train with the compiled step (cydnn.compile: each step one CUDA graph; "
                        "LeNet-5 on its fused kernels); --no-cuda-graph runs the per-op reference loop")
    p.add_argument("--json", action="store_true", help="print one JSON summary object as the last line")
    p.add_argument("--traceback", action="store_true",
                   help="on Ctrl-C or an error, show the Python traceback as well as the one-line message")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars, no per-epoch lines, no notes: only errors and the --json line")
    return p


_DESCRIPTION = """Train a classifier (LeNet-5, an MLP or a small CNN) on MNIST, Fashion-MNIST, CIFAR-10
or your own images, from one command.  Some defaults depend on --model: each model has its recipe."""


def _fail(message):
    raise SystemExit(message)


def check_args(args):
    """Resolve the recipe's defaults, then refuse bad values before anything is loaded or trained:
    SystemExit with one line.  Returns ``args`` (completed: model, dataset, recipe values)."""
    if args.classic:
        if args.model not in ("lenet5", "lenet5-classic"):
            _fail(f"--classic is LeNet-5's; it cannot go with --model {args.model}")
        args.model = "lenet5-classic"
    if args.data is None and args.dataset is None:
        args.dataset = "mnist"
    recipe = RECIPES[args.model]
    for name in ("epochs", "batch_size", "weight_decay"):
        if getattr(args, name) is None:
            setattr(args, name, recipe[name])
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit_train is not None and args.limit_train < 1:
        _fail(f"--limit-train must be >= 1, got {args.limit_train}")
    if args.max_shift is not None and args.max_shift < 0:
        _fail(f"--max-shift must be >= 0, got {args.max_shift}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        _fail(f"--lr must be a finite number > 0, got {args.lr}")
    for name in ("momentum", "weight_decay"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            _fail(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if not (math.isfinite(args.holdout) and 0 < args.holdout < 1):
        _fail(f"--holdout must be a fraction in (0, 1), got {args.holdout}")
    if args.seed < 0:
        _fail(f"--seed must be >= 0, got {args.seed}")
    for option, path in (("--save", args.save), ("--plot", args.plot)):
        if path:
            _check_output_path(option, path)
    if args.plot:
        check_plot_backend()
    check_model_available(args.model)
    _check_data(args)
    args.checked = True
    return args


def check_plot_backend():
    """SystemExit when matplotlib (its Figure and Agg canvas: no display needed) cannot be imported."""
    try:
        import matplotlib.figure  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as e:
        _fail(f"--plot needs matplotlib: pip install 'cydnn[plot]' ({e})")


def _check_output_path(option, path):
    """SystemExit with one line when nothing can be written at ``path`` (checked before training)."""
    if os.path.isdir(path):
        _fail(f"{option}: cannot write {path}: it is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        _fail(f"{option}: cannot write {path}: the folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        _fail(f"{option}: cannot write {path}: the folder {folder} is not writable")


def _check_mirror(mirror):
    if "://" in mirror:
        scheme = urllib.parse.urlsplit(mirror).scheme.lower()
        if scheme not in ("http", "https", "file"):
            _fail(f"--mirror {mirror}: unsupported URL scheme {scheme!r} (use http://, https://, file:// or a folder)")
    elif not os.path.isdir(os.path.expanduser(mirror)):
        what = "is a file, not a folder" if os.path.exists(os.path.expanduser(mirror)) else "does not exist"
        _fail(f"--mirror {mirror}: the folder {what} (a mirror is a URL or a folder holding the dataset's files)")


def _check_data(args):
    """The data options: the mirrors, the --data paths, the dataset's availability in this cydnn,
    and whether the model can take a named dataset's images."""
    from . import datasets
    if args.data is not None:
        if args.mirror:
            _fail("--mirror is for --dataset downloads; --data reads your own files")
        for option, path in (("--data", args.data), ("--test-data", args.test_data)):
            if path is None:
                continue
            if not os.path.exists(path):
                _fail(f"{option} {path}: no such file or folder")
            need = "ImageFolder" if os.path.isdir(path) else "from_npz"
            if not hasattr(datasets, need):
                _fail(f"{option} {path}: reading it needs cydnn.datasets.{need}, which this cydnn lacks")
        return
    if args.test_data is not None:
        _fail("--test-data goes with --data (a --dataset has its own test set)")
    for mirror in args.mirror or ():
        _check_mirror(mirror)
    if not hasattr(datasets, DATASETS[args.dataset]):
        _fail(f"--dataset {args.dataset} needs cydnn.datasets.{DATASETS[args.dataset]}, which this cydnn lacks")
    check_model_input(args.model, DATASET_SHAPES[args.dataset], args.dataset)


def check_model_input(model, shape, source):
    """SystemExit when ``model`` cannot take images of ``shape`` (C, H, W) from ``source``."""
    c, h, w = shape
    if model.startswith("lenet5") and shape != (1, 28, 28):
        _fail(f"--model {model} takes 1x28x28 images; {source} has {c}x{h}x{w}: use --model smallcnn or mlp")
    if model == "smallcnn" and (h != w or h < 8):
        _fail(f"--model smallcnn takes square images of at least 8x8; {source} has {c}x{h}x{w}")


def check_model_available(model):
    """SystemExit when this cydnn lacks a layer ``model`` needs."""
    from . import nn
    needs = {"smallcnn": ("AdaptiveAvgPool2d", "BatchNorm2d")}.get(model, ())
    missing = [name for name in needs if not hasattr(nn, name)]
    if missing:
        _fail(f"--model {model} needs {' and '.join('cydnn.nn.' + m for m in missing)}, which this cydnn lacks")
