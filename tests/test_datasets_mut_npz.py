"""Mutation-driven tests of cydnn.datasets.npz (the bounded, pickle-free .npz reader): archives
built byte by byte here (.npy format versions 1.0, 2.0 and 3.0, an unknown version, Fortran
order, refused dtypes, a header that disagrees with the member's size, a corrupt CRC, a member
shorter than the size it declares), each refusal's exact message naming the file and the
member, and the size limit at its boundary."""

import io
import struct
import zipfile

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import DatasetError
from cydnn.datasets import npz as N


def _npy(array, version=(1, 0)):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version, allow_pickle=False)
    return buf.getvalue()


def _zip(path, members, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _msg(path, required=("images",), optional=()):
    with pytest.raises(DatasetError) as e:
        N.read_npz(path, required, optional)
    return str(e.value)


# ------------------------------------------------------------------ reading
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_every_npy_format_version_is_read(tmp_path, version):
    a = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    s = np.array(["ab", "cde"])
    p = _zip(tmp_path / "v.npz", {"images.npy": _npy(a, version), "classes.npy": _npy(s, version)})
    out = N.read_npz(p, ("images",), ("classes",))
    assert set(out) == {"images", "classes"}
    np.testing.assert_array_equal(out["images"], a)
    assert out["images"].dtype == np.int16 and out["images"].shape == (2, 3, 4)
    assert out["classes"].tolist() == ["ab", "cde"]


def test_unknown_format_version_is_refused(tmp_path):
    raw = bytearray(_npy(np.zeros(3, np.uint8)))
    raw[6:8] = bytes([4, 0])
    p = _zip(tmp_path / "v4.npz", {"images.npy": bytes(raw)})
    assert _msg(p) == f"{p}: member 'images.npy': unknown .npy format version (4, 0)"


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_fortran_order_members_come_back_equal(tmp_path, version):
    a = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    raw = _npy(a, version)
    assert b"'fortran_order': True" in raw
    p = _zip(tmp_path / "f.npz", {"images.npy": raw})
    got = N.read_npz(p, ("images",))["images"]
    np.testing.assert_array_equal(got, a)
    assert got.shape == (3, 4) and got.flags.writeable


def test_members_come_back_writable_and_independent(tmp_path):
    p = _zip(tmp_path / "w.npz", {"images.npy": _npy(np.arange(4, dtype=np.uint8))})
    got = N.read_npz(p, ("images",))["images"]
    got[0] = 9
    assert N.read_npz(p, ("images",))["images"].tolist() == [0, 1, 2, 3]


def test_optional_members_after_a_missing_one_are_still_read(tmp_path):
    p = _zip(tmp_path / "o.npz", {"images.npy": _npy(np.ones(2, np.uint8)),
                                 "b.npy": _npy(np.arange(3, dtype=np.int64)),
                                 "other.npy": _npy(np.zeros(1))})
    out = N.read_npz(p, ("images",), ("a", "b", "c"))
    assert sorted(out) == ["b", "images"]
    assert out["b"].tolist() == [0, 1, 2]


def test_deflated_archives_are_read(tmp_path):
    a = np.arange(100, dtype=np.uint8)
    p = _zip(tmp_path / "d.npz", {"images.npy": _npy(a)}, zipfile.ZIP_DEFLATED)
    np.testing.assert_array_equal(N.read_npz(p, ("images",))["images"], a)


# ------------------------------------------------------------------ missing members
def test_missing_member_lists_what_the_archive_holds(tmp_path):
    p = _zip(tmp_path / "e.npz", {})
    assert _msg(p) == (f"{p}: no member 'images.npy' (it holds nothing); save with "
                       f"np.savez(path, images=..., labels=...)")
    q = _zip(tmp_path / "x.npz", {"x.npy": _npy(np.zeros(1)), "a.npy": _npy(np.zeros(1))})
    assert _msg(q) == (f"{q}: no member 'images.npy' (it holds ['a.npy', 'x.npy']); save with "
                       f"np.savez(path, images=..., labels=...)")


def test_a_member_named_twice_is_refused(tmp_path):
    p = tmp_path / "twice.npz"
    with pytest.warns(UserWarning):
        _zip(p, {"images.npy": _npy(np.zeros(1))})
        with zipfile.ZipFile(p, "a") as z:
            z.writestr("images.npy", _npy(np.ones(1)))
    assert _msg(p) == f"{p}: member 'images.npy' appears twice; refusing an ambiguous archive"


def test_not_a_zip(tmp_path):
    p = tmp_path / "no.npz"
    p.write_bytes(b"not a zip at all")
    assert _msg(p) == f"{p}: not an .npz (zip) archive, or a corrupt one (File is not a zip file)"


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("array", [np.zeros(2, np.complex64), np.array([b"a", b"b"]),
                                   np.zeros(2, "datetime64[s]"), np.zeros(2, [("a", "<i4"), ("b", "<f4")]),
                                   np.zeros(2, "V4")])
def test_dtypes_other_than_numbers_and_unicode_are_refused(tmp_path, array):
    p = _zip(tmp_path / "t.npz", {"images.npy": _npy(array)})
    assert _msg(p) == (f"{p}: member 'images.npy' has dtype {array.dtype}: only plain numbers and fixed-width "
                       f"strings are read (never Python objects, which would need unpickling)")


def test_object_arrays_are_refused_without_unpickling(tmp_path):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    p = _zip(tmp_path / "obj.npz", {"images.npy": buf.getvalue()})
    assert _msg(p) == (f"{p}: member 'images.npy' has dtype object: only plain numbers and fixed-width "
                       f"strings are read (never Python objects, which would need unpickling)")


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint32, np.float16, np.float64, "U3"])
def test_plain_dtypes_are_read(tmp_path, dtype):
    a = np.ones(3, dtype)
    p = _zip(tmp_path / "ok.npz", {"images.npy": _npy(a)})
    got = N.read_npz(p, ("images",))["images"]
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, a)


