"""The choice, per batch bucket, between the fused network (fused_net.py: the whole forward in one kernel, at
its fastest cluster size) and the generic plan's graph, timed on the bucket's own input as its calls run
(numpy calls through mapped memory against the plan's upload, graph and download); and, where the plan won but
a kernel generated for the network may beat it, that kernel's compile and a second timing once it is ready.
:class:`~cydnn.compiler.inference.CompiledInference` holds one :class:`FusedChoice`.
"""
import numpy as np

from .. import _C
from .executor import least_times, time_calls
from .fused_net import CLUSTERS, FusedNetwork, describe

__all__ = ["FusedChoice", "GENERATED_HOPE", "EXPECTED_CLUSTER"]

#: Where the plan beats the fused network's interpreter by less than this factor, the kernel generated for the
#: network is compiled anyway and timed against the plan once it is ready: generated kernels ran 15-45 % faster
#: than the interpreter (docs/performance.md, sessions 18 and 23), and waiting for the interpreter to win first
#: left the 3x32x32 CNN's and LeNet 16/32's one-image calls on the plan (62 and 44 us).
GENERATED_HOPE = 1.8
#: The cluster size whose generated kernel starts compiling as soon as a one-image bucket's first call comes,
#: before that call builds its plan and times the candidates (0.3-0.4 s of the CNN's and LeNet 16/32's first call
#: on the H100, during which NVRTC already runs): the largest, chosen for one image by four of the five zoo networks
#: the fused network takes (the small MLP chose 8: docs/performance.md, session 29).  Where the timing chooses
#: another, or the plan by too much to hope, the compile is stopped (``FusedChoice.choose``).
EXPECTED_CLUSTER = CLUSTERS[-1]
#: Rounds of timing behind a bucket's choice (``FusedChoice._time``): each candidate's least time counts.
TIME_ROUNDS = 3


def _plan_from_host(x, m, host, plan_launch, plan_output):
    """The plan as a numpy call runs it: ``host`` into the input's first ``m`` rows, the graph, the output back."""
    rows = x if x.shape[0] == m else x[:m]

    def run():
        rows.set_(host)
        plan_launch()
        return plan_output().numpy()
    return run


