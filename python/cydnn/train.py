"""Train LeNet-5 on MNIST or Fashion-MNIST from one command.

    python -m cydnn.train                         # MNIST, the defaults below, on the GPU when there is one
    python -m cydnn.train --device cpu --epochs 1 --limit-train 10000 --json

The defaults (SGD with Nesterov momentum 0.9, lr 0.03 with a cosine schedule
per step, weight decay 5e-4, batch 32, random shifts of up to 2 pixels, 20
epochs) reach better than 99.2% test accuracy on
MNIST -- LeCun et al. (1998) report 0.95% error (99.05%) for LeNet-5.

On the GPU the whole dataset is uploaded once and batches are built there
(``ops.gather_batch``); a training step queues its kernels without waiting for
the GPU.  Losses and predictions are read back once per epoch.
"""
import argparse
import functools
import json
import math
import os
import signal
import sys
import threading

import numpy as np

__all__ = ["main", "train", "build_parser", "TrainingInterrupted"]

DATASETS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def build_parser():
    p = argparse.ArgumentParser(prog="python -m cydnn.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=sorted(DATASETS), default="mnist")
    p.add_argument("--data-dir", default=None, help="dataset cache (default: $CYDNN_DATA or ./data)")
    p.add_argument("--mirror", action="append", default=None, metavar="URL_OR_DIR",
                   help="where to download from, tried in order (repeatable; replaces the default mirrors)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 0.03 sgd, 2e-3 adam)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (Nesterov)")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--schedule", choices=["cosine", "step", "none"], default="cosine",
                   help="cosine: to 0 over the run, per step; step: x0.1 every third of the epochs")
    p.add_argument("--max-shift", type=int, default=2, help="random translation of training images, in pixels")
    p.add_argument("--classic", action="store_true", help="LeCun's 1998 LeNet-5 (32x32 input, tanh, avg-pool)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-train", type=int, default=None, metavar="N", help="use the first N training images")
    p.add_argument("--save", default=None, metavar="PATH", help="write a checkpoint (.npz) at the end")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write loss/accuracy curves and a confusion matrix (PNG; needs matplotlib)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="on the GPU, train with the compiled step (fused kernels replayed as CUDA graphs; "
                        "see cydnn.fast); --no-cuda-graph runs the per-op reference loop")
    p.add_argument("--json", action="store_true", help="print one JSON summary object as the last line")
    p.add_argument("--traceback", action="store_true",
                   help="on Ctrl-C or an error, show the Python traceback as well as the one-line message")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


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


