"""The parts of the runtime and harness that need no GPU: heap layout, array
checks, poison bytes, size parsing, and every op family's NumPy reference."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT, SPECS
from tsgen.bench import parse_size, parse_sizes
from tsgen.errors import RuntimeSetupError
from tsgen.harness import _poison_value, as_bits, poison_byte
from tsgen.ops import get_family
from tsgen.manifest import Buffer, KernelEntry, Manifest
from tsgen.runtime.world import ALIGN, check_array, layout, np_dtype

# ---------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------


def _buf(name, dtype, per_count, fixed, role="scratch", init=0):
    return Buffer(name, dtype, role, per_count=per_count, fixed=fixed, init=init)


def test_layout_offsets_sizes_and_order():
    buffers = [
        _buf("a", "uint8", 1, 0, "input"),  # 1000 B -> 1024
        _buf("empty", "uint32", 0, 0),  # 0 B, still its own slot
        _buf("sig", "uint64", 0, 1, "signal", init=0xFF),  # 8 B -> 256
        _buf("h", "float16", 2, 3, "output"),  # (2*1000+3)*2 = 4006 B -> 4096
        _buf("bf", "bfloat16", 1, 0),  # 2000 B -> 2048
    ]
    slots, heap = layout(buffers, 1000)
    assert [s.name for s in slots] == ["a", "empty", "sig", "h", "bf"]
    assert [s.elems for s in slots] == [1000, 0, 1, 2003, 1000]
    assert [s.nbytes for s in slots] == [1000, 0, 8, 4006, 2000]
    assert [s.offset for s in slots] == [0, 1024, 1280, 1536, 5632]
    assert heap == 5632 + 2048
    assert [s.role for s in slots] == ["input", "scratch", "signal", "output", "scratch"]
    assert slots[2].init_byte == 0xFF and slots[0].init_byte == 0


def test_layout_all_empty_and_no_buffers():
    slots, heap = layout([_buf("x", "uint8", 1, 0), _buf("y", "uint64", 1, 0)], 0)
    assert [s.offset for s in slots] == [0, ALIGN]
    assert heap == 2 * ALIGN
    assert layout([], 123) == ([], ALIGN)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
@pytest.mark.parametrize("count", [1, 17, 4000037])
def test_layout_of_shipped_manifests(path, count):
    manifest = json.loads((ROOT / "generated" / f"{path.stem}.json").read_text())
    slots, heap = Manifest.load(ROOT / "generated" / f"{path.stem}.json").layout(count)
    assert [s.name for s in slots] == [b["name"] for b in manifest["buffers"]]
    end = 0
    for s, b in zip(slots, manifest["buffers"]):
        assert s.offset % ALIGN == 0
        assert s.offset >= end, "slots overlap or are out of order"
        e = b["elems"]
        assert s.elems == (e["per_count"] + e["per_world_count"]) * count + e["fixed"]  # world 1
        assert s.nbytes == s.elems * np_dtype(b["dtype"]).itemsize
        end = s.offset + max(s.nbytes, 1)
    assert heap % ALIGN == 0 and end <= heap < end + ALIGN


# ---------------------------------------------------------------------------
# check_array
# ---------------------------------------------------------------------------


class FakeDevice:
    def __init__(self, id):
        self.id = id


class FakeArray:
    """What check_array looks at on a CuPy array."""

    def __init__(self, dtype, shape, device):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.size = int(np.prod(shape))
        self.device = FakeDevice(device)


def _check(array, dtype="float32", elems=12, device=1):
    check_array(array, name="src", rank=1, device=device, dtype=dtype, elems=elems)


def test_check_array_accepts_a_fitting_array():
    assert _check(FakeArray("float32", (12,), 1)) is None
    assert _check(FakeArray("float32", (3, 4), 1)) is None  # any shape of the right size
    assert _check(FakeArray("uint16", (12,), 1), dtype="bfloat16") is None


@pytest.mark.parametrize("array,message", [
    (np.zeros(12, np.float32),
     "buffer 'src' of rank 1: got a NumPy array on the host; pass a CuPy array on GPU 1"),
    ([0.0] * 12, "buffer 'src' of rank 1: got list; pass a CuPy array on GPU 1"),
    (FakeArray("float64", (12,), 1), "buffer 'src' of rank 1: dtype float64 but the kernel takes float32"),
    (FakeArray("float32", (3, 5), 1),
     "buffer 'src' of rank 1: 15 elements (shape (3, 5)) but this call needs 12"),
    (FakeArray("float32", (12,), 0), "buffer 'src' of rank 1: array is on GPU 0, rank 1 runs on GPU 1"),
], ids=["numpy", "list", "dtype", "size", "device"])
def test_check_array_refuses(array, message):
    with pytest.raises(RuntimeSetupError) as e:
        _check(array)
    assert str(e.value) == message
    assert e.value.exit_code == 2


def test_check_array_bfloat16_is_not_float16():
    with pytest.raises(RuntimeSetupError, match="dtype float16 but the kernel takes bfloat16"):
        _check(FakeArray("float16", (12,), 1), dtype="bfloat16")


# ---------------------------------------------------------------------------
# harness helpers
# ---------------------------------------------------------------------------


def test_poison_byte_changes_every_call():
    values = [poison_byte(c) for c in range(1000)]
    assert all(0 <= v <= 0xFF for v in values)
    assert all(a != b for a, b in zip(values, values[1:]))
    assert values[0] == 0x7D
    assert _poison_value(np.dtype("uint32"), 0) == 0x7D7D7D7D
    assert _poison_value(np.dtype("uint16"), 1) == poison_byte(1) * 0x0101


def test_poison_is_never_a_value_a_float_output_holds_by_right():
    """Every poison, as float16: NaN; as bfloat16 and float32: NaN or beyond 1e36."""
    from tsgen.ops.collectives import to_f64

    for call in range(16):
        for dtype, bits in (("float16", np.uint16), ("bfloat16", np.uint16), ("float32", np.uint32)):
            a = np.array([_poison_value(np.dtype(bits), call)], bits)
            v = to_f64(a if dtype == "bfloat16" else a.view(dtype), dtype)[0]  # bf16 travels as its bits
            assert np.isnan(v) or (dtype != "float16" and abs(v) > 1e36), (call, dtype, v)


def test_as_bits_is_an_exact_same_size_view():
    a = np.array([0.0, -0.0, np.nan], dtype=np.float32)
    a[2] = np.frombuffer(np.uint32(0x7FC00123).tobytes(), np.float32)[0]  # NaN with a payload
    bits = as_bits(a)
    assert bits.dtype == np.uint32
    assert bits.tolist() == [0, 0x80000000, 0x7FC00123]
    assert np.shares_memory(bits, a)
    assert as_bits(np.zeros(3, np.float16)).dtype == np.uint16
    assert as_bits(np.zeros(3, np.uint8)).dtype == np.uint8
    assert as_bits(np.zeros(3, np.int32)).dtype == np.uint32


# ---------------------------------------------------------------------------
# bench sizes
# ---------------------------------------------------------------------------


def test_parse_sizes():
    assert parse_sizes("1K:1M") == [1 << k for k in range(10, 21)]
    assert parse_sizes("1M,256M") == [1 << 20, 256 << 20]
    assert parse_sizes("1M:1G:4") == [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
    assert parse_sizes("3K:10K") == [3 << 10, 6 << 10]
    assert parse_sizes("4096") == [4096]
    assert parse_size("2KiB") == parse_size("2kb") == parse_size(" 2K ") == 2048


@pytest.mark.parametrize("text", ["abc", "1X", "1M,,2M", "-1K:1M", "1M:1G:x", "1M:1G:1", "1M:1G:0",
                                  "0:1M", "1G:1M", "1:2:3:4", ""])
def test_parse_sizes_rejects(text):
    with pytest.raises(RuntimeSetupError):
        parse_sizes(text)


# ---------------------------------------------------------------------------
# NumPy references (world 3) and inputs
# ---------------------------------------------------------------------------

W = 3


def _spec(op, **fields):
    base = {"name": "t", "op": op, "world_sizes": [2, 3, 4]}
    base.update(fields)
    return get_family(op).Spec.model_validate(base)


def _inputs(n=5):
    return [np.arange(n, dtype=np.uint32) + 100 * (r + 1) for r in range(W)]


def _put(src, shift=1):
    return {(r + shift) % W: src[r] for r in range(W)}  # dst rank -> expected


def _get(src, shift=1):
    return {r: src[(r + shift) % W] for r in range(W)}


REFERENCE_CASES = {
    "put_warp": (_spec("put_warp"), _put),
    "put_block": (_spec("put_block"), _put),
    "get_warp": (_spec("get_warp"), _get),
    "get_block": (_spec("get_block"), _get),
    "remote_st": (_spec("remote_st", params={"semantics": "release", "scope": "sys"}), _put),
    "remote_ld": (_spec("remote_ld", params={"semantics": "acquire", "scope": "gpu"}), _get),
    "signal_wait_peer": (_spec("signal_wait", params={"where": "peer"}), _put),
    "signal_wait_local": (_spec("signal_wait", params={"where": "local"}), lambda src: dict(enumerate(src))),
    "barrier_blocks": (_spec("barrier_blocks"), lambda src: dict(enumerate(src))),
    "barrier_all": (_spec("barrier_all"), _get),
    "simple_shift": (_spec("simple_shift"), _put),
}


def test_reference_cases_cover_every_primitive():
    from tsgen.ops import primitives

    assert {c[0].op for c in REFERENCE_CASES.values()} == {f.kind for f in primitives.FAMILIES}


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_reference(case):
    spec, expect = REFERENCE_CASES[case]
    src = _inputs()
    out = get_family(spec.op).reference(spec, W, 5, {"src": src})
    assert list(out) == ["dst"]
    want = expect(src)
    for rank in range(W):
        assert out["dst"][rank].tolist() == want[rank].tolist(), (case, rank)
        assert not np.shares_memory(out["dst"][rank], src[rank]), "reference must copy"


@pytest.mark.parametrize("op", ["put_block", "get_warp", "barrier_all", "simple_shift"])
def test_reference_shift_2(op):
    spec = _spec(op, world_sizes=[3], params={"shift": 2})
    src = _inputs()
    out = get_family(op).reference(spec, W, 5, {"src": src})["dst"]
    put = op in ("put_block", "simple_shift")
    for r in range(W):
        if put:
            assert out[(r + 2) % W].tolist() == src[r].tolist()
        else:
            assert out[r].tolist() == src[(r + 2) % W].tolist()


SIMPLE_SHIFT_DTYPES = ["uint8", "int32", "uint32", "float32", "float16", "bfloat16"]


def _bits(a):
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_pattern_inputs_differ_across_ranks(case):
    spec, _ = REFERENCE_CASES[case]
    family = get_family(spec.op)
    count = 1000
    inputs = family.make_inputs(spec, W, count, np.random.default_rng(0), pattern=True)
    assert set(inputs) == {b.name for b in family.buffers(spec) if b.role == "input"}
    for name, per_rank in inputs.items():
        assert len(per_rank) == W
        bits = [_bits(a) for a in per_rank]
        n = next(b for b in family.buffers(spec) if b.name == name).elems(count)
        assert all(b.size == n for b in bits)
        for a in range(W):
            for b in range(a + 1, W):
                assert not np.any(bits[a] == bits[b]), (case, name, a, b)


@pytest.mark.parametrize("dtype", SIMPLE_SHIFT_DTYPES)
def test_pattern_inputs_every_dtype(dtype):
    """Pattern values encode (rank, index): distinct across ranks and along a rank
    (within the pattern's period), finite for float types."""
    spec = _spec("simple_shift", dtype=dtype)
    family = get_family("simple_shift")
    n = 2048
    src = family.make_inputs(spec, 8, n, np.random.default_rng(0), pattern=True)["src"]
    assert all(a.dtype == np_dtype(dtype) for a in src)
    bits = [_bits(a) for a in src]
    if dtype == "uint8":  # 8 bits: only the same index must differ across ranks
        for a in range(8):
            for b in range(a + 1, 8):
                assert not np.any(bits[a] == bits[b]), (a, b)
    else:
        assert len(np.unique(np.concatenate(bits))) == 8 * n
    if dtype in ("float32", "float16"):
        assert all(np.isfinite(a).all() for a in src)
    if dtype == "bfloat16":  # exponent all ones = inf / NaN
        assert all(((b >> 7) & 0xFF != 0xFF).all() for b in bits)


def test_random_inputs_are_seeded():
    spec = _spec("simple_shift", dtype="float16")
    family = get_family("simple_shift")
    a = family.make_inputs(spec, W, 100, np.random.default_rng([0, 1]), pattern=False)["src"]
    b = family.make_inputs(spec, W, 100, np.random.default_rng([0, 1]), pattern=False)["src"]
    c = family.make_inputs(spec, W, 100, np.random.default_rng([0, 2]), pattern=False)["src"]
    assert all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(a, b))
    assert not np.array_equal(_bits(a[0]), _bits(c[0]))
    assert not np.array_equal(_bits(a[0]), _bits(a[1]))


