"""tsgen test, driven on CPU through a fake World whose
'kernel' writes the family's reference (or leaves rank 1's outputs poisoned): the
harness must pass the first and fail the second. The same with one process per GPU
(threads with one rank each, a real store, one shared fake heap): the barriers
around the launch must make it pass, and removing them must make it fail.
The GPU tests run the real thing."""
import contextlib
from pathlib import Path
import os
import threading
import time
import numpy as np
import pytest
import tsgen.harness as H
import tsgen.runtime as R
from tsgen.ops import get_family
from tsgen.manifest import Manifest
from tsgen.runtime.world import module_files, np_dtype

class Arr(np.ndarray):
    def set(self, a): self[...] = a
    def get(self): return np.asarray(self).copy()

class FakeCp:
    class cuda:
        @staticmethod
        def Device(i): return contextlib.nullcontext()

class Bufs:
    def __init__(self, module, count):
        self.module, self.count = module, count
        self.slots, _ = module.manifest.layout(count, module.world.size)
        self.data = module.world.heap(lambda: [{s.name: np.zeros(s.elems, np_dtype(s.dtype)).view(Arr)
                                                for s in self.slots} for _ in range(module.world.size)])
    def array(self, name, rank):
        if rank == 0 and self.module.world.slow_rank_0:
            time.sleep(0.002)  # rank 0 loads slowly: a peer that does not wait for it races ahead
        return self.data[rank][name]
    def free(self): pass

class Module:
    def __init__(self, world, manifest, source, break_it):
        # the harness hands over the lowered Manifest in memory, never a file it wrote and reads back
        assert isinstance(manifest, Manifest), manifest
        self.manifest, self.source = module_files(manifest, source)
        assert self.source.is_file() and self.source.name == manifest.source
        self.world, self.break_it = world, break_it
    def alloc(self, count): return Bufs(self, count)
    def launch(self, bufs):
        fam = get_family(self.spec.op)
        size = self.world.size
        inputs = {n: [bufs.array(n, r).get() for r in range(size)] for n in self.in_names}
        out = fam.reference(self.spec, size, bufs.count, inputs)
        # one process drives every rank: all outputs; one rank per process: it 'puts' its neighbour's
        writes = range(size) if len(self.world.ranks) == size else [(r + 1) % size for r in self.world.ranks]
        for n, per in out.items():
            for r in writes:
                if not (self.break_it and r == 1):
                    bufs.array(n, r)[...] = per[r].view(bufs.array(n, r).dtype)

class World:
    break_it = False
    spec_path = None
    slow_rank_0 = False
    shared, colocated = False, 1  # one GPU per rank (tests/test_shared_cpu.py fakes sharing)
    def __init__(self, n, backend="single", share_gpus=None):
        self.size, self.devices, self.cp, self.ranks = n, {r: r for r in range(n)}, FakeCp, list(range(n))
        self.backend = type("NoStore", (), {"store": None})
    def heap(self, make): return make()
    barrier, exchange, is_root = R.World.barrier, R.World.exchange, R.World.is_root
    def __enter__(self): return self
    def __exit__(self, *a): pass
    def synchronize(self): pass
    def load(self, manifest, arch=None, source=None):
        m = Module(self, manifest, source, self.break_it)
        m.spec = H.load_spec(self.spec_path).model
        m.in_names = [b.name for b in get_family(m.spec.op).buffers(m.spec) if b.role in ("input", "inout")]
        return m



@pytest.fixture
def fake_world(monkeypatch):
    monkeypatch.setattr(R, "World", World)
    return World


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("spec", ["all_reduce_two_shot", "allgather", "put_block", "reduce_scatter_inplace_f32",
                                  "simple_shift"])
def test_run_test_passes_right_and_fails_wrong(fake_world, spec, broken):
    fake_world.break_it, fake_world.spec_path = broken, f"specs/{spec}.yaml"
    lines = []
    ok = H.run_test(fake_world.spec_path, 3, count=1003, iters=3, echo=lines.append)
    assert ok == (not broken), lines


class IpcWorld(World):
    """This thread's rank of a world of one process per GPU: the rank comes from the
    thread's name (conftest.together), the store is real, the heap is shared."""
    rendezvous, common = None, {}
    lock = threading.Lock()
    def __init__(self, n, backend="single", share_gpus=None):
        assert backend == "ipc"
        super().__init__(n)
        rank = int(threading.current_thread().name.split()[1])
        self.ranks, self.devices = [rank], {rank: rank}
        self.backend = type("Ipc", (), {"store": IpcWorld.rendezvous[rank]})
    def heap(self, make):
        with IpcWorld.lock:  # the first rank to allocate makes it, the others map it
            return IpcWorld.common.setdefault("heap", make())


