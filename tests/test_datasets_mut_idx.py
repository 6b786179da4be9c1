"""Mutation-driven tests of cydnn.datasets.idx: exact messages naming the file and the problem,
and known data read back from small IDX files the tests write."""

import re
import struct

import numpy as np
import pytest

import cydnn.datasets as ds
from cydnn.datasets import idx as I


def _idx(dims, payload=None, code=0x08):
    head = struct.pack(">BBBB", 0, 0, code, len(dims)) + b"".join(struct.pack(">I", d) for d in dims)
    if payload is None:
        payload = bytes((i * 7 + 3) % 256 for i in range(int(np.prod(dims))))
    return head + payload


def test_idx_size():
    assert I._idx_size(60000, 28, 28) == 4 + 12 + 60000 * 784
    assert I._idx_size(10000) == 4 + 4 + 10000


@pytest.mark.parametrize("dims", [(5,), (3, 2, 4), (1, 1, 1), (0,), (0, 2, 3)])
def test_known_data_bytes_and_file(tmp_path, dims):
    raw = _idx(dims)
    want = np.frombuffer(raw[4 + 4 * len(dims):], dtype=np.uint8).reshape(dims)
    for src in (raw, bytearray(raw), memoryview(raw)):
        got = ds.read_idx(src)
        assert got.dtype == np.uint8 and got.shape == dims
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable
    p = tmp_path / "x.idx"
    p.write_bytes(raw)
    got = ds.read_idx(p)
    np.testing.assert_array_equal(got, want)
    assert got.shape == dims and got.flags.writeable
    got = ds.read_idx(str(p))
    np.testing.assert_array_equal(got, want)


def test_bytes_copy_is_independent():
    raw = bytearray(_idx((4,)))
    got = ds.read_idx(bytes(raw))
    got[0] = 99
    assert ds.read_idx(bytes(raw))[0] == raw[8]


def _msg(src):
    with pytest.raises(ValueError) as e:
        ds.read_idx(src)
    return str(e.value)


def test_too_short_for_magic(tmp_path):
    assert _msg(b"\0\0\x08") == "IDX data: only 3 bytes, too short for the 4-byte IDX magic number"
    assert _msg(b"") == "IDX data: only 0 bytes, too short for the 4-byte IDX magic number"
    p = tmp_path / "s.idx"
    p.write_bytes(b"\0\0")
    assert _msg(p) == f"IDX file {str(p)!r}: only 2 bytes, too short for the 4-byte IDX magic number"


def test_four_bytes_is_enough_for_magic():
    # exactly 4 bytes: the magic is read, and the header is what is too short
    assert _msg(b"\0\0\x08\x01") == (
        "IDX data: 4 bytes, too short for the 8-byte header of a rank-1 file")


@pytest.mark.parametrize("first", [b"\x01\0", b"\0\x01", b"\x80\x00"])
def test_bad_magic(first):
    raw = first + b"\x08\x01" + struct.pack(">I", 1) + b"\x05"
    magic = int.from_bytes(raw[:4], "big")
    assert _msg(raw) == (
        f"IDX data: bad magic number 0x{magic:08X}: an IDX file starts with two zero bytes "
        "(expected 0x00000801 for labels or 0x00000803 for images)")


def test_bad_magic_file_long(tmp_path):
    # longer than 16 bytes and not an IDX header: the first bytes say why
    p = tmp_path / "b.idx"
    p.write_bytes(b"\x12\x34\x08\x01" + bytes(40))
    assert _msg(p) == (
        f"IDX file {str(p)!r}: bad magic number 0x12340801: an IDX file starts with two zero bytes "
        "(expected 0x00000801 for labels or 0x00000803 for images)")


@pytest.mark.parametrize("code", [0x09, 0x0B, 0x0D, 0x00, 0x07])
def test_bad_dtype(code, tmp_path):
    raw = _idx((2,), b"\1\2", code=code)
    assert _msg(raw) == (
        f"IDX data: data type byte is 0x{code:02X}, but only 0x08 (unsigned byte) is "
        f"supported (magic number 0x0000{code:02X}01)")


