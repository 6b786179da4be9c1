#!/usr/bin/env python3
"""Train LeNet-5 on MNIST: a thin wrapper around `python -m cydnn.train` (same options).

    python examples/train_lenet.py                                  # the defaults, GPU when there is one
    python examples/train_lenet.py --device cpu --epochs 1 --limit-train 10000 --save lenet.npz
"""
import sys

from cydnn.train import main

if __name__ == "__main__":
    sys.exit(main())
