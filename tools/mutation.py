#!/usr/bin/env python
"""Mutation testing of cydnn's Python modules, each against its own tests, with cosmic-ray.

    python tools/mutation.py optim ops/cpu          # run two modules, print the scores
    python tools/mutation.py --list                 # the module -> tests table, with mutant counts
    python tools/mutation.py optim --survivors      # also print the diff of every surviving mutant
    python tools/mutation.py --all                  # every module of the table (a nightly run)

A mutant is the module with one small change (``+`` made ``-``, ``<`` made ``<=``, a constant
changed, a ``not`` added, a loop made to run zero times, ...).  The module's tests are run against
it; a failing test *kills* it, a passing suite lets it *survive*.  The score is
killed / (killed + survived); a survivor is either a gap in the tests or a change that does not
alter behaviour (an equivalent mutant), and docs/reliability.md ("Mutation testing") says which.

Why cosmic-ray and not mutmut: mutmut 3 maps a source file to its module name from the path and
supports only sources at ./, src/ or source/ (ours are under python/), and it rewrites every
function into a trampoline, which the Cython-facing code does not need.  cosmic-ray mutates one
occurrence at a time, in place, and runs any test command, so each module gets exactly its tests.
To keep the work tree untouched (and to let a run go on while someone edits), this script copies
python/, tests/ and pyproject.toml into a scratch folder and mutates the copy there.

Budget: one mutant costs one pytest start (about a second for cydnn) plus the module's tests, and
``-x`` stops at the first failure, so killed mutants are cheap.  By default the replacements of an
arithmetic operator by a bitwise or shift operator (``+`` -> ``|``, ``*`` -> ``<<``, ...) are left
out: on float arrays they always raise TypeError, so they cost a run each and tell nothing;
``--all-operators`` puts them back.  optim takes about 5 minutes on one core, ops/cpu about 15.
The runs are serial (one core); results go to build/mutation/<module>.json.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> (sources to mutate, the test files that exercise them).  Keep each module's tests to
# the files that really check it: every extra file is paid once per mutant.
TABLE = {
    "optim": (["python/cydnn/optim.py"], ["tests/test_optim.py"]),
    "ops/cpu": (["python/cydnn/ops/cpu"], ["tests/test_ops_cpu.py"]),
    "serialization": (["python/cydnn/serialization.py"],
                      ["tests/test_serialization.py", "tests/test_faults_checkpoint.py",
                       "tests/test_faults_checkpoint_more.py"]),
    "interop": (["python/cydnn/interop.py"], ["tests/test_interop.py"]),
    "onnx_import": (["python/cydnn/onnx_import.py"], ["tests/test_onnx_import.py", "tests/test_onnx_refusals.py"]),
    "datasets": (["python/cydnn/datasets"], ["tests/test_datasets.py", "tests/test_faults_download.py",
                                             "tests/test_faults_download_fs.py"]),
    # The compiler's Python passes (being written): its tests are whatever tests/test_compiler*.py holds.
    "compiler": (["python/cydnn/compiler"], ["tests/test_compiler*.py"]),
}

# Arithmetic -> bitwise/shift replacements: always a TypeError on floats (see the docstring).
CHEAP_SKIPS = [r"core/ReplaceBinaryOperator_\w+_(BitAnd|BitOr|BitXor|LShift|RShift)$"]


def sources_and_tests(name, root=ROOT):
    sources, test_globs = TABLE[name]
    tests = sorted({str(p.relative_to(root)) for g in test_globs for p in root.glob(g)})
    missing = [s for s in sources if not (root / s).exists()]
    return sources, tests, missing


def make_copy(scratch):
    """python/, tests/ and pyproject.toml into `scratch`, without caches and build outputs
    (the built extension is kept: the tests import it)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.c", "*.cpp", "build")
    for part in ("python", "tests"):
        shutil.copytree(ROOT / part, scratch / part, ignore=ignore, symlinks=True)
    shutil.copy2(ROOT / "pyproject.toml", scratch / "pyproject.toml")


def pytest_args(tests):
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]


def test_command(scratch, tests):
    # `env` gives the tests the copy's sources only (not cosmic-ray's own import path).
    return shlex.join(["env", f"PYTHONPATH={scratch / 'python'}", *pytest_args(tests)])


def write_config(path, sources, command, timeout, skips):
    lines = ["[cosmic-ray]",
             "module-path = [" + ", ".join(json.dumps(s) for s in sources) + "]",
             f"timeout = {timeout:.1f}",
             "excluded-modules = []",
             f"test-command = {json.dumps(command)}",
             "", "[cosmic-ray.distributor]", 'name = "local"',
             "", "[cosmic-ray.filters.operators-filter]",
             "exclude-operators = [" + ", ".join(json.dumps(s) for s in skips) + "]", ""]
    path.write_text("\n".join(lines))


def cosmic_ray(*args, cwd):
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL)


