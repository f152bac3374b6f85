import os
import zlib
from pathlib import Path

# One BLAS thread per test process, set before NumPy loads: pytest-xdist already runs a process
# per core, and OpenBLAS threads spinning beside them made NumPy-heavy tests 10x slower (the
# simulated attention benches: 36 s instead of 4 s on a busy 2-core machine).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))

# Never let anything this test suite starts use NVLink multicast (tsgen/env.py names the variables).
from tsgen.env import force_no_multicast  # noqa: E402

force_no_multicast()


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


# TSGEN_SPREAD_GPUS=0,1 (tools/gpu_gate.sh SPREAD=1 on a machine of several GPUs, with TSGEN_SHARE_GPUS=1):
# each pytest-xdist worker sees one of those GPUs, round robin, before anything touches CUDA, so the
# shared-GPU suite (every world on one GPU) runs on all of them at once, each GPU with its own turn lock.
_SPREAD = os.environ.get("TSGEN_SPREAD_GPUS", "")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _SPREAD and _WORKER.startswith("gw"):
    _gpus = _SPREAD.split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[int(_WORKER[2:]) % len(_gpus)]

if os.environ.get("TSGEN_SHARE_GPUS") == "1":
    # test processes (pytest -n N) compile in parallel and take turns on the shared GPU (harness.gpu_turn)
    _gpu = f"-gpu{os.environ['CUDA_VISIBLE_DEVICES']}" if _SPREAD and _WORKER else ""
    os.environ.setdefault("TSGEN_GPU_LOCK", f"/tmp/tsgen-gpu-{os.getuid()}{_gpu}.lock")
    from tsgen.env import shared_gpu_env

    shared_gpu_env()  # before any CUDA call: queues and eager module loading (tsgen/env.py)


def gate_part() -> tuple[int, int] | None:
    """TSGEN_GATE_PART=k/n (tools/gpu_gate.sh PART=k/n): this run is part k of n of the GPU suite,
    so that a gate longer than one device call runs over n calls; None when unset."""
    part = os.environ.get("TSGEN_GATE_PART", "")
    if not part:
        return None
    k, _, n = part.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"TSGEN_GATE_PART={part!r}: expected k/n with 1 <= k <= n, e.g. 1/2")
    return int(k), int(n)


def exhaustive(*values, id=None):
    """One case of a parametrized sweep that the default run leaves out (marked `exhaustive`): the
    rest of a sweep whose representative cases run everywhere. `-m exhaustive` runs them (the GPU gate,
    tools/gpu_gate.sh, does, on its 16 cores); any other run deselects them, saying how many."""
    return pytest.param(*values, id=id, marks=pytest.mark.exhaustive)


def representative(names, keep) -> list:
    """`names` as pytest cases: those in `keep` run by default, the others are `exhaustive`. Each of
    `keep` must be among `names` (a renamed case fails here, it does not move every case away)."""
    names = list(names)
    assert set(keep) <= set(names), f"representative cases {sorted(set(keep) - set(names))} not in {names}"
    return [name if name in keep else exhaustive(name, id=name) for name in names]


def shared_build_cases(paths) -> list:
    """(mode, path) cases of a build sweep over shipped specs that the runtime loads as shared libraries (their
    manifests' compile mode): "shared" runs by default (the module `tsgen build specs --compile` left in the
    compile cache); "cubin", the same device code through nvcc a second time, is `exhaustive`. The SASS tests
    of those specs read the shared library (cuobjdump lists the same kernels)."""
    return [pytest.param(mode, path, id=f"{mode}-{path.stem}", marks=[pytest.mark.exhaustive] if mode == "cubin" else [])
            for mode in ("cubin", "shared") for path in paths]


def _keeps_exhaustive(config) -> bool:
    """Whether this run selects the `exhaustive` cases: only when its -m expression names the marker."""
    return "exhaustive" in (config.getoption("markexpr", "") or "")


_LEFT_OUT = ("`exhaustive` cases deselected (the rest of the plan sweep, of the build sweeps and of the fuzzers): "
             "-m exhaustive runs them")


def pytest_report_header(config):
    if not _keeps_exhaustive(config):
        return _LEFT_OUT


def pytest_terminal_summary(terminalreporter, config):
    """Said at the end too (under pytest-xdist the deselection happens in the workers, out of the tally)."""
    if not _keeps_exhaustive(config) and not config.getoption("collectonly", False):
        terminalreporter.write_line(_LEFT_OUT)


