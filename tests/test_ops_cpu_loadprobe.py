"""The load probe of ``_threads`` (how many cores other processes keep busy) fed malformed, partial,
short and garbage /proc/stat contents, with its clock, its own CPU time and the machine stood in for:
every number it returns is known exactly, and it never raises (it is made when ops/cpu is imported).

Written from the mutants that survived docs/mutation/ops-cpu.md's session-17 run ("Session 18");
the well-formed cases are in test_cpu_kernels_threads.py.
"""
import os

import pytest

from cydnn.ops.cpu import _threads

# user nice system idle iowait irq softirq steal guest guest_nice (ticks), as proc(5)
CPU0 = "cpu0 11 13 17 1000 2000 19 23 29 31 37"   # busy: 11+13+17+19+23+29 = 112
CPU1 = "cpu1 3 5 7 1000 2000 41 43 47 53 59"       # busy: 3+5+7+41+43+47 = 146
CPU2 = "cpu2 100 0 0 0 0 0 0 0 0 0"                # busy: 100
AGGREGATE = "cpu  114 18 24 3000 4000 60 66 76 84 96"


class Machine:
    """A stat file, a clock and an own-CPU counter that the test moves by hand."""

    def __init__(self, tmp_path, text=""):
        self.path = tmp_path / "stat"
        self.now, self.own = 10.0, 2.0
        self.write(text)

    def write(self, text):
        self.path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))

    def probe(self, cpus=frozenset({"cpu0", "cpu1"}), tick=100):
        p = _threads.LoadProbe(str(self.path), clock=lambda: self.now, own_cpu=lambda: self.own, cpus=cpus)
        p.tick = tick
        return p


def lines(*rows):
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------ one reading


def test_busy_seconds_add_user_nice_system_irq_softirq_steal_of_the_cpus_counted(tmp_path):
    m = Machine(tmp_path, lines(AGGREGATE, CPU0, CPU1, CPU2, "intr 1 2 3", "ctxt 5", "btime 1"))
    assert m.probe()._busy_seconds() == (112 + 146) / 100
    assert m.probe(cpus={"cpu1"})._busy_seconds() == 146 / 100
    assert m.probe(cpus={"cpu1", "cpu2"}, tick=250)._busy_seconds() == (146 + 100) / 250


def test_fields_after_the_eighth_are_not_read(tmp_path):
    """guest and guest_nice are already in user and nice; newer kernels may add more fields."""
    m = Machine(tmp_path, lines("cpu0 1 2 3 4 5 6 7 8 junk more", "cpu1 10 20 30 40 50 60 70 80 9 9 9 9"))
    assert m.probe()._busy_seconds() == (1 + 2 + 3 + 6 + 7 + 8 + 10 + 20 + 30 + 60 + 70 + 80) / 100


def test_short_lines_count_the_missing_fields_as_zero(tmp_path):
    """Old kernels wrote four fields (user nice system idle); a truncated line, fewer."""
    m = Machine(tmp_path, lines("cpu0 10 20 30 40", "cpu1 5", "cpu2"))
    assert m.probe(cpus={"cpu0", "cpu1", "cpu2"})._busy_seconds() == 65 / 100
    m.write("cpu2")  # no numbers at all: counted, as zero
    assert m.probe(cpus={"cpu2"})._busy_seconds() == 0.0


@pytest.mark.parametrize("text", ["", "\n\n", lines(AGGREGATE), lines(AGGREGATE, "intr 1 2", "ctxt 3"),
                                  lines(CPU2), lines("cpu", "cpu ", "processes 4"), "garbage"])
def test_without_a_line_of_the_cpus_counted_there_is_no_reading(tmp_path, text):
    assert Machine(tmp_path, text).probe()._busy_seconds() is None


@pytest.mark.parametrize("bad", ["cpu0 12 x 30 40", "cpu0 1.5 2 3", "cpu0 1 2 3 4 5 6 7 0x10", "cpu0 - - -",
                                 "cpu0 1 2 3 4 5 6 7 \ufffd", "cpu0 1e3"])
def test_a_counted_line_that_is_not_integers_gives_no_reading(tmp_path, bad):
    m = Machine(tmp_path, lines(CPU1, bad))
    assert m.probe()._busy_seconds() is None
    assert m.probe(cpus={"cpu1"})._busy_seconds() == 146 / 100  # the line of a CPU not counted is not read


def test_bytes_that_are_not_ascii(tmp_path):
    """Replaced, not an error: a stray byte in a line not read changes nothing; in a number of a
    counted line, the reading is unknown."""
    m = Machine(tmp_path, lines(CPU0, CPU1).encode() + b"intr 1 \xff\xfe 2\nname caf\xc3\xa9\n")
    assert m.probe()._busy_seconds() == (112 + 146) / 100
    m.write(b"cpu0 1\xff 2 3\n" + lines(CPU1).encode())
    assert m.probe()._busy_seconds() is None


