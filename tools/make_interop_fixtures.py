"""Write tests/fixtures/pytorch_lenet/: PyTorch LeNet-5 weights in every form cydnn reads.

Needs torch, onnx and safetensors (not cydnn: these files are made the way a
PyTorch user would make them, independently of cydnn's exporter)::

    python3 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch numpy onnx onnxscript safetensors
    /tmp/torchenv/bin/python tools/make_interop_fixtures.py

Writes, for the modern LeNet-5 (seed 0):
    modern.npz            np.savez of the state_dict
    modern.safetensors    safetensors.numpy.save_file of it
    modern_txt/<k>.txt    np.savetxt of each flattened tensor (fmt %.9g: exact for float32)
    modern_bin/<k>.bin    each tensor as raw little-endian float32
    modern.onnx           torch.onnx.export(dynamo=False, opset 17), dynamic batch
for the classic LeNet-5 (seed 1): classic.npz and classic.onnx; and
    expected.npz          images (8, 28, 28) float32 pixels in [0, 1];
                          inputs_modern (8, 1, 28, 28) and inputs_classic (8, 1, 32, 32):
                          the images normalised as cydnn's LeNet5 does ((v - 0.1307) / 0.3081,
                          classic padded by 2 first); logits_modern, logits_classic (8, 10):
                          torch's output for those inputs (float32, CPU).
"""
import argparse
import os
import shutil
import sys

import numpy as np
import safetensors.numpy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_lenet import TorchLeNet5, export_onnx, state_dict_numpy  # noqa: E402

MEAN, STD = 0.1307, 0.3081
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "pytorch_lenet")


def normalise(images, pad):
    v = np.pad(images.astype(np.float32), ((0, 0), (pad, pad), (pad, pad)))
    return ((v - np.float32(MEAN)) / np.float32(STD))[:, None]


def synthetic_digits(n, rng):
    """Blurry strokes on black, pixels in [0, 1]: closer to MNIST than uniform noise."""
    images = np.zeros((n, 28, 28), dtype=np.float32)
    yy, xx = np.mgrid[0:28, 0:28]
    for img in images:
        for _ in range(rng.integers(2, 5)):
            (y0, x0), (y1, x1) = rng.uniform(5, 23, size=(2, 2))
            for t in np.linspace(0, 1, 20):
                y, x = y0 + t * (y1 - y0), x0 + t * (x1 - x0)
                img += np.exp(-((yy - y) ** 2 + (xx - x) ** 2) / 2.0)
    return np.clip(images / images.max(axis=(1, 2), keepdims=True), 0, 1).astype(np.float32)


def write_folder(path, state, ext):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    for k, v in state.items():
        if ext == "txt":
            np.savetxt(os.path.join(path, f"{k}.txt"), v.ravel(), fmt="%.9g")
        else:
            v.astype("<f4").tofile(os.path.join(path, f"{k}.bin"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)

    images = synthetic_digits(8, np.random.default_rng(2024))
    expected = {"images": images}
    for name, classic, seed in (("modern", False, 0), ("classic", True, 1)):
        torch.manual_seed(seed)
        model = TorchLeNet5(classic=classic).eval()
        state = state_dict_numpy(model)
        inputs = normalise(images, 2 if classic else 0)
        with torch.no_grad():
            logits = model(torch.from_numpy(inputs)).numpy()
        expected[f"inputs_{name}"], expected[f"logits_{name}"] = inputs, logits.astype(np.float32)
        np.savez(os.path.join(out, f"{name}.npz"), **state)
        export_onnx(model, os.path.join(out, f"{name}.onnx"))
        if not classic:
            safetensors.numpy.save_file(state, os.path.join(out, f"{name}.safetensors"))
            write_folder(os.path.join(out, f"{name}_txt"), state, "txt")
            write_folder(os.path.join(out, f"{name}_bin"), state, "bin")
    np.savez(os.path.join(out, "expected.npz"), **expected)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"wrote {out} ({total / 1e6:.2f} MB) with torch {torch.__version__}")


if __name__ == "__main__":
    main()
