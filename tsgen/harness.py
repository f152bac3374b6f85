"""`tsgen test` and `tsgen bench`: run a spec on GPUs against its reference.

Each call: fresh seeded inputs on every rank (call 0 uses an integer
pattern that makes a misplaced chunk visible), outputs poisoned with a byte
that changes from call to call, one launch on every rank, then every output
compared bit for bit with the NumPy reference. Signals are never reset
between calls: the epoch just counts up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import KernelFailed, RuntimeSetupError
from .headers import amalgamate
from .printed import device_output, flush_stdout
from .manifest import Manifest
from .ops import get_family
from .render import render
from .spec import LoadedSpec, describe_variant, load_spec, spec_variant
from .toolchain import write_cached


def shared_gpu_variant(loaded: LoadedSpec, world, echo: Callable[[str], None]) -> LoadedSpec:
    """In a world whose ranks share GPUs: the spec variant whose co-located grids are all
    resident at once (fit_shared), the spec itself when it fits as it is. Says what it ran."""
    if not world.shared:
        return loaded
    refuse_shared(loaded)  # before the device is asked anything
    sms = world.cp.cuda.runtime.getDeviceProperties(world.devices[world.ranks[0]])["multiProcessorCount"]
    variant, fitted = fit_shared(loaded, world.colocated, sms, world.size)
    if world.is_root:
        echo(f"shared GPU: {world.size} ranks on {len(set(world.backend.bus_ids))} GPU(s), up to "
             f"{world.colocated} per GPU of {sms} SMs; {fitted}")
    return variant


def refuse_shared(loaded: LoadedSpec) -> None:
    """RuntimeSetupError where the spec's family does not run on a shared GPU (OpFamily.shared_refusal)."""
    refusal = get_family(loaded.model.op).shared_refusal(loaded.model)
    if refusal:
        raise RuntimeSetupError(f"{loaded.path}: {refusal}")


def fit_shared(loaded: LoadedSpec, colocated: int, sms: int, world_size: int) -> tuple[LoadedSpec, str]:
    """(variant, what it is) for `colocated` ranks on each GPU of `sms` SMs: the spec variant whose
    co-located grids are all resident at once (OpFamily.shared_fit: one block per SM, whatever the
    kernel's occupancy), checked like a shipped spec, its plan verified on the CPU at `world_size`;
    the spec itself when it fits as it is. RuntimeSetupError where the family refuses shared GPUs
    or the fitted plan fails. tsgen test --share-gpus and tsgen.torch.load (TSGEN_SHARE_GPUS=1)."""
    refuse_shared(loaded)
    updates = get_family(loaded.model.op).shared_fit(loaded.model, colocated, sms)
    if not updates:
        return loaded, "the spec fits as it is"
    variant = spec_variant(loaded, updates)
    fitted = f"fitted variant: {describe_variant(updates)}"
    plan = variant.plans.get(world_size)  # built when the variant was validated
    if plan is not None:
        from .plan.verifier import verify as verify_plan

        problems = verify_plan(plan, schedules=4, seed=0)
        if problems:
            raise RuntimeSetupError(f"{loaded.path}: the {fitted} fails plan verification at world size "
                                    f"{world_size}: {problems[0]}")
        fitted += " (plan verified)"
    return variant, fitted


@dataclass(frozen=True)
class CachedModule:
    """A lowered spec rendered into the cache: its manifest (in memory) and its source's path;
    World.load(module.manifest, source=module.source) loads it."""

    manifest: Manifest
    source: Path


def render_to_cache(loaded: LoadedSpec, skew: int | str | None = None) -> CachedModule:
    """Lower and render the spec and write its source into the cache (so tests always match
    the spec); the manifest stays in memory. `skew`: render the test-only rank skew with this
    seed (render's `skew`)."""
    rendered = render(loaded, base=loaded.path.resolve().parent.parent, skew=skew)
    folder = ("render", loaded.sha256[:16] + ("" if skew is None else f"-skew{skew}"))
    return CachedModule(rendered.lowered.manifest, write_cached(folder, f"{rendered.name}.cu", rendered.source))


def materialize(loaded: LoadedSpec, skew: int | str | None = None) -> Path:
    """render_to_cache, and the manifest written beside the source: its path, for tools that
    load a module by path (World.load(path)) or read its files."""
    module = render_to_cache(loaded, skew)
    return write_cached(("render", module.source.parent.name), f"{module.source.stem}.json",
                        module.manifest.to_json())