def test_unreadable_files(tmp_path):
    for path in (tmp_path / "missing", tmp_path):  # absent; a directory
        p = _threads.LoadProbe(str(path), clock=lambda: 1.0, own_cpu=lambda: 0.0, cpus={"cpu0"})
        assert p._busy_seconds() is None and p.last == (1.0, None, 0.0)


def test_without_the_affinity_every_cpu_line_counts_but_the_total(tmp_path, monkeypatch):
    """No sched_getaffinity (or it fails): every cpuN line, never the aggregate "cpu" line nor the
    other lines, blank ones included."""
    def fails(pid):
        raise OSError("no affinity here")
    monkeypatch.setattr(os, "sched_getaffinity", fails, raising=False)
    m = Machine(tmp_path, lines(AGGREGATE, "", CPU0, "   ", CPU1, CPU2, "cpu", "intr 1000 2000", "ctxt 5",
                                "softirq 7 7 7"))
    p = m.probe(cpus=None)
    assert p._names() is None
    assert p._busy_seconds() == (112 + 146 + 100) / 100


def test_the_cpus_are_this_process_s_affinity(tmp_path, monkeypatch):
    asked = []

    def affinity(pid):
        asked.append(pid)
        return {1, 2} if pid == 0 else {0, 1, 2, 3}
    monkeypatch.setattr(os, "sched_getaffinity", affinity, raising=False)
    m = Machine(tmp_path, lines(AGGREGATE, CPU0, CPU1, CPU2))
    p = m.probe(cpus=None)
    assert p._names() == {"cpu1", "cpu2"} and set(asked) == {0}
    assert p._busy_seconds() == (146 + 100) / 100