def _run_ipc(monkeypatch, spec, barriers=True, slow=True, broken=False, size=3):
    from conftest import close_ranks, localhost_ranks, together

    monkeypatch.setattr(R, "World", IpcWorld)
    monkeypatch.setenv("WORLD_SIZE", str(size))
    monkeypatch.setenv("RANK", "0")
    if not barriers:
        monkeypatch.setattr(IpcWorld, "barrier", lambda self, label: None)
    IpcWorld.break_it, IpcWorld.spec_path, IpcWorld.slow_rank_0, IpcWorld.common = broken, spec, slow, {}
    IpcWorld.rendezvous = localhost_ranks(size)
    lines = [[] for _ in range(size)]
    try:
        oks = together(IpcWorld.rendezvous, lambda r, rv: H.run_test(spec, None, count=1003, iters=4, backend="ipc",
                                                                     echo=lines[r].append))
    finally:
        close_ranks(IpcWorld.rendezvous)
    assert all(isinstance(ok, bool) for ok in oks), oks
    assert len(set(oks)) == 1, f"ranks disagree on the verdict: {oks}"
    assert all(not lines[r] for r in range(1, size)), "only rank 0 prints"
    return oks[0], lines[0]


@pytest.mark.parametrize("spec", ["allgather", "put_block", "all_reduce_one_shot"])
def test_one_process_per_gpu_passes_with_the_barriers(monkeypatch, spec):
    ok, lines = _run_ipc(monkeypatch, f"specs/{spec}.yaml")
    assert ok, lines
    assert [l.split(":")[0] for l in lines[:3]] == [f"{spec} rank {r}/3" for r in range(3)]
    assert lines[-1].startswith(f"{spec}: PASS on 3 GPUs (ipc: one process per rank)")


def test_one_process_per_gpu_gathers_a_failure_from_another_rank(monkeypatch):
    ok, lines = _run_ipc(monkeypatch, "specs/allgather.yaml", broken=True, slow=False)
    assert not ok
    assert any(l.startswith("allgather rank 1/3: FAIL") for l in lines), lines  # seen by rank 1, printed by rank 0


def test_one_process_per_gpu_without_barriers_fails(monkeypatch):
    """The negative control: a peer launching before rank 0 has loaded and poisoned,
    or a rank checking before its writer ran, must make the test fail."""
    ok, lines = _run_ipc(monkeypatch, "specs/allgather.yaml", barriers=False)
    assert not ok, lines


def test_poison_counts_only_where_it_survives():
    """A value equal to the poison's bits but within the tolerance of the reference is counted
    unwritten -- unless the op overwrites its outputs first (gemm_reduce_scatter reduce: add
    zeroes c, and its 16-bit adds may land one unit away from the once-rounded reference)."""
    from tsgen.ops.collectives import to_f64

    poison = np.array([H._poison_value(np.dtype(np.uint16), 7)], np.uint16)
    want = poison - 1  # one unit in the last place below the poison's bits
    tol = 2.0**-7 * np.abs(to_f64(want, "bfloat16"))  # one unit
    assert H.wrong_elements(poison, want, tol, "bfloat16", 7).tolist() == [0]
    assert H.wrong_elements(poison, want, tol, "bfloat16", None).tolist() == []
    assert H.wrong_elements(poison, want, np.array([0.0]), "bfloat16", None).tolist() == [0]
    from tsgen.spec import load_spec
    from conftest import ROOT
    fam = get_family("gemm_reduce_scatter")
    assert not fam.poison_survives(load_spec(ROOT / "specs" / "gemm_reduce_scatter_push_add.yaml").model)
    assert fam.poison_survives(load_spec(ROOT / "specs" / "gemm_reduce_scatter_push_interleaved.yaml").model)