def filter_operators(config, session, cwd):
    subprocess.run([sys.executable, "-m", "cosmic_ray.tools.filters.operators_filter", str(session), str(config)],
                   cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_session(session):
    """(counts, survivors): counts of killed/survived/incompetent/skipped; survivors as
    (file, line, operator, diff)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome
    counts = {"killed": 0, "survived": 0, "incompetent": 0, "skipped": 0, "pending": 0}
    survivors = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        counts["pending"] = sum(1 for _ in db.pending_work_items)
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                counts["skipped"] += 1
            elif result.test_outcome == TestOutcome.KILLED:
                counts["killed"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                m = item.mutations[0]
                survivors.append((str(m.module_path), m.start_pos[0], m.operator_name, result.diff or ""))
            else:
                counts["incompetent"] += 1
    survivors.sort()
    return counts, survivors


def run_module(name, scratch_root, args):
    sources, tests, missing = sources_and_tests(name)
    if missing or not tests:
        print(f"{name:14s} not run: " + (f"no {', '.join(missing)}" if missing else "no tests match the table"))
        return None
    scratch = scratch_root / name.replace("/", "_")
    make_copy(scratch)
    command = test_command(scratch, tests)
    started = time.monotonic()
    base = subprocess.run(pytest_args(tests), cwd=scratch, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(scratch / "python")})
    baseline = time.monotonic() - started
    if base.returncode != 0:
        print(f"{name:14s} not run: its tests fail before any mutation:\n{base.stdout[-2000:]}")
        return None
    config, session = scratch / "cr.toml", scratch / "session.sqlite"
    write_config(config, sources, command, max(60.0, 10 * baseline), [] if args.all_operators else CHEAP_SKIPS)
    cosmic_ray("init", str(config), str(session), cwd=scratch)
    filter_operators(config, session, cwd=scratch)
    counts, _ = read_session(session)
    if args.list:
        print(f"{name:14s} {counts['pending']:5d} mutants ({counts['skipped']} bitwise skipped)  "
              f"sources {' '.join(sources)}  tests {' '.join(tests)}  (tests take {baseline:.1f} s)")
        return None
    print(f"{name:14s} {counts['pending']} mutants against {' '.join(tests)} ...", flush=True)
    started = time.monotonic()
    cosmic_ray("exec", str(config), str(session), cwd=scratch)
    counts, survivors = read_session(session)
    done = counts["killed"] + counts["survived"]
    score = counts["killed"] / done if done else float("nan")
    out = ROOT / "build" / "mutation"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name.replace('/', '_')}.json").write_text(json.dumps(
        {"module": name, "tests": tests, **counts, "score": score, "seconds": time.monotonic() - started,
         "survivors": [{"file": f, "line": ln, "operator": op, "diff": d} for f, ln, op, d in survivors]},
        indent=1))
    print(f"{name:14s} killed {counts['killed']:4d}  survived {counts['survived']:3d}  "
          f"incompetent {counts['incompetent']:3d}  score {score:.1%}  ({time.monotonic() - started:.0f} s)")
    if args.survivors:
        for f, line, op, diff in survivors:
            print(f"--- survivor {f}:{line} {op}")
            print("\n".join(ln for ln in diff.splitlines() if ln.startswith(("+", "-")) and
                            not ln.startswith(("+++", "---"))))
    return score


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", help=f"modules of the table: {', '.join(TABLE)}")
    p.add_argument("--all", action="store_true", help="every module of the table")
    p.add_argument("--list", action="store_true", help="count the mutants and show the table; run nothing")
    p.add_argument("--survivors", action="store_true", help="print each surviving mutant's change")
    p.add_argument("--all-operators", action="store_true", help="keep the arithmetic -> bitwise replacements")
    p.add_argument("--min-score", type=float, default=None, help="exit 1 if a module scores below this (0-1)")
    p.add_argument("--keep", metavar="DIR", help="work in DIR (kept) instead of a temporary folder")
    args = p.parse_args(argv)
    names = list(TABLE) if (args.all or (args.list and not args.modules)) else args.modules
    unknown = [n for n in names if n not in TABLE]
    if unknown or not names:
        p.error(f"name modules from: {', '.join(TABLE)}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        sys.exit("tools/mutation.py needs cosmic-ray: pip install -e '.[dev]'")
    scratch_root = Path(args.keep or tempfile.mkdtemp(prefix="cydnn-mutation-"))
    scratch_root.mkdir(parents=True, exist_ok=True)
    try:
        scores = {n: run_module(n, scratch_root, args) for n in names}
    finally:
        if not args.keep:
            shutil.rmtree(scratch_root, ignore_errors=True)
    low = [n for n, s in scores.items() if s is not None and args.min_score is not None and s < args.min_score]
    if low:
        sys.exit(f"below {args.min_score:.0%}: {', '.join(low)}")


if __name__ == "__main__":
    main()
