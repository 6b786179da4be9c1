"""NVRTC in the background (compiler/nvrtc_jobs.py) and its disk cache (compiler/kernel_cache.py): a compile in a
child process, killed at exit or when its network goes; compiles beyond the limit wait their turn; a second compile
of the same source comes from the disk; what the cache reads back is checked; without NVRTC the interpreter stays.
CPU only (NVRTC needs no GPU): the kernels these compiles give are run in test_fused_net_gen.py.
"""
import os

import pytest

from cydnn.compiler import fused_net, fused_net_gen, nvrtc_jobs

from test_fused_net_gen import _layers, needs_nvrtc


def test_the_kernel_cache_folder_and_its_switch(tmp_path):
    from cydnn.compiler import kernel_cache
    assert kernel_cache.cache_dir({"CYDNN_KERNEL_CACHE": "off"}) is None
    assert kernel_cache.cache_dir({"CYDNN_KERNEL_CACHE": " 0 "}) is None
    assert kernel_cache.cache_dir({"CYDNN_KERNEL_CACHE": str(tmp_path)}) == str(tmp_path)
    assert kernel_cache.cache_dir({"XDG_CACHE_HOME": "/x/cache"}) == os.path.join("/x/cache", "cydnn", "kernels")
    assert kernel_cache.cache_dir({}) == os.path.join(os.path.expanduser("~"), ".cache", "cydnn", "kernels")
    k = kernel_cache.key("src", {"a.h": "1"}, ["-O3"], "nvrtc 13.0")
    assert k != kernel_cache.key("src", {"a.h": "2"}, ["-O3"], "nvrtc 13.0")        # a header changed
    assert k != kernel_cache.key("src", {"a.h": "1"}, ["-O3"], "nvrtc 13.1")        # another NVRTC
    assert k != kernel_cache.key("src2", {"a.h": "1"}, ["-O3"], "nvrtc 13.0")
    assert k == kernel_cache.key("src", {"a.h": "1"}, ("-O3",), "nvrtc 13.0") and len(k) == 64


def test_what_the_kernel_cache_reads_back_is_checked(tmp_path):
    from cydnn.compiler import kernel_cache
    elf = b"\x7fELF" + bytes(200)
    assert kernel_cache.store(str(tmp_path), "k1", elf) and kernel_cache.load(str(tmp_path), "k1") == elf
    assert [p.name for p in tmp_path.iterdir()] == ["k1.cubin"]              # no temporary file left
    (tmp_path / "k2.cubin").write_bytes(b"#!/bin/sh\n" + bytes(200))        # not an ELF
    (tmp_path / "k3.cubin").write_bytes(b"\x7fELF")                         # truncated
    assert kernel_cache.load(str(tmp_path), "k2") is None and kernel_cache.load(str(tmp_path), "k3") is None
    assert kernel_cache.load(str(tmp_path), "missing") is None and kernel_cache.load(None, "k1") is None
    big = tmp_path / "k4.cubin"
    with open(big, "wb") as f:                                               # over the bound: not read whole
        f.write(b"\x7fELF")
        f.seek(kernel_cache.MAX_BYTES + 10)
        f.write(b"\0")
    assert kernel_cache.load(str(tmp_path), "k4") is None
    (tmp_path / "k6.cubin").write_bytes(b"\x7fELF" + bytes(60))             # the smallest it takes: 64 bytes
    (tmp_path / "k7.cubin").write_bytes(b"\x7fELF" + bytes(59))
    assert kernel_cache.load(str(tmp_path), "k6") is not None and kernel_cache.load(str(tmp_path), "k7") is None
    with open(tmp_path / "k8.cubin", "wb") as f:                             # exactly the bound: taken
        f.write(b"\x7fELF")
        f.seek(kernel_cache.MAX_BYTES - 1)
        f.write(b"\0")
    assert len(kernel_cache.load(str(tmp_path), "k8")) == kernel_cache.MAX_BYTES
    (tmp_path / "k9.cubin").mkdir()                                          # the rename fails: no leftovers
    before = sorted(p.name for p in tmp_path.iterdir())
    assert kernel_cache.store(str(tmp_path), "k9", elf) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    assert kernel_cache.store(str(blocked), "k5", elf) is False               # refused: no error, no cache
    assert kernel_cache.store(None, "k5", elf) is False