class _Log:
    """A fake CuPy whose streams, events and device switches append to one log."""

    def __init__(self):
        self.log, self.device = [], 0
        outer = self

        class Stream:
            def __init__(self, name):
                self.name, self.ptr = name, id(self)

            def record(self):
                outer.log.append(("record", self.name))
                return self.name

            def wait_event(self, event):
                outer.log.append(("wait", self.name, event))

        class Device:
            def __init__(self, dev):
                self.dev = dev

            def __enter__(self):
                outer.device = self.dev

            def __exit__(self, *exc):
                return False

        self.Stream = Stream
        self.current = {0: Stream("current0"), 1: Stream("current1")}
        self.cuda = type("cuda", (), {"Device": Device,
                                      "get_current_stream": staticmethod(lambda: self.current[self.device])})


def test_launch_is_ordered_with_the_callers_streams_without_ranks_waiting_for_each_other():
    """Module.launch without `streams`: every rank stream waits for its device's current stream
    BEFORE any launch (ranks sharing GPU 0 must not wait for each other's kernels), and each
    current stream waits for its ranks AFTER all launches. With `streams`, no ordering is added.
    (On a GPU: tests/test_gemm_gpu.py writes inputs and poison with CuPy on the current stream
    and launches at once; before this ordering its outputs raced the poison.)"""
    from tsgen.runtime.world import Module

    fake = _Log()
    devices = {0: 0, 1: 0, 2: 1}  # ranks 0 and 1 share GPU 0
    streams = {r: fake.Stream(f"rank{r}") for r in devices}
    world = type("W", (), {"cp": fake, "devices": devices, "ranks": sorted(devices), "streams": streams,
                           "launched": {}})()
    module = object.__new__(Module)
    module.world, module.launcher, module.manifest = world, None, type("M", (), {"name": "k"})()
    module.kernel = KernelEntry("k_w3", "k_w3_launch", 3, (1, 1, 1), (32, 1, 1), 0, (), ())
    module.functions = {r: (lambda r: lambda *a, **k: fake.log.append(("launch", f"rank{r}")))(r) for r in devices}
    bufs = type("B", (), {"arg_values": staticmethod(lambda args, rank: [])})()

    module.launch(bufs)
    assert world.launched == {0: "k/k_w3", 1: "k/k_w3", 2: "k/k_w3"}  # what World.synchronize names on a failure
    kinds = [e[0] for e in fake.log]
    first_launch, last_launch = kinds.index("launch"), len(kinds) - 1 - kinds[::-1].index("launch")
    before, after = fake.log[:first_launch], fake.log[last_launch + 1:]
    assert ("wait", "rank0", "current0") in before and ("wait", "rank1", "current0") in before
    assert ("wait", "rank2", "current1") in before
    assert not any(e[0] == "wait" and e[1].startswith("rank") for e in fake.log[first_launch:])
    assert {e[2] for e in after if e[0] == "wait" and e[1] == "current0"} == {"rank0", "rank1"}
    assert {e[2] for e in after if e[0] == "wait" and e[1] == "current1"} == {"rank2"}

    fake.log.clear()
    module.launch(bufs, streams=streams)
    assert [e[0] for e in fake.log] == ["launch"] * 3


