"""Where the tests find real MNIST, and what happens when it is not there: ONE lookup for every file.

``FOLDER`` is ``$CYDNN_TEST_MNIST``, else ``../shared/data/mnist`` beside the clone (where CI and
the project's machines keep the four MNIST .gz files).  When they are missing, the tests that
need them are skipped with the reason -- unless ``CYDNN_REQUIRE_MNIST=1`` (CI sets it: see
.ci/run), which turns that skip into a failure, so a green run always means they ran.

Use :func:`require` in a fixture, or ``pytestmark = pytest.mark.usefixtures("real_mnist")`` with
``from mnist_data import real_mnist`` for a whole module.
"""
import os
from pathlib import Path

import pytest

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
FOLDER = Path(os.environ.get("CYDNN_TEST_MNIST", Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
REQUIRED = os.environ.get("CYDNN_REQUIRE_MNIST", "") == "1"


def missing():
    """None when FOLDER holds the four .gz files, else why not."""
    absent = [n for n in FILES if not (FOLDER / f"{n}.gz").is_file()]
    if absent:
        return (f"real MNIST not found in {FOLDER} (missing {', '.join(n + '.gz' for n in absent)}); set "
                f"CYDNN_TEST_MNIST to a folder holding the four MNIST .gz files")
    return None


def require():
    """FOLDER, or skip (fail with CYDNN_REQUIRE_MNIST=1) saying what is missing."""
    reason = missing()
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"{reason}; CYDNN_REQUIRE_MNIST=1 makes this a failure", pytrace=False)
        pytest.skip(reason)
    return FOLDER


@pytest.fixture
def real_mnist():
    """The real MNIST folder (see :func:`require`)."""
    return require()
