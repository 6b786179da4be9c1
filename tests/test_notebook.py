"""The teaching notebook runs in a real Jupyter kernel and draws every picture.

It is executed by nbclient (Jupyter's own executor) with an ipykernel kernel, through the README's
command ``python tools/make_notebook.py --execute`` with ``--out`` into a temporary folder, so the
committed copy is never touched. Without a GPU (CI) the notebook trains on 2,000 images and its GPU
cells say what they would show; its pictures must still be there: every ``plt.show()`` of a cell
gives that cell one ``image/png`` output (matplotlib's inline backend, as in Jupyter).
"""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_notebook.py"
NOTEBOOK = ROOT / "examples" / "notebooks" / "framework_internals.ipynb"
MNIST = Path(os.environ.get("CYDNN_TEST_MNIST", ROOT.parent / "shared" / "data" / "mnist"))


def _need_jupyter():
    for module in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]')")


def _run(out, env_extra, timeout=240):
    """The README's notebook command, into ``out``; one BLAS thread so a busy CI machine stays quick."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, str(TOOL), "--execute", "--out", str(out), "--timeout", "200"],
                          env=env, capture_output=True, text=True, timeout=timeout)


def _code_cells(path):
    nb = json.loads(Path(path).read_text())
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _text(cell):
    return "".join("".join(o["text"]) if isinstance(o.get("text"), list) else o.get("text", "")
                   for o in cell["outputs"])


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    _need_jupyter()
    if not MNIST.is_dir():
        pytest.skip(f"real MNIST not found in {MNIST} (set CYDNN_TEST_MNIST to a folder with the four .gz files)")
    tmp = tmp_path_factory.mktemp("notebook")
    before = hashlib.sha256(NOTEBOOK.read_bytes()).hexdigest()
    proc = _run(tmp / "executed.ipynb", {"CYDNN_DATA": str(tmp / "data"), "CYDNN_MNIST_MIRROR": str(MNIST)})
    after = hashlib.sha256(NOTEBOOK.read_bytes()).hexdigest()
    return proc, tmp / "executed.ipynb", before == after


def test_notebook_runs_without_error(executed):
    proc, out, _ = executed
    assert proc.returncode == 0, proc.stderr[-4000:]
    cells = _code_cells(out)
    errors = [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, errors
    assert all(c["execution_count"] for c in cells), "a cell did not run"
    silent = [_source(c)[:80] for c in cells if not c["outputs"]]
    assert not silent, f"cells that showed nothing: {silent}"


def test_every_plot_cell_shows_its_images(executed):
    proc, out, _ = executed
    assert proc.returncode == 0, proc.stderr[-4000:]
    plot_cells = 0
    for cell in _code_cells(out):
        shows = _source(cell).count("plt.show()")
        images = sum("image/png" in o.get("data", {}) for o in cell["outputs"])
        assert images == shows, f"{shows} plt.show() but {images} images in:\n{_source(cell)[:300]}"
        plot_cells += shows > 0
    assert plot_cells >= 4


def test_notebook_shows_what_it_teaches(executed):
    proc, out, _ = executed
    assert proc.returncode == 0, proc.stderr[-4000:]
    cells = _code_cells(out)
    text = "".join(_text(c) for c in cells)
    for expected in ("cudnnConvolutionForward", "worst relative difference", "test accuracy", "MNIST in "):
        assert expected in text, expected
    plan = [c for c in cells if "step.explain()" in _source(c)]
    assert len(plan) == 1, "one cell shows the compiler's plan"
    import cydnn
    if not hasattr(cydnn, "compile"):
        assert "no cydnn.compile yet" in _text(plan[0])
    else:
        text = _text(plan[0])
        assert "no cydnn.compile yet" not in text and "conv1" in text and "fc3" in text, text[:2000]


def test_run_writes_a_copy_not_the_committed_notebook(executed):
    _, _, committed_untouched = executed
    assert committed_untouched


def test_committed_notebook_is_built_from_the_tool_without_agg():
    """The .ipynb holds exactly the tool's cells (edits go to tools/notebook_cells.py), and none forces Agg."""
    _need_jupyter()
    spec = importlib.util.spec_from_file_location("make_notebook", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    committed = json.loads(NOTEBOOK.read_text())["cells"]
    assert [(c["cell_type"], _source(c)) for c in committed] == [(c.cell_type, c.source) for c in tool.build().cells]
    sources = "".join(_source(c) for c in committed if c["cell_type"] == "code")
    assert "matplotlib.use(" not in sources and "Agg" not in sources
    assert "%matplotlib inline" in sources


def test_without_mnist_the_notebook_says_what_to_do_in_one_line(tmp_path):
    _need_jupyter()
    empty = tmp_path / "empty-mirror"
    empty.mkdir()
    proc = _run(tmp_path / "failed.ipynb", {"CYDNN_DATA": str(tmp_path / "data"), "CYDNN_MNIST_MIRROR": str(empty)},
                timeout=120)
    assert proc.returncode == 1, proc.stderr[-4000:]
    errors = [o for c in _code_cells(tmp_path / "failed.ipynb") for o in c["outputs"] if o["output_type"] == "error"]
    assert len(errors) == 1
    assert errors[0]["ename"] == "MNISTUnavailable"
    lines = [line for line in errors[0]["traceback"] if line.strip()]
    assert len(lines) == 1, lines
    assert "CYDNN_MNIST_MIRROR=" in lines[0] and "CYDNN_DATA=" in lines[0] and str(tmp_path / "data") in lines[0]
    assert "StopIteration" not in proc.stderr


def test_a_python_without_jupyter_is_told_what_to_install(monkeypatch, capsys):
    """The GPU machine's Python lacked nbformat and the tool died in an ImportError traceback: it now names
    what is missing and how to install it, before writing anything, and exits 2."""
    spec = importlib.util.spec_from_file_location("make_notebook", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("nbformat", "ipykernel")
                        else real(name, *a))
    monkeypatch.setattr(tool, "write", lambda *a: pytest.fail("wrote a notebook"))
    assert tool.main(["--execute"]) == 2
    err = capsys.readouterr().err
    assert "lacks nbformat, ipykernel" in err and 'pip install -e ".[test]"' in err
