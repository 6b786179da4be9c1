"""Train a classifier on MNIST, Fashion-MNIST, CIFAR-10 or your own images from one command.

    python -m cydnn.train                         # LeNet-5 on MNIST, on the GPU when there is one
    python -m cydnn.train --device cpu --epochs 1 --limit-train 10000 --json
    python -m cydnn.train --model smallcnn --dataset fashion-mnist
    python -m cydnn.train --model smallcnn --data my_images.npz      # 'images' and 'labels'

Each model has its recipe (``train_cli.RECIPES``); LeNet-5's (SGD with
Nesterov momentum 0.9, lr 0.03 with a cosine schedule per step, weight decay
5e-4, batch 32, random shifts of up to 2 pixels, 20 epochs) reaches better
than 99.2% test accuracy on MNIST -- LeCun et al. (1998) report 0.95% error
(99.05%) for LeNet-5.

On the GPU the whole dataset is uploaded once and batches are built there
(``ops.gather_batch``); a training step queues its kernels without waiting for
the GPU.  Losses and predictions are read back once per epoch.

The command line (parser, recipes, the checks made before anything is loaded)
is in ``train_cli.py``, the figure in ``train_plot.py``; this module runs the training.
"""
import functools
import json
import math
import os
import signal
import sys
import threading

import numpy as np

from .train_cli import DATASETS, RECIPES, _check_output_path, build_parser, check_args  # noqa: F401
from .train_cli import check_model_input, program_name  # noqa: F401
from .train_plot import make_figure, plot  # noqa: F401

__all__ = ["main", "train", "build_parser", "check_args", "plot", "TrainingInterrupted"]


def resolve_device(name, log):
    """'auto' -> 'cuda' when a GPU is usable, else 'cpu' (said once)."""
    import cydnn
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        cydnn.cuda.check_device(0)  # raises DeviceUnavailableError with the reason
        return "cuda"
    try:
        cydnn.cuda.check_device(0)
        return "cuda"
    except cydnn.CydnnError as e:
        log(f"no usable GPU ({e}); training on the CPU")
        return "cpu"


def _lr_schedule(optimizer, args, steps_per_epoch):
    from cydnn import optim
    if args.schedule == "cosine":
        return optim.CosineAnnealingLR(optimizer, T_max=max(1, args.epochs * steps_per_epoch)), "step"
    if args.schedule == "step":
        return optim.StepLR(optimizer, step_size=max(1, math.ceil(args.epochs / 3)), gamma=0.1), "epoch"
    return None, None


def evaluate(model, loader, num_classes):
    """(accuracy, confusion matrix) over a loader, in eval mode."""
    from cydnn import ops
    model.eval()
    confusion = np.zeros((num_classes, num_classes), np.int64)
    for x, y in loader:
        backend = ops.backend_of(x)
        pred = backend.to_numpy(model(x)).argmax(axis=1)
        np.add.at(confusion, (backend.to_numpy(y).astype(np.int64), pred), 1)
    return float(np.trace(confusion) / max(1, confusion.sum())), confusion


class Data:
    """What the training needs of a dataset: the arrays of both splits, the class names, the
    per-channel statistics, and a name for the messages."""

    def __init__(self, name, train_images, train_labels, test_images, test_labels, classes, mean, std):
        self.name, self.classes = name, list(classes)
        self.train_images, self.train_labels = train_images, train_labels
        self.test_images, self.test_labels = test_images, test_labels
        self.shape = (1,) + train_images.shape[1:] if train_images.ndim == 3 else tuple(train_images.shape[1:])
        self.mean, self.std = _per_channel(mean, self.shape[0]), _per_channel(std, self.shape[0])

    @property
    def num_classes(self):
        return len(self.classes)


