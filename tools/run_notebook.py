"""Execute a Jupyter notebook without Jupyter: every code cell in one namespace.

    python3 tools/run_notebook.py examples/notebooks/framework_internals.ipynb [--out OUT] [--timeout S]

For machines without nbclient/ipykernel (the GPU machine): stdout and stderr
become ``stream`` outputs, matplotlib figures (Agg) ``display_data`` PNGs, the
value of a cell's last expression an ``execute_result``, an exception an
``error`` output and exit status 1.  The cells run with the notebook's folder
as the working directory.  The result is a valid nbformat 4 notebook, written
to OUT (default: in place) through a temporary file and a rename.
"""
import argparse
import ast
import base64
import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def _figures():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", dpi=80, bbox_inches="tight")
        out.append({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": ["<Figure>"]}})
    plt.close("all")
    return out


def run_cell(source, ns, count):
    outputs, stdout, stderr = [], io.StringIO(), io.StringIO()
    result, error = None, None
    try:
        tree = ast.parse(source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            exec(compile(tree, f"<cell {count}>", "exec"), ns)
            if last is not None:
                result = eval(compile(ast.Expression(last.value), f"<cell {count}>", "eval"), ns)
    except BaseException as e:  # noqa: BLE001 -- reported as the cell's error output
        error = e
    for name, buf in (("stdout", stdout), ("stderr", stderr)):
        if buf.getvalue():
            outputs.append({"output_type": "stream", "name": name, "text": buf.getvalue().splitlines(True)})
    outputs += _figures()
    if error is not None:
        tb = traceback.format_exception(type(error), error, error.__traceback__)
        outputs.append({"output_type": "error", "ename": type(error).__name__, "evalue": str(error),
                        "traceback": [line.rstrip("\n") for line in tb]})
    elif result is not None:
        outputs.append({"output_type": "execute_result", "execution_count": count, "metadata": {},
                        "data": {"text/plain": repr(result).splitlines(True)}})
    return outputs, error


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebook")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=int, default=1800, help="seconds for the whole notebook")
    args = p.parse_args(argv)
    path = Path(args.notebook).resolve()
    nb = json.loads(path.read_text())
    os.environ.setdefault("MPLBACKEND", "Agg")
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError(f"over {args.timeout} s")))
    signal.alarm(args.timeout)
    cwd = os.getcwd()
    os.chdir(path.parent)
    ns = {"__name__": "__main__"}
    failed, count, start = None, 0, time.time()
    try:
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            count += 1
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            t = time.time()
            cell["outputs"], error = run_cell(source, ns, count)
            cell["execution_count"] = count
            print(f"cell {count}: {time.time() - t:.1f} s" + (f"  ERROR {type(error).__name__}: {error}"
                                                               if error else ""), file=sys.stderr)
            if error is not None:
                failed = error
                break
    finally:
        signal.alarm(0)
        os.chdir(cwd)
    out = Path(args.out).resolve() if args.out else path
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    print(f"{count} cells in {time.time() - start:.1f} s -> {out}" + (" (FAILED)" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
