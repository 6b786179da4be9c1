"""The suite's own hygiene: every name a test module's functions read as a global is defined once the module is
imported (or is a builtin). CI has no GPU, so it never runs the bodies of the ``gpu`` tests; a test moved between
files without its import, or a helper renamed, would otherwise first fail on the device. Module-level code needs no
check (importing the module runs it); class bodies read their own names and are left out too."""
import builtins
import dis
import importlib
import types
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MODULES = sorted(p.stem for p in TESTS.glob("test_*.py"))


def _globals_read(code):
    """Names loaded with LOAD_GLOBAL by ``code`` and every function nested in it."""
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            yield ins.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _globals_read(const)


def undefined_globals(path, module):
    code = compile(path.read_text(), str(path), "exec")
    return sorted(n for n in set(_globals_read(code)) if not hasattr(module, n) and not hasattr(builtins, n))


@pytest.mark.parametrize("name", MODULES)
def test_every_global_a_test_reads_is_defined(name):
    module = importlib.import_module(name)
    assert undefined_globals(TESTS / f"{name}.py", module) == []


def test_the_check_finds_an_undefined_name(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text("import numpy as np\n\n\ndef test_x():\n    return np.zeros(1) + missing_helper(pd)\n")
    module = types.ModuleType("probe")
    exec(compile(src.read_text(), str(src), "exec"), module.__dict__)
    assert undefined_globals(src, module) == ["missing_helper", "pd"]
