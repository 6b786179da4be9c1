#!/usr/bin/env python3
"""Where a training step's compile spends its time: cProfile around ``cydnn.compile(model, optimizer,
batch_size=B)`` and the first step, for one of bench_zoo's networks (the process warmed first with a small
compile of the same network: cuDNN's handles, the kernels' first loads).

    python3 benchmarks/compile_profile.py smallcnn_bn 256      # on the GPU machine

Prints the seconds, then the 30 entries of most cumulative time and the 15 of most own time.  Session 36
(docs/performance/zoo-session-36.md): SmallCNN at batch 256, 2.95 s, of which 2.87 s in executor.time_replayed
(each candidate way of a step captured and replayed, twice round).
"""
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cydnn  # noqa: E402
import bench_zoo  # noqa: E402


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    name, batch = sys.argv[1], int(sys.argv[2])
    bench_zoo.cydnn_train(name, 32, 5, 1, True)
    model, opt, x, y, shape = bench_zoo.train_setup(name, batch)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    step = cydnn.compile(model, opt, batch_size=batch, input_shape=shape)
    step(x, y)
    cydnn.cuda.synchronize()
    prof.disable()
    print(f"{name} b{batch}: compile + first step {time.perf_counter() - t0:.2f} s")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