def train(args, log=None):
    """Run the training described by parsed ``args``; returns the summary dict."""
    import cydnn
    from cydnn import datasets, models, nn, optim

    log = log or (lambda msg: print(msg, file=sys.stderr))
    device = resolve_device(args.device, log)

    cls = getattr(datasets, DATASETS[args.dataset])
    train_set = cls(root=args.data_dir, train=True, mirrors=args.mirror)
    test_set = cls(root=args.data_dir, train=False, mirrors=args.mirror)
    train_images, train_labels = train_set.images, train_set.labels
    if args.limit_train is not None:
        if args.limit_train < 1:
            raise SystemExit(f"--limit-train must be >= 1, got {args.limit_train}")
        if args.limit_train > len(train_images):
            log(f"--limit-train {args.limit_train} is more than the {len(train_images)} training images: "
                f"using all of them")
        train_images, train_labels = train_images[:args.limit_train], train_labels[:args.limit_train]
    _note_sizes(args, len(train_images), log)

    model = models.LeNet5(classic=args.classic, num_classes=len(cls.classes), seed=args.seed,
                          mean=cls.mean, std=cls.std).to(device)
    common = dict(mean=cls.mean, std=cls.std, pad=model.input_pad, device=device, seed=args.seed)
    train_loader = datasets.DataLoader(train_images, train_labels, batch_size=args.batch_size, shuffle=True,
                                       max_shift=args.max_shift, **common)
    test_loader = datasets.DataLoader(test_set.images, test_set.labels, batch_size=1000, shuffle=False,
                                      max_shift=0, **common)

    if args.optimizer == "adam":
        lr = 2e-3 if args.lr is None else args.lr
        optimizer = optim.Adam(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    else:
        lr = 0.03 if args.lr is None else args.lr
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.momentum > 0,
                              weight_decay=args.weight_decay)
    scheduler, schedule_unit = _lr_schedule(optimizer, args, len(train_loader))
    loss_fn = nn.CrossEntropyLoss()

    log(f"training LeNet-5{' (classic)' if args.classic else ''} on {args.dataset} "
        f"({len(train_images)} train / {len(test_set)} test images) on {device}"
        + (f" [{cydnn.cuda.get_device_name()}]" if device == "cuda" else "")
        + f": {args.optimizer} lr {lr:g}, batch {args.batch_size}, {args.epochs} epochs, seed {args.seed}")

    progress = None
    if not args.no_progress:
        try:
            from tqdm import tqdm as progress
        except ImportError:  # tqdm is a dependency, but keep training without it
            progress = None

    # The compiled step (cydnn.fast): fused kernels and CUDA graphs on the GPU; the
    # per-op reference loop on the CPU, with --no-cuda-graph, or for what it can't run.
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
        test_acc, confusion = evaluate(model, test_loader, len(cls.classes))
        record = {"epoch": epoch, "loss": loss, "train_accuracy": train_acc, "test_accuracy": test_acc,
                  "seconds": seconds, "images_per_second": len(train_images) / seconds,
                  "lr": optimizer.lr}
        history.append(record)
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
        "dataset": args.dataset,
        "model": "LeNet5" + ("(classic)" if args.classic else ""),
        "optimizer": args.optimizer,
        "lr": lr,
        "batch_size": args.batch_size,
        "execution": compiled.info()["mode"],
        "seed": args.seed,
        "train_images": len(train_images),
        "history": history,
    }
    if args.save:
        model.save(args.save, metadata={k: v for k, v in summary.items() if k != "history"})
        log(f"saved {args.save}")
    if args.plot:
        plot(history, confusion if history else None, cls.classes, args.plot)
        log(f"wrote {args.plot}")
    return summary


def plot(history, confusion, classes, path):
    """Loss and accuracy curves and the last confusion matrix, as one PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'cydnn[plot]'") from None
    epochs = [h["epoch"] for h in history]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.5))
    a1.plot(epochs, [h["loss"] for h in history], marker="o")
    a1.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    a2.plot(epochs, [100 * h["train_accuracy"] for h in history], marker="o", label="train")
    a2.plot(epochs, [100 * h["test_accuracy"] for h in history], marker="o", label="test")
    a2.set(title="accuracy", xlabel="epoch", ylabel="%")
    a2.legend()
    if confusion is not None:
        im = a3.imshow(np.log1p(confusion), cmap="Blues")
        for i in range(confusion.shape[0]):
            for j in range(confusion.shape[1]):
                dark = np.log1p(confusion[i, j]) > 0.6 * np.log1p(confusion.max())
                a3.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
        a3.set(title="test confusion matrix (log colour)", xlabel="predicted", ylabel="true",
               xticks=range(len(classes)), yticks=range(len(classes)))
        fig.colorbar(im, ax=a3)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    import os
    os.replace(tmp, path)


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


def check_args(args):
    """Refuse bad values before anything is loaded or trained: SystemExit with one line."""
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit_train is not None and args.limit_train < 1:
        raise SystemExit(f"--limit-train must be >= 1, got {args.limit_train}")
    if args.max_shift < 0:
        raise SystemExit(f"--max-shift must be >= 0, got {args.max_shift}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr must be a finite number > 0, got {args.lr}")
    for name in ("momentum", "weight_decay"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise SystemExit(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    for option, path in (("--save", args.save), ("--plot", args.plot)):
        if path:
            _check_output_path(option, path)


def _check_output_path(option, path):
    """SystemExit with one line when nothing can be written at ``path`` (checked before training)."""
    if os.path.isdir(path):
        raise SystemExit(f"{option}: cannot write {path}: it is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SystemExit(f"{option}: cannot write {path}: the folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SystemExit(f"{option}: cannot write {path}: the folder {folder} is not writable")


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
        if args.traceback or not isinstance(e, (OSError, datasets.DatasetDownloadError, CydnnError,
                                                serialization.CheckpointError)):
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