@needs_nvrtc
def test_a_second_compile_of_the_same_source_comes_from_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CYDNN_KERNEL_CACHE", str(tmp_path / "kernels"))
    _, _, nodes, layers = _layers("mlp")
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    text = fused_net_gen.source(bound, 16, 0, 784, 784, 10, True)
    first = nvrtc_jobs.Generation(text)
    assert first.wait(120) and not first.cached and first._proc is not None    # NVRTC, in a child process
    entries = list((tmp_path / "kernels").iterdir())
    assert len(entries) == 1 and entries[0].read_bytes() == first.result()
    again = nvrtc_jobs.Generation(text)
    assert again.done() and again.cached and again._proc is None and again.result() == first.result()
    entries[0].write_bytes(b"garbage")                                       # a damaged entry: compiled again
    third = nvrtc_jobs.Generation(text)
    assert third.wait(120) and not third.cached and third.result() == first.result()
    assert entries[0].read_bytes() == first.result()                         # and the entry mended
    other = nvrtc_jobs.Generation(text.replace("write_output", "write_output ", 1))
    assert other.wait(120) and not other.cached                              # another source: its own entry
    assert len(list((tmp_path / "kernels").iterdir())) == 2


@needs_nvrtc
def test_a_source_nvrtc_refuses_comes_back_with_its_log():
    with pytest.raises(fused_net_gen.GenerationError, match=r"NVRTC refused the generated source: .*undefined"):
        fused_net_gen.compile_cubin('#include "fused_net_layers.cuh"\n__global__ void k() { undefined_thing(); }\n')
    gen = nvrtc_jobs.Generation("this is not CUDA")
    assert gen.wait(60) and gen.done()
    with pytest.raises(fused_net_gen.GenerationError, match="NVRTC refused"):
        gen.result()


@needs_nvrtc
def test_a_background_compile_runs_in_a_child_process_and_can_be_killed():
    _, _, nodes, layers = _layers("mlp")
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    text = fused_net_gen.source(bound, 16, 0, 784, 784, 10, True)
    gen = nvrtc_jobs.Generation(text)
    assert gen._proc.pid != os.getpid() and gen in nvrtc_jobs._running
    assert gen.wait(120)
    assert gen.result() == fused_net_gen.compile_cubin(text) and not os.path.exists(gen._dir)
    assert gen not in nvrtc_jobs._running and gen.seconds > 0
    slow = nvrtc_jobs.Generation(text)           # what the exit hook does to a compile still running
    slow.kill()
    with pytest.raises(fused_net_gen.GenerationError, match="killed: the program exited before the compile ended"):
        slow.result()
    assert slow._proc.returncode != 0 and not os.path.exists(slow._dir) and slow not in nvrtc_jobs._running


@needs_nvrtc
def test_a_compile_is_timed_by_the_child_not_by_when_it_is_looked_at(tmp_path, monkeypatch):
    """``seconds`` ends when NVRTC's child finished (its own record), however late the parent looks; NVRTC's own
    part is kept too (the compile time reported: bench_zoo, info()["fused_net"]["generated"])."""
    import time
    monkeypatch.setenv("CYDNN_KERNEL_CACHE", str(tmp_path))
    _, _, nodes, layers = _layers("mlp")
    text = fused_net_gen.source([fused_net.FusedNetwork._bind(layer, 16) for layer in layers], 16, 0, 784, 784, 10,
                                True)
    t0 = time.perf_counter()
    gen = nvrtc_jobs.Generation(text)
    gen._proc.wait(120)                                # the child is done; nobody has looked yet
    time.sleep(1.0)
    assert gen.done() and gen.result()[:4] == b"\x7fELF"
    late = time.perf_counter() - t0
    assert 0 < gen.nvrtc_seconds <= gen.seconds <= late - 0.9, (gen.nvrtc_seconds, gen.seconds, late)
    again = nvrtc_jobs.Generation(text)                # from the disk cache: no NVRTC
    assert again.done() and again.cached and again.nvrtc_seconds is None