def _per_channel(value, channels):
    """A dataset's mean or std as the model and the loader take it: a float for one channel, else a tuple."""
    values = [float(v) for v in np.atleast_1d(np.asarray(value, dtype=np.float64)).ravel()]
    if len(values) not in (1, channels):
        raise SystemExit(f"the dataset gives {len(values)} values for its mean or std, not 1 or {channels} "
                         f"(one per channel)")
    if channels == 1:
        return values[0]
    return tuple(values) if len(values) == channels else tuple(values * channels)


def _read_user_data(datasets, path):
    """An .npz (``images``, ``labels``) or an image folder, through cydnn.datasets."""
    return datasets.ImageFolder(path) if os.path.isdir(path) else datasets.from_npz(path)


def _classes_of(dataset):
    classes = getattr(dataset, "classes", None)
    if classes is None or not len(classes):
        classes = [str(i) for i in range(int(dataset.num_classes))]
    return list(classes)


def load_data(args, log):
    """The training and test images of ``--dataset`` (downloaded and cached) or ``--data``
    (with ``--test-data``, or ``--holdout`` of it, split with ``--seed``)."""
    from cydnn import datasets
    if args.data is None:
        cls = getattr(datasets, DATASETS[args.dataset])
        train_set = cls(root=args.data_dir, train=True, mirrors=args.mirror)
        test_set = cls(root=args.data_dir, train=False, mirrors=args.mirror)
        return Data(args.dataset, train_set.images, train_set.labels, test_set.images, test_set.labels,
                    _classes_of(train_set), train_set.mean, train_set.std)
    full = _read_user_data(datasets, args.data)
    images, labels = full.images, np.asarray(full.labels)
    if args.test_data is not None:
        test = _read_user_data(datasets, args.test_data)
        if test.images.shape[1:] != images.shape[1:]:
            raise SystemExit(f"--test-data {args.test_data} holds images of shape {test.images.shape[1:]}, "
                             f"--data {args.data} of shape {images.shape[1:]}: they must be alike")
        classes = _classes_of(full) if len(_classes_of(full)) >= len(_classes_of(test)) else _classes_of(test)
        return Data(args.data, images, labels, test.images, np.asarray(test.labels), classes, full.mean, full.std)
    n_test = int(round(args.holdout * len(images)))
    if n_test < 1 or n_test >= len(images):
        raise SystemExit(f"--holdout {args.holdout} of the {len(images)} images of {args.data} leaves "
                         f"{n_test} test and {len(images) - n_test} training images: both need at least one "
                         f"(or give --test-data)")
    order = np.random.default_rng(np.random.SeedSequence(args.seed, spawn_key=(2,))).permutation(len(images))
    test_idx, train_idx = np.sort(order[:n_test]), np.sort(order[n_test:])
    log(f"holding out {n_test} of the {len(images)} images of {args.data} for testing (--holdout {args.holdout}, "
        f"seed {args.seed})")
    return Data(args.data, images[train_idx], labels[train_idx], images[test_idx], labels[test_idx],
                _classes_of(full), full.mean, full.std)


def build_model(args, data):
    """The model ``--model`` names, for ``data``'s images and classes (on the CPU)."""
    from cydnn import models
    check_model_input(args.model, data.shape, data.name)
    c, h, w = data.shape
    common = dict(mean=data.mean, std=data.std, seed=args.seed)
    try:
        if args.model.startswith("lenet5"):
            return models.LeNet5(classic=args.model == "lenet5-classic", num_classes=data.num_classes, **common)
        if args.model == "mlp":
            return models.MLP(sizes=(c * h * w, 128, data.num_classes), input_shape=data.shape, **common)
        return models.SmallCNN(in_channels=c, num_classes=data.num_classes, input_size=h, **common)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise SystemExit(f"--model {args.model} cannot be built for {data.name}: {e}") from None


def _model_name(model):
    return type(model).__name__ + ("(classic)" if getattr(model, "classic", False) else "")


