#!/usr/bin/env python
"""Mutation testing of cydnn's Python modules, each against its own tests, with mutmut.

    python tools/mutation.py optim ops/cpu          # run two modules, print the scores
    python tools/mutation.py --list                 # the module -> tests table
    python tools/mutation.py optim --survivors      # also print the change of every survivor
    python tools/mutation.py --all                  # every module of the table (a nightly run)

A mutant is the module with one small change (``+`` made ``-``, ``<`` made ``<=``, a constant or
a message changed, an argument dropped, ``and`` made ``or``, ...).  The module's tests run against
it; a failing test *kills* it, a passing suite lets it *survive*.  The score is
killed / (killed + survived + not covered by any test); a survivor is either a gap in the tests or
a change that does not alter behaviour (an equivalent mutant), and docs/reliability.md
("Mutation testing") says which for the modules measured.

Why mutmut (3.x) rather than cosmic-ray: both work with Python 3.11 and pytest 9, but cosmic-ray
starts one pytest process per mutant (imports numpy, cydnn and the CUDA libraries each time):
on CI's 2 loaded cores that measured ~10 s a mutant, two hours for optim alone.  mutmut loads the
tests once, records which tests reach each function, and forks a worker per mutant that runs only
those tests: ~3 mutants a second, optim in about 4 minutes.  mutmut derives module names from
the file path and expects the sources at ./ or src/; ours are under python/, so this script
stages a scratch copy laid out as src/cydnn + tests/ (the work tree is never touched, and a run
can go on while someone edits).

Each module is run on its own scratch copy, with only its tests (the table below): keep those to
the files that really check the module, every extra file costs time per mutant.  Results go to
build/mutation/<module>.json.  ``--jobs`` sets mutmut's workers (default 1: the CI and dev
machines have 2 cores shared with others).

``--retest-survivors`` re-runs mutmut in the kept folder.  When the test selection changed (test
files added), mutmut clears every stored verdict before it runs the named survivors; this script
saves them first and puts back those of the mutants it did not re-test.  If mutmut's first step
(one pass of the selected tests) fails, the kept results may still be lost: copy the folder before
a retest you cannot afford to repeat.
"""
import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> (sources to mutate, under python/; the test files that exercise them).
TABLE = {
    "optim": (["cydnn/optim.py"], ["tests/test_optim*.py", "tests/test_faults_api.py"]),
    "ops/cpu": (["cydnn/ops/cpu"], ["tests/test_ops_cpu*.py", "tests/test_cpu_kernels*.py", "tests/test_layers_norm.py",
                                    "tests/test_datasets_loader.py", "tests/test_datasets_augment.py"]),
    "serialization": (["cydnn/serialization.py", "cydnn/checkpoint_checks.py"],
                      ["tests/test_serialization*.py", "tests/test_faults_checkpoint*.py",
                       "tests/test_hostile_readers.py"]),
    "interop": (["cydnn/interop.py"], ["tests/test_interop*.py"]),
    "onnx_import": (["cydnn/onnx_import.py", "cydnn/onnx_builder.py", "cydnn/onnx_checks.py"],
                    ["tests/test_onnx_*.py", "tests/test_hostile_readers.py"]),
    "datasets": (["cydnn/datasets"], ["tests/test_datasets*.py", "tests/test_faults_download*.py",
                                      "tests/test_download_lock.py"]),
    # The compiler's Python passes (trace, passes, lower, ...).
    "compiler": (["cydnn/compiler"], ["tests/test_compiler*.py", "tests/test_fused_train.py", "tests/test_fused_net_gen.py"]),
}

KILLED = {1, 3, 24, -24, 36, 152, 255, -9, -11, 37}     # failed, pytest error, timeouts, crashes, type check
SURVIVED, NO_TESTS, SKIPPED = {0}, {5, 33}, {34}


def sources_and_tests(name, root=ROOT):
    sources, test_globs = TABLE[name]
    tests = sorted({p.relative_to(root).as_posix() for g in test_globs for p in root.glob(g)})
    missing = [s for s in sources if not (root / "python" / s).exists()]
    return sources, tests, missing