def test_host_launch_modules_prepare_every_rank_before_any_call():
    """prepare(rank, device) for every rank this process drives, in rank order; a failure names
    the rank, the GPU, the entry point and the module."""
    import contextlib

    from tsgen.runtime.world import prepare_ranks

    calls = []

    @contextlib.contextmanager
    def scope(device):
        calls.append(("enter", device))
        yield
        calls.append(("exit", device))

    prepare_ranks(lambda r, d: calls.append((r, d)) or 0, "m_w4_prepare", {2: 0, 0: 0, 3: 1, 1: 1}, "m", scope)
    assert calls == [x for r, d in [(0, 0), (1, 1), (2, 0), (3, 1)] for x in (("enter", d), (r, d), ("exit", d))]
    with pytest.raises(RuntimeSetupError, match=r"rank 1: m_w4_prepare failed with cudaError 101 \(m, GPU 1\)"):
        prepare_ranks(lambda r, d: 101 if r == 1 else 0, "m_w4_prepare", {0: 0, 1: 1}, "m", scope)


def test_every_shipped_launcher_with_side_streams_has_a_prepare():
    """A generated source whose host launcher makes per-rank side streams (the lanes of
    tsgen/fused.cuh, tsgen/grid.cuh, tsgen/ce.cuh) names a prepare for every world size, and the
    source defines each prepare named (docs/lab/shared_gpu.md, 2026-11-26: made at a first call,
    a stream stalled it)."""
    lanes_made = 0
    for source in sorted((ROOT / "generated").glob("*.cu")):
        manifest = json.loads(source.with_suffix(".json").read_text())
        text = source.read_text()
        if "lanes(rank, &l)" in text or "lanes_get(rank, &lanes)" in text:
            lanes_made += 1
            assert all(k.get("prepare") for k in manifest["kernels"]), source.name
        for k in manifest["kernels"]:
            if k.get("prepare"):
                assert f'extern "C" cudaError_t {k["prepare"]}(int rank, int device)' in text, (source.name, k["name"])
    assert lanes_made >= 5  # fused, cp_attention, cannon / summa, copy-engine collectives