def pytest_collection_modifyitems(config, items):
    """The `exhaustive` cases are deselected unless the -m expression names that marker (see `exhaustive`).
    Under TSGEN_GATE_PART=k/n keep the tests whose id's CRC-32 is k - 1 modulo n: the parts are
    disjoint, together they are the whole suite, and a test stays in its part from run to run."""
    if not _keeps_exhaustive(config):
        rest = [item for item in items if item.get_closest_marker("exhaustive") is None]
        if len(rest) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("exhaustive")])
            items[:] = rest
    part = gate_part()
    if part is None:
        return
    k, n = part
    keep, dropped = [], []
    for item in items:
        (keep if zlib.crc32(item.nodeid.encode()) % n == k - 1 else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def sharing() -> bool:
    """TSGEN_SHARE_GPUS=1: worlds larger than the machine's GPU count run with ranks sharing
    GPUs (docs/testing.md "Testing on one GPU"); with enough GPUs every rank still gets its own."""
    return os.environ.get("TSGEN_SHARE_GPUS") == "1"


def need_gpus(n: int, processes: bool = False):
    """Skip unless a world of `n` ranks can run here: n GPUs, or one GPU shared by the ranks
    (TSGEN_SHARE_GPUS=1). `processes`: one process per rank, which may share a GPU only
    under MPS (without it they are time-sliced and never resident together)."""
    have = gpu_count()
    if have >= n:
        return
    if not sharing() or have == 0:
        pytest.skip(f"needs {n} GPUs with CuPy (or TSGEN_SHARE_GPUS=1 and one GPU); this machine has {have}")
    from tsgen.runtime.placement import mps_active

    if processes and not mps_active():
        pytest.skip(f"{n} processes sharing {have} GPU(s) need the MPS daemon (nvidia-cuda-mps-control -d)")


@pytest.fixture(autouse=True)
def _chdir_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# Compiling: tests use the compile cache `tsgen build --compile` fills (TSGEN_CACHE_DIR, else
# ~/.cache/tsgen), so the sources it compiled are not compiled again; a test that must see a
# compile happen uses `own_cache`.


def missing_tool(find) -> str | None:
    """Why a tool is missing (the ToolchainError `find()` raises), or None when it is there."""
    from tsgen.errors import ToolchainError

    try:
        find()
        return None
    except ToolchainError as e:
        return str(e)


def rendered_source(loaded, out):
    """Render a loaded spec into folder `out` (its .cu and .json); the .cu's path."""
    from tsgen.render import render

    r = render(loaded, base=out)
    for name, text in r.files().items():
        (out / name).write_text(text)
    return out / f"{r.name}.cu"


def host_program(loaded, main: str, out, name: str, module: str | None = None):
    """A host executable of a spec's header functions: `loaded` rendered into `out`, then `main` (a C++ program
    whose "SOURCE" is replaced by the rendered .cu's path and "MODULE", where given, by `module`) compiled by nvcc
    for sm_90a as out/name; its path."""
    import subprocess

    from tsgen.headers import include_flags
    from tsgen.toolchain import find_nvcc, gencode_flags

    source = rendered_source(loaded, out)
    text = main.replace("SOURCE", str(source))
    if module is not None:
        text = text.replace("MODULE", module)
    (out / f"{name}.cu").write_text(text)
    exe = out / name
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(out / f"{name}.cu")], check=True, capture_output=True)
    return exe


def load_script(path: Path):
    """A script that is not a package module (tools/*.py, tests/torch_checks.py), imported from its
    file under its stem's name, for tests of its pieces that need no GPU."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPEC_HEAD = "# yaml-language-server: $schema=../schema/tsgen.schema.json\n"


def spec_problems(tmp_path, text: str) -> list[str]:
    """The loader's problems for a spec file holding `text` (under the schema line), with the
    file's path taken off: `LINE:COL: field: message`. [] when it loads."""
    from tsgen.errors import SpecError
    from tsgen.spec import load_spec

    path = tmp_path / "bad.yaml"
    path.write_text(SPEC_HEAD + text)
    try:
        load_spec(path)
    except SpecError as e:
        return [p.removeprefix(f"{path}:") for p in e.problems]
    return []


def compile_test(missing: str | None):
    """Decorator for a test that runs nvcc: marks it `compile`, and skips it with `missing`
    as the reason when that says a tool is missing (None: nothing is)."""

    def mark(test):
        return pytest.mark.compile(pytest.mark.skipif(missing is not None, reason=str(missing))(test))

    return mark


def _installed_nvcc() -> Path | None:
    from tsgen.toolchain import find_nvcc

    return None if missing_tool(find_nvcc) else find_nvcc().resolve()


_NVCC = _installed_nvcc()