def _toml_list(items):
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def stage(scratch, sources, tests, skip=()):
    """The scratch copy: src/cydnn (with the built extension), tests/, cpp/, setup.py, and a pyproject.toml with
    the project's pytest settings plus mutmut's."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.c", "*.cpp", "build")
    shutil.copytree(ROOT / "python" / "cydnn", scratch / "src" / "cydnn", ignore=ignore, symlinks=True)
    shutil.copytree(ROOT / "tests", scratch / "tests", ignore=ignore, symlinks=True)
    shutil.copytree(ROOT / "cpp", scratch / "cpp")      # tests/test_compiler_kernels.py reads the C sources
    shutil.copy2(ROOT / "setup.py", scratch / "setup.py")   # test_fused_net_gen.py reads its header list
    text = (ROOT / "pyproject.toml").read_text()
    text = text[text.index("[tool.pytest.ini_options]"):] if "[tool.pytest.ini_options]" in text else ""

    toml_list = _toml_list
    text += ("\n[tool.mutmut]\n"
             f"source_paths = {toml_list('src/' + s for s in sources)}\n"
             'also_copy = ["src/cydnn", "cpp", "setup.py"]\n'
             f"do_not_mutate = {toml_list('src/' + p for p in skip)}\n"
             f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
             'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n')
    (scratch / "pyproject.toml").write_text(text)


def mutmut(*args, cwd, capture=False):
    # The tests must import the mutated copy (mutmut puts mutants/src first).
    env = {**os.environ, "PYTHONPATH": _mutmut_path()}
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                          stderr=subprocess.STDOUT if capture else subprocess.DEVNULL)


def read_results(scratch, only=()):
    """Counts per outcome and the names of the surviving (and untested) mutants; with ``only``
    (globs under python/, e.g. 'cydnn/datasets/loader.py'), of the mutants of those files alone."""
    counts = {"killed": 0, "survived": 0, "no_tests": 0, "skipped": 0, "not_checked": 0}
    survivors = []
    for meta in sorted((scratch / "mutants" / "src").rglob("*.py.meta")):
        source = meta.relative_to(scratch / "mutants" / "src").as_posix()[:-len(".meta")]
        if only and not any(fnmatch.fnmatch(source, g) for g in only):
            continue
        for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if code in KILLED:
                counts["killed"] += 1
            elif code in SURVIVED or code in NO_TESTS:
                counts["survived" if code in SURVIVED else "no_tests"] += 1
                survivors.append(key)
            elif code in SKIPPED:
                counts["skipped"] += 1
            else:
                counts["not_checked"] += 1
    return counts, sorted(survivors)


# Run in the scratch folder: the changed lines of each named mutant (mutmut's own diff).
_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
out = {}
for key, path in json.load(sys.stdin):
    diff = get_diff_for_mutant(key, path=path)
    out[key] = "\\n".join(ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
print(json.dumps(out))
"""


def survivor_diffs(scratch, survivors):
    todo = []
    for meta in (scratch / "mutants" / "src").rglob("*.py.meta"):
        keys = json.loads(meta.read_text())["exit_code_by_key"]
        path = meta.relative_to(scratch / "mutants").as_posix()[:-len(".meta")]
        todo += [(k, path) for k in survivors if k in keys]
    out = subprocess.run([sys.executable, "-c", _DIFFS], cwd=scratch, input=json.dumps(todo), text=True,
                         capture_output=True, env={**os.environ, "PYTHONPATH": _mutmut_path()})
    return json.loads(out.stdout) if out.returncode == 0 else {k: f"(no diff: {out.stderr[-300:]})" for k in survivors}


def _mutmut_path():
    # Keep mutmut importable, drop any path that would hand the tests the work tree's cydnn.
    return os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p and not (Path(p) / "cydnn").is_dir())


def run_module(name, scratch_root, args):
    sources, tests, missing = sources_and_tests(name)
    if missing or not tests:
        print(f"{name:14s} not run: " + (f"no python/{', python/'.join(missing)} yet" if missing
                                        else "no test file matches the table"))
        return None
    if args.list:
        print(f"{name:14s} python/{' python/'.join(sources)}  <-  {' '.join(tests)}")
        return None
    scratch = scratch_root / name.replace("/", "_")
    again = []
    if args.retest_survivors:
        if not (scratch / "mutants").is_dir():
            print(f"{name:14s} not run: --retest-survivors needs a previous run kept in {scratch}")
            return None
        again = read_results(scratch, args.only)[1]
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
        shutil.rmtree(scratch / "tests")               # today's tests; the mutated sources stay as they were
        shutil.copytree(ROOT / "tests", scratch / "tests", ignore=ignore, symlinks=True)
        toml = (scratch / "pyproject.toml").read_text()
        line = f"pytest_add_cli_args_test_selection = {_toml_list(tests)}"
        if line not in toml:       # test files added since that run: select today's list
            toml = "\n".join(line if ln.startswith("pytest_add_cli_args_test_selection =") else ln
                             for ln in toml.splitlines()) + "\n"
            (scratch / "pyproject.toml").write_text(toml)
            print(f"{name:14s} note: the table's test files changed since that run; today's list is used")
        print(f"{name:14s} re-testing {len(again)} survivors against today's tests ...", flush=True)
        if not again:
            return read_score(name, scratch, args, 0.0, None, sources, tests)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
        stage(scratch, sources, tests, args.skip)
        print(f"{name:14s} mutating python/{' python/'.join(sources)} against {' '.join(tests)} ...", flush=True)
    started = time.monotonic()
    kept = _verdicts(scratch) if again else {}
    out = mutmut("run", "--max-children", str(args.jobs), *again, cwd=scratch, capture=True)
    if kept:
        _restore_verdicts(scratch, kept, set(again))
    return read_score(name, scratch, args, time.monotonic() - started, out, sources, tests)