def test_a_context_refused_by_mps_says_why_and_what_to_do(tmp_path):
    """Measured on one H200 under MPS (docs/lab/shared_gpu.md, 2026-11-26): with
    CUDA_DEVICE_MAX_CONNECTIONS=32 in every rank, the 4th process's first stream failed with
    cudaErrorMemoryAllocation. The message must name MPS and the variable, not only 'out of memory'."""
    from tsgen.runtime.world import context_failure

    (tmp_path / "control").write_text("")
    mps = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    error = RuntimeError("cudaErrorMemoryAllocation: out of memory")
    text = context_failure(error, {2: 0}, True, {**mps, "CUDA_DEVICE_MAX_CONNECTIONS": "32"})
    assert text.startswith("rank 2 on GPU 0: creating the CUDA context failed: cudaErrorMemoryAllocation")
    assert "under MPS this may be how the server turned this client away" in text
    assert "Reached maximum number of device connections" in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32; unset it" in text
    assert "run fewer processes per GPU, or stop other MPS clients" in context_failure(error, {2: 0}, True, mps)
    # not a shared world of processes, or no MPS daemon: the CUDA error alone, no guess
    plain = "rank 2 on GPU 0: creating the CUDA context failed: cudaErrorMemoryAllocation: out of memory"
    assert context_failure(error, {2: 0}, False, mps) == plain
    other = RuntimeError("cudaErrorInvalidDevice: invalid device ordinal")  # not how MPS refuses: no guess
    assert "MPS" not in context_failure(other, {2: 0}, True, {**mps, "CUDA_DEVICE_MAX_CONNECTIONS": "32"})
    assert context_failure(error, {2: 0}, True, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}) == plain


