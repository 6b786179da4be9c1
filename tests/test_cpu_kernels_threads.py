"""The thread policy of the C kernels of conv and pool: ``_threads.kernel_threads`` and its load probe.

The probe is driven with a fake /proc/stat, clock and own CPU time, so that
every number it returns is known; one test runs it on this machine against a
process kept busy beside it.
"""
import os
import subprocess
import sys
import time

import pytest

from cydnn.ops.cpu import _threads


FORKED = {}  # whether this test process is itself a forked child, as _threads saw it before the fixture


@pytest.fixture(autouse=True)
def not_forked(monkeypatch):
    """The policy as a process that was not forked has it (these tests also run in forked workers, e.g.
    mutmut's, where a forked child's kernels run on one thread)."""
    FORKED["before"] = _threads._FORKED
    monkeypatch.setattr(_threads, "_FORKED", False)


def stat_text(cpu0, cpu1, cpu2=(0,) * 8):
    """A /proc/stat with three CPUs; each tuple is user nice system idle iowait irq softirq steal (ticks)."""
    total = [a + b + c for a, b, c in zip(cpu0, cpu1, cpu2)]
    lines = ["cpu  " + " ".join(map(str, total)) + " 0 0"]
    lines += [f"cpu{i} " + " ".join(map(str, v)) + " 0 0" for i, v in enumerate((cpu0, cpu1, cpu2))]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"


class Fake:
    def __init__(self, tmp_path):
        self.path = tmp_path / "stat"
        self.now, self.own = 100.0, 5.0
        self.write((0,) * 8, (0,) * 8)

    def write(self, cpu0, cpu1, cpu2=(0,) * 8):
        self.path.write_text(stat_text(cpu0, cpu1, cpu2))

    def probe(self, cpus=frozenset({"cpu0", "cpu1"})):
        p = _threads.LoadProbe(str(self.path), clock=lambda: self.now, own_cpu=lambda: self.own, cpus=cpus)
        p.tick = 100
        return p


def test_the_probe_counts_the_busy_time_of_others(tmp_path):
    fake = Fake(tmp_path)
    probe = fake.probe()
    assert probe.busy_elsewhere() is None  # no interval yet
    fake.now += 0.01
    assert probe.busy_elsewhere() is None  # too short to tell (FIRST_SECONDS)
    # 1 s later: cpu0 busy 100 ticks (user 60, system 30, irq 5, steal 5), cpu1 50 ticks of nice,
    # idle / iowait not counted; this process used 0.4 s: others kept 1.5 - 0.4 = 1.1 cores busy
    fake.now, fake.own = 101.0, 5.4
    fake.write((60, 0, 30, 999, 999, 5, 0, 5), (0, 50, 0, 999, 0, 0, 0, 0), (100, 0, 0, 0, 0, 0, 0, 0))
    assert probe.busy_elsewhere() == pytest.approx(1.1)
    # within PROBE_SECONDS the last value is kept, the file not read again
    fake.path.write_text("garbage")
    fake.now += _threads.PROBE_SECONDS / 2
    assert probe.busy_elsewhere() == pytest.approx(1.1)
    # next interval, 0.5 s: 10 more ticks on cpu0, this process 0.2 s more: never below 0
    fake.now = 101.5
    fake.write((70, 0, 30, 999, 999, 5, 0, 5), (0, 50, 0, 999, 0, 0, 0, 0))
    fake.own += 0.2
    assert probe.busy_elsewhere() == 0.0


def test_the_probe_counts_only_the_cpus_given(tmp_path):
    fake = Fake(tmp_path)
    probe = fake.probe(cpus={"cpu1"})
    fake.now += 1
    fake.write((100, 0, 0, 0, 0, 0, 0, 0), (30, 0, 0, 70, 0, 0, 0, 0))
    assert probe.busy_elsewhere() == pytest.approx(0.3)


def test_without_proc_stat_the_machine_counts_as_idle(tmp_path):
    probe = _threads.LoadProbe(str(tmp_path / "missing"), clock=lambda: 50.0 + time.monotonic())
    time.sleep(0.06)
    assert probe.busy_elsewhere() == 0.0