class FusedChoice:
    """Per batch bucket, the fused kernel at its fastest cluster size or the generic plan.

    ``mode``: ``"auto"`` (the faster, timed on the bucket's own input), ``"force"`` (the fused
    kernel wherever it takes the network: for tests and benchmarks), ``"off"``.  Before any
    timing the kernel's output is compared with the plan's on the same input (a self-test, as the
    graph capture has one); a difference beyond rounding turns the fused kernel off, with the
    reason in ``reason`` and a warning in the log.
    """

    def __init__(self, nodes, softmax, mode, capacity, resident_us=None):
        self.mode, self.reason, self.net = mode, None, None
        self.clusters, self.timed_us, self.skipped = {}, {}, {}
        self.hoped = {}       # bucket -> (cluster, the fused call, the plan's call): the plan won, a kernel compiles
        self.expected = None  # the cluster whose kernel started compiling before any timing (expect), until chosen
        if mode == "off":
            self.reason = "switched off (fused_net='off')"
            return
        layers = describe(nodes)
        if isinstance(layers, str):
            self.reason = layers
            return
        try:
            self.net = FusedNetwork(layers, nodes[0].in_shape[1:], nodes[-1].out_shape[1:], softmax, capacity,
                                    resident_us)
        except (_C.CydnnError, ValueError) as e:
            self.reason = f"the fused kernel refused the network: {e}"

    def expect(self, bucket):
        """A bucket's first call, before its plan is built and its candidates timed: for one image, the kernel
        generated for EXPECTED_CLUSTER starts compiling now, so that NVRTC runs while the plan is built (``choose``
        keeps it where that cluster serves the bucket or may, and stops it otherwise)."""
        if (self.net is not None and bucket == 1 and bucket not in self.clusters and self.expected is None
                and self.net.generated.start(EXPECTED_CLUSTER)):
            self.expected = EXPECTED_CLUSTER

    def cluster(self, bucket):
        """The cluster size chosen for ``bucket`` (None: the plan; missing: not chosen yet).  Where the plan won
        but a generated kernel was being compiled for the bucket (GENERATED_HOPE), the first call after its
        compile ends times it against the plan again, as the first choice did, and keeps the faster."""
        if bucket in self.hoped:
            self._hope(bucket)
        return self.clusters.get(bucket, "?")

    @staticmethod
    def _time(candidates, rounds=TIME_ROUNDS):
        """Seconds a call of each candidate takes (key -> seconds): each candidate's least time over ``rounds``
        rounds that time every candidate in turn (a warm-up call and 3 calls each: ``executor.least_times``), so
        that one slow moment does not hand a bucket to the slower way for the process's life (seen on the H100:
        the all-conv plan's 10,000 images timed once at 2,456 us a chunk, against its usual 600, lost to a
        2,087 us kernel)."""
        return least_times(candidates, 3, rounds, timer=time_calls)

    def _hope(self, bucket):
        cluster, fused_call, plan_call = self.hoped[bucket]
        if self.net is None or self.net.generated.compiling(cluster):
            if self.net is None:
                del self.hoped[bucket]
            return
        del self.hoped[bucket]
        if self.net.generated.get(cluster) is None:      # refused, or not faster than the interpreter
            return
        times = self._time({"fused": fused_call, "plan": plan_call})
        fused, plan = times["fused"], times["plan"]
        self.timed_us[bucket].update({f"generated/{cluster}": round(1e6 * fused, 1), "plan again": round(1e6 * plan, 1)})
        if fused < plan:
            self.clusters[bucket] = cluster

    def choose(self, bucket, m, x, plan_launch, plan_output, log=None, host=None):
        """Choose for ``bucket`` with the plan's input ``x`` (its first ``m`` rows are real).  ``host``: the
        numpy rows ``x`` was uploaded from, where the call came with numpy: then each candidate is timed as a
        numpy call runs it -- the fused network's ``run_host`` (mapped memory: one launch, one wait) against
        the plan's upload, graph and download -- not on device arrays, where the plan's two copies are not
        seen (a 3-kernel plan 2 us faster on the device was 15 us slower from numpy)."""
        if self.net is None:
            self.clusters[bucket] = None
            return None
        plan_launch()
        ref = plan_output().numpy()[:m]
        dy = self.net._dy
        candidates = {}
        for r in CLUSTERS:
            try:
                self.net.forward(x, dy, bucket, r)
            except _C.CydnnError as e:            # e.g. no GPC with 16 free SMs for a 16-block cluster
                self.skipped[r] = str(e)
                continue
            got = dy.numpy()[:m * self.net.out_size].reshape(ref.shape)
            tol = 1e-4 * max(1.0, float(np.nanmax(np.abs(ref))) if ref.size else 1.0)
            if not np.allclose(got, ref, rtol=1e-4, atol=tol, equal_nan=True):
                self.reason = (f"self-test failed: the fused kernel (cluster {r}) differs from the plan by "
                               f"{float(np.nanmax(np.abs(got - ref))):.3g}")
                if log is not None:
                    log.warning("compile: %s; running the plan", self.reason)
                self.net = None
                self.clusters[bucket] = None
                return None
            candidates[r] = ((lambda r=r: self.net.forward(x, dy, bucket, r)) if host is None
                             else (lambda r=r: self.net.run_host(host, r)))
        if not candidates:                       # no cluster size launches here (e.g. a GPU older than sm_90)
            self.reason = "the fused kernel cannot run here: " + "; ".join(sorted(set(self.skipped.values())))
            self.net = None
            self.clusters[bucket] = None
            return None
        if self.mode == "auto":
            candidates[None] = plan_launch if host is None else _plan_from_host(x, m, host, plan_launch, plan_output)
        times = self._time(candidates)
        chosen = min(times, key=times.get)
        self.timed_us[bucket] = {("plan" if k is None else f"fused/{k}"): round(1e6 * t, 1) for k, t in times.items()}
        self.clusters[bucket] = chosen
        if chosen is not None:
            self.net.generated.start(chosen)      # in the background; the interpreter serves meanwhile
        elif self.mode == "auto":                 # the plan won: perhaps not against the generated kernel
            best = min((k for k in times if k is not None), key=times.get)
            if times[best] <= GENERATED_HOPE * times[None] and self.net.generated.start(best):
                self.hoped[bucket] = (best, candidates[best], candidates[None])
        self._settle_expected()
        return chosen

    def _settle_expected(self):
        """After a choice: the compile ``expect`` started is kept where a bucket runs its cluster or hopes for it,
        else stopped (its CPU goes to the compile that was chosen)."""
        wanted = set(self.clusters.values()) | {c for c, _, _ in self.hoped.values()}
        if self.expected is not None and self.expected not in wanted:
            self.net.generated.drop(self.expected, f"dropped: cluster {self.expected} was not chosen")
        self.expected = None