_TURN = threading.local()  # .depth: gpu_turn blocks this thread is inside (an inner one holds nothing new)


@contextlib.contextmanager
def gpu_turn(world=None):
    """Hold the GPU alone while this block runs, when TSGEN_GPU_LOCK names a lock file (the test
    suite sets it when ranks share GPUs): test processes then compile in parallel and take turns
    on the GPU, so one test's grids never take the SMs another's ranks need to be resident.
    A rank of a world of several processes never takes it (its peers would wait on it): the
    test that starts them does (tests/test_gpu_ipc.py, through run_in_turn). Inside a turn of its
    own thread, a turn is already held: the inner block runs as it is (a second flock of the same
    file from this process would wait on the first forever). The time queued is not counted by a
    test's time limit (_paused_alarm), and every turn is logged (_log_turn)."""
    path = os.environ.get("TSGEN_GPU_LOCK")
    depth = getattr(_TURN, "depth", 0)
    if not path or depth or (world is not None and world.backend.store is not None):
        yield
        return
    from .files import held_lock

    with contextlib.ExitStack() as held:
        asked = time.monotonic()
        try:
            with _paused_alarm():
                held.enter_context(held_lock(Path(path)))  # in /tmp: never through a planted symlink
        except OSError as e:
            raise RuntimeSetupError(f"TSGEN_GPU_LOCK={path}: {e.strerror or e}") from None
        got = time.monotonic()
        _TURN.depth = 1
        try:
            yield
        finally:
            _TURN.depth = 0
            _log_turn(got - asked, time.monotonic() - got)


def run_in_turn(cmd: list[str], **kwargs):
    """subprocess.run(cmd, **kwargs) while this process holds the GPU's turn (gpu_turn), the child
    running without TSGEN_GPU_LOCK (it must not queue for the turn its parent holds, nor wait for
    it when its context is refused for memory: runtime/world.py first_streams): a child's time
    limit (timeout=) then bounds its own work, never a wait for other tests' turns."""
    import subprocess

    given = kwargs.pop("env", None)
    env = {k: v for k, v in (os.environ if given is None else given).items() if k != "TSGEN_GPU_LOCK"}
    with gpu_turn():
        return subprocess.run(cmd, env=env, **kwargs)


# How long a test's SIGALRM timer is pushed out while the test queues for the GPU's turn.
TURN_WAIT_CAP_S = 3600.0


