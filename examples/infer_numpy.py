#!/usr/bin/env python3
"""Load a checkpoint and classify a few MNIST test digits given as numpy arrays.

    python -m cydnn.train --epochs 2 --save lenet.npz
    python examples/infer_numpy.py lenet.npz --count 8
"""
import argparse

import numpy as np

import cydnn
from cydnn import datasets


def ascii_digit(image, width=28):
    shades = " .:-=+*#%@"
    rows = []
    for row in image[::2]:  # every other row keeps the aspect ratio in a terminal
        rows.append("".join(shades[int(v) * (len(shades) - 1) // 255] for v in row[:width]))
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--mirror", action="append", default=None)
    args = p.parse_args()

    device = args.device
    if device == "auto":
        device = "cuda" if cydnn.cuda.is_available() else "cpu"
    model = cydnn.load(args.checkpoint, device=device)
    test = datasets.MNIST(root=args.data_dir, train=False, mirrors=args.mirror)

    images = test.images[:args.count]                  # uint8 numpy (N, 28, 28): what predict takes
    probs = model.predict(images)                       # (N, 10) float32 numpy
    for i, (image, p_row) in enumerate(zip(images, probs)):
        print(ascii_digit(image))
        print(f"test image {i}: predicted {p_row.argmax()} ({p_row.max():.1%}), true {test.labels[i]}\n")
    correct = (probs.argmax(axis=1) == test.labels[:args.count]).sum()
    print(f"{correct}/{len(images)} correct on {device}")


if __name__ == "__main__":
    main()
