"""A simulated GPU for the bench wing's CPU tests: streams with device clocks, events, graphs.

Each stream has a device time `t` (us) at which its queue drains; a launch starts at
max(t, host) and takes `kernel_us`; an event records max(t, host) on its stream; waiting on an
event (or synchronizing) moves the host clock to it; every API call moves the host clock by
HOST_US. So events on another stream than the calls bracket nothing (their stream is idle),
and a skipped launch leaves a region of a few host steps. Modules write the family's
reference into the outputs of the ranks they run (and advance the device call counter), as
the real kernels would; `break_rank` leaves one rank's outputs alone. moe's dispatch (its pair
and its dispatch entry) also writes what its rank receives (tsgen.bench.moe_phases.expected_received);
the dispatch entry through `Module.deliver`, which a test replaces to deliver wrong rows there.
"""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np

import tsgen.runtime as R
from tsgen.ops import get_family
from tsgen.runtime.world import module_files, np_dtype

HOST_US = 0.05


class Arr(np.ndarray):
    def set(self, a):
        self[...] = a

    def get(self, stream=None):
        return np.asarray(self).copy()


def arr(a) -> Arr:
    return np.asarray(a).view(Arr)


class Clock:
    host = 0.0

    @classmethod
    def tick(cls):
        cls.host += HOST_US


class Stream:
    _ids = iter(range(1, 10**9))
    by_ptr: dict = {}
    current = None

    def __init__(self, non_blocking=True):
        self.t, self.capture, self.ptr = 0.0, None, next(Stream._ids)
        Stream.by_ptr[self.ptr] = self

    def run(self, us: float, effect=None):
        Clock.tick()
        if self.capture is not None:
            self.capture.append((us, effect))
            return
        self.t = max(self.t, Clock.host) + us
        if effect is not None:
            effect()

    def begin_capture(self):
        self.capture = []

    def end_capture(self):
        graph, self.capture = Graph(self.capture), None
        return graph

    def synchronize(self):
        Clock.host = max(Clock.host, self.t)

    def __enter__(self):
        Stream.current = self
        return self

    def __exit__(self, *a):
        Stream.current = None


class Graph:
    def __init__(self, nodes):
        self.nodes = nodes

    def launch(self, stream):
        for us, effect in self.nodes:
            stream.run(us, effect)


class Event:
    def __init__(self, *a, **k):
        self.t = None

    def record(self, stream=None):
        Clock.tick()
        self.t = max(stream.t, Clock.host)

    def synchronize(self):
        Clock.host = max(Clock.host, self.t)

    @property
    def done(self):
        return self.t <= Clock.host


class FakeCp:
    """The parts of CuPy the bench touches."""

    PROPS = {"name": b"NVIDIA H100 80GB HBM3", "multiProcessorCount": 132, "clockRate": 1980000, "major": 9,
             "minor": 0, "l2CacheSize": 50 << 20}
    float16, float32, uint16, uint32, int32 = np.float16, np.float32, np.uint16, np.uint32, np.int32

    class cuda:
        Event = Event
        Stream = Stream

        @staticmethod
        def Device(i):
            return contextlib.nullcontext()

        @staticmethod
        def get_elapsed_time(a, b):
            return (b.t - a.t) / 1e3

        class runtime:
            @staticmethod
            def getDeviceProperties(dev):
                return FakeCp.PROPS

            @staticmethod
            def runtimeGetVersion():
                return 13000

            @staticmethod
            def driverGetVersion():
                return 13000

            @staticmethod
            def memcpyPeerAsync(dst, ddev, src, sdev, n, stream_ptr):
                Stream.by_ptr[stream_ptr].run(max(2.0, n / 400e3))  # 400 GB/s, 2 us at least

    class random:
        class RandomState:
            def __init__(self, seed):
                self.rng = np.random.default_rng(seed)

            def standard_normal(self, n, dtype=np.float32):
                return arr(self.rng.standard_normal(n).astype(dtype))

            def randint(self, lo, hi, n, dtype=np.int64):
                return arr(self.rng.integers(lo, hi, n).astype(dtype))

        @staticmethod
        def standard_normal(shape, dtype=np.float32):
            return arr(np.random.default_rng(0).standard_normal(shape).astype(dtype))

    @staticmethod
    def empty(shape, dtype):
        return arr(np.empty(shape, dtype))

    @staticmethod
    def matmul(a, b, out):
        m, k = a.shape
        Stream.current.run(max(1.0, 2.0 * m * k * b.shape[1] / 400e6))  # 400 TFLOP/s


class Bufs:
    def __init__(self, module, count):
        self.module, self.count = module, count
        self.slots, self.heap_bytes = module.manifest.layout(count, module.world.size)
        self.by_name = {s.name: s for s in self.slots}
        self.bases = {r: (r + 1) << 40 for r in range(module.world.size)}
        self.data = [{s.name: arr(np.zeros(s.elems, np_dtype(s.dtype))) for s in self.slots}
                     for _ in range(module.world.size)]
        self.calls_begun, self.snapshots, self.received = {}, {}, {}
        self.by_content, self.refs = {}, {}

    def same_inputs(self, snapshot):
        """The snapshot of a call's inputs, as the one object of a call before it that held the same
        bytes: an op that does not overwrite its inputs sees the same inputs every call, and its NumPy
        reference (float64 attention backward: seconds a call) is then computed once, not per call."""
        digest = hashlib.sha1()
        for name in sorted(snapshot):
            for a in snapshot[name]:
                digest.update(f"{name}:{a.dtype}:{a.shape}".encode())
                digest.update(np.ascontiguousarray(a).view(np.uint8).data)
        return self.by_content.setdefault(digest.hexdigest(), snapshot)

    def reference(self, fam, spec, world, inputs):
        """fam.reference of one snapshot (a pure function of spec, world, count and the inputs), once per
        snapshot object; the outputs are copied into the buffers, never written."""
        key = (id(inputs), id(spec), world)
        if key not in self.refs:
            self.refs[key] = (spec, fam.reference(spec, world, self.count, inputs))
        return self.refs[key][1]

    def array(self, name, rank):
        return self.data[rank][name]

    def free(self):
        pass