def test_the_clock_tick_comes_from_sysconf(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_CLK_TCK": 250}[name])
    m = Machine(tmp_path, lines(CPU0))
    p = _threads.LoadProbe(str(m.path), clock=lambda: 1.0, own_cpu=lambda: 0.0, cpus={"cpu0"})
    assert p.tick == 250 and p._busy_seconds() == 112 / 250
    monkeypatch.delattr(os, "sysconf")
    assert _threads.LoadProbe(str(m.path), clock=lambda: 1.0, own_cpu=lambda: 0.0, cpus={"cpu0"}).tick == 100


def test_own_cpu_is_this_process_s_user_and_system_time(tmp_path, monkeypatch):
    """os.times(): user, system, children's user, children's system, elapsed -- only the first two."""
    monkeypatch.setattr(os, "times", lambda: (1.5, 2.25, 100.0, 200.0, 9999.0))
    p = _threads.LoadProbe(str(tmp_path / "missing"), clock=lambda: 1.0, cpus={"cpu0"})
    assert p.own_cpu() == 3.75 and p.last == (1.0, None, 3.75)


# ------------------------------------------------------------------ intervals


def test_the_intervals_start_exactly_at_first_seconds_and_probe_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(_threads, "PROBE_SECONDS", 0.25)
    m = Machine(tmp_path, lines(CPU0, CPU1))  # 2.58 busy seconds at 10.0
    p = m.probe()
    p.FIRST_SECONDS = 0.5
    m.write(lines("cpu0 61 0 0 0 0 0 0 0", "cpu1 0 0 0 0 0 0 0 0"))
    m.now = 10.25
    assert p.busy_elsewhere() is None and p.last == (10.0, 2.58, 2.0)  # not read before 10.5
    m.now = 10.5  # exactly FIRST_SECONDS: read; fewer busy seconds than before, never below 0
    assert p.busy_elsewhere() == 0.0 and p.last == (10.5, 0.61, 2.0)
    m.write(lines("cpu0 86 0 0 0 0 0 0 0", "cpu1 0 0 0 0 0 0 0 0"))
    m.own = 2.05
    m.now = 10.7
    assert p.busy_elsewhere() == 0.0  # kept within PROBE_SECONDS
    m.now = 10.75  # exactly PROBE_SECONDS: 0.25 busy seconds, 0.05 of them ours, over 0.25 s
    assert p.busy_elsewhere() == pytest.approx(0.8, abs=1e-12)
    m.write(lines("cpu0 186 0 0 0 0 0 0 0", "cpu1 0 0 0 0 0 0 0 0"))
    m.now = 10.9
    assert p.busy_elsewhere() == pytest.approx(0.8, abs=1e-12)
    m.now = 11.25  # 1.0 busy second over 0.5 s: 2 cores
    assert p.busy_elsewhere() == pytest.approx(2.0, abs=1e-12)


def test_busy_seconds_larger_than_the_clock(tmp_path):
    """/proc/stat's busy seconds add up over every CPU: on a busy many-core machine they are far above
    the monotonic clock (about the uptime).  The interval is the clock's."""
    m = Machine(tmp_path, lines("cpu0 100000 0 0 0 0 0 0 0", "cpu1 100000 0 0 0 0 0 0 0"))
    p = m.probe()
    m.write(lines("cpu0 100050 0 0 0 0 0 0 0", "cpu1 100075 0 0 0 0 0 0 0"))
    m.now += 0.5
    assert p.busy_elsewhere() == pytest.approx(2.5, abs=1e-9)


def test_a_clock_that_did_not_move_never_divides_by_zero(tmp_path):
    """The probe reads the clock once to decide and once for the reading: a reading stamped with the
    last one's time (a coarse or stepped clock) keeps the last value, and counts from there."""
    m = Machine(tmp_path, lines(CPU0, CPU1))
    times = [10.0, 11.0, 10.0, 12.0, 12.0]  # made at 10.0; decides at 11.0, reads at 10.0; 12.0 and 12.0
    p = _threads.LoadProbe(str(m.path), clock=lambda: times.pop(0), own_cpu=lambda: 2.0, cpus={"cpu0", "cpu1"})
    p.tick = 100
    m.write(lines("cpu0 1000 0 0 0 0 0 0 0", CPU1))  # 11.46 busy seconds
    assert p.busy_elsewhere() is None and p.last == (10.0, 11.46, 2.0)
    m.write(lines("cpu0 1200 0 0 0 0 0 0 0", CPU1))  # 2 busy seconds more, over 12 - 10 s
    assert p.busy_elsewhere() == pytest.approx(1.0, abs=1e-12) and not times


def test_a_missing_reading_gives_0_and_the_next_interval_counts_again(tmp_path):
    m = Machine(tmp_path, lines(CPU0, CPU1))
    p = m.probe()
    for text in ("garbage", lines("cpu0 1 2 x"), "", lines(CPU2)):  # no reading: 0.0, the machine taken as idle
        m.now += 1
        m.write(text)
        assert p.busy_elsewhere() == 0.0, text
        assert p.last == (m.now, None, 2.0)
    m.now += 1
    m.write(lines("cpu0 500 0 0 0 0 0 0 0", "cpu1 0 0 0 0 0 0 0 0"))
    assert p.busy_elsewhere() == 0.0  # a reading again, but nothing to subtract it from
    m.now += 0.5
    m.write(lines("cpu0 550 0 0 0 0 0 0 0", "cpu1 25 0 0 0 0 0 0 0"))
    assert p.busy_elsewhere() == pytest.approx(1.5, abs=1e-12)


def test_a_probe_made_without_a_reading_starts_at_0(tmp_path):
    m = Machine(tmp_path, "")  # e.g. read while being written
    p = m.probe()
    assert p.last == (10.0, None, 2.0)
    m.write(lines(CPU0, CPU1))
    m.now += 1
    assert p.busy_elsewhere() == 0.0


@pytest.mark.parametrize("text", [b"", b"\x00" * 100, b"cpu0", b"cpu0 \xff\xfe", b"cpu0\tcpu1\n\n\x00",
                                  b"cpu0 " + b"9" * 5000,  # over int()'s 4300 digits b"cpu0 -5 2 3 4", b"\n".join([b"cpu0 1 2 3"] * 10000),
                                  bytes(range(256)) * 8])
def test_garbage_never_raises(tmp_path, text):
    m = Machine(tmp_path, text)
    p = m.probe()  # reads the file once
    m.now += 1
    m.own += 0.5
    assert p.busy_elsewhere() == 0.0  # nothing parsed, or the same ticks twice (less our own time)


# ------------------------------------------------------------------ the module's probe, fork() and one core


def test_a_forked_child_marks_itself_and_makes_a_new_probe(monkeypatch):
    """What os.register_at_fork runs in a child: the fork rule on, and a probe with a lock of its own
    (the parent's may have been held by another thread at the fork)."""
    old = _threads._probe
    monkeypatch.setattr(_threads, "_FORKED", False)
    monkeypatch.setattr(_threads, "_probe", old)  # put back after the test
    _threads._after_fork_in_child()
    assert _threads._FORKED is True
    assert type(_threads._probe) is _threads.LoadProbe and _threads._probe is not old
    assert _threads._probe.lock is not old.lock and not _threads._probe.lock.locked()


def test_fork_safe_passes_the_count_through_unless_forked(monkeypatch):
    monkeypatch.setattr(_threads, "_FORKED", False)
    assert [_threads.fork_safe(t) for t in (1, 2, 7)] == [1, 2, 7]
    monkeypatch.setattr(_threads, "_FORKED", True)
    assert [_threads.fork_safe(t) for t in (1, 2, 7)] == [1, 1, 1]


class Refuses:
    def busy_elsewhere(self):
        raise AssertionError("the probe was read")


def test_one_core_never_reads_the_probe(monkeypatch):
    monkeypatch.setattr(_threads, "_FORKED", False)
    monkeypatch.setattr(_threads, "_OMP_CAP", 1)
    monkeypatch.setattr(_threads, "_probe", Refuses())
    monkeypatch.setattr(_threads, "KERNEL_PARALLEL_ELEMENTS", 10)
    monkeypatch.delenv("CYDNN_CPU_LOAD_PROBE", raising=False)
    assert _threads.kernel_threads(10) == 1 and _threads.kernel_threads(10 ** 9) == 1
