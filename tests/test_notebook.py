"""The teaching notebook runs top to bottom (on a small MNIST subset without a GPU).

It is executed by tools/run_notebook.py, the same dependency-free executor
that filled the committed copy on the GPU machine (which has no Jupyter), into
a temporary file: the committed outputs are not touched.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "framework_internals.ipynb"
MNIST = Path(os.environ.get("CYDNN_TEST_MNIST", ROOT.parent / "shared" / "data" / "mnist"))


def test_notebook_runs_top_to_bottom(tmp_path):
    pytest.importorskip("matplotlib")
    if not MNIST.is_dir():
        pytest.skip(f"real MNIST not found in {MNIST} (set CYDNN_TEST_MNIST)")
    out = tmp_path / "executed.ipynb"
    env = dict(os.environ, CYDNN_NB_LIMIT="2000", CYDNN_TEST_MNIST=str(MNIST), MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "run_notebook.py"), str(NOTEBOOK), "--out", str(out),
                           "--timeout", "170"], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    nb = json.loads(out.read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert sum(o["output_type"] == "display_data" for o in outputs) >= 5        # the pictures were drawn
    text = "".join("".join(o.get("text", [])) for o in outputs)
    assert "cudnnConvolutionForward" in text and "test accuracy" in text and "worst relative difference" in text