@contextlib.contextmanager
def _paused_alarm():
    """The block (a wait for the GPU's turn) does not count against an armed SIGALRM timer
    (pytest-timeout's per-test limit, its signal method; tools/gpu_gate.sh asks for that method):
    the timer is pushed out by TURN_WAIT_CAP_S during the block and set back to what was left
    before it. A test whose calls each queue behind a dozen other test processes may wait minutes
    in all, and flock serves waiters in no order. The main thread's only: the timer is the
    process's, and a test's limit is its main thread's; no timer armed: nothing to do."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    left, interval = signal.getitimer(signal.ITIMER_REAL)
    if left <= 0:
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, left + TURN_WAIT_CAP_S, interval)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, left, interval)


def _log_turn(waited: float, held: float) -> None:
    """One line per GPU turn in $TSGEN_RESULTS_DIR/gpu_turn.jsonl (the gate's logs): which test, how
    long it queued, how long it held the GPU. A log that cannot be written is skipped: it must not
    replace the test's own outcome."""
    out = os.environ.get("TSGEN_RESULTS_DIR")
    if out:
        row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "pid": os.getpid(),
               "waited_s": round(waited, 3), "held_s": round(held, 3)}
        try:
            with open(os.path.join(out, "gpu_turn.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError:
            pass


# The byte written over every output before call `call` (POISON_BYTES[call % 8]; neighbours
# differ, so a value left from the call before is told apart). Repeated to fill an element, each
# is NaN as a float16, NaN or beyond 1e36 in magnitude as a bfloat16 or float32: no output
# compared within a tolerance can hold it by right, so an element that holds it was not written.
# (An arithmetic byte sequence made call 9's poison 0xB8B8 = -8.8e-5 in bfloat16, a value
# attention outputs took by right: one element in a few million was then counted unwritten.)
POISON_BYTES = (0x7D, 0xFE, 0x7C, 0xFF, 0x7E, 0xFD, 0x7F, 0xFC)


def poison_byte(call: int) -> int:
    return POISON_BYTES[call % len(POISON_BYTES)]


def as_bits(a: np.ndarray) -> np.ndarray:
    """Same-size unsigned view: compare exactly, NaN payloads included."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@dataclass
class RankTally:
    wrong: int = 0
    checked: int = 0
    first: list[str] = field(default_factory=list)
    bad_calls: list[int] = field(default_factory=list)  # the calls with a wrong element, in order


def run_test(
    spec_path: str | Path,
    gpus: int | None = None,
    count: int | None = None,
    iters: int | None = None,
    seed: int = 0,
    arch: str = "sm_90a",
    echo: Callable[[str], None] = print,
    mutate: Callable[[str], str] | None = None,
    dtype: str | None = None,
    backend: str = "single",
    before_launch: Callable[[int], None] | None = None,
    share_gpus: bool | None = None,
    skew: int | str | None = None,
    variant: dict | None = None,
    report: dict | None = None,
    after_call: Callable[[int, Any, Any], None] | None = None,
) -> bool:
    """True when every output of every call on every rank matched. `mutate`
    edits the generated source before compiling: negative controls use it to
    remove a barrier or a wait and show that the test then fails.

    `backend` "single" drives `gpus` GPUs from this process; "ipc" or "nvshmem" drives this
    process's rank of a world started by a launcher (`gpus`, if given, must match
    it): every rank makes the same seeded inputs for all ranks, loads and checks
    its own, and the results meet in the store, so every rank returns the same
    verdict and only rank 0 prints. `before_launch(call)` runs just before each
    launch (`tools/ipc_checks.py die` kills a rank there).

    `share_gpus` (None: TSGEN_SHARE_GPUS) lets ranks share GPUs; the spec variant that fits
    them is derived and printed (shared_gpu_variant). `skew` compiles in the test-only rank
    skew with that seed. `variant`: spec fields to change first (spec_variant), e.g.
    {"world_sizes": [8]} to run a spec at a world size it does not ship for. `report`, if given, gets
    "calls" (the calls run), "calls_wrong" (those with a wrong element on some rank) and "calls_right"
    (the others, by number): a negative control's detection rate over its calls, each call a new skew
    schedule (the skew hashes the call number), and which calls it missed. `after_call(call, world, buffers)` runs once each call's kernels are done on every
    rank, before its outputs are checked (tools/attention_trace.py reads the kernel's trace there)."""
    from .runtime import World
    from .runtime.backends import world_size

    loaded = load_spec(spec_path)
    if dtype is not None:  # same spec, another element type (the dtype matrix of the GPU tests)
        loaded = spec_variant(loaded, {"dtype": dtype, "name": f"{loaded.model.name}_{dtype}"})
    loaded = spec_variant(loaded, variant or {})
    spec = loaded.model
    family = get_family(spec.op)
    gpus = world_size(backend, gpus)
    if gpus not in spec.world_sizes:
        asked = f"--gpus {gpus}" if backend == "single" else f"the launcher's {gpus} ranks"
        raise RuntimeSetupError(
            f"{spec_path}: compiled for world sizes {list(spec.world_sizes)}; {asked} is not one"
        )
    count, iters = run_settings(spec, count, iters)
    cached = render_to_cache(loaded, skew=skew)  # cache problems show before any GPU is touched
    t0 = time.perf_counter()
    with World(gpus, backend=backend, share_gpus=share_gpus) as world:
        fitted = shared_gpu_variant(loaded, world, echo)
        if fitted is not loaded:  # ranks share a GPU: the variant whose grids fit
            loaded, spec = fitted, fitted.model
            cached = render_to_cache(loaded, skew=skew)
        source = cached.source if mutate is None else _mutated(cached.source, mutate)
        module = world.load(cached.manifest, arch=arch, source=source)
        tallies = {rank: RankTally() for rank in world.ranks}
        bufs = module.alloc(count)
        # an error leaves the heap to World.__exit__: it aborts the peers first, then frees once
        outputs = [s for s in bufs.slots if s.role in ("output", "inout")]
        poison_survives = family.poison_survives(spec)
        for call in range(iters):
            rng = np.random.default_rng([seed, call])
            inputs = family.make_inputs(spec, gpus, count, rng, pattern=(call == 0))
            expected = family.reference(spec, gpus, count, inputs)
            tol = family.tolerance(spec, gpus, count, inputs)
            # With one process per GPU: no rank launches before every rank has loaded
            # its inputs and poisoned its outputs (a fast peer's puts would be poisoned
            # over), and none checks (or loads the next call) before every rank's kernel
            # is done (a slow peer may still be writing our outputs or reading our inputs).
            load_call(world, bufs, inputs, call)
            world.synchronize()
            world.barrier(f"call {call}: inputs loaded, outputs poisoned")
            if before_launch is not None:
                before_launch(call)
            try:  # alone on the GPU while its kernels run, where tests share one
                with gpu_turn(world), device_output() as printed:
                    module.launch(bufs)
                    world.synchronize()
            except KernelFailed as e:
                raise KernelFailed(f"{spec.name}, call {call} of {iters}: {e}{printed.diagnosis()}") from None
            world.barrier(f"call {call}: every kernel done")
            if after_call is not None:
                after_call(call, world, bufs)
            poison_call = call if poison_survives else None  # see OpFamily.poison_survives
            for rank in world.ranks:
                for s in outputs:
                    got = as_bits(bufs.array(s.name, rank).get())
                    want = as_bits(np.ascontiguousarray(expected[s.name][rank]))
                    bad = wrong_elements(got.view(expected[s.name][rank].dtype), expected[s.name][rank],
                                         None if tol is None else tol[s.name][rank],
                                         None if tol is None else s.dtype,
                                         poison_call)
                    t = tallies[rank]
                    t.checked += got.size
                    t.wrong += bad.size
                    if bad.size and call not in t.bad_calls:
                        t.bad_calls.append(call)
                    if bad.size and len(t.first) < 3:
                        i = int(bad[0])
                        t.first.append(
                            f"call {call}: {s.name}[{i}] = {got[i]:#x}, expected {want[i]:#x} "
                            f"({bad.size} wrong{', poison left: unwritten' if poison_survives and (got[bad] == _poison_value(got.dtype, call)).all() else ''})"
                        )
        bufs.free()
        gathered = world.exchange("test results", [[r, t.wrong, t.checked, t.first, t.bad_calls]
                                                   for r, t in tallies.items()])
        tallies = {r: RankTally(*rest) for part in gathered for r, *rest in part}
        root, shared = world.is_root, world.shared and len(set(world.backend.bus_ids))
    elapsed = time.perf_counter() - t0
    ok = all(passed(t) for t in tallies.values())
    if report is not None:
        wrong = {c for t in tallies.values() for c in t.bad_calls}
        report.update(calls=iters, calls_wrong=len(wrong), calls_right=[c for c in range(iters) if c not in wrong])
    if not root:
        return ok
    for rank, t in sorted(tallies.items()):
        status = "PASS" if passed(t) else "FAIL"
        echo(f"{spec.name} rank {rank}/{gpus}: {status}  {iters} calls x {count} {family.count_unit}, "
             f"{t.wrong} wrong of {t.checked}")
        for line in t.first:
            echo(f"    {line}")
    how = "" if backend == "single" else f" ({backend}: one process per rank)"
    where = f"{gpus} ranks sharing {shared} GPU(s)" if shared else f"{gpus} GPUs"
    echo(f"{spec.name}: {'PASS' if ok else 'FAIL'} on {where}{how}{f' with skew {skew}' if skew is not None else ''} "
         f"({elapsed:.1f} s)")
    return ok


def run_settings(spec, count: int | None, iters: int | None) -> tuple[int, int]:
    """Elements per rank and calls of a test: the spec's `test` defaults, or the command line's
    within the same bounds (TestConfig); RuntimeSetupError naming the option otherwise."""
    from pydantic import ValidationError

    from .spec_types import TestConfig

    values = {"count": spec.test.count if count is None else count,
              "iters": spec.test.iters if iters is None else iters}
    try:
        checked = TestConfig(**values)
    except ValidationError as e:
        err = e.errors()[0]
        name = err["loc"][0]
        raise RuntimeSetupError(f"--{name} {values[name]}: {err['msg']} "
                                f"({TestConfig.model_fields[name].description})") from None
    return checked.count, checked.iters


def passed(tally: RankTally) -> bool:
    """A rank passes when it checked something and found nothing wrong."""
    return tally.checked > 0 and tally.wrong == 0


def load_call(world, bufs, inputs: dict[str, list[np.ndarray]], call: int) -> None:
    """Copy this process's ranks' inputs into their buffers and poison their outputs
    (call `call`'s byte). `inputs` holds every rank's: the same seed gives them all."""
    for rank in world.ranks:
        with world.cp.cuda.Device(world.devices[rank]):
            for name, per_rank in inputs.items():
                bufs.array(name, rank).set(per_rank[rank].view(bufs.array(name, rank).dtype))
            for s in bufs.slots:
                if s.role == "output":
                    bufs.array(s.name, rank).view(np.uint8)[...] = poison_byte(call)


def wrong_elements(got: np.ndarray, want: np.ndarray, tol: np.ndarray | None, dtype: str | None,
                   call: int | None) -> np.ndarray:
    """Indices of wrong elements: bits differ (tol None), or off by more than `tol` (values
    of `dtype`), or still holding call `call`'s poison bytes where the reference does not
    (call None: the op overwrites its outputs first, see OpFamily.poison_survives)."""
    got_bits, want_bits = as_bits(got), as_bits(np.ascontiguousarray(want))
    if tol is None:
        return np.flatnonzero(got_bits != want_bits)
    from .ops.collectives import to_f64

    diff = np.abs(to_f64(got_bits.view(want.dtype), dtype) - to_f64(want, dtype))
    if call is None:
        return np.flatnonzero(~(diff <= tol))
    poisoned = (got_bits == _poison_value(got_bits.dtype, call)) & (want_bits != got_bits)
    return np.flatnonzero(~(diff <= tol) | poisoned)


def leave_now(code: int) -> None:
    """End the process with `code` without the interpreter's teardown: after a kernel
    trapped, the CUDA context is dead and unloading modules from it fails loudly."""
    flush_stdout()  # C stdio too: the device printf of a timeout goes through it
    sys.stderr.flush()
    os._exit(code)


def _mutated(source: Path, mutate: Callable[[str], str]) -> Path:
    """Copy of a rendered source in its one-file form (tsgen.headers.amalgamate: an edit reaches
    the library's code as well as the op's), edited (for negative controls); its path."""
    text = amalgamate(source.read_text())
    changed = mutate(text)
    if changed == text:
        raise ValueError("mutation left the source unchanged")
    folder = ("render", source.parent.name, "mutated", hashlib.sha256(changed.encode()).hexdigest()[:16])
    return write_cached(folder, source.name, changed)


def _poison_value(dtype: np.dtype, call: int) -> int:
    """The bits of an element filled with call `call`'s poison byte."""
    b = poison_byte(call)
    v = 0
    for _ in range(dtype.itemsize):
        v = (v << 8) | b
    return v


def probe_timeout(spec_path: str | Path, gpus: int, arch: str = "sm_90a", timeout_ms: int = 300,
                  share_gpus: bool | None = None) -> int:
    """Launch only rank 0 of a spec whose kernel waits on a peer: the wait never
    completes, so the kernel must print the timeout diagnosis and trap.
    Returns 0 when that happened, 1 otherwise (a hang would be a test failure
    of its own: the probe itself is bounded by the timeout)."""
    from .runtime import World

    loaded = load_spec(spec_path)
    spec = loaded.model
    if not get_family(spec.op).blocks_wait:
        raise RuntimeSetupError(f"{spec_path}: op {spec.op} never waits; probe a signal or barrier spec")
    probe = render_to_cache(spec_variant(loaded, {"sync": {"timeout_ms": timeout_ms}}))
    with World(gpus, share_gpus=share_gpus) as world, gpu_turn():
        module = world.load(probe.manifest, arch=arch, source=probe.source)
        bufs = module.alloc(1024)
        with device_output(echo_through=False) as printed:
            start = time.perf_counter()
            module.launch(bufs, ranks=[0])
            try:
                world.synchronize()
                failed = None
            except KernelFailed as e:
                failed = str(e)
            waited = time.perf_counter() - start
        # The context is dead after a trap: leak the heap rather than touch it.
        bufs.bases = {}
        world.backend._heaps.clear()
    printed = printed.text
    print(printed.rstrip())
    if failed and "tsgen: timeout" in printed:
        print(f"probe: the wait timed out after {waited:.2f} s as it should ({failed.splitlines()[0]})")
        return 0
    print(f"probe: expected a timeout trap; kernel {'failed: ' + failed if failed else 'finished'} "
          f"after {waited:.2f} s without the message")
    return 1
