"""tsgen test and the bench correctness check, driven on CPU through a fake World whose
'kernel' writes the family's reference (or leaves rank 1's outputs poisoned): the
harness must pass the first and fail the second. The GPU tests run the real thing."""
import contextlib
import numpy as np
import pytest
import tsgen.harness as H
import tsgen.runtime as R
from tsgen.ops import get_family
from tsgen.runtime.world import layout, np_dtype

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
        self.slots, _ = layout(module.manifest, count, module.world.size)
        self.data = [{s.name: np.zeros(s.elems, np_dtype(s.dtype)).view(Arr) for s in self.slots}
                     for _ in range(module.world.size)]
    def array(self, name, rank): return self.data[rank][name]
    def free(self): pass

class Module:
    def __init__(self, world, manifest, break_it):
        import json
        self.world, self.manifest, self.break_it = world, json.load(open(manifest)), break_it
    def alloc(self, count): return Bufs(self, count)
    def launch(self, bufs):
        fam = get_family(self.spec.op)
        inputs = {n: [bufs.array(n, r).get() for r in range(self.world.size)] for n in self.in_names}
        out = fam.reference(self.spec, self.world.size, bufs.count, inputs)
        for n, per in out.items():
            for r, a in enumerate(per):
                if not (self.break_it and r == 1):
                    bufs.array(n, r)[...] = a.view(bufs.array(n, r).dtype)

class World:
    break_it = False
    spec_path = None
    def __init__(self, n): self.size, self.devices, self.cp = n, list(range(n)), FakeCp
    def __enter__(self): return self
    def __exit__(self, *a): pass
    def synchronize(self): pass
    def load(self, manifest, arch=None):
        m = Module(self, manifest, World.break_it)
        m.spec = H.load_spec(World.spec_path).model
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


@pytest.mark.parametrize("broken,wrong", [(False, 0), (True, 4096)])
def test_bench_check_once(fake_world, broken, wrong):
    from tsgen import bench

    fake_world.break_it, fake_world.spec_path = broken, "specs/all_reduce_one_shot.yaml"
    w = fake_world(2)
    m = w.load(H.materialize(H.load_spec(fake_world.spec_path)))
    assert bench.check_once(w, m, m.alloc(4096), m.spec, 2, 4096) == wrong
