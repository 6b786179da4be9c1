"""Helpers shared by the fault tests: environments for child processes, private tmpfs mounts."""
import os
import signal
import shutil
import subprocess
import sys
import warnings
import types
from pathlib import Path

import cydnn

TESTS = Path(__file__).resolve().parent
#: PYTHONPATH for a child process: the cydnn this test process imported, then tests/.
PYTHONPATH = os.pathsep.join([str(Path(cydnn.__file__).resolve().parents[1]), str(TESTS)]
                             + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


def interruptible():
    """``preexec_fn`` for a child that a test interrupts with SIGINT: Ctrl-C at its default.  A suite
    started in the background (``pytest &``, nohup, some CI runners) runs with SIGINT ignored, which
    children inherit; Python then installs no KeyboardInterrupt handler in them, and cydnn's training
    guard deliberately leaves an ignored SIGINT ignored -- the child would never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_env(**extra):
    """os.environ for a child Python that imports this cydnn and the test helpers, no proxy for loopback."""
    return dict(os.environ, PYTHONPATH=PYTHONPATH, NO_PROXY="127.0.0.1,localhost",
                no_proxy="127.0.0.1,localhost", **extra)


def _probe_unshare():
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


#: Whether a child can run in a private mount namespace with its own tmpfs (root, `unshare -m`):
#: real read-only and full file systems, gone when the child exits.
UNSHARE_AVAILABLE = _probe_unshare()
UNSHARE_REASON = "needs root and `unshare -m` with tmpfs mounts (a private mount namespace)"


def run_on_tmpfs(mountpoint, options, script, *args, env=None, timeout=120):
    """Run ``python -c script *args`` with a fresh tmpfs (mount ``options``) at ``mountpoint``,
    in a private mount namespace; returns the CompletedProcess."""
    shell = f'mount -t tmpfs -o {options} tmpfs "$1" && shift && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", shell, "sh", str(mountpoint), sys.executable, "-c",
                           script, *map(str, args)], env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout)


def where_warnings_point(monkeypatch, module):
    """Record where ``warnings.warn`` in ``module`` attributes its warning: the frame ``stacklevel``
    levels up, as Python counts them.  Frames of mutmut's trampoline (a wrapper that exists only
    while mutation testing runs) are not counted, so the check means the same in both settings."""
    where = []
    real = warnings.warn

    def warn(message, category=UserWarning, stacklevel=1):
        frame, level = sys._getframe(1), 1
        while level < stacklevel:
            frame = frame.f_back
            if not frame.f_code.co_filename.replace(os.sep, "/").endswith("mutmut/mutation/trampoline.py"):
                level += 1
        where.append(frame.f_code.co_filename)
        real(message, category, stacklevel=1)

    monkeypatch.setattr(module, "warnings", types.SimpleNamespace(warn=warn))
    return where