class Module:
    def __init__(self, world, manifest, source=None):
        self.world = world
        # as the real World.load: a Manifest in memory with its source, or a NAME.json path
        self.manifest, self.source = module_files(manifest, source)
        assert self.source.is_file() and self.source.name == self.manifest.source, self.source
        self.kernel = self.manifest.kernel(world.size)

    def alloc(self, count):
        return Bufs(self, count)

    def launch_entry(self, entry, bufs, ranks, streams, extra=None):
        """One entry of a call of several (moe's dispatch, combine): the output it writes and its
        counter (tsgen.bench.moe_phases.PHASES)."""
        from tsgen.bench.moe_phases import PHASES

        written, counter = PHASES[entry]
        for r in ranks:
            assert extra is None or len(extra(r)) == 1  # combine's y
        self.launch(bufs, ranks, streams, only=(written,), counter=counter, entry=entry)

    @staticmethod
    def deliver(rank, segments):
        """The received rows (moe_phases.Received) the dispatch entry writes on `rank`: all of them, right."""
        return segments

    def launch(self, bufs, ranks=None, streams=None, only=None, counter="calls", entry=None):
        """A call (`entry` None) or one entry of it (launch_entry)."""
        world = self.world
        ranks = list(world.ranks if ranks is None else ranks)
        spec = world.spec  # the variant the runner loaded (see World.load)
        fam = get_family(spec.op)
        ins = [b.name for b in fam.buffers(spec) if b.role in ("input", "inout")]
        counts = fam.bench.counts_calls

        def effect(r):
            def go():
                # call k of every rank sees the inputs as they were when the first rank began call k
                # (the real kernels' entry signals see to that; in-place ops overwrite them)
                k = bufs.calls_begun.get(r, 0)
                bufs.calls_begun[r] = k + 1
                if k not in bufs.snapshots:
                    bufs.snapshots[k] = bufs.same_inputs({n: [bufs.array(n, q).get() for q in range(world.size)]
                                                          for n in ins})
                out = bufs.reference(fam, spec, world.size, bufs.snapshots[k])
                # a put writes its peer's output, every other op its own
                q = (r + spec.params.shift) % world.size if getattr(fam, "direction", None) == "put" else r
                if q != world.break_rank:
                    for n, per in out.items():
                        if only is None or n in only:
                            bufs.array(n, q)[...] = per[q].view(bufs.array(n, q).dtype)
                    if fam.kind == "moe" and entry in (None, "dispatch"):  # the call's number: its counter after it
                        self.write_received(bufs, q, bufs.snapshots[k], int(bufs.array(counter, r)[0]) + 1,
                                            self.deliver if entry else (lambda rank, segments: segments))
                if counts:
                    bufs.array(counter, r)[0] += 1
            return go

        for r in ranks:
            (streams or world.streams)[r].run(world.kernel_us, effect(r))

    def write_received(self, bufs, rank, inputs, call, deliver):
        from tsgen.bench.moe_phases import expected_received

        key = (call & 1, id(inputs))  # the rows depend on the inputs and, low-latency, the call's half
        if key not in bufs.received:
            bufs.received[key] = expected_received(self.world.spec, self.world.size, inputs, call)
        for seg in deliver(rank, bufs.received[key][rank]):
            a, width = bufs.array(seg.name, rank), seg.rows.shape[1]
            a[seg.start * width:seg.start * width + seg.rows.size] = seg.rows.reshape(-1).view(a.dtype)

    def close(self):
        pass


class World:
    """A world of `n` simulated GPUs (or ranks sharing one, with share_gpus)."""

    kernel_us = 40.0
    break_rank = None
    share = False

    def __init__(self, n, backend="single", share_gpus=None):
        shared = bool(share_gpus) or World.share
        self.size, self.cp = n, FakeCp
        self.devices = {r: (0 if shared else r) for r in range(n)}
        self.ranks = list(range(n))
        self.shared, self.colocated = (n > 1 and shared), (n if shared else 1)
        self.backend = type("B", (), {"store": None, "bus_ids": ["0"] * n if shared else [str(r) for r in range(n)]})
        self.streams = self.make_streams()
        self.spec = None

    def make_streams(self):
        return {r: Stream() for r in self.ranks}

    barrier, exchange, is_root = R.World.barrier, R.World.exchange, R.World.is_root

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass

    def synchronize(self):
        Clock.host = max([Clock.host] + [s.t for s in Stream.by_ptr.values() if s.capture is None])

    def load(self, manifest, arch=None, source=None):
        self.spec = World.last_spec  # the (variant) spec the runner rendered: see install()
        return Module(self, manifest, source)

    last_spec = None


def install(monkeypatch, **attrs):
    """The fake World everywhere the bench makes one; the spec the runner renders is recorded."""
    import tsgen.bench.runner as runner

    real = runner.render_to_cache

    def render_to_cache(loaded, skew=None):
        World.last_spec = loaded.model
        return real(loaded, skew)

    monkeypatch.setattr(runner, "render_to_cache", render_to_cache)
    monkeypatch.setattr(R, "World", World)
    for k, v in {**dict(kernel_us=40.0, break_rank=None, share=False), **attrs}.items():
        monkeypatch.setattr(World, k, v)
    return World
