"""The training command's figure: loss and accuracy per epoch, and the last test confusion matrix.

Built with matplotlib's object API (a ``Figure`` on an Agg canvas): no
pyplot, no global backend switched, nothing shown on a screen; so the command
works without a display and a notebook importing this keeps its own backend.
"""
import os

__all__ = ["make_figure", "plot"]

#: Above this many classes the confusion matrix has no numbers in its cells.
MAX_ANNOTATED_CLASSES = 20


def make_figure(history, confusion, classes, title=""):
    """A matplotlib ``Figure`` of the run: ``history`` is the list of per-epoch records
    (``epoch``, ``loss``, ``train_accuracy``, ``test_accuracy``), ``confusion`` the last
    (classes x classes) test confusion matrix or None.

    Epoch axes have integer ticks; the confusion matrix is coloured on a
    symmetric log scale (counts from 0 up), its colour bar labelled; the
    figure's title is ``title`` followed by the final test accuracy.
    """
    from matplotlib.colors import SymLogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = Figure(figsize=(15, 4.8))
    a1, a2, a3 = fig.subplots(1, 3)
    epochs = [h["epoch"] for h in history]
    a1.plot(epochs, [h["loss"] for h in history], marker="o")
    a1.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    a2.plot(epochs, [100 * h["train_accuracy"] for h in history], marker="o", label="train")
    a2.plot(epochs, [100 * h["test_accuracy"] for h in history], marker="o", label="test")
    a2.set(title="accuracy", xlabel="epoch", ylabel="%")
    a2.legend()
    for ax in (a1, a2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if confusion is not None:
        n = confusion.shape[0]
        norm = SymLogNorm(linthresh=1, vmin=0, vmax=max(1, int(confusion.max())), base=10)
        im = a3.imshow(confusion, cmap="Blues", norm=norm)
        if n <= MAX_ANNOTATED_CLASSES:
            for i in range(n):
                for j in range(n):
                    dark = norm(confusion[i, j]) > 0.6
                    a3.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")
        a3.set(title="test confusion matrix", xlabel="predicted", ylabel="true",
               xticks=range(n), yticks=range(n))
        if n <= MAX_ANNOTATED_CLASSES:
            names = [str(c) for c in classes][:n]
            a3.set_xticklabels(names, rotation=45 if max(map(len, names), default=0) > 2 else 0, ha="right"
                               if max(map(len, names), default=0) > 2 else "center")
            a3.set_yticklabels(names)
        top = max(1, int(confusion.max()))
        powers = {10 ** k for k in range(len(str(top))) if 10 ** k <= top}
        bar = fig.colorbar(im, ax=a3, ticks=sorted({0, top} | powers))
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        bar.set_label("test images (log scale)")
    else:
        a3.set_axis_off()
    final = history[-1]["test_accuracy"] if history else None
    accuracy = "no epoch finished" if final is None else f"final test accuracy {final:.2%}"
    fig.suptitle(f"{title}: {accuracy}" if title else accuracy)
    fig.tight_layout()
    return fig


def plot(history, confusion, classes, path, title=""):
    """Write :func:`make_figure`'s figure to ``path`` as a PNG (through a temporary file renamed into place)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'cydnn[plot]'") from None
    fig = make_figure(history, confusion, classes, title=title)
    FigureCanvasAgg(fig)
    tmp = f"{path}.tmp.png"
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
