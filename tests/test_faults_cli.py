"""The training command facing odd arguments, divergence, errors and Ctrl-C: one clear line, the right
exit code (beside test_faults_train.py, which runs the same command on the real MNIST).

The command runs in a real subprocess (as a user runs it) on the CPU, with
``cydnn.datasets.MNIST`` replaced by the 400-image dataset of tests/tiny_idx.py
so that each run takes seconds whatever the machine's load, and needs no MNIST.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cydnn import datasets, train

sys.path.insert(0, str(Path(__file__).parent))
import tiny_idx  # noqa: E402
from faultkit import child_env, interruptible  # noqa: E402

CLI = textwrap.dedent("""
    import sys
    import cydnn.datasets, tiny_idx
    cydnn.datasets.MNIST = tiny_idx.Tiny          # 400 images instead of 60,000
    from cydnn.train import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    return tiny_idx.write_mirror(tmp_path_factory.mktemp("tiny-mirror"))


def command(tmp_path, mirror, *extra):
    return [sys.executable, "-c", CLI, "--mirror", str(mirror), "--data-dir", str(tmp_path / "data"),
            "--device", "cpu", "--no-progress", *extra]


def run(tmp_path, mirror, *extra, timeout=300):
    return subprocess.run(command(tmp_path, mirror, *extra), env=child_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def test_batch_size_larger_than_the_dataset_gives_one_batch_per_epoch(tmp_path, mirror):
    out = run(tmp_path, mirror, "--epochs", "2", "--batch-size", "1000", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: --batch-size 1000 is more than the 400 training images: one batch of 400 per epoch" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["train_images"] == 400 and summary["batch_size"] == 1000


def test_limit_train_larger_than_the_dataset_is_clamped_with_a_note(tmp_path, mirror):
    out = run(tmp_path, mirror, "--epochs", "1", "--limit-train", "1000000", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--limit-train 1000000 is more than the 400 training images: using all of them" in out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["train_images"] == 400


def test_divergence_is_one_line_with_the_epoch(tmp_path, mirror):
    ckpt = tmp_path / "lenet.npz"
    out = run(tmp_path, mirror, "--epochs", "3", "--lr", "1e6", "--save", str(ckpt))
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "RuntimeWarning" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("training diverged at epoch 1/3 (loss nan); try a smaller --lr (it was 1e+06)")
    assert last.endswith(f"{ckpt} was not written")
    assert not ckpt.exists() and os.listdir(tmp_path) == ["data"]


@pytest.mark.parametrize("argv, message", [
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0, got -0.1"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--momentum", "nan"], "--momentum must be a finite number >= 0, got nan"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0, got -1.0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--epochs", "-2"], "--epochs must be >= 1, got -2"),
    (["--limit-train", "0"], "--limit-train must be >= 1, got 0"),
    (["--max-shift", "-1"], "--max-shift must be >= 0, got -1"),
    (["--save", "/nonexistent-folder/lenet.npz"], "--save: cannot write /nonexistent-folder/lenet.npz: "
                                                  "the folder /nonexistent-folder does not exist"),
    (["--plot", "/nonexistent-folder/c.png"], "--plot: cannot write /nonexistent-folder/c.png: the folder"),
])
def test_bad_arguments_fail_at_once_in_one_line(argv, message, tmp_path, monkeypatch):
    """Refused before any work: neither training nor the dataset is reached (counted by stand-ins,
    not timed), and nothing is written."""
    monkeypatch.chdir(tmp_path)
    reached = []
    monkeypatch.setattr(train, "train", lambda *a, **k: reached.append("train"))
    monkeypatch.setattr(datasets.IDXDataset, "__init__", lambda *a, **k: reached.append("dataset"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    assert str(info.value).startswith(message)
    assert reached == []                                 # before any data is loaded
    assert os.listdir(tmp_path) == []


def test_save_to_a_directory_fails_before_training(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit, match="--save: cannot write .*out: it is a directory"):
        train.main(["--save", str(tmp_path / "out")])


def start_and_interrupt(tmp_path, mirror, *extra, after_epochs=1):
    """Start a long run; once ``after_epochs`` epoch lines were printed, send SIGINT.
    Returns (process, seconds from SIGINT to exit, stdout, stderr)."""
    proc = subprocess.Popen(command(tmp_path, mirror, "--epochs", "100000", *extra), env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=interruptible)
    lines = []
    try:
        while len(lines) < after_epochs:
            line = proc.stdout.readline()
            assert line, f"the run ended early: {proc.communicate()[1][-3000:]}"
            lines.append(line)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, took, "".join(lines) + out, err


def test_ctrl_c_stops_quickly_with_a_short_message_and_no_partial_checkpoint(tmp_path, mirror):
    ckpt = tmp_path / "lenet.npz"
    proc, took, out, err = start_and_interrupt(tmp_path, mirror, "--save", str(ckpt), after_epochs=2)
    assert proc.returncode == 130, err[-3000:]
    # Generous on purpose: the handler raises between two bytecodes, so the exit takes well under a
    # second on an idle machine; 60 s still fails a run that ignored the signal (100,000 epochs),
    # and a CI machine shared by many jobs never flakes it.  The work done after the signal is
    # bounded below instead: the run stopped inside the epoch it reports.
    assert took < 60, f"{took:.1f} s from SIGINT to exit"
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted (Ctrl-C) during epoch ")
    assert last.endswith(f"training stopped; {ckpt} was not written")
    epoch = int(last.split("during epoch ")[1].split("/")[0])
    finished = [ln for ln in out.splitlines() if ln.startswith("epoch ")]
    assert epoch >= 3                                            # two epochs had finished
    assert len(finished) == epoch - 1                            # and none after the one interrupted
    assert finished[-1].startswith(f"epoch {epoch - 1:2d}/100000 ")
    assert sorted(os.listdir(tmp_path)) == ["data"]              # no checkpoint, no temporary


def test_ctrl_c_with_traceback_shows_it(tmp_path, mirror):
    proc, took, out, err = start_and_interrupt(tmp_path, mirror, "--traceback")
    assert "Traceback" in err and "TrainingInterrupted: interrupted during epoch" in err
    assert proc.returncode == 130


def test_ctrl_c_outside_the_loop_is_also_short(monkeypatch, capsys):
    """Ctrl-C while the data loads or the checkpoint is written: the generic message, exit code 130
    (a save interrupted midway removes its temporary file: see test_faults_checkpoint)."""
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "train", interrupted)
    assert train.main([]) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): training stopped\n"


@pytest.fixture
def sigint():
    """The process's SIGINT handler, put back after the test (which sets its own)."""
    saved = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, saved)


def test_the_guard_is_gone_after_training(sigint):
    signal.signal(signal.SIGINT, signal.default_int_handler)     # as in a terminal (the suite may run with it ignored)
    before = signal.getsignal(signal.SIGINT)
    undo = train._interrupt_guard([], 3)
    assert signal.getsignal(signal.SIGINT) is not before
    with pytest.raises(train.TrainingInterrupted, match="epoch 1/3"):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    undo()
    assert signal.getsignal(signal.SIGINT) is before
    assert issubclass(train.TrainingInterrupted, KeyboardInterrupt)


def test_an_ignored_ctrl_c_stays_ignored(sigint):
    """nohup or a background job: SIGINT ignored before training is left ignored (and put back as is)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    undo = train._interrupt_guard([], 3)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    undo()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_no_mirror_works_is_one_error_line_and_exit_1(tmp_path):
    empty = tmp_path / "empty-mirror"
    empty.mkdir()
    out = subprocess.run(command(tmp_path, empty, "--epochs", "1"), env=child_env(), capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "error: could not download t10k-images-idx3-ubyte.gz for Tiny from any mirror:" in out.stderr
    assert f"  - {empty}: file not found: {empty}/t10k-images-idx3-ubyte.gz" in out.stderr
