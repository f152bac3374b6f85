"""Copy-engine collectives (params.transport: copy_engine): the verified plan is
scheduled over streams, and the host launcher enqueues exactly its steps --
waits before each copy, signals after it -- as cudaMemcpyAsync and small
kernels. CPU checks: the stream program, the rendered launcher, the shared
library's exported launchers, and spec errors."""

import ctypes
import json
import re
from collections import Counter

import pytest

from conftest import ROOT, compile_test

from tsgen.ops import get_family
from tsgen.plan.ir import SignalRef
from tsgen.plan.lower import stream_program
from tsgen.plan.verifier import verify
from tsgen.shipped import shipped_specs
from tsgen.spec import load_spec
from tsgen.toolchain import compile_source, find_nvcc

CE_SPECS = shipped_specs(transport="copy_engine")


def _plan(spec_path, w):
    spec = load_spec(spec_path).model
    return get_family(spec.op).comm_plan(spec, w)


def test_copy_engine_specs_ship():
    ops = {load_spec(s).model.op for s in CE_SPECS}
    assert {"allgather", "all_to_all", "reduce_scatter", "all_reduce"} <= ops
    assert all(s.stem.endswith("_ce") for s in CE_SPECS)  # the copy-engine variant of a spec is NAME_ce


@pytest.mark.parametrize("w", [2, 3, 4, 8])
@pytest.mark.parametrize("spec", CE_SPECS, ids=lambda p: p.stem)
def test_stream_program_is_the_plan(spec, w):
    """Every step once, on the stream the schedule gave it; waits right before its op,
    signals right after, in the stream's order."""
    plan = _plan(spec, w)
    for r in range(w):
        steps = plan.ranks[r].steps
        program = stream_program(plan, r)
        assert len(program) == plan.nblocks
        seen = Counter()
        for b, ops in enumerate(program):
            order = [sh.step for sh in plan.ranks[r].blocks[b]]
            waited, ran, signalled = [], [], []
            for op in ops:
                if op.kind == "sync":
                    if op.signal_step >= 0:
                        signalled.append(op.signal_step)
                        assert steps[op.signal_step].signals
                        # the signal comes after the step's op (if it has one) on this stream
                        if steps[op.signal_step].op != "none":
                            assert ran and ran[-1] == op.signal_step
                    if op.wait_step >= 0:
                        waited.append(op.wait_step)
                else:
                    ran.append(op.step)
                    assert steps[op.step].op == op.kind
                    if steps[op.step].waits:  # its waits were the last sync before it
                        assert waited and waited[-1] == op.step
                    seen[op.step] += 1
            assert ran == [i for i in order if steps[i].op != "none"]
            assert waited == [i for i in order if steps[i].waits]
            assert signalled == [i for i in order if steps[i].signals]
        assert all(seen[i] == 1 for i, s in enumerate(steps) if s.op != "none")


def test_broken_copy_engine_plan_fails_verify():
    plan = _plan(ROOT / "specs" / "allgather_ce.yaml", 4)
    steps = plan.ranks[1].steps
    i = next(k for k, s in enumerate(steps) if s.op == "copy" and s.signals)
    sig = steps[i].signals[0]
    steps[i] = steps[i].__class__(**{**steps[i].__dict__, "signals": (SignalRef(sig.rank, sig.name, sig.index ^ 1),)})
    assert verify(plan, schedules=10)


def test_launcher_enqueues_one_memcpy_per_copy_step():
    text = (ROOT / "generated" / "allgather_ce.cu").read_text()
    manifest = json.loads((ROOT / "generated" / "allgather_ce.json").read_text())
    assert manifest["host_launch"] is True
    k4 = next(k for k in manifest["kernels"] if k["world_size"] == 4)
    assert [a["role"] for a in k4["launcher_args"]][:3] == ["peers", "peers_host", "rank"]
    body = text.split(f'extern "C" cudaError_t {k4["launcher"]}(')[1].split("\n}\n")[0]
    plan = _plan(ROOT / "specs" / "allgather_ce.yaml", 4)
    copies = sum(s.op == "copy" for rp in plan.ranks for s in rp.steps)
    assert len(re.findall(r"^\s+q\.copy\(\d+, ", body, re.M)) == copies
    assert [int(x) for x in re.findall(r"case (\d+):", body)] == [0, 1, 2, 3]


def test_copy_engine_spec_errors(tmp_path):
    from tsgen.errors import SpecError

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nop: allgather\nworld_sizes: [2]\nparams:\n  transport: copy_engine\n"
                   "  direction: multimem\n")
    with pytest.raises(SpecError, match="transport"):
        load_spec(bad)
    bad.write_text("name: bad\nop: allgather\nworld_sizes: [2]\nparams:\n  transport: dma\n")
    with pytest.raises(SpecError, match="transport"):
        load_spec(bad)
    # two_shot_pull stores each reduced share to every rank in one step: no single memcpy does that
    bad.write_text("name: bad\nop: all_reduce\nworld_sizes: [2, 4]\nparams:\n  algorithm: two_shot_pull\n"
                   "  transport: copy_engine\n")
    with pytest.raises(SpecError, match="several ranks in one step"):
        load_spec(bad)


try:
    find_nvcc()
    NO_NVCC = None
except Exception as e:  # noqa: BLE001
    NO_NVCC = str(e)


@compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
@pytest.mark.parametrize("spec", CE_SPECS, ids=lambda p: p.stem)
def test_shared_library_exports_the_launchers(spec):
    name = load_spec(spec).model.name
    res = compile_source(ROOT / "generated" / f"{name}.cu", mode="shared")
    lib = ctypes.CDLL(str(res.output))  # loads without a GPU: the CUDA runtime starts lazily
    manifest = json.loads((ROOT / "generated" / f"{name}.json").read_text())
    for k in manifest["kernels"]:
        assert getattr(lib, k["launcher"])
    for fn, entry in res.report.items():
        assert entry.get("spill_stores", 0) == 0 and entry.get("spill_loads", 0) == 0, (fn, entry)
