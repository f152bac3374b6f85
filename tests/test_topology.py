"""The NVLink mesh check on CPU: the decision over a pair matrix, and the NVML
reading through a fake pynvml (absent, failing, full mesh, partial mesh)."""

from __future__ import annotations

import sys
import types

import pytest

from tsgen.errors import RuntimeSetupError
from tsgen.runtime import topology
from tsgen.runtime.topology import check_full_mesh, mesh_problem

LABELS = [f"rank {r} (GPU {r})" for r in range(4)]


def _matrix(n, missing=()):
    """All pairs linked except the (i, j) in `missing` (one direction only)."""
    return [[i != j and (i, j) not in missing for j in range(n)] for i in range(n)]


def test_full_mesh_and_no_nvlink_at_all_pass():
    assert mesh_problem(LABELS, _matrix(4)) is None
    assert mesh_problem(LABELS, [[False] * 4 for _ in range(4)]) is None  # PCIe only: peer access decides
    assert mesh_problem(LABELS[:1], [[False]]) is None
    assert mesh_problem(LABELS[:2], [[False, False], [False, False]]) is None
    assert mesh_problem(LABELS[:2], _matrix(2)) is None


def test_partial_mesh_names_the_pair():
    msg = mesh_problem(LABELS, _matrix(4, missing={(1, 3), (3, 1)}))
    assert msg.startswith("rank 1 (GPU 1) and rank 3 (GPU 3) have no NVLink between them, but rank 0 (GPU 0) and "
                          "rank 1 (GPU 1) do: a partial NVLink mesh (5 of 6 pairs)")
    assert "TSGEN_ALLOW_PARTIAL_MESH=1" in msg


def test_one_way_link_counts_as_missing():
    msg = mesh_problem(LABELS[:3], _matrix(3, missing={(2, 0)}))
    assert msg.startswith("rank 0 (GPU 0) and rank 2 (GPU 2) have no NVLink between them")


def test_two_pairs_of_bridged_gpus_are_a_partial_mesh():
    bridged = [[(i // 2 == j // 2) and i != j for j in range(4)] for i in range(4)]  # 0-1 and 2-3 only
    assert mesh_problem(LABELS, bridged).startswith("rank 0 (GPU 0) and rank 2 (GPU 2) have no NVLink")


def fake_pynvml(links: set[frozenset], init_fails=False):
    calls = []
    m = types.ModuleType("pynvml")
    m.NVML_P2P_CAPS_INDEX_NVLINK, m.NVML_P2P_STATUS_OK, m.NVML_P2P_STATUS_NOT_SUPPORTED = 2, 0, 5

    def init():
        calls.append("init")
        if init_fails:
            raise RuntimeError("NVML Shared Library Not Found")

    def status(a, b, index):
        assert index == 2
        return 0 if frozenset((a, b)) in links else 5

    m.nvmlInit = init
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetHandleByPciBusId = lambda bus: bus
    m.nvmlDeviceGetP2PStatus = status
    return m, calls


BUS = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"]
ALL = {frozenset((a, b)) for a in BUS for b in BUS if a != b}


@pytest.fixture(autouse=True)
def _fresh_cache():
    topology.nvlink_matrix.cache_clear()
    yield
    topology.nvlink_matrix.cache_clear()


def test_nvml_full_mesh(monkeypatch):
    nvml, calls = fake_pynvml(ALL)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    check_full_mesh(BUS, env={})
    assert calls == ["init", "shutdown"]


def test_nvml_partial_mesh_is_refused(monkeypatch):
    nvml, calls = fake_pynvml(ALL - {frozenset((BUS[0], BUS[2]))})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(RuntimeSetupError) as e:
        check_full_mesh(BUS, env={})
    assert str(e.value).startswith("rank 0 (GPU 0000:18:00.0) and rank 2 (GPU 0000:3a:00.0) have no NVLink")
    assert calls == ["init", "shutdown"]
    check_full_mesh(BUS, env={"TSGEN_ALLOW_PARTIAL_MESH": "1"})  # asked for: runs anyway


def test_no_nvml_or_failing_nvml_falls_back_without_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    check_full_mesh(BUS, env={})
    topology.nvlink_matrix.cache_clear()
    nvml, calls = fake_pynvml(set(), init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    check_full_mesh(BUS, env={})
    assert calls == ["init"]


def test_two_gpus_never_ask_nvml(monkeypatch):
    nvml, calls = fake_pynvml(set())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    check_full_mesh(BUS[:2], env={})
    assert calls == []