def train(args, log=None):
    """Run the training described by parsed ``args``; returns the summary dict.

    ``args`` as :func:`build_parser` parses them; :func:`check_args` completes them (the
    recipe's defaults) and runs here if it did not already."""
    import cydnn
    from cydnn import datasets, nn, optim

    if not getattr(args, "checked", False):
        check_args(args)
    quiet = getattr(args, "quiet", False)
    log = log or ((lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr)))
    device = resolve_device(args.device, log)

    data = load_data(args, log)
    train_images, train_labels = data.train_images, data.train_labels
    if args.limit_train is not None:
        if args.limit_train > len(train_images):
            log(f"--limit-train {args.limit_train} is more than the {len(train_images)} training images: "
                f"using all of them")
        train_images, train_labels = train_images[:args.limit_train], train_labels[:args.limit_train]
    _note_sizes(args, len(train_images), log)

    model = build_model(args, data).to(device)
    recipe = RECIPES[args.model]
    colour = data.shape[0] > 1
    max_shift = args.max_shift if args.max_shift is not None else \
        recipe.get("colour_max_shift", recipe["max_shift"]) if colour else recipe["max_shift"]
    flip = colour if args.flip is None else args.flip
    if flip and not colour:
        raise SystemExit(f"--flip is for colour images; {data.name} is single-channel (a flipped digit is "
                         f"another digit): use --max-shift")
    common = dict(mean=data.mean, std=data.std, pad=model.input_pad, device=device, seed=args.seed,
                  num_classes=data.num_classes)
    train_loader = datasets.DataLoader(train_images, train_labels, batch_size=args.batch_size, shuffle=True,
                                       max_shift=max_shift, flip=flip, **common)
    test_loader = datasets.DataLoader(data.test_images, data.test_labels, batch_size=1000, shuffle=False,
                                      max_shift=0, **common)

    lr = recipe["lr"][args.optimizer] if args.lr is None else args.lr
    if args.optimizer == "adam":
        optimizer = optim.Adam(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    else:
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.momentum > 0,
                              weight_decay=args.weight_decay)
    scheduler, schedule_unit = _lr_schedule(optimizer, args, len(train_loader))
    loss_fn = nn.CrossEntropyLoss()

    name = "LeNet-5" + (" (classic)" if args.model == "lenet5-classic" else "") if args.model.startswith("lenet5") \
        else type(model).__name__
    log(f"training {name} on {data.name} "
        f"({len(train_images)} train / {len(data.test_images)} test images) on {device}"
        + (f" [{cydnn.cuda.get_device_name()}]" if device == "cuda" else "")
        + f": {args.optimizer} lr {lr:g}, batch {args.batch_size}, {args.epochs} epochs, seed {args.seed}")

    progress = None
    if not (args.no_progress or quiet):
        try:
            from tqdm import tqdm as progress
        except ImportError:  # tqdm is a dependency, but keep training without it
            progress = None

    # The compiled step (cydnn.compiler): the whole step one CUDA graph on the GPU (LeNet-5: its fused
    # kernels); the per-op reference loop on the CPU, with --no-cuda-graph, or for what it can't run.
    compiled = model.compile(optimizer, args.batch_size, loss_fn=loss_fn, cuda_graph=args.cuda_graph,
                             fused=args.cuda_graph)
    info = compiled.info()
    if device == "cuda":
        log(f"execution: {info['mode']}" + (f" ({info['reason']})" if info["reason"] else ""))

    history = []
    train_seconds = 0.0
    unguard = _interrupt_guard(history, args.epochs)
    for epoch in range(1, args.epochs + 1):
        model.train()
        bar = None if progress is None else functools.partial(
            progress, desc=f"epoch {epoch}/{args.epochs}", unit="batch", leave=False, file=sys.stderr, disable=None)
        stats = compiled.train_epoch(train_loader, scheduler if schedule_unit == "step" else None, progress=bar)
        seconds, loss, train_acc = stats["seconds"], stats["loss"], stats["accuracy"]
        train_seconds += seconds
        if schedule_unit == "epoch":
            scheduler.step()
        test_acc, confusion = evaluate(model, test_loader, data.num_classes)
        record = {"epoch": epoch, "loss": loss, "train_accuracy": train_acc, "test_accuracy": test_acc,
                  "seconds": seconds, "images_per_second": len(train_images) / seconds,
                  "lr": optimizer.lr}
        history.append(record)
        if not quiet:
            print(f"epoch {epoch:2d}/{args.epochs}  loss {loss:.4f}  train acc {train_acc:.2%}  "
                  f"test acc {test_acc:.2%}  {record['images_per_second']:,.0f} img/s  {seconds:.2f} s", flush=True)
        if not math.isfinite(loss):
            unguard()
            raise SystemExit(f"training diverged at epoch {epoch}/{args.epochs} (loss {loss}); try a smaller "
                             f"--lr (it was {lr:g})" + (f"; {args.save} was not written" if args.save else ""))
    unguard()

    summary = {
        "test_accuracy": history[-1]["test_accuracy"] if history else None,
        "epochs": args.epochs,
        "train_seconds": train_seconds,
        "seconds_per_epoch": train_seconds / max(1, args.epochs),
        "device": device,
        "dataset": data.name,
        "model": _model_name(model),
        "optimizer": args.optimizer,
        "lr": lr,
        "batch_size": args.batch_size,
        "execution": compiled.info()["mode"],
        "seed": args.seed,
        "train_images": len(train_images),
        "history": history,
    }
    if args.save:
        cydnn.save(model, args.save, metadata={k: v for k, v in summary.items() if k != "history"})
        log(f"saved {args.save}")
    if args.plot:
        plot(history, confusion if history else None, data.classes, args.plot, title=f"{name} on {data.name}")
        log(f"wrote {args.plot}")
    return summary


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during the training loop: ``epoch`` was in progress, out of ``epochs``."""

    def __init__(self, epoch, epochs):
        super().__init__(f"interrupted during epoch {epoch}/{epochs}")
        self.epoch, self.epochs = epoch, epochs


def _interrupt_guard(history, epochs):
    """Make Ctrl-C in the training loop raise TrainingInterrupted (naming the epoch in progress,
    ``len(history) + 1``); returns the function that puts the previous handler back.

    Python's own handler raises KeyboardInterrupt between two bytecodes, so the
    loop stops within one op (milliseconds on the CPU; on the GPU the next
    read-back waits for the queued kernels).  Nothing is saved then: a
    checkpoint is only ever written whole, after the last epoch.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):           # ignored (nohup, a background job): leave it so
        return lambda: None

    def handler(signum, frame):
        raise TrainingInterrupted(len(history) + 1, epochs)
    signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, previous)


def _note_sizes(args, used, log):
    """Say when --batch-size exceeds the (limited) training set: it works, one batch per epoch."""
    if args.batch_size > used:
        log(f"note: --batch-size {args.batch_size} is more than the {used} training images: "
            f"one batch of {used} per epoch")


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):   # a divergence says so itself
            summary = train(args)
    except KeyboardInterrupt as e:
        if args.traceback:
            import traceback
            traceback.print_exc()
        where = f" during epoch {e.epoch}/{e.epochs}" if isinstance(e, TrainingInterrupted) else ""
        # A checkpoint is written only after the last epoch, to a temporary file renamed into
        # place: an interrupt leaves the previous file at --save (or none), never a partial one.
        print(f"interrupted (Ctrl-C){where}: training stopped"
              + (f"; {args.save} was not written" if args.save and isinstance(e, TrainingInterrupted) else ""),
              file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as e:
        from cydnn import CydnnError, datasets, serialization
        known = (OSError, datasets.DatasetDownloadError, CydnnError, serialization.CheckpointError)
        known += tuple(getattr(datasets, name) for name in ("DatasetError",) if hasattr(datasets, name))
        if args.traceback or not isinstance(e, known):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