def test_host_launchers_of_ranks_sharing_a_gpu_run_in_rank_order_on_the_callers_thread():
    """Where ranks share a GPU and the launcher has no side streams (no prepare), every rank's host
    launcher is called from the caller's thread in rank order (measured: from a thread per rank,
    moe_ll's first call on one GPU hung in most runs at W 4 and W 8, docs/lab/shared_gpu.md,
    2026-11-26); one rank per GPU, or a launcher with side streams, keeps a thread per rank."""
    import threading

    from tsgen.runtime.world import Module, sequential_launch

    assert sequential_launch({0: 0, 1: 0}, [0, 1], side_streams=False)
    assert not sequential_launch({0: 0, 1: 0}, [0, 1], side_streams=True)
    assert not sequential_launch({0: 0, 1: 1}, [0, 1], side_streams=False)

    fake = _Log()
    for devices, prepare, on_caller in [({0: 0, 1: 0, 2: 0, 3: 0}, None, True), ({0: 0, 1: 1}, None, False),
                                        ({0: 0, 1: 0}, "k_prepare", False)]:
        seen = []
        world = type("W", (), {"cp": fake, "devices": devices, "ranks": sorted(devices), "launched": {},
                               "streams": {r: fake.Stream(f"rank{r}") for r in devices}})()
        module = object.__new__(Module)
        module.world, module._pool, module._registered = world, None, []
        module.manifest = type("M", (), {"name": "k"})()
        module.kernel = KernelEntry("k_w4", "k_w4_launch", 4, (1, 1, 1), (32, 1, 1), 0, (), (), prepare or "")
        module._host_launch = lambda buffers, rank, stream, *entry, seen=seen: seen.append((rank, threading.get_ident()))
        module.launcher = object()
        module.launch(None, streams=world.streams)
        module.close()
        assert sorted(r for r, _ in seen) == sorted(devices)
        if on_caller:
            assert seen == [(r, threading.get_ident()) for r in sorted(devices)]
        else:
            assert all(t != threading.get_ident() for _, t in seen)