# ------------------------------------------------------------------ sizes
def test_header_and_member_size_must_agree(tmp_path):
    raw = _npy(np.arange(3, dtype=np.int32))
    p = _zip(tmp_path / "short.npz", {"images.npy": raw[:-4]})
    assert _msg(p) == (f"{p}: member 'images.npy': its header declares shape (3,) of int32 (12 bytes) but "
                       f"the member holds 8 bytes after the header")
    q = _zip(tmp_path / "long.npz", {"images.npy": raw + b"\0" * 5})
    assert _msg(q) == (f"{q}: member 'images.npy': its header declares shape (3,) of int32 (12 bytes) but "
                       f"the member holds 17 bytes after the header")


def test_size_limit_boundary(tmp_path, monkeypatch):
    raw = _npy(np.arange(10, dtype=np.uint8))
    p = _zip(tmp_path / "lim.npz", {"images.npy": raw})
    monkeypatch.setattr(datasets, "MAX_NPZ_MEMBER_BYTES", len(raw))
    assert N.read_npz(p, ("images",))["images"].tolist() == list(range(10))     # equal: accepted
    monkeypatch.setattr(datasets, "MAX_NPZ_MEMBER_BYTES", len(raw) - 1)
    assert _msg(p) == (f"{p}: member 'images.npy' declares {len(raw)} bytes uncompressed, more than the "
                       f"{len(raw) - 1}-byte limit (MAX_NPZ_MEMBER_BYTES); refusing to read it")


def test_default_limit_when_the_package_has_none(monkeypatch):
    assert N._max_member_bytes() == datasets.MAX_NPZ_MEMBER_BYTES == 4 << 30
    monkeypatch.delattr(datasets, "MAX_NPZ_MEMBER_BYTES")
    assert N._max_member_bytes() == N._DEFAULT_MAX == 4 << 30


# ------------------------------------------------------------------ corrupt members
def test_a_bad_crc_names_the_error_type(tmp_path):
    raw = _npy(np.arange(16, dtype=np.uint8))
    p = _zip(tmp_path / "crc.npz", {"images.npy": raw})
    data = bytearray(p.read_bytes())
    at = data.index(raw) + len(raw) - 1          # last payload byte, stored uncompressed
    data[at] ^= 0xFF
    p.write_bytes(bytes(data))
    assert _msg(p) == (f"{p}: member 'images.npy' is truncated or corrupt "
                       f"(BadZipFile: Bad CRC-32 for file 'images.npy')")


def _patch_file_size(path, name, new_size):
    """Rewrite the uncompressed size a stored member declares (local header and central directory)."""
    data = bytearray(path.read_bytes())
    local = data.index(b"PK\x03\x04")
    struct.pack_into("<I", data, local + 22, new_size)
    central = data.index(b"PK\x01\x02")
    struct.pack_into("<I", data, central + 24, new_size)
    path.write_bytes(bytes(data))


def test_a_member_shorter_than_it_declares_is_truncated(tmp_path):
    # The header declares 12 data bytes, the zip directory the matching size, but the stored
    # bytes (and their CRC) stop 4 bytes early: zipfile returns 8 bytes without an error.
    full = _npy(np.arange(3, dtype=np.int32))
    p = _zip(tmp_path / "trunc.npz", {"images.npy": full[:-4]})
    _patch_file_size(p, "images.npy", len(full))
    assert _msg(p) == f"{p}: member 'images.npy' is truncated: 8 of 12 bytes"
