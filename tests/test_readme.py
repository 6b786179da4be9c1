"""Every command in README.md and docs/*.md runs as written.

The README's shell blocks (```bash / ```sh / ```shell) are split into command lines (a line ending
in a backslash continues on the next; comments stay, bash drops them). Each line falls under the
FIRST rule that matches it:

1. ``pip install`` (network, and it changes this environment): not run here; CI's ``.ci/run`` runs
   the README's install command itself.
2. ``pytest``: not run here; it is this suite.
3. ``--device cuda`` (needs a GPU): not run here.
4. ``tools/make_notebook.py``: run by tests/test_notebook.py, as written plus ``--out`` into a
   temporary folder (running it twice would double the suite's longest test).
5. ``cydnn.train`` without ``--mirror``: it downloads MNIST from the public mirrors (no network
   here) and trains the full 20 epochs: not run here.
6. everything else is run with bash, each in a fresh temporary copy of the repository (a folder of
   links to the repository's top-level entries, without ``data/`` and ``build/``, with ``../shared``
   linked beside it), with ``python``/``python3`` meaning this interpreter, one BLAS thread and a
   time bound; it must exit 0 (and with ``--json`` print the JSON summary the README describes).

Every line that calls ``cydnn.train``, whichever rule it falls under, must give options that the
command's own parser (``cydnn.train.build_parser``) accepts.

Inline commands in README.md and docs/*.md (code spans that start with ``python``/``python3``, or a
path to a ``.py`` file followed by arguments) must name scripts and modules that exist, and only options ``cydnn.train`` has
(their values may be placeholders such as ``--seed S``).
"""
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "performance").glob("*.md"))
SHARED = ROOT.parent / "shared"
TIMEOUT = 150      # seconds for one command

BLOCK = re.compile(r"^[ \t]*```(?:bash|sh|shell)[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def shell_commands(text):
    """The command lines of the shell blocks of a markdown text, continuation lines joined."""
    out = []
    for block in BLOCK.findall(text):
        pending = ""
        for line in block.splitlines():
            line = line.strip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = pending + line, ""
            if line and not line.startswith("#"):
                out.append(line)
    return out


def rule(command):
    """(number, reason) of the first rule of the module docstring that matches the command."""
    if "pip install" in command:
        return 1, "pip install: network, and CI's .ci/run runs it"
    if "pytest" in command:
        return 2, "the test suite itself"
    if "--device cuda" in command:
        return 3, "needs a GPU"
    if "tools/make_notebook.py" in command:
        return 4, "run by tests/test_notebook.py"
    if "cydnn.train" in command and "--mirror" not in command:
        return 5, "downloads from the public mirrors and trains 20 epochs"
    return 6, "run"


def train_args(command):
    """The arguments after ``-m cydnn.train`` (or ``cydnn-train``) in a command, up to ``&&``/``;``/``|``."""
    words = shlex.split(command, comments=True)
    for i, w in enumerate(words):
        if w == "cydnn.train" and i and words[i - 1] == "-m" or w == "cydnn-train":
            args = []
            for a in words[i + 1:]:
                if a in ("&&", "||", ";", "|"):
                    break
                args.append(a)
            return args
    return None


README_COMMANDS = shell_commands(README.read_text())


def test_the_readme_has_the_commands_this_test_classifies():
    rules = [rule(c)[0] for c in README_COMMANDS]
    assert 6 in rules and 5 in rules and 4 in rules, README_COMMANDS
    assert any("tools/make_notebook.py --execute" in c for c in README_COMMANDS), "the notebook command"


def _copy_of_repo(tmp):
    """A temporary copy of the repository: links to its top-level entries, ../shared beside it."""
    repo = tmp / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("data", "build", ".git"):
            (repo / entry.name).symlink_to(entry)
    if SHARED.exists():
        (tmp / "shared").symlink_to(SHARED)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return repo, bin_dir


@pytest.mark.parametrize("command", [c for c in README_COMMANDS if rule(c)[0] == 6])
def test_readme_command_runs(command, tmp_path):
    if "../shared/" in command and not SHARED.is_dir():
        pytest.skip(f"the command reads {SHARED}, which is not there")
    repo, bin_dir = _copy_of_repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "CYDNN_DATA"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", MPLBACKEND="Agg")
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run(["bash", "-c", f"set -eo pipefail\n{command}"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    if "--json" in command:              # README: "the last line is one JSON object with test_accuracy, ..."
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert 0 <= summary["test_accuracy"] <= 1 and summary["device"] == "cpu", summary


@pytest.mark.parametrize("command", [c for c in README_COMMANDS if train_args(c) is not None])
def test_readme_train_command_parses(command):
    """Every README command line that trains (whichever rule it falls under) gives options that parse."""
    from cydnn.train import build_parser
    args = train_args(command)
    assert args is not None, command
    build_parser().parse_args(args)        # argparse exits (a test failure) on an unknown or bad option


def _ignored(path):
    """Whether git ignores ``path`` (a developer's local file that CI's clean clone will not have); False outside a
    git checkout or without git."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return False
    return subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path], stdin=subprocess.DEVNULL).returncode == 0


def _inline_commands():
    for path in [README, *DOCS]:
        for span in INLINE.findall(path.read_text()):
            span = span.strip()
            if re.match(r"(python3?|cydnn-train)\s", span) or re.match(r"[\w.-]+/[\w./-]+\.py\s+\S", span):
                yield path.relative_to(ROOT), span


@pytest.mark.parametrize("where,command", list(_inline_commands()), ids=lambda v: str(v))
def test_inline_command_names_what_exists(where, command):
    words = shlex.split(command)
    if words[0] in ("python", "python3"):
        words = words[1:]
    if words[0] == "-m":
        module = words[1]
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module} in `{command}`"
        if module != "cydnn.train":
            return
    elif words[0] != "cydnn-train":
        assert (ROOT / words[0]).is_file(), f"{where}: no file {words[0]} in `{command}`"
        assert not _ignored(words[0]), f"{where}: {words[0]} in `{command}` is ignored by git: a clean clone lacks it"
        return
    from cydnn.train import build_parser
    known = build_parser()._option_string_actions          # values may be placeholders (`--seed S`)
    unknown = [w for w in train_args(command) or [] if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"{where}: `{command}` uses options cydnn.train does not have: {unknown}"