class Stub:
    def __init__(self, busy):
        self.busy = busy

    def busy_elsewhere(self):
        return self.busy


@pytest.mark.parametrize("busy, cap, want", [(None, 2, 1), (0.0, 2, 2), (0.45, 2, 2), (0.55, 2, 1), (1.0, 2, 1),
                                             (2.0, 2, 1), (0.0, 1, 1), (1.0, 8, 7), (2.4, 8, 6), (2.6, 8, 5),
                                             (9.0, 8, 1)])
def test_kernel_threads_leave_the_busy_cores(monkeypatch, busy, cap, want):
    monkeypatch.delenv("CYDNN_CPU_LOAD_PROBE", raising=False)
    monkeypatch.setattr(_threads, "_OMP_CAP", cap)
    monkeypatch.setattr(_threads, "_probe", Stub(busy))
    monkeypatch.setattr(_threads, "KERNEL_PARALLEL_ELEMENTS", 1000)
    assert _threads.kernel_threads(999) == 1
    assert _threads.kernel_threads(1000) == want


def test_the_probe_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(_threads, "_OMP_CAP", 4)
    monkeypatch.setattr(_threads, "_probe", Stub(3.0))
    monkeypatch.setenv("CYDNN_CPU_LOAD_PROBE", "0")
    assert _threads.kernel_threads(1 << 20) == 4


def test_the_default_threshold_puts_lenet_on_several_threads():
    assert _threads.KERNEL_PARALLEL_ELEMENTS == 1 << 15 or "CYDNN_CPU_KERNEL_PARALLEL_ELEMENTS" in os.environ
    assert 64 * 16 * 8 * 8 >= _threads.KERNEL_PARALLEL_ELEMENTS or "CYDNN_CPU_KERNEL_PARALLEL_ELEMENTS" in os.environ


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_the_probe_sees_a_busy_process():
    probe = _threads.LoadProbe()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the child has started
        probe.busy_elsewhere()
        time.sleep(_threads.PROBE_SECONDS + 0.3)
        assert probe.busy_elsewhere() >= 0.5  # the child, at least half a core (more if the machine is busy)
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(os, "register_at_fork"), reason="needs os.fork")
def test_a_forked_child_runs_the_kernels_on_one_thread_instead_of_hanging(monkeypatch):
    """GNU OpenMP's thread pool does not survive fork(): a child forked after a convolution ran on two
    threads used to wait for ever in its next parallel region.  The child must now finish the same
    convolution (on one thread) and give the parent's result; the parent keeps its threads."""
    import numpy as np
    from cydnn.ops.cpu import conv

    if FORKED["before"]:  # two threads here could meet the hang under test (a pool inherited from our parent)
        pytest.skip("this test process is itself a forked child (e.g. a mutmut worker)")
    monkeypatch.setenv("CYDNN_CPU_LOAD_PROBE", "0")
    monkeypatch.setattr(_threads, "KERNEL_PARALLEL_ELEMENTS", 0)
    monkeypatch.setattr(_threads, "_OMP_CAP", 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6, 14, 14)).astype(np.float32)
    w = rng.standard_normal((16, 6, 5, 5)).astype(np.float32)
    assert _threads.kernel_threads(1 << 20) == 2
    want, _ = conv.conv_forward(x, w, None, 1, 0)       # two threads: the parent's pool exists now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if it computed the same result on one thread
        try:
            os.close(read)
            got, _ = conv.conv_forward(x, w, None, 1, 0)
            ok = _threads._FORKED and _threads.kernel_threads(1 << 20) == 1 and np.allclose(got, want, atol=1e-5)
            os.write(write, b"ok" if ok else b"wrong")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)
        pytest.fail("the forked child did not finish a convolution in 30 s (OpenMP's pool after fork)")
    said = os.read(read, 16)
    os.close(read)
    assert said == b"ok", said
    assert not _threads._FORKED and _threads.kernel_threads(1 << 20) == 2