@pytest.fixture(autouse=True)
def _nvcc_only_in_compile_tests(request, monkeypatch):
    """The inner loop deselects the `compile` tests: a test without that marker that starts the
    installed nvcc in this process (to compile; `nvcc --version` is cheap) fails, saying so. A
    child process that runs nvcc (a tool, `python -m tsgen build --compile`) is beyond this check.
    GPU tests compile what they run: the inner loop never runs them (they skip without a GPU)."""
    if _NVCC is None or any(request.node.get_closest_marker(m) is not None for m in ("compile", "gpu")):
        return
    import subprocess

    class Popen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            argv = [args] if isinstance(args, (str, os.PathLike)) else list(args)
            if (Path(argv[0]).name == "nvcc" and "--version" not in argv
                    and Path(argv[0]).resolve() == _NVCC):
                raise AssertionError(f"{request.node.nodeid} runs nvcc: mark it `compile` (conftest.compile_test)")
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Popen)


# -- tsgen.torch on CPU (tests/test_torch_cpu.py, tests/test_torch_attention_cpu.py): torch imported lazily

def fake_mode():
    """FakeTensorMode taking real tensors too: tsgen.torch's fake kernels run without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_groups(other: bool = False):
    """A fake world of 8 ranks (this process is rank 0) and groups of 2, 4 and 5 ranks in it (and,
    `other`, a group [1, 2] rank 0 is not in), for a module fixture: yields the groups, then closes
    every tsgen.torch op and the world."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tsgen.torch as tt

    if dist.is_initialized():  # pragma: no cover - another test left one behind
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    made = {n: dist.new_group(list(range(n))) for n in (2, 4, 5)}
    if other:
        made["other"] = dist.new_group([1, 2])  # rank 0 is not in it
    yield made
    tt.close_all()
    dist.destroy_process_group()


def aot_graphs(make):
    """torch.compile(fullgraph=True) with AOTAutograd of `fn` on `args`, where (fn, args) = make() is
    called under FakeTensorMode (CPU fake tensors: autograd on fake CUDA tensors needs a CUDA build);
    the output summed and backpropagated. Returns (args, output, the call targets of the forward
    graph, of the backward graph)."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    fw, bw = [], []

    def keep(store):
        def compiler(gm, example_inputs):
            store.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    with fake_mode():
        fn, args = make()
        y = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep(fw), bw_compiler=keep(bw)))(*args)
        y.sum().backward()
    return args, y, *([str(n.target) for n in g[0].graph.nodes if n.op == "call_function"] for g in (fw, bw))


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty compile cache of this test's own."""
    d = tmp_path / "tsgen-cache"
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(d))
    return d


class CliResult:
    def __init__(self, code: int, stdout: str, stderr: str):
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def __repr__(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.stdout}--- stderr\n{self.stderr}"


def run_cli(*args: str) -> CliResult:
    """`tsgen ARGS` in this process (click's CliRunner), in the current folder:
    exit code, stdout and stderr apart. Unexpected exceptions propagate."""
    from click.testing import CliRunner

    from tsgen.cli import main

    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart by itself
    r = runner.invoke(main, [str(a) for a in args], catch_exceptions=False)
    return CliResult(r.exit_code, r.stdout, r.stderr)


# ---------------------------------------------------------------------------
# Several ranks in one process (threads), meeting through a real store on localhost
# ---------------------------------------------------------------------------


def localhost_ranks(size: int, port: int | None = None, timeout: float = 10.0, store: str = "tsgen"):
    """One Rendezvous per rank, each connected from its own thread (rank 0 serves)."""
    import threading

    from tsgen.launch import free_port
    from tsgen.runtime.store import connect

    env = {"TSGEN_STORE": store, "TSGEN_STORE_TIMEOUT": str(timeout), "TSGEN_STORE_SECRET": "test secret"}
    port = port or free_port()
    out = [None] * size

    def join(r):
        out[r] = connect("127.0.0.1", port, r, size, env)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out), "a rank failed to connect"
    return out


def together(items, fn, timeout: float = 60):
    """fn(rank, item) for every item at once, one thread each; results (or the
    exception raised) in rank order."""
    import threading

    results = [None] * len(items)

    def run(r):
        try:
            results[r] = fn(r, items[r])
        except Exception as e:  # noqa: BLE001 -- returned to the test
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,), name=f"rank {r}") for r in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def close_ranks(rendezvous):
    for rv in reversed(rendezvous):  # rank 0 (the server) last
        rv.close()


@pytest.fixture(autouse=True)
def _leave_with_a_dead_context(request):
    """After a GPU test whose kernel trapped or faulted, this process's CUDA context is dead and
    every later test in it would fail with the same sticky error: end the process, so that
    pytest-xdist replaces the worker (the test is reported as crashed) and the rest run."""
    yield
    if request.node.get_closest_marker("gpu") is None or gpu_count() == 0:
        return
    import cupy

    try:
        for d in range(cupy.cuda.runtime.getDeviceCount()):
            with cupy.cuda.Device(d):
                cupy.cuda.runtime.deviceSynchronize()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            print(f"\n{request.node.nodeid}: CUDA context lost ({e}); ending this worker", flush=True)
            os._exit(3)
