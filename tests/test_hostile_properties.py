"""Runs the property-based hostile-file tests (tests/hostile_properties.py) in a child pytest whose
address space is capped at its size after the imports + 512 MiB (RLIMIT_AS) and whose every
example has a 5 s deadline: a reader that tries to allocate what a file declares fails there with
MemoryError, one that hangs fails its deadline.  HOSTILE_EXAMPLES (default 40) sets the examples
per reader; HOSTILE_RANDOM=1 draws new ones instead of the fixed (derandomized) sequence."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from faultkit import child_env
from hostilekit import EXTRA_MIB

HERE = Path(__file__).resolve().parent


def test_every_reader_under_hostile_properties_with_a_memory_cap():
    pytest.importorskip("hypothesis")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           str(HERE / "hostile_properties.py")],
                          env=child_env(HOSTILE_CAP_MIB=str(EXTRA_MIB)), cwd=HERE.parent,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    if "onnx" in out and re.search(r"\b0 passed|\d+ skipped", out) and proc.returncode == 0 \
            and "passed" not in out:
        pytest.skip("the property tests need the onnx package")
    assert proc.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 8, out[-3000:]      # every property ran, the cap's control too
