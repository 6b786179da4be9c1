"""A disk cache of the kernels NVRTC compiles for a network (nvrtc_jobs.py's Generation).

The same source, headers, options and NVRTC give equivalent code (not always the same bytes: NVRTC 13 vectorises some
loads differently from one process to the next, docs/performance/zoo-session-36.md), so a program run again (a
notebook re-run, a script, a service restarting) takes the cubin from disk in milliseconds instead of NVRTC's 0.3-3 s,
and keeps the same one.

NVRTC 12.9+ has a cache of its own where a driver is loaded: what it compiled goes into the driver's compute cache
(``~/.nv/ComputeCache``, ``$CUDA_CACHE_PATH``; ``$CUDA_CACHE_DISABLE=1`` turns it off) and the same source and
options come back from it (the CNN's whole form in 0.1 s against 1.7-2.9 s cold on the H100's host, session 37).
This cache is kept beside it: it serves where that one is off, full or evicted, or NVRTC is older, and it is
cydnn's to clear.  Benchmarks that time compiles start both empty (benchmarks/bench_zoo.py: ``fresh_caches``).

Where: ``$CYDNN_KERNEL_CACHE`` (a folder; ``0`` or ``off``: no cache), else ``$XDG_CACHE_HOME/cydnn/kernels``,
else ``~/.cache/cydnn/kernels``.  An entry is ``<sha256 of everything the compile depends on>.cubin``,
written under a temporary name and renamed, so a reader never sees half a file and two writers race
harmlessly.  What is read back is checked before use: an ELF header and a size under ``MAX_BYTES``
(anything else is ignored and compiled again); the kernel it holds then meets the same check as a fresh
one (fused_net.py: the interpreter's outputs on 1 and 4 images) before it serves.  A folder that cannot be
made or written leaves the cache off for that compile, never an error.
"""
import hashlib
import json
import os
import tempfile

#: the largest entry read back (the generated kernels are 0.1-1 MB)
MAX_BYTES = 64 << 20
_ELF = b"\x7fELF"


def cache_dir(environ=None):
    """The cache's folder, or None when ``$CYDNN_KERNEL_CACHE`` is 0 / off."""
    env = os.environ if environ is None else environ
    text = env.get("CYDNN_KERNEL_CACHE", "").strip()
    if text.lower() in ("0", "off"):
        return None
    if text:
        return text
    base = env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cydnn", "kernels")


def key(text, headers, options, compiler):
    """The entry's name: a digest of the source, the headers it includes, NVRTC's options and which NVRTC
    (its path and version)."""
    blob = json.dumps({"text": text, "headers": headers, "options": list(options), "nvrtc": compiler},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load(folder, name):
    """The cubin stored under ``name``, or None (no cache, no entry, unreadable, not an ELF, too big)."""
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, name + ".cubin"), "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES or len(data) < 64 or not data.startswith(_ELF):
        return None
    return data


def store(folder, name, cubin):
    """Keep ``cubin`` under ``name``; whether it was written (False: no cache, or the folder refused)."""
    if folder is None:
        return False
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=name[:16] + "-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, os.path.join(folder, name + ".cubin"))
        return True
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
