"""The object cache of the build (build_tools/object_cache.py): what its key depends on, and hits.

The key must change with anything that changes the object (the source, any
header it may include, the command line, the compilers) and with nothing else
(where the tree or the build folder lies); a hit copies the stored object.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "build_tools"))
import object_cache  # noqa: E402

CMD = ["nvcc", "-std=c++17", "-O3", "-gencode", "arch=compute_90,code=sm_90"]


@pytest.fixture
def tree(tmp_path):
    """A source, two headers, a build folder: paths as setup.py passes them."""
    cpp = tmp_path / "repo" / "cpp"
    cpp.mkdir(parents=True)
    (cpp / "conv.cu").write_text("#include \"common.cuh\"\n__global__ void k() {}\n")
    (cpp / "common.cuh").write_text("#pragma once\n")
    (cpp / "cydnn.h").write_text("int cydnn_version(void);\n")
    return cpp


def key(cpp, build=None, cmd=CMD, toolchain="nvcc 13.0\ngcc 12.2", source="conv.cu"):
    build = build or (cpp.parent / "build")
    src, obj = str(cpp / source), str(build / "cuda" / "conv.o")
    headers = [str(cpp / "common.cuh"), str(cpp / "cydnn.h")]
    full = list(cmd) + ["-I" + str(cpp), "-c", src, "-o", obj]
    return object_cache.object_key(src, headers, full, toolchain,
                                   replacements=[(obj, "<object>"), (src, "<source>"), (str(cpp), "<cpp>")])


def test_the_key_changes_with_the_source(tree):
    before = key(tree)
    (tree / "conv.cu").write_text("#include \"common.cuh\"\n__global__ void k() { }\n")
    assert key(tree) != before


@pytest.mark.parametrize("header", ["common.cuh", "cydnn.h"])
def test_the_key_changes_with_any_header(tree, header):
    before = key(tree)
    with open(tree / header, "a") as f:
        f.write("// changed\n")
    assert key(tree) != before


def test_the_key_changes_with_the_flags_and_the_toolchain(tree):
    before = key(tree)
    assert key(tree, cmd=CMD[:-2] + ["-gencode", "arch=compute_80,code=sm_80"]) != before
    assert key(tree, cmd=CMD + ["-DNDEBUG"]) != before
    assert key(tree, cmd=[CMD[0], "-O3", "-std=c++17"] + CMD[3:]) != before  # argument order counts
    assert key(tree, toolchain="nvcc 13.1\ngcc 12.2") != before
    assert key(tree, toolchain="nvcc 13.0\ngcc 13.1") != before


def test_the_key_does_not_depend_on_where_the_tree_or_the_build_lies(tree, tmp_path):
    before = key(tree)
    assert key(tree, build=tmp_path / "elsewhere" / "tmpbuild") == before
    other = tmp_path / "clone" / "cpp"
    other.mkdir(parents=True)
    for f in tree.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    assert key(other) == before
    (other / "conv.cu").rename(other / "renamed.cu")  # the name is part of the content hashed
    assert key(other, source="renamed.cu") != before


def test_a_header_moved_between_files_changes_the_key(tree):
    """Two headers whose concatenation is the same are still told apart (lengths are hashed)."""
    (tree / "common.cuh").write_text("ab")
    (tree / "cydnn.h").write_text("c")
    first = key(tree)
    (tree / "common.cuh").write_text("a")
    (tree / "cydnn.h").write_text("bc")
    assert key(tree) != first


def test_a_miss_then_a_hit_copies_the_object(tmp_path):
    cache = tmp_path / "cache"
    built = tmp_path / "build1" / "conv.o"
    built.parent.mkdir()
    built.write_bytes(b"\x7fELF object bytes")
    dest = tmp_path / "build2" / "cuda" / "conv.o"
    assert object_cache.fetch(str(cache), "ab" * 32, str(dest)) is False and not dest.exists()
    stored = object_cache.store(str(cache), "ab" * 32, str(built))
    assert stored is not None and Path(stored).read_bytes() == built.read_bytes()
    built.write_bytes(b"changed after storing")  # the cache holds its own copy
    assert object_cache.fetch(str(cache), "ab" * 32, str(dest)) is True
    assert dest.read_bytes() == b"\x7fELF object bytes"
    assert not list(dest.parent.glob("*.from-cache")) and not list(Path(stored).parent.glob("*.part"))


def test_no_cache_means_always_a_miss(tmp_path):
    obj = tmp_path / "a.o"
    obj.write_bytes(b"x")
    assert object_cache.store(None, "cd" * 32, str(obj)) is None
    assert object_cache.fetch(None, "cd" * 32, str(tmp_path / "b.o")) is False


def test_an_unwritable_cache_is_skipped(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    obj = tmp_path / "a.o"
    obj.write_bytes(b"x")
    assert object_cache.store(str(blocker), "ef" * 32, str(obj)) is None


def test_the_cache_folder(tmp_path):
    home = os.path.expanduser("~")
    assert object_cache.cache_dir({}) == os.path.join(home, ".cache", "cydnn", "build")
    assert object_cache.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "cydnn" / "build")
    env = {"XDG_CACHE_HOME": str(tmp_path), "CYDNN_BUILD_CACHE": str(tmp_path / "mine")}
    assert object_cache.cache_dir(env) == str(tmp_path / "mine")
    for off in ("0", "off", "OFF", "false"):
        assert object_cache.cache_dir({"CYDNN_BUILD_CACHE": off}) is None


def test_tool_identity_names_a_missing_tool():
    text = object_cache.tool_identity(["/nonexistent/nvcc"], [sys.executable])
    assert "/nonexistent/nvcc" in text and "not run" in text
    assert "Python" in text  # `python --version` ran


def test_a_source_depends_on_the_headers_it_includes_and_theirs(tmp_path):
    """setup.py keys each object on local_includes(source): the cpp/ headers named in an #include "..." and
    theirs in turn (so a header's change recompiles only its includers); system and staged headers are not
    followed, an include cycle ends."""
    cpp = tmp_path / "cpp"
    cpp.mkdir()
    (cpp / "a.cu").write_text('#include <cstdio>\n#include "common.cuh"\n  #  include "loss_rows.cuh"\n'
                              '#include "cudnn.h"\n')
    (cpp / "b.cu").write_text('#include "common.cuh"\n')
    (cpp / "common.cuh").write_text('#pragma once\n#include "cydnn.h"\n#include "common.cuh"\n')
    (cpp / "cydnn.h").write_text("int f(void);\n")
    (cpp / "loss_rows.cuh").write_text("#pragma once\n")
    (cpp / "unused.cuh").write_text("#pragma once\n")
    got = object_cache.local_includes(str(cpp / "a.cu"), str(cpp))
    assert got == sorted(str(cpp / n) for n in ("common.cuh", "cydnn.h", "loss_rows.cuh"))
    assert object_cache.local_includes(str(cpp / "b.cu"), str(cpp)) == sorted(
        str(cpp / n) for n in ("common.cuh", "cydnn.h"))
    src, obj = str(cpp / "b.cu"), str(tmp_path / "b.o")

    def key_b():
        return object_cache.object_key(src, object_cache.local_includes(src, str(cpp)), ["nvcc", "-c", src],
                                       "nvcc", replacements=[(obj, "<object>"), (src, "<source>")])
    before = key_b()
    (cpp / "loss_rows.cuh").write_text("#pragma once\n// changed\n")
    assert key_b() == before                      # b.cu does not include it
    (cpp / "cydnn.h").write_text("int f(void);\nint g(void);\n")
    assert key_b() != before                      # through common.cuh


def test_the_extension_is_linked_again_when_a_cuda_object_changes(tmp_path):
    """setuptools relinks only where a source or ``depends`` is newer than the extension: a change to a .cu file alone
    left the old library in place.  unlink_if_objects_changed removes it where the objects' bytes differ from the last
    link's (the first time, with no record, too), and keeps it where they are the same."""
    objs = [tmp_path / "a.o", tmp_path / "b.o"]
    for o, data in zip(objs, (b"a1", b"b1")):
        o.write_bytes(data)
    stamp, target = tmp_path / "build" / "cuda_objects.sha256", tmp_path / "_C.so"
    target.write_bytes(b"old")
    assert object_cache.unlink_if_objects_changed(objs, stamp, target) and not target.exists()   # no record yet
    target.write_bytes(b"linked")
    assert not object_cache.unlink_if_objects_changed(objs, stamp, target) and target.exists()   # the same bytes
    objs[1].write_bytes(b"b2")
    assert object_cache.unlink_if_objects_changed(objs, stamp, target) and not target.exists()
    assert not object_cache.unlink_if_objects_changed(objs, stamp, target)                      # nothing to remove
