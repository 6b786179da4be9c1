"""Builds the teaching notebook from tools/notebook_cells.py and, when asked, runs it with nbclient.

    python tools/make_notebook.py --execute               # run it into build/notebooks/framework_internals.ipynb
    python tools/make_notebook.py --execute --out PATH    # run it into PATH
    python tools/make_notebook.py --execute --in-place    # refresh the committed copy's outputs (the GPU machine)
    python tools/make_notebook.py --in-place              # rewrite the committed copy from the cells, no outputs

The cells in tools/notebook_cells.py are the source of examples/notebooks/framework_internals.ipynb:
edit them, not the .ipynb. The committed notebook is written only with ``--in-place``; every other run writes a copy.
``--execute`` runs the notebook the way Jupyter does: nbclient (Jupyter's own executor) starts an
ipykernel kernel in the notebook's folder and runs every cell; plots come out of matplotlib's
inline backend as ``image/png`` outputs. A cell that raises stops the run (exit status 1, the
copy is still written, with the error in it). MNIST is found by the notebook itself through
``cydnn.datasets`` (the cache in ``$CYDNN_DATA``, a mirror in ``$CYDNN_MNIST_MIRROR``, or the public
mirrors); when ``$CYDNN_DATA`` is unset this tool points it at the repository's ``data/`` folder,
the cache ``python -m cydnn.train`` fills when started from the repository root.
Needs ``pip install -e ".[test]"`` (nbclient, nbformat, ipykernel, matplotlib).
"""
import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "framework_internals.ipynb"
DEFAULT_OUT = ROOT / "build" / "notebooks" / NOTEBOOK.name

CELLS_FILE = Path(__file__).with_name("notebook_cells.py")


def cells():
    """``[(kind, source), ...]`` from tools/notebook_cells.py (loaded by path: tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("notebook_cells", CELLS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CELLS


def build():
    """The notebook (an nbformat NotebookNode) from the cells, with stable cell ids."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    for i, (kind, source) in enumerate(cells()):
        cell = nbformat.v4.new_code_cell(source) if kind == "code" else nbformat.v4.new_markdown_cell(source)
        cell.id = f"cell-{i}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def execute(nb, timeout, kernel_name):
    """Runs every cell with nbclient in the notebook's folder; returns the error that stopped it, or None."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    os.environ.setdefault("CYDNN_DATA", str(ROOT / "data"))
    from jupyter_client.manager import AsyncKernelManager
    with tempfile.TemporaryDirectory(prefix="cydnn-kernel-") as sockets:
        # Local (ipc) sockets in a private folder rather than TCP ports: nothing listens on the network.
        km = AsyncKernelManager(kernel_name=kernel_name, transport="ipc",
                                connection_file=os.path.join(sockets, "kernel.json"))
        client = NotebookClient(nb, km=km, timeout=timeout, kernel_name=kernel_name, record_timing=False,
                                resources={"metadata": {"path": str(NOTEBOOK.parent)}})
        return _run(client, CellExecutionError)


def _run(client, error_type):
    try:
        client.execute()
    except error_type as e:
        return e
    return None


def write(nb, out):
    """Writes through a temporary file and a rename, so a reader never sees half a notebook."""
    import nbformat
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    nbformat.write(nb, str(tmp))
    os.replace(tmp, out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python tools/make_notebook.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--execute", action="store_true", help="run every cell with nbclient (default: write it unrun)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, help=f"where to write (default: {DEFAULT_OUT.relative_to(ROOT)})")
    where.add_argument("--in-place", action="store_true", help=f"write the committed {NOTEBOOK.relative_to(ROOT)}")
    p.add_argument("--timeout", type=int, default=600, help="seconds one cell may run (default: 600)")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default: python3, this Python)")
    args = p.parse_args(argv)
    needed = ("nbformat",) + (("nbclient", "ipykernel", "matplotlib") if args.execute else ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:     # say what to install, before any work, instead of an ImportError's traceback
        print(f"make_notebook: this Python ({sys.executable}) lacks {', '.join(missing)}: "
              f'pip install -e ".[test]" installs them', file=sys.stderr)
        return 2
    out = NOTEBOOK if args.in_place else (args.out or DEFAULT_OUT).resolve()
    nb = build()
    error, start = None, time.perf_counter()
    if args.execute:
        error = execute(nb, args.timeout, args.kernel)
    write(nb, out)
    ran = f"executed in {time.perf_counter() - start:.1f} s" if args.execute else "not executed"
    print(f"{out} ({ran})", file=sys.stderr)
    if error is not None:
        print(f"a cell raised, the run stopped there:\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