@needs_nvrtc
def test_compiles_beyond_the_limit_wait_their_turn_and_dropped_ones_are_killed(monkeypatch):
    monkeypatch.setattr(nvrtc_jobs, "MAX_RUNNING", 1)
    _, _, nodes, layers = _layers("mlp")
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    text = fused_net_gen.source(bound, 16, 0, 784, 784, 10, True)
    first, second = nvrtc_jobs.Generation(text), nvrtc_jobs.Generation(text + "// 2\n")
    assert first._proc is not None and second._proc is None and nvrtc_jobs._queue == [second]
    assert second.wait(120) and first.done()           # the second starts once the first is done
    assert second.result()[:4] == b"\x7fELF" and not nvrtc_jobs._queue and not nvrtc_jobs._running

    class Net:
        def src(self, cluster, form="whole"):
            return [text, text] if form == "layers" else text

        def trial(self, cluster, kernel):
            return True, {}
    owner = Net()
    kernels = nvrtc_jobs.GeneratedKernels(owner.src, owner.trial)
    nvrtc_jobs.LAYERS_MIN_RUNNING, keep = 1, nvrtc_jobs.LAYERS_MIN_RUNNING
    try:
        kernels.start(16)
    finally:
        nvrtc_jobs.LAYERS_MIN_RUNNING = keep
    gens = list(kernels._pending[16].values())
    assert kernels.info[16] == {"status": "compiling"} and len(gens) == len(nvrtc_jobs.FORMS)
    assert isinstance(kernels._pending[16]["layers"], nvrtc_jobs.Linked) and len(kernels._pending[16]["layers"].units) == 2
    del kernels                                        # the network went: its compiles are killed
    for gen in gens:
        with pytest.raises(fused_net_gen.GenerationError, match="dropped: the network went"):
            gen.result()
    assert not nvrtc_jobs._running and not nvrtc_jobs._queue


def test_the_generated_kernels_hold_their_network_weakly():
    """A network's device buffers go when it goes, not at a later garbage collection: no cycle through
    the object that manages its generated kernels."""
    import gc
    import weakref

    class Net:
        def src(self, cluster, form="whole"):
            return f"// {cluster}"

        def trial(self, cluster, kernel):
            return True, {}
    net = Net()
    net.generated = nvrtc_jobs.GeneratedKernels(net.src, net.trial, on=False)
    assert net.generated.source(8) == "// 8"
    ref = weakref.ref(net)
    gc.disable()
    try:
        del net
        assert ref() is None
    finally:
        gc.enable()


@needs_nvrtc
def test_a_program_that_exits_with_compiles_running_and_waiting_exits_cleanly():
    """The exit hook kills the running NVRTC child and ends the waiting ones: status 0, nothing on
    stderr (no finaliser tripping over a torn-down module), no temporary folder left."""
    import subprocess
    import sys
    child = """
import sys
from cydnn.compiler import nvrtc_jobs as g
g.MAX_RUNNING, g.LAYERS_MIN_RUNNING = 1, 1
text = '#include "fused_net_layers.cuh"\\n__global__ void k() {}\\n'
class Net:
    def src(self, c, form="whole"): return [text] if form == "layers" else text
    def trial(self, c, k): return True, {}
owner = Net()
owner.kernels = g.GeneratedKernels(owner.src, owner.trial)
for c in (1, 2, 4):
    owner.kernels.start(c)
g._kept = [g.Generation(text) for _ in range(2)]     # held to the end: only the exit hook ends these
assert len(g._running) == 1 and len(g._queue) == 3 * 2 + 2 - 1      # a unit and the whole form a cluster size
gens = [gen for f in owner.kernels._pending.values() for gen in [f["layers"].units[0], f["whole"]]] + g._kept
print("\\n".join(gen._dir for gen in gens))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    dirs = done.stdout.split()
    assert len(dirs) == 3 * 2 + 2 and not any(os.path.exists(d) for d in dirs)


def test_without_nvrtc_the_interpreter_stays_and_the_reason_is_kept(monkeypatch):
    def missing():
        raise fused_net_gen.GenerationError("NVRTC not found: libnvrtc.so: cannot open shared object file")
    monkeypatch.setattr(fused_net_gen, "_nvrtc", missing)

    class Net:
        def src(self, cluster, form="whole"):
            return ["// nothing"] if form == "layers" else "// nothing"

        def trial(self, cluster, kernel):
            raise AssertionError("no kernel to try")
    owner = Net()
    kernels = nvrtc_jobs.GeneratedKernels(owner.src, owner.trial)
    kernels.start(8)
    assert kernels.wait(8, timeout=10) is None and kernels.get(8) is None
    assert kernels.info[8]["status"] == "refused" and "NVRTC not found" in kernels.info[8]["reason"]
    kernels.start(8)                                  # refused once: not tried again on every call
    assert 8 not in kernels._pending and not nvrtc_jobs._running and not nvrtc_jobs._queue
