"""Proof that PyTorch-trained LeNet-5 weights run in cydnn as in PyTorch, every way they travel.

For each variant (modern, classic) this trains a PyTorch LeNet-5 for one
epoch on MNIST (data on the GPU, batch 128, SGD with momentum), then:

  torch -> cydnn  exports the state_dict as .npz, .safetensors, a .txt folder,
                  a .bin folder and .onnx (torch.onnx.export, dynamo=False) into a
                  temporary folder, imports each into cydnn (load_pytorch_weights /
                  load_onnx) on --device (and cpu with --cpu-too), and compares the
                  logits of the 10,000 test images with PyTorch's: max |diff| must
                  be <= --tol (1e-4) and the predicted classes identical (also those
                  of cydnn's predict() on the raw uint8 images);
  cydnn -> torch  exports cydnn's copy with model.export_weights in each form and
                  loads it into a fresh torch model with load_state_dict: the
                  weights must come back bit for bit.

TF32 is off on both sides.  One table row per check; exit status 1 if any
fails.  Needs torch (CUDA), onnx, safetensors and cydnn; no network::

    python tools/pytorch_roundtrip.py --mnist /path/to/mnist [--cpu-too] [--json out.json]

``--mnist`` holds train-images-idx3-ubyte, train-labels-idx1-ubyte,
t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (each may also be .gz).
"""
import argparse
import copy
import gzip
import json
import os
import sys
import tempfile
import time

import numpy as np
import safetensors.numpy
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_lenet import TorchLeNet5, export_onnx, load_state_dict_numpy, state_dict_numpy  # noqa: E402

import cydnn  # noqa: E402
from cydnn import datasets, models, ops  # noqa: E402

MEAN, STD = 0.1307, 0.3081
FORMS = ("npz", "safetensors", "txt", "bin", "onnx")


def read_mnist(folder, name):
    path = os.path.join(folder, name)
    if os.path.exists(path):
        return datasets.read_idx(path)
    if os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz", "rb") as f:
            return datasets.read_idx(f.read())
    raise FileNotFoundError(f"{path} (or {path}.gz) not found")


def normalise(images, pad):
    """Exactly cydnn's preprocessing (ImageClassifier.preprocess), float32 (N, 1, H, W)."""
    v = np.pad(images.astype(np.float32) / np.float32(255), ((0, 0), (pad, pad), (pad, pad)))
    return np.ascontiguousarray(((v - np.float32(MEAN)) / np.float32(STD))[:, None])


def train(classic, train_x, train_y, device, seed, epochs, batch_size, lr):
    torch.manual_seed(seed)
    model = TorchLeNet5(classic=classic).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator(device=device).manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(train_x), device=device, generator=gen)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.eval()


def export_torch(model, form, folder):
    """Write ``model``'s weights as a PyTorch user would, in ``form``; returns the path."""
    state = state_dict_numpy(model)
    path = os.path.join(folder, f"torch.{form}")
    if form == "npz":
        np.savez(path, **state)
    elif form == "safetensors":
        safetensors.numpy.save_file(state, path)
    elif form in ("txt", "bin"):
        os.makedirs(path)
        for k, v in state.items():
            if form == "txt":
                np.savetxt(os.path.join(path, f"{k}.txt"), v.ravel(), fmt="%.9g")
            else:
                v.astype("<f4").tofile(os.path.join(path, f"{k}.bin"))
    else:
        export_onnx(copy.deepcopy(model).cpu(), path)
    return path


def read_for_torch(path, form, shapes):
    """What a PyTorch user does with cydnn's export_weights output: name -> numpy array."""
    if form == "npz":
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    if form == "safetensors":
        return safetensors.numpy.load_file(path)
    out = {}
    for k, shape in shapes.items():
        file = os.path.join(path, f"{k}.{form}")
        flat = np.loadtxt(file, dtype=np.float32, ndmin=1) if form == "txt" else np.fromfile(file, "<f4")
        out[k] = flat.reshape(shape)
    return out