def test_bad_dtype_exact():
    raw = _idx((2,), b"\1\2", code=0x0D)
    assert _msg(raw) == ("IDX data: data type byte is 0x0D, but only 0x08 (unsigned byte) is "
                         "supported (magic number 0x00000D01)")


@pytest.mark.parametrize("rank", [0, 2, 4])
def test_bad_rank(rank, tmp_path):
    raw = struct.pack(">BBBB", 0, 0, 8, rank) + struct.pack(">I", 1) * rank + b"\1"
    assert _msg(raw) == (
        f"IDX data: rank {rank} (magic number 0x0000080{rank}) is not supported: expected "
        "1 (labels, 0x00000801) or 3 (images, 0x00000803)")
    p = tmp_path / "r.idx"
    p.write_bytes(raw)
    assert _msg(p) == (
        f"IDX file {str(p)!r}: rank {rank} (magic number 0x0000080{rank}) is not supported: expected "
        "1 (labels, 0x00000801) or 3 (images, 0x00000803)")


def test_header_too_short(tmp_path):
    raw = b"\0\0\x08\x03" + struct.pack(">II", 2, 2)          # 12 of 16 header bytes
    assert _msg(raw) == "IDX data: 12 bytes, too short for the 16-byte header of a rank-3 file"
    p = tmp_path / "h.idx"
    p.write_bytes(raw)
    assert _msg(p) == f"IDX file {str(p)!r}: 12 bytes, too short for the 16-byte header of a rank-3 file"
    raw1 = b"\0\0\x08\x01\0\0"
    assert _msg(raw1) == "IDX data: 6 bytes, too short for the 8-byte header of a rank-1 file"


@pytest.mark.parametrize("r,c", [(0, 3), (3, 0), (0, 0)])
def test_zero_rows_or_cols(r, c):
    raw = _idx((2, r, c), b"")
    assert _msg(raw) == f"IDX data: images of size {r}x{c}: rows and columns must be > 0"


def test_payload_truncated_and_trailing_bytes():
    raw = _idx((2, 2, 3))
    assert _msg(raw[:-1]) == (
        "IDX data: dimensions (2, 2, 3) need 12 data bytes after the header, but 11 follow (truncated)")
    assert _msg(raw + b"\0\0") == (
        "IDX data: dimensions (2, 2, 3) need 12 data bytes after the header, but 14 follow (trailing bytes)")


def test_file_payload_truncated_and_trailing(tmp_path):
    p = tmp_path / "t.idx"
    raw = _idx((3, 2, 2))
    p.write_bytes(raw[:-2])
    assert _msg(p) == (f"IDX file {str(p)!r}: dimensions (3, 2, 2) need 12 data bytes after the header, "
                       "but 10 follow (truncated)")
    p.write_bytes(raw + b"\1")
    assert _msg(p) == (f"IDX file {str(p)!r}: dimensions (3, 2, 2) need 12 data bytes after the header, "
                       "but 13 follow (trailing bytes)")
    p.write_bytes(_idx((5,)) + b"\1\2\3")
    assert _msg(p) == (f"IDX file {str(p)!r}: dimensions (5,) need 5 data bytes after the header, "
                       "but 8 follow (trailing bytes)")


def test_limit_exact_boundary(monkeypatch, tmp_path):
    raw = _idx((2, 2, 3))
    monkeypatch.setattr(ds, "MAX_IDX_BYTES", 12)
    np.testing.assert_array_equal(ds.read_idx(raw).ravel(), np.frombuffer(raw[16:], np.uint8))
    p = tmp_path / "l.idx"
    p.write_bytes(raw)
    assert ds.read_idx(p).shape == (2, 2, 3)
    monkeypatch.setattr(ds, "MAX_IDX_BYTES", 11)
    assert _msg(raw) == ("IDX data: header declares dimensions (2, 2, 3) = 12 bytes, more than "
                         "the 11-byte limit (MAX_IDX_BYTES): refusing it")
    assert _msg(p) == (f"IDX file {str(p)!r}: header declares dimensions (2, 2, 3) = 12 bytes, more than "
                       "the 11-byte limit (MAX_IDX_BYTES): refusing it")


