"""Where a fused LeNet-5 epoch's time goes: ``train_epoch`` against the epoch's graph launches alone (the GPU's
part), at batch 64 on MNIST, two rounds of 5 epochs; what is left between them is the host's work while the GPU
waits (session 37: 1.2-2.2 ms of a 71 ms epoch before the next epoch's order was drawn ahead, 0.8-0.9 after).
Works on trees from before the compiler too (their CompiledStep's ``_run_fused``), for an A/B of two builds:

    python3 benchmarks/lenet_epoch_host.py .mnist        # a folder with MNIST's four .gz files
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))      # the tree being measured (run from its root)
import bench_lenet as bl  # noqa: E402
from cydnn import _C, datasets, models, optim  # noqa: E402


def timed(fn, k=5):
    out = []
    for _ in range(k):
        _C.synchronize()
        t = time.perf_counter()
        fn()
        _C.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main(folder):
    x_train, y_train = bl.load_mnist(folder, tempfile.mkdtemp())[:2]
    model = models.LeNet5(seed=0).to("cuda")
    opt = optim.SGD(model.parameters(), lr=bl.LR, momentum=bl.MOMENTUM, nesterov=True, weight_decay=bl.WD)
    step = model.compile(opt, 64, fused=True, cuda_graph=True)
    loader = datasets.DataLoader(x_train, y_train, batch_size=64, seed=0, mean=model.mean, std=model.std,
                                 pad=model.input_pad, device="cuda")
    step.train_epoch(loader)                              # builds and captures
    n = loader.num_samples
    n_full, tail = n // 64, n - (n // 64) * 64
    if hasattr(step, "_lenet"):
        launch = lambda: step._lenet._launch(n_full, tail)       # noqa: E731
    else:                                                 # a tree from before the compiler
        launch = lambda: step._run_fused(n_full, tail)           # noqa: E731
    for rnd in range(2):
        ep = [step.train_epoch(loader)["seconds"] for _ in range(5)]
        alone = timed(launch)
        print(f"round {rnd}: train_epoch median {statistics.median(ep) * 1e3:.2f} ms (min {min(ep) * 1e3:.2f}); "
              f"the launches alone median {statistics.median(alone) * 1e3:.2f} (min {min(alone) * 1e3:.2f})",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