def cydnn_logits(model, inputs, batch_size=2500):
    model.eval()
    backend = ops.backend(model.device)
    return np.concatenate([backend.to_numpy(model(backend.asarray(inputs[s:s + batch_size])))
                           for s in range(0, len(inputs), batch_size)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist", required=True, help="folder with the four MNIST IDX files (or .gz)")
    parser.add_argument("--device", default="cuda", help="cydnn device to import on (default cuda)")
    parser.add_argument("--cpu-too", action="store_true", help="also import and compare on cydnn's cpu backend")
    parser.add_argument("--variants", default="modern,classic", help="modern,classic (default both)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=1e-4, help="max |logit diff| allowed (default 1e-4)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()

    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch_device == "cpu":
        print("warning: torch sees no GPU; training on the CPU", file=sys.stderr)
    for flag in ("cudnn", "cuda"):       # TF32 off, as cydnn (its default)
        obj = torch.backends.cudnn if flag == "cudnn" else torch.backends.cuda.matmul
        obj.allow_tf32 = False
    devices = [args.device] + (["cpu"] if args.cpu_too and args.device != "cpu" else [])

    train_images = read_mnist(args.mnist, "train-images-idx3-ubyte")
    train_labels = read_mnist(args.mnist, "train-labels-idx1-ubyte")
    test_images = read_mnist(args.mnist, "t10k-images-idx3-ubyte")
    test_labels = read_mnist(args.mnist, "t10k-labels-idx1-ubyte")

    rows, summary = [], {}
    header = f"{'variant':8s} {'direction':13s} {'form':12s} {'device':6s} {'max|diff|':>10s} {'class diffs':>11s} " \
             f"{'seconds':>7s}  result"
    print(header)
    print("-" * len(header))

    def report(row):
        rows.append(row)
        diff = "" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.2e}"
        classes = "" if row["class_mismatches"] is None else str(row["class_mismatches"])
        print(f"{row['variant']:8s} {row['direction']:13s} {row['form']:12s} {row['device']:6s} {diff:>10s} "
              f"{classes:>11s} {row['seconds']:7.2f}  {'ok' if row['ok'] else 'FAIL: ' + row['error']}", flush=True)

    with tempfile.TemporaryDirectory(prefix="cydnn_roundtrip_") as tmp:
        for variant in args.variants.split(","):
            classic = variant == "classic"
            pad = 2 if classic else 0
            t0 = time.perf_counter()
            x_train = torch.from_numpy(normalise(train_images, pad)).to(torch_device)
            y_train = torch.from_numpy(train_labels.astype(np.int64)).to(torch_device)
            model = train(classic, x_train, y_train, torch_device, args.seed, args.epochs, args.batch_size, args.lr)
            inputs = normalise(test_images, pad)
            with torch.no_grad():
                ref = model(torch.from_numpy(inputs).to(torch_device)).cpu().numpy()
            ref_classes = ref.argmax(axis=1)
            accuracy = float((ref_classes == test_labels).mean())
            summary[variant] = {"torch_test_accuracy": accuracy, "train_seconds": time.perf_counter() - t0}
            print(f"# {variant}: torch trained {args.epochs} epoch(s) in {time.perf_counter() - t0:.1f} s, "
                  f"test accuracy {accuracy:.4f}", flush=True)
            folder = os.path.join(tmp, variant)
            os.makedirs(folder)
            loaded = None
            for form in FORMS:
                path = export_torch(model, form, folder)
                for device in devices:
                    t0 = time.perf_counter()
                    row = {"variant": variant, "direction": "torch->cydnn", "form": form, "device": device,
                           "max_abs_diff": None, "class_mismatches": None, "ok": False, "error": ""}
                    try:
                        if form == "onnx":
                            net = cydnn.load_onnx(path, device=device)
                            if not isinstance(net, models.LeNet5) or net.classic != classic:
                                raise TypeError(f"load_onnx gave {type(net).__name__}, not a {variant} LeNet5")
                        else:
                            net = cydnn.load_pytorch_weights(models.LeNet5(classic=classic).to(device), path)
                        out = cydnn_logits(net, inputs)
                        row["max_abs_diff"] = float(np.abs(out - ref).max())
                        row["class_mismatches"] = int((out.argmax(axis=1) != ref_classes).sum())
                        predicted = net.predict_classes(test_images)        # raw uint8, cydnn's preprocessing
                        row["predict_mismatches"] = int((predicted != ref_classes).sum())
                        problems = []
                        if not row["max_abs_diff"] <= args.tol:
                            problems.append(f"max |diff| {row['max_abs_diff']:.3e} > {args.tol}")
                        if row["class_mismatches"] or row["predict_mismatches"]:
                            problems.append(f"classes differ on {row['class_mismatches']} images "
                                            f"(predict: {row['predict_mismatches']})")
                        row["ok"], row["error"] = not problems, "; ".join(problems)
                        if form == "npz" and device == devices[0]:
                            loaded = net
                    except Exception as e:          # a row per failure, then go on
                        row["error"] = f"{type(e).__name__}: {e}"
                    row["seconds"] = time.perf_counter() - t0
                    report(row)
            # cydnn -> torch: export_weights in each form, load_state_dict, compare bit for bit
            original = state_dict_numpy(model)
            shapes = {k: v.shape for k, v in original.items()}
            for form in ("npz", "safetensors", "txt", "bin"):
                t0 = time.perf_counter()
                row = {"variant": variant, "direction": "cydnn->torch", "form": form, "device": devices[0],
                       "max_abs_diff": None, "class_mismatches": None, "ok": False, "error": ""}
                try:
                    if loaded is None:
                        raise RuntimeError("no cydnn model (the npz import failed)")
                    path = cydnn.export_weights(loaded, os.path.join(folder, f"cydnn.{form}"), format=form)
                    back = TorchLeNet5(classic=classic)
                    load_state_dict_numpy(back, read_for_torch(path, form, shapes))
                    got = state_dict_numpy(back)
                    row["max_abs_diff"] = max(float(np.abs(got[k] - original[k]).max()) for k in original)
                    exact = all(np.array_equal(got[k], original[k]) for k in original)
                    row["ok"], row["error"] = exact, "" if exact else "weights differ after the round trip"
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                row["seconds"] = time.perf_counter() - t0
                report(row)

    ok = bool(rows) and all(r["ok"] for r in rows)
    total = time.perf_counter() - t_start
    failed = sum(not r["ok"] for r in rows)
    print(f"{'ALL OK' if ok else f'{failed} FAILED'}: {len(rows)} checks in {total:.1f} s "
          f"(torch {torch.__version__}, cydnn {cydnn.__version__})")
    if args.json:
        info = {"ok": ok, "seconds": total, "tol": args.tol, "torch": torch.__version__,
                "torch_device": torch.cuda.get_device_name(0) if torch_device == "cuda" else "cpu",
                "cydnn": cydnn.versions() if "cuda" in devices else {"cydnn": cydnn.__version__},
                "args": vars(args), "variants": summary, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
