"""A content-addressed cache of compiled object files, shared by every build of cydnn on a machine.

Compiling the CUDA sources takes minutes; most re-installs change none of them.
An object is stored under the SHA-256 of everything that decides its bytes:

- the source file's contents (not its path: a clone elsewhere hits the cache);
- the contents of every header it may include (the cpp/ headers it names in an
  ``#include "..."``, and theirs in turn: :func:`local_includes`; and the staged
  cuDNN/cuBLAS headers), each with its file name -- so a change to one header
  recompiles only the sources that include it;
- the compiler command line, with the paths that differ between builds (the
  source, the output, the include folders) replaced by stable names;
- the compiler's identity: ``nvcc --version`` and the host compiler's
  ``--version`` (nvcc calls it).

A hit copies the stored object to where the build wants it; a miss compiles
and then stores the result (written to a temporary name and renamed, so a
concurrent build never reads half a file).  Nothing is ever looked up by
modification time.

Where: ``$CYDNN_BUILD_CACHE`` when set (a folder; ``0`` or ``off`` turns the
cache off), else ``$XDG_CACHE_HOME/cydnn/build``, else ``~/.cache/cydnn/build``.
"""
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

__all__ = ["cache_dir", "tool_identity", "local_includes", "object_key", "fetch", "store", "unlink_if_objects_changed"]

ENV = "CYDNN_BUILD_CACHE"
KEY_VERSION = b"cydnn-object-cache-1"
_OFF = ("0", "off", "no", "false", "none")


def cache_dir(environ=None):
    """The cache folder, or None when the cache is turned off (``$CYDNN_BUILD_CACHE`` = 0/off/no/false)."""
    env = os.environ if environ is None else environ
    override = env.get(ENV)
    if override is not None and override.strip():
        if override.strip().lower() in _OFF:
            return None
        return os.path.abspath(os.path.expanduser(override.strip()))
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cydnn", "build")


def tool_identity(*commands):
    """The ``--version`` output of each command (one string), naming the ones that failed to run."""
    out = []
    for cmd in commands:
        try:
            proc = subprocess.run(list(cmd) + ["--version"], capture_output=True, text=True, timeout=120)
            out.append(f"{cmd}: rc {proc.returncode}\n{proc.stdout}{proc.stderr}")
        except (OSError, subprocess.SubprocessError) as e:
            out.append(f"{cmd}: not run ({type(e).__name__})")
    return "\n".join(out)


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def local_includes(source, folder):
    """The headers of ``folder`` that ``source`` includes with ``#include "name"``, directly or through one
    another (sorted paths).  A name not in ``folder`` (a system or staged header) is not followed; a line
    commented out still counts (the key may change more often than needed, never less)."""
    seen, todo = set(), [source]
    while todo:
        with open(todo.pop(), "rb") as f:
            text = f.read()
        for name in _INCLUDE.findall(text):
            path = os.path.join(folder, name.decode(errors="replace"))
            if path not in seen and os.path.isfile(path):
                seen.add(path)
                todo.append(path)
    return sorted(seen)


def _update_file(h, path, label):
    h.update(f"\0{label}\0{len(os.path.basename(path))}:{os.path.basename(path)}\0".encode())
    with open(path, "rb") as f:
        data = f.read()
    h.update(str(len(data)).encode() + b"\0")
    h.update(data)


def object_key(source, headers, command, toolchain, replacements=()):
    """The SHA-256 (hex) naming the object compiled from ``source`` by ``command``.

    ``headers``: the files the source may include (order does not matter);
    ``command``: the compiler's arguments (a list); every occurrence of a path in
    ``replacements`` (pairs ``(path, name)``, e.g. the output file, the include
    folders) is replaced by its name first, so that the key does not depend on
    where the build runs.  ``toolchain``: :func:`tool_identity`'s text.
    """
    h = hashlib.sha256(KEY_VERSION)
    _update_file(h, source, "source")
    for header in sorted(headers, key=lambda p: (os.path.basename(p), p)):
        _update_file(h, header, "header")
    pairs = sorted(replacements, key=lambda pair: -len(pair[0]))  # longest path first
    for arg in command:
        arg = str(arg)
        for path, name in pairs:
            if path:
                arg = arg.replace(path, name)
        h.update(b"\0arg\0" + arg.encode())
    h.update(b"\0toolchain\0" + toolchain.encode())
    return h.hexdigest()


def _path(directory, key):
    return os.path.join(directory, key[:2], key + ".o")


def fetch(directory, key, dest):
    """Copy the object stored under ``key`` to ``dest``; True on a hit, False on a miss (or no cache)."""
    if directory is None:
        return False
    src = _path(directory, key)
    if not os.path.isfile(src):
        return False
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    tmp = dest + ".from-cache"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    return True


def store(directory, key, obj):
    """Store the object file ``obj`` under ``key`` (atomically); a cache that cannot be written is
    skipped silently (the build itself succeeded).  Returns the stored path or None."""
    if directory is None:
        return None
    dest, tmp = _path(directory, key), None
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), suffix=".part")
        os.close(fd)
        shutil.copyfile(obj, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        return dest
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        return None


def unlink_if_objects_changed(objects, stamp, target):
    """Remove the linked ``target`` where ``objects`` (their bytes, in order) are not those it was linked from, as
    recorded in the file ``stamp`` (rewritten).  setuptools links an extension again only when a source or one of
    its ``depends`` is newer than it; the CUDA objects are extra objects, so a change to cpp/*.cu alone left the old
    extension in place.  (They are not ``depends``: those enter the host object's cache key.)  Returns whether the
    target was removed."""
    h = hashlib.sha256()
    for obj in objects:
        with open(obj, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    digest = h.hexdigest()
    try:
        with open(stamp) as f:
            old = f.read().strip()
    except OSError:
        old = None
    removed = False
    if old != digest and os.path.exists(target):
        os.remove(target)
        removed = True
    os.makedirs(os.path.dirname(os.path.abspath(stamp)), exist_ok=True)
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    return removed