def test_a_context_refused_for_memory_is_tried_again_after_the_gpus_turn(tmp_path):
    """Where test processes take turns on a GPU (TSGEN_GPU_LOCK), a first context refused for memory
    waits for the lock and is tried again; other errors, MPS ranks and a run without the lock raise
    at once; after CONTEXT_TRIES the error stands."""
    from tsgen.runtime.world import CONTEXT_TRIES, first_streams

    class Err(Exception):
        pass

    def failing(n, text="cudaErrorMemoryAllocation: out of memory"):
        tries = []

        def make():
            tries.append(1)
            if len(tries) <= n:
                raise Err(text)
            return {0: "stream"}
        return make, tries

    env, naps = {"TSGEN_GPU_LOCK": str(tmp_path / "gpu.lock")}, []
    make, tries = failing(2)
    assert first_streams(make, Err, False, env, naps.append) == {0: "stream"} and len(tries) == 3
    assert naps == [1.0, 2.0]
    for args in [(False, {}), (True, env)]:  # no lock; ranks of processes (MPS)
        make, tries = failing(1)
        with pytest.raises(Err):
            first_streams(make, Err, args[0], args[1], naps.append)
        assert len(tries) == 1
    make, tries = failing(1, "cudaErrorInvalidDevice")
    with pytest.raises(Err):
        first_streams(make, Err, False, env, naps.append)
    make, tries = failing(CONTEXT_TRIES)
    with pytest.raises(Err):
        first_streams(make, Err, False, env, naps.append)
    assert len(tries) == CONTEXT_TRIES