def test_the_gpu_turn_does_not_count_its_queueing_against_the_test_time_limit(tmp_path, monkeypatch):
    """A test's time limit (pytest-timeout's SIGALRM timer) does not run while the test queues for the
    GPU's turn behind another test process, even where the wait is longer than the time left; each
    turn is logged (test, wait, hold); a turn inside a turn holds nothing new (no self-deadlock);
    a child started in the turn (run_in_turn) runs without the lock, so it cannot queue for it."""
    import json
    import signal
    import subprocess
    import sys

    from tsgen.files import held_lock

    lock = tmp_path / "gpu.lock"
    monkeypatch.setenv("TSGEN_GPU_LOCK", str(lock))
    monkeypatch.setenv("TSGEN_RESULTS_DIR", str(tmp_path))
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.monotonic()))
    started = threading.Event()

    def other_test():  # holds the turn for 1 s (a thread: flock locks are per open file)
        with held_lock(lock):
            started.set()
            time.sleep(1.0)

    t = threading.Thread(target=other_test)
    t.start()
    started.wait()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # less time left than the wait
        before = time.monotonic()
        with H.gpu_turn():
            waited = time.monotonic() - before
            left = signal.getitimer(signal.ITIMER_REAL)[0]
            with H.gpu_turn():  # nested: runs at once
                pass
        assert waited >= 0.7 and not fired, (waited, fired)  # the timer did not fire during the wait
        assert 0.3 < left <= 0.5, left  # and after it, what was left before it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        t.join()
    rows = [json.loads(line) for line in (tmp_path / "gpu_turn.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["waited_s"] >= 0.7 and rows[0]["held_s"] >= 0
    with H.gpu_turn():  # no timer armed: none is armed by the turn
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    for env in (None, {"TSGEN_GPU_LOCK": "x", "PATH": os.environ["PATH"]}):
        proc = H.run_in_turn([sys.executable, "-c", "import os; print(os.environ.get('TSGEN_GPU_LOCK'))"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert proc.stdout.strip() == "None"
    assert len((tmp_path / "gpu_turn.jsonl").read_text().splitlines()) == 4


# ---------------------------------------------------------------------------
# OracleHooks.once_per_inputs: reference and tolerance share their expensive part
# ---------------------------------------------------------------------------


def test_once_per_inputs_computes_once_per_inputs_and_key():
    """The same inputs dict and key: computed once; an equal but different dict, or another key: again."""
    from tsgen.ops.base import OpFamily

    fam, calls = OpFamily(), []
    inputs = {"x": [np.arange(4)]}

    def compute():
        calls.append(1)
        return len(calls)

    assert fam.once_per_inputs(inputs, ("s", 2), compute) == 1
    assert fam.once_per_inputs(inputs, ("s", 2), compute) == 1
    assert fam.once_per_inputs({"x": [np.arange(4)]}, ("s", 2), compute) == 2  # a new call's inputs
    assert fam.once_per_inputs(inputs, ("s", 3), compute) == 3  # another world
    assert len(calls) == 3


@pytest.mark.parametrize("spec, world, heavy", [
    ("attention_hd128", 1, "tsgen.ops.attention.attention_reference"),
    ("cp_attention", 2, "tsgen.ops.cp_attention.attention_reference"),
    ("moe_fp8", 2, "tsgen.ops.moe.dispatch_reference"),
    ("gemm_bf16", 1, None),
    ("gemm_reduce_scatter", 2, None),
    ("allgather_gemm", 2, None),
    ("cannon", 4, None),
    ("attention_backward_hd128", 1, "tsgen.ops.attention_backward.attention_backward_reference"),
])
def test_reference_and_tolerance_share_one_computation(spec, world, heavy, monkeypatch):
    """The harness asks for reference, then tolerance, of one call's inputs: the float64 attention, the
    dispatched rows or the GEMM's products are computed once for both (small shapes; the families'
    once_per_inputs), and the next call's inputs get their own."""
    import importlib

    from tsgen.ops import get_family
    from tsgen.spec import load_spec, spec_variant

    loaded = load_spec(Path(__file__).resolve().parents[1] / "specs" / f"{spec}.yaml")
    small = {"attention_hd128": {"params": {"batch": 1, "heads": 2, "kv_heads": 2}},
             "cp_attention": {"params": {"batch": 1, "heads": 2, "kv_heads": 2}},
             "moe_fp8": {"params": {"hidden": 256, "experts": 8}},
             "gemm_bf16": {"params": {"n": 256, "k": 256}},
             "gemm_reduce_scatter": {"params": {"n": 256, "k": 256}},
             "allgather_gemm": {"params": {"n": 256, "k": 256}},
             "cannon": {"params": {"n": 512, "k": 512}},
             "attention_backward_hd128": {"params": {"batch": 1, "heads": 2, "kv_heads": 2}}}[spec]
    model = spec_variant(loaded, small).model
    family = get_family(model.op)
    calls = []
    if heavy:
        module, name = heavy.rsplit(".", 1)
        mod = importlib.import_module(module)
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    else:  # the GEMMs: count the matrix products
        real_once = family.once_per_inputs
        monkeypatch.setattr(family, "once_per_inputs",
                            lambda inputs, key, compute: real_once(inputs, key, lambda: calls.append(1) or compute()))
    count = 64
    for call in range(2):
        inputs = family.make_inputs(model, world, count, np.random.default_rng(call), pattern=False)
        ref = family.reference(model, world, count, inputs)
        tol = family.tolerance(model, world, count, inputs)
        assert set(tol or {}) <= set(ref)
        assert len(calls) == call + 1