def test_huge_declared_file_refused_after_header(tmp_path):
    p = tmp_path / "big.idx"
    p.write_bytes(b"\0\0\x08\x03" + struct.pack(">III", 100000, 100000, 100000) + bytes(8))
    m = _msg(p)
    assert m == (f"IDX file {str(p)!r}: header declares dimensions (100000, 100000, 100000) = "
                 f"{100000 ** 3} bytes, more than the {ds.MAX_IDX_BYTES}-byte limit (MAX_IDX_BYTES): refusing it")


def test_dims_helper():
    head = _idx((7, 300, 70000), b"")
    assert I._dims(head) == (7, 300, 70000)
    assert I._dims(_idx((65537,), b"")) == (65537,)


def test_check_idx_header_messages():
    with pytest.raises(ValueError, match=re.escape(
            "W: not an unsigned-byte IDX file of rank 1 or 3 (it starts with b'\\x00\\x00\\x08\\x02')")):
        I._check_idx_header(b"\0\0\x08\x02" + bytes(8), "W")
    for bad in (b"\0\0\x08", b"\x01\0\x08\x01", b"\0\x01\x08\x01", b"\0\0\x09\x01"):
        with pytest.raises(ValueError, match="W: not an unsigned-byte IDX file of rank 1 or 3"):
            I._check_idx_header(bad + bytes(4), "W")
    with pytest.raises(ValueError) as e:
        I._check_idx_header(b"\0\0\x08\x03" + bytes(8), "W")
    assert str(e.value) == "W: too short for the header of a rank-3 IDX file"
    assert I._check_idx_header(b"\0\0\x08\x03" + struct.pack(">III", 2, 3, 5), "W") == 30
    assert I._check_idx_header(b"\0\0\x08\x01" + struct.pack(">I", 9), "W") == 9


def test_check_pair_and_labels():
    imgs = np.zeros((3, 2, 2), np.uint8)
    I._check_pair(imgs, np.array([0, 1, 9]), 10)
    with pytest.raises(ValueError) as e:
        I._check_pair(np.zeros((3, 4)), np.array([0, 1, 2]), 10, what="W")
    assert str(e.value) == "W: images must have shape (N, rows, cols), got (3, 4)"
    with pytest.raises(ValueError) as e:
        I._check_pair(imgs, np.zeros((3, 1)), 10)
    assert str(e.value) == "dataset: labels must have shape (N,), got (3, 1)"
    with pytest.raises(ValueError) as e:
        I._check_pair(imgs, np.array([0, 1]), 10, what="W")
    assert str(e.value) == "W: 3 images but 2 labels"
    with pytest.raises(ValueError) as e:
        I._check_labels(3, np.array([0, 10, 2]), 10, what="W")
    assert str(e.value) == "W: labels must lie in [0, 10), found values from 0 to 10"
    with pytest.raises(ValueError) as e:
        I._check_labels(3, np.array([-1, 5, 2]), 10)
    assert str(e.value) == "dataset: labels must lie in [0, 10), found values from -1 to 5"
    I._check_labels(0, np.zeros((0,), np.int64), 10)
    I._check_labels(2, np.array([0, 0]), 1)
    I._check_labels(2, np.array([9, 9]), 10)


def test_header_of_exactly_four_bytes():
    # a valid magic of 4 bytes passes the first check; the missing sizes are the second
    with pytest.raises(ValueError) as e:
        I._check_idx_header(b"\0\0\x08\x01", "W")
    assert str(e.value) == "W: too short for the header of a rank-1 IDX file"


def test_dims_read_all_four_big_endian_bytes(monkeypatch, tmp_path):
    # a dimension >= 2**24 uses the first byte of its 4-byte size
    p = tmp_path / "d.idx"
    p.write_bytes(b"\0\0\x08\x01" + struct.pack(">I", 0x01000005) + b"\1\2\3")
    assert _msg(p) == (f"IDX file {str(p)!r}: dimensions (16777221,) need 16777221 data bytes after "
                       "the header, but 3 follow (truncated)")
    monkeypatch.setattr(ds, "MAX_IDX_BYTES", 1 << 24)
    assert _msg(p) == (f"IDX file {str(p)!r}: header declares dimensions (16777221,) = 16777221 bytes, "
                       f"more than the {1 << 24}-byte limit (MAX_IDX_BYTES): refusing it")
