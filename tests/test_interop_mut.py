"""What the PyTorch-weights reader and writer promise, to the letter (found by mutation testing,
docs/mutation/interop.md): every problem listed, in order, in one message naming the file; buffers
and their integer dtype; how each form is recognised; the bounds of the folder forms at their
exact limits; and, for export, where the temporary file or folder lies, the modes, the text
format, and which errors are re-raised naming the path."""
import errno
import json
import os
import sys
import types
import zipfile

import numpy as np
import pytest

import cydnn
from cydnn import interop, models, nn
from cydnn.interop import WeightsError


def net(seed=0):
    """A linear layer and a batch norm: parameters, float buffers and an int64 buffer."""
    return nn.Sequential(nn.Linear(3, 2, rng=seed), nn.BatchNorm1d(2))


def state_of(model):
    return {k: np.array(v) for k, v in model.state_dict().items()}


def write_npz(path, arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return str(path)


def safetensors_bytes(arrays):
    """A .safetensors file written by hand: u64 header length, JSON header, the tensors' bytes."""
    header, data = {}, b""
    for name, a in arrays.items():
        a = np.array(a, dtype="<f4", order="C")         # (ascontiguousarray makes a 0-d array 1-d)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def refused(model, path, **kwargs):
    """The message of the WeightsError loading ``path`` into ``model`` raises; the model unchanged."""
    before = state_of(model)
    with pytest.raises(WeightsError) as info:
        cydnn.load_pytorch_weights(model, path, **kwargs)
    for k, v in state_of(model).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    return str(info.value)


def unfit(path, *problems):
    return f"{path}: weights do not fit the model: " + "; ".join(problems)


# ------------------------------------------------------------------------ buffers and dtypes
def test_buffers_round_trip_with_the_integer_counter(tmp_path):
    src = net(1)
    src[1].running_mean[...] = [0.25, -0.5]
    src[1].num_batches_tracked[...] = 7
    for fmt in ("npz", "txt"):
        path = cydnn.export_weights(src, tmp_path / f"w_{fmt}", format=fmt)
        dst = cydnn.load_pytorch_weights(net(2), path)
        for k, v in state_of(src).items():
            np.testing.assert_array_equal(state_of(dst)[k], v, err_msg=k)
        assert state_of(dst)["1.num_batches_tracked"].dtype == np.int64


def test_every_problem_listed_in_order(tmp_path):
    s = state_of(net())
    s["0.weight"] = np.zeros((2, 3), np.complex64)
    s["0.bias"] = np.array([2**24 + 1, 0], np.int64)         # float32 cannot hold 2**24 + 1
    s["1.weight"] = np.array(["a", "b"], "U1")
    s["1.bias"] = np.array([True, False])
    s["1.num_batches_tracked"] = np.array(2.5)                # an int64 buffer: 2.5 is not an integer
    p = write_npz(tmp_path / "w.npz", s)
    assert refused(net(), p) == unfit(
        p, "parameter '0.weight' has dtype complex64 (complex); expected a real floating-point array of shape (2, 3)",
        "parameter '0.bias': int64 values such as 16777217 are not exactly representable in float32; "
        "refusing a lossy cast",
        "parameter '1.weight' has dtype <U1 (<U1); expected a real floating-point array of shape (2,)",
        "parameter '1.bias' has dtype bool (bool); expected a real floating-point array of shape (2,)",
        "parameter '1.num_batches_tracked': float64 values such as 2.5 are not exactly representable in int64; "
        "refusing a lossy cast")


def test_integers_a_float64_model_holds_exactly_load(tmp_path):
    s = state_of(net())
    s["0.bias"] = np.array([2**24 + 1, -3], np.int64)
    model = cydnn.load_pytorch_weights(net().double(), write_npz(tmp_path / "w.npz", s))
    assert model[0].bias.data.tolist() == [2**24 + 1, -3]


def test_unexpected_missing_and_shape_problems_in_that_order(tmp_path):
    s = state_of(net())
    del s["1.bias"]
    s["1.running_mean"] = np.zeros(3, np.float32)
    s["zz"] = np.zeros(1, np.float32)
    p = write_npz(tmp_path / "w.npz", s)
    assert refused(net(), p) == unfit(p, "unexpected parameters ['zz']", "missing parameters ['1.bias']",
                                      "parameter '1.running_mean': expected shape (2,), got (3,)")
    s = state_of(net())
    s["0.weight"], s["0.bias"] = np.zeros((3, 3), np.float32), np.zeros(5, np.float32)
    p = write_npz(tmp_path / "v.npz", s)
    assert refused(net(), p) == unfit(p, "parameter '0.weight': expected shape (2, 3), got (3, 3)",
                                      "parameter '0.bias': expected shape (2,), got (5,)")


def test_not_strict_reads_past_an_unexpected_name(tmp_path):
    src = net(3)
    p = write_npz(tmp_path / "w.npz", {"aaa": np.zeros(1, np.float32), **state_of(src)})
    dst = cydnn.load_pytorch_weights(net(4), p, strict=False)
    np.testing.assert_array_equal(dst[0].weight.data, src[0].weight.data)
    np.testing.assert_array_equal(dst[1].running_var, src[1].running_var)
    src = models.LeNet5(seed=3)                                      # names that sort after "aaa"
    folder = cydnn.export_weights(src, tmp_path / "f", format="bin")
    (tmp_path / "f" / "aaa.bin").write_bytes(b"\0" * 4)
    assert sorted(os.listdir(folder))[0] == "aaa.bin"
    dst = cydnn.load_pytorch_weights(models.LeNet5(seed=4), folder, strict=False)
    np.testing.assert_array_equal(dst.fc3.bias.data, src.fc3.bias.data)


# ------------------------------------------------------------------------ .npz
def test_npz_member_twice(tmp_path):
    p = str(tmp_path / "w.npz")
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("a.npy", b"x")
        z.writestr("a", b"y")
    assert refused(net(), p) == f"{p}: parameter 'a' is in the archive twice; refusing to guess which counts"


def test_npz_holding_a_top_level_pickle(tmp_path):
    p = str(tmp_path / "w.pt")
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("data.pkl", b"\x80\x02}q\x00.")
    assert refused(net(), p).startswith(f"{p} is a torch.save (pickle) file, which cydnn never unpickles")


def test_npz_bad_name_names_the_file(tmp_path):
    p = write_npz(tmp_path / "w.npz", {"a b": np.zeros(1)})
    assert refused(net(), p).startswith(f"{p}: parameter name 'a b': part 'a b' is neither an identifier")


def test_npz_object_member(tmp_path):
    s = state_of(net())
    s["0.bias"] = np.array([object(), object()], dtype=object)
    p = write_npz(tmp_path / "w.npz", s)
    assert refused(net(), p) == (f"{p}: parameter '0.bias' holds pickled Python objects, an object array, "
                                 f"which is never loaded; save numeric arrays")


def test_npz_member_wider_than_float64_is_refused_unread(tmp_path):
    s = state_of(net())
    s["0.bias"] = np.array([b"123456789", b"x"], "S9")             # 9 bytes an item: past 8 (float64)
    p = write_npz(tmp_path / "w.npz", s)
    assert refused(net(), p) == (f"{p}: parameter '0.bias': the .npy header declares shape (2,) of |S9 = 18 bytes, "
                                 f"more than the 16 it may hold; refusing to allocate it")


# ------------------------------------------------------------------------ .safetensors
def test_safetensors_found_by_content_whatever_the_name(tmp_path):
    src = net(5)
    p = tmp_path / "weights.bin"
    p.write_bytes(safetensors_bytes(state_of(src)))
    dst = cydnn.load_pytorch_weights(net(6), str(p))
    np.testing.assert_array_equal(dst[0].weight.data, src[0].weight.data)


def test_a_short_file_named_safetensors(tmp_path):
    p = tmp_path / "w.safetensors"
    p.write_bytes(b"12345")
    assert refused(net(), str(p)) == f"{p}: cannot read it as .safetensors: too short for a header (5 bytes)"


def test_safetensors_shape_and_name_problems(tmp_path):
    s = state_of(net())
    s["0.bias"] = np.zeros(3, np.float32)
    p = tmp_path / "w.safetensors"
    p.write_bytes(safetensors_bytes(s))
    assert refused(net(), str(p)) == unfit(p, "parameter '0.bias': expected shape (2,), got (3,)")
    p.write_bytes(safetensors_bytes({"a b": np.zeros(1)}))
    assert refused(net(), str(p)).startswith(f"{p}: parameter name 'a b': part 'a b'")


# ------------------------------------------------------------------------ neither
def test_what_an_unknown_file_looks_like(tmp_path):
    p = tmp_path / "junk.dat"
    p.write_bytes(b"hello world")
    third = "a folder of <name>.txt / <name>.bin files is the third form"
    assert refused(net(), str(p)) == (f"{p}: neither an .npz archive nor a .safetensors file "
                                      f"(it starts with b'hello wor'); {third}")
    p = tmp_path / "m.onnx"
    p.write_bytes(b"\x08\x07\x12\x04test")
    assert refused(net(), str(p)) == (f"{p}: neither an .npz archive nor a .safetensors file "
                                      f"(it starts with b'\\x08\\x07\\x12\\x04test'); {third}; "
                                      f"it looks like an ONNX model: load it with cydnn.load_onnx(path)")


# ------------------------------------------------------------------------ folders
def test_folder_ignores_hidden_files_and_names_bad_ones(tmp_path):
    src = net(7)
    folder = cydnn.export_weights(src, tmp_path / "w", format="bin")
    (tmp_path / "w" / ".0.weight.bin").write_bytes(b"junk")        # hidden: an editor's, not a weight
    np.testing.assert_array_equal(cydnn.load_pytorch_weights(net(8), folder)[0].weight.data, src[0].weight.data)
    (tmp_path / "w" / "a b.bin").write_bytes(b"")
    assert refused(net(), folder).startswith(f"{folder}: file 'a b.bin': parameter name 'a b': part 'a b'")


def test_bin_of_the_wrong_size(tmp_path):
    folder = cydnn.export_weights(net(), tmp_path / "w", format="bin")
    file = tmp_path / "w" / "0.weight.bin"
    prefix = f"{file}: parameter '0.weight': expected shape (2, 3) = 6 float32 values = 24 bytes, got"
    file.write_bytes(b"\0" * 20)
    assert refused(net(), folder) == f"{prefix} 20 bytes (truncated?)"
    file.write_bytes(b"\0" * 28)
    assert refused(net(), folder) == f"{prefix} 28 bytes"


def test_two_counts_that_differ_are_both_listed(tmp_path):
    folder = cydnn.export_weights(net(), tmp_path / "w", format="txt")
    np.savetxt(tmp_path / "w" / "0.weight.txt", np.zeros(5))
    np.savetxt(tmp_path / "w" / "0.bias.txt", np.zeros(3))
    assert refused(net(), folder) == unfit(folder, "parameter '0.bias': expected shape (2,) (2 values), got 3 values",
                                           "parameter '0.weight': expected shape (2, 3) (6 values), got 5 values")


def test_txt_size_bound_is_exact(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    limit = interop.MAX_TXT_BYTES_PER_VALUE * 2 + 4096            # 0.bias holds 2 values
    text = "1.5\n-2\n#"
    (folder / "0.bias.txt").write_text(text + "x" * (limit - len(text) - 1) + "\n")
    assert os.path.getsize(folder / "0.bias.txt") == limit
    assert cydnn.load_pytorch_weights(net(), str(folder), strict=False)[0].bias.data.tolist() == [1.5, -2.0]
    (folder / "0.bias.txt").write_text(text + "x" * (limit - len(text)) + "\n")
    assert refused(net(), str(folder), strict=False) == (
        f"{folder / '0.bias.txt'}: parameter '0.bias': {limit + 1} bytes of text for 2 values "
        f"(at most {interop.MAX_TXT_BYTES_PER_VALUE} a value); refusing to parse it")


# ------------------------------------------------------------------------ normalize
def test_normalize_is_applied_and_checked_naming_the_file(tmp_path):
    p = cydnn.export_weights(models.LeNet5(seed=1), tmp_path / "w.npz")
    model = cydnn.load_pytorch_weights(models.LeNet5(), p, normalize=(0.5, 0.25))
    assert (model.mean, model.std) == (0.5, 0.25)
    with pytest.raises(WeightsError) as info:
        cydnn.load_pytorch_weights(models.LeNet5(), p, normalize=(0, 0))
    assert str(info.value) == f"{p}: normalize=(mean, std) needs finite numbers > 0 for the std, got 0"


# ------------------------------------------------------------------------ export: files
def test_missing_safetensors_package_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ImportError) as info:
        cydnn.export_weights(net(), tmp_path / "w.safetensors", format="safetensors")
    assert str(info.value) == ("reading or writing .safetensors needs the 'safetensors' package: "
                               "pip install safetensors  (or pip install 'cydnn[safetensors]')")


def test_file_written_beside_the_target_then_given_a_plain_mode(tmp_path, monkeypatch):
    seen, real = [], np.savez

    def savez(f, **arrays):
        seen.append(f.name)
        real(f, **arrays)
    monkeypatch.setattr(interop.np, "savez", savez)
    path = cydnn.export_weights(net(), tmp_path / "w.npz")
    (tmp,) = seen
    assert os.path.dirname(tmp) == str(tmp_path)
    assert os.path.basename(tmp).startswith(".w.npz.") and tmp.endswith(".tmp")
    assert os.listdir(tmp_path) == ["w.npz"] and os.stat(path).st_mode & 0o777 == 0o666 & ~umask()
    os.chmod(path, 0o640)
    cydnn.export_weights(net(), path)
    assert os.stat(path).st_mode & 0o777 == 0o640


def umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("mask, file_mode, folder_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_new_exports_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, folder_mode):
    before = os.umask(mask)
    try:
        file = cydnn.export_weights(net(), tmp_path / "w.npz")
        folder = cydnn.export_weights(net(), tmp_path / "w", format="bin")
    finally:
        os.umask(before)
    assert os.stat(file).st_mode & 0o777 == file_mode
    assert os.stat(folder).st_mode & 0o777 == folder_mode
    assert {os.stat(os.path.join(folder, e)).st_mode & 0o777 for e in os.listdir(folder)} == {file_mode}


def test_write_errors(tmp_path, monkeypatch):
    path = str(tmp_path / "w.npz")

    def fail(error):
        def savez(f, **arrays):
            f.write(b"PK\x03\x04 half")
            raise error
        monkeypatch.setattr(interop.np, "savez", savez)

    fail(OSError(errno.ENOSPC, "No space left on device"))         # write(2) names no file
    with pytest.raises(OSError) as info:
        cydnn.export_weights(net(), path)
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, path)
    assert info.value.strerror == f"No space left on device (writing {path})"
    fail(PermissionError(errno.EACCES, "Permission denied", "/elsewhere"))    # already names its file
    with pytest.raises(PermissionError) as info:
        cydnn.export_weights(net(), path)
    assert info.value.filename == "/elsewhere"
    fail(RuntimeError("not a file-system error"))
    with pytest.raises(RuntimeError, match="^not a file-system error$"):
        cydnn.export_weights(net(), path)
    assert os.listdir(tmp_path) == []


def test_export_refuses_bad_names_and_writes_c_order(tmp_path):
    bad = types.SimpleNamespace(state_dict=lambda: {"a/b": np.zeros(1)})
    path = str(tmp_path / "w.npz")
    with pytest.raises(WeightsError) as info:
        cydnn.export_weights(bad, path)
    assert str(info.value).startswith(f"export to {path}: parameter name 'a/b': part 'a/b' is neither")
    fortran = types.SimpleNamespace(state_dict=lambda: {"w": np.asfortranarray(np.arange(6.0).reshape(2, 3))})
    cydnn.export_weights(fortran, path)
    with zipfile.ZipFile(path) as z, z.open("w.npy") as f:
        np.lib.format.read_magic(f)
        assert np.lib.format.read_array_header_1_0(f)[1] is False          # not fortran_order
    with np.load(path) as z:
        np.testing.assert_array_equal(z["w"], np.arange(6.0).reshape(2, 3))


# ------------------------------------------------------------------------ export: folders
def test_folder_built_beside_the_target_with_plain_modes_and_9_digits(tmp_path, monkeypatch):
    folders, real = [], interop.child_path

    def child_path(folder, *args):
        folders.append(folder)
        return real(folder, *args)
    monkeypatch.setattr(interop, "child_path", child_path)
    model = types.SimpleNamespace(state_dict=lambda: {"w": np.array([1e-5, 0.1, 3], np.float32)})
    path = cydnn.export_weights(model, tmp_path / "w", format="txt")
    assert set(folders) == {folders[0]} and os.path.dirname(folders[0]) == str(tmp_path)
    assert os.path.basename(folders[0]).startswith(".w.") and folders[0].endswith(".tmp")
    assert os.stat(path).st_mode & 0o777 == 0o777 & ~umask()
    assert (tmp_path / "w" / "w.txt").read_text() == "9.99999975e-06\n0.100000001\n3\n"


def test_folder_swap_and_its_failure(tmp_path, monkeypatch):
    path = str(tmp_path / "w")
    cydnn.export_weights(net(1), path, format="bin")
    before = {e: (tmp_path / "w" / e).read_bytes() for e in os.listdir(path)}
    renames, real = [], os.rename

    def rename(src, dst):
        renames.append((src, dst))
        return real(src, dst)
    monkeypatch.setattr(interop.os, "rename", rename)
    cydnn.export_weights(net(2), path, format="bin")
    (old, moved_to), (tmp, _) = renames[0], renames[1]
    assert old == path and os.path.dirname(moved_to) == str(tmp_path)
    assert os.path.basename(moved_to).startswith(".w.") and moved_to.endswith(".old")
    assert os.listdir(tmp_path) == ["w"]
    cydnn.export_weights(net(1), path, format="bin")                # back to the first state

    def failing(src, dst):
        if src.endswith(".tmp"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)
    monkeypatch.setattr(interop.os, "rename", failing)
    with pytest.raises(OSError) as info:
        cydnn.export_weights(net(2), path, format="bin")
    assert (info.value.errno, info.value.filename) == (errno.EXDEV, path)
    assert os.listdir(tmp_path) == ["w"]                            # the old folder put back, nothing left
    assert {e: (tmp_path / "w" / e).read_bytes() for e in os.listdir(path)} == before
    fresh = str(tmp_path / "fresh")
    with pytest.raises(OSError) as info:
        cydnn.export_weights(net(2), fresh, format="txt")
    assert (info.value.errno, info.value.filename) == (errno.EXDEV, fresh)
    assert os.listdir(tmp_path) == ["w"]


def test_folder_write_errors(tmp_path, monkeypatch):
    path = str(tmp_path / "w")

    def savetxt(*args, **kwargs):
        raise error
    monkeypatch.setattr(interop.np, "savetxt", savetxt)
    error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as info:
        cydnn.export_weights(net(), path, format="txt")
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, path)
    assert info.value.strerror == f"No space left on device (writing {path})"
    error = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="^boom$"):
        cydnn.export_weights(net(), path, format="txt")
    assert os.listdir(tmp_path) == []