def _verdicts(scratch):
    """Every mutant's exit code in a kept run, by its .meta file."""
    return {meta: json.loads(meta.read_text())["exit_code_by_key"]
            for meta in (scratch / "mutants" / "src").rglob("*.py.meta")}


def _restore_verdicts(scratch, kept, retested):
    """Put back the verdicts mutmut cleared: when the test selection changed (new test files), mutmut
    resets every stored exit code before running the named mutants, so without this the mutants that
    were not re-tested would read as not checked."""
    for meta, before in kept.items():
        if not meta.exists():
            continue
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        lost = {k: v for k, v in before.items() if k not in retested and codes.get(k) is None and v is not None}
        if lost:
            codes.update(lost)
            meta.write_text(json.dumps(data))


def read_score(name, scratch, args, seconds, out=None, sources=(), tests=()):
    counts, survivors = read_results(scratch, args.only)
    total = counts["killed"] + counts["survived"] + counts["no_tests"]
    if (out is not None and out.returncode != 0) or total == 0:
        print(f"{name:14s} mutmut failed" + (f" (exit {out.returncode}):\n{out.stdout[-3000:]}" if out else ""))
        return 0.0
    score = counts["killed"] / total
    diffs = survivor_diffs(scratch, survivors) if (args.survivors or args.json) else {}
    report = ROOT / "build" / "mutation"
    report.mkdir(parents=True, exist_ok=True)
    label = name.replace('/', '_') + "".join("-" + Path(g).stem for g in args.only)
    (report / f"{label}.json").write_text(json.dumps(
        {"module": name, "only": args.only, "sources": sources, "tests": tests, **counts, "score": score, "seconds": seconds,
         "survivors": {k: diffs.get(k, "") for k in survivors}}, indent=1))
    print(f"{name:14s} killed {counts['killed']:4d}  survived {counts['survived']:3d}  "
          f"untested {counts['no_tests']:3d}  score {score:6.1%}  ({seconds:.0f} s)", flush=True)
    if args.survivors:
        for key in survivors:
            print(f"--- {key}\n{diffs[key]}")
    return score


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", help=f"modules of the table: {', '.join(TABLE)}")
    p.add_argument("--all", action="store_true", help="every module of the table")
    p.add_argument("--list", action="store_true", help="show the module -> tests table; run nothing")
    p.add_argument("--survivors", action="store_true", help="print each surviving mutant's change")
    p.add_argument("--json", action="store_true", help="put the survivors' changes in build/mutation/*.json")
    p.add_argument("--jobs", type=int, default=1, help="mutants tested at once (default 1)")
    p.add_argument("--skip", action="append", default=[], metavar="GLOB",
                   help="files not to mutate, under python/ (e.g. 'cydnn/ops/cpu/norm.py'); repeatable")
    p.add_argument("--min-score", type=float, default=None, help="exit 1 if a module scores below this (0-1)")
    p.add_argument("--keep", metavar="DIR", help="stage in DIR and keep it (mutmut browse/show work there)")
    p.add_argument("--retest-survivors", action="store_true",
                   help="with --keep DIR of an earlier run: copy today's tests in and re-test only its survivors "
                        "(after adding tests that should kill them; the sources must not have changed)")
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="with --retest-survivors: re-test and score only the mutants of these files, under "
                        "python/ (e.g. 'cydnn/datasets/loader.py'); repeatable. The score printed and the json "
                        "(build/mutation/<module>-<file>.json) are for those files alone")
    args = p.parse_args(argv)
    if args.only and not args.retest_survivors:
        p.error("--only goes with --retest-survivors (a fresh run scopes its files with --skip)")
    names = list(TABLE) if (args.all or (args.list and not args.modules)) else args.modules
    unknown = [n for n in names if n not in TABLE]
    if unknown or not names:
        p.error(f"name modules from: {', '.join(TABLE)}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    if not args.list:
        try:
            import mutmut  # noqa: F401
        except ImportError:
            sys.exit("tools/mutation.py needs mutmut: pip install -e '.[dev]'")
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
