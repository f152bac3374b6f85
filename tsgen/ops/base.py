"""What every op family provides, and the module ABI it hands the renderer.

An op family is small and declarative: a spec model (its `params`), a
template, the symmetric buffers its kernels use, a NumPy reference, and the
bytes it moves. `OpFamily` is the union of five groups of hooks, one class each:

    Selection      what it is: kind, summary, category, gpu_sweep, variant_worlds,
                   min_world, transport(), is_multimem(), reserved_sms(); tests, bench
                   and tools select ops by these (tsgen.ops.families,
                   tsgen.shipped.shipped_specs), never by lists of op kinds
    SchemaHooks    the spec: Spec, check(), summary_of(), shared_fit()
    LoweringHooks  spec -> module: template, count_unit, blocks_wait, host_launch,
                   template_for(), launched_from_host(), device_libs(), template_vars(),
                   comm_plans(), check_plans(), lower(), buffers(), constants(), abi()
    OracleHooks    what it computes: make_inputs(), reference(), tolerance(),
                   poison_survives()
    BenchHooks     how it is timed: bench (tsgen/ops/conventions.py), bytes_moved()

A family overrides hooks of any group; every hook is reached on the family itself.

The module ABI: every kernel of every family has the same leading arguments

    (char* const* peers, int rank, uint64_t* calls, uint64_t count, <buffers>)

so the runtime launches any kernel from its manifest with no per-op glue:
`peers` is the table of each rank's symmetric-heap base, `calls` this
rank's call counter (the kernel derives its epoch, the call number 1, 2, ...
that signals count up to, from it and advances it as it ends, so CUDA graph
replay needs no host-side epoch), `count` the run-time size in the family's
unit (bytes or elements), then one pointer per buffer, in the order the
family lists them, each pointing into the calling rank's heap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

# the manifest's records are the ABI's: families import them from here
from ..manifest import DTYPES, Arg, Buffer, KernelEntry  # noqa: F401
from ..runtime.placement import fit_blocks
from ..spec_types import SpecBase
from .conventions import BenchConventions

LEADING_ARGS: tuple[tuple[str, str, str], ...] = (
    ("peers", "char* const*", "peers"),
    ("rank", "int", "rank"),
    ("calls", "uint64_t*", "calls"),
    ("count", "uint64_t", "count"),
)


CALLS = Buffer("calls", "uint64", "signal", per_count=0, fixed=2)


@dataclass(frozen=True)
class Kernel:
    """One extern "C" entry point: the op compiled for one world size."""

    name: str
    world_size: int
    grid: int
    block: int
    smem: int
    args: tuple[Arg, ...]
    # arguments of the host launcher, before its trailing cudaStream_t (None: `args`)
    launcher_args: tuple[Arg, ...] | None = None
    # blocks per SM the kernel is compiled to fit (__launch_bounds__' second argument; 0: not
    # given, and ptxas may trade spills for more blocks per SM)
    min_blocks: int = 0
    # True when the host launcher has a `<name>_prepare(rank, device)` (KernelEntry.prepare)
    prepares: bool = False

    @property
    def launcher(self) -> str:
        return f"{self.name}_launch"

    @property
    def prepare(self) -> str:
        return f"{self.name}_prepare" if self.prepares else ""

    def manifest(self) -> KernelEntry:
        """The manifest's entry for this kernel (how the runtime launches it)."""
        return KernelEntry(self.name, self.launcher, self.world_size, (self.grid, 1, 1), (self.block, 1, 1),
                           self.smem, self.args, self.launcher_args or self.args, self.prepare)


@dataclass
class ModuleAbi:
    """Everything the template renders from and the manifest records."""

    family: "OpFamily"
    spec: SpecBase
    buffers: tuple[Buffer, ...]
    kernels: tuple[Kernel, ...]
    constants: dict[str, int] = field(default_factory=dict)  # compile-time, per module


CATEGORIES = ("primitive", "collective", "compute", "fused", "sequence", "moe")
# Generic GPU sweeps of tests/test_gpu.py (a family names the one that runs its shipped specs):
#   "specs":      each spec through the harness at its world sizes among 2, 3, 4 (and variant_worlds)
#   "collective": each spec at its test count at world sizes 2, 3, 4, 8 (variants where not shipped)
#   "one_gpu":    each spec through the harness on one GPU
#   None:         none; the family's own GPU test file covers it
GPU_SWEEPS = ("specs", "collective", "one_gpu", None)


def copy_engine_refusal(instead: str) -> str:
    """Why a copy-engine transport is refused on a shared GPU (OpFamily.shared_refusal), naming
    what to test there `instead`."""
    return ("the copy-engine transport does not run on a shared GPU: copies between ranks of one GPU "
            "are same-device copies that stalled a rank's launcher while its peer waited (measured); "
            f"test {instead} here, or run on separate GPUs")


class Selection:
    """What the family is: tests, bench and tools select ops by these attributes (through
    tsgen.ops.families and tsgen.shipped.shipped_specs), never by lists of op kinds."""

    kind: ClassVar[str]
    summary: ClassVar[str]
    category: ClassVar[str]  # one of CATEGORIES: every family states it (the registry checks)
    gpu_sweep: ClassVar[str | None] = "specs"  # one of GPU_SWEEPS
    # world sizes the GPU sweep also runs as a variant of a spec that does not ship them
    # (ops of any world size: 8; ops whose shapes fix the world size: none)
    variant_worlds: ClassVar[tuple[int, ...]] = (8,)
    min_world: ClassVar[int] = 2  # 1: the op runs on one GPU

    def transport(self, spec: Any) -> str:
        """How ranks' data moves: "p2p" (loads and stores through peer pointers, the default),
        "copy_engine" or "nvshmem" where the spec chooses (params.transport)."""
        return "p2p"

    def is_multimem(self, spec: Any) -> bool:
        """True for NVLink-multicast variants (compiled only; the runtime refuses them)."""
        return False

    def shared_refusal(self, spec: Any) -> str | None:
        """Why the spec cannot run with ranks sharing a GPU (harness.shared_gpu_variant raises it),
        None where it can. Copy-engine transports are refused: measured 2026-11-23 on one H100,
        allgather_ce with 2 ranks on the GPU timed out at its first call in one run of 6 calls and
        passed in others (a rank's wait for the other's entry signal never ended while its
        launcher thread sat in the CUDA runtime)."""
        return copy_engine_refusal("the p2p variant of the spec") if self.transport(spec) == "copy_engine" else None

    def reserved_sms(self, spec: Any) -> int:
        """SMs each rank leaves free beside its grid (params.reserve_sms of the fused GEMMs)."""
        return 0


class SchemaHooks:
    """The spec: its model, the checks beyond field types, its banner line, its variants."""

    Spec: ClassVar[type[SpecBase]]

    def check(self, spec: Any) -> list[tuple[tuple, str]]:
        """Cross-field problems as (field path, message); [] when the spec is fine."""
        return []

    def summary_of(self, spec: Any) -> str:
        """The banner's one-line summary of this spec's variant (default: the family's)."""
        return self.summary

    def shared_fit(self, spec: Any, colocated: int, sms: int) -> dict[str, Any]:
        """Spec fields to change (nested, for spec.spec_variant) so that `colocated` ranks'
        grids are all resident at once on one GPU of `sms` SMs; {} when the spec fits as it is.
        The bound is one block per SM, whatever the kernel's occupancy. Pure."""
        if colocated == 1:
            return {}
        blocks = fit_blocks(spec.launch.blocks, colocated, sms)
        return {"launch": {"blocks": blocks}} if blocks != spec.launch.blocks else {}


class LoweringHooks:
    """From a checked spec to what is rendered and launched: comm plans, the module ABI
    (buffers, kernels, constants), the template and its names, how the runtime launches it."""

    template: ClassVar[str]  # file under templates/ops/
    count_unit: ClassVar[str] = "elements"  # or "bytes"
    # True when blocks wait on other blocks (barriers, signals from the same
    # grid): the runtime then refuses a grid that cannot be resident at once.
    blocks_wait: ClassVar[bool] = False
    # True when the runtime must call the module's host launcher (`<kernel>_launch`,
    # compiled into a shared library) instead of launching the kernel itself: ops
    # whose call is more than one kernel (copy-engine transfers between kernels, or
    # TMA descriptors encoded on the host). The launcher takes `launcher_args`.
    host_launch: ClassVar[bool] = False
    # True when that launcher runs work on side streams of its own (made per rank, see `prepares`).
    side_streams: ClassVar[bool] = False

    def template_for(self, spec: Any) -> str:
        """Template file under templates/ops/ for this spec."""
        return self.template

    def launched_from_host(self, spec: Any) -> bool:
        """True when the runtime must call the host launcher (see `host_launch`)."""
        return self.host_launch

    def prepares(self, spec: Any) -> bool:
        """True when the host launcher makes per-rank things (side streams, events) that its
        template also makes up front in `<kernel>_prepare(rank, device)` (KernelEntry.prepare)."""
        return self.side_streams

    def device_libs(self, spec: Any) -> tuple[str, ...]:
        """Device libraries the module is linked against (-rdc=true + device link, see
        toolchain.DEVICE_LIBS): () for self-contained sources, ("nvshmem",) for the
        NVSHMEM transport. Recorded in the manifest as `device_libs` when not empty."""
        return ()

    def template_vars(self, spec: Any) -> dict[str, Any]:
        """Extra names the op's template uses (beyond spec, the module ABI, constants)."""
        return {}

    # tsgen.lowering calls these once per loaded spec
    def comm_plans(self, spec: Any) -> dict[int, Any]:
        """World size -> the comm plan (tsgen.plan.ir.CommPlan) the kernels run, for families
        whose kernels run one; {} otherwise. Built once per loaded spec, after `check` passed
        (tsgen.spec), and handed to check_plans and lower."""
        return {}

    def check_plans(self, spec: Any, plans: dict[int, Any]) -> list[tuple[tuple, str]]:
        """Problems only the comm plans show (table limits ...), as `check`'s; [] when fine."""
        return []

    def lower(self, spec: Any, plans: dict[int, Any]) -> tuple[ModuleAbi, dict[str, Any]]:
        """The module ABI and the template's extra names (template_vars) of `spec`, whose comm
        plans are `plans`. Families with plans override it so that neither is built from the
        plans again; the default is abi(spec) and template_vars(spec)."""
        return self.abi(spec), self.template_vars(spec)

    # the module ABI: buffers, kernel arguments, constants
    def buffers(self, spec: Any) -> tuple[Buffer, ...]:
        raise NotImplementedError

    def constants(self, spec: Any) -> dict[str, int]:
        """Compile-time constants beyond the launch shape (e.g. SHIFT)."""
        return {}

    def abi(self, spec: Any) -> ModuleAbi:
        constants = {
            "THREADS": spec.launch.threads,
            "BLOCKS": spec.launch.blocks,
            "UNROLL": spec.launch.unroll,
        }
        constants.update(self.constants(spec))
        return one_kernel_abi(self, spec, smem=0, constants=constants)


class OracleHooks:
    """What the op computes, as the harness checks it: inputs, NumPy reference, tolerance,
    and whether an unwritten output still shows the poison."""

    def make_inputs(
        self, spec: Any, world: int, count: int, rng: np.random.Generator, pattern: bool
    ) -> dict[str, list[np.ndarray]]:
        """Per-rank input arrays. `pattern`: values that encode (rank, index)."""
        out: dict[str, list[np.ndarray]] = {}
        for b in self.buffers(spec):
            if b.role != "input":
                continue
            n = b.elems(count, world)
            out[b.name] = [fill(b.dtype, n, rng, pattern, r) for r in range(world)]
        return out

    def reference(
        self, spec: Any, world: int, count: int, inputs: dict[str, list[np.ndarray]]
    ) -> dict[str, list[np.ndarray]]:
        raise NotImplementedError

    def tolerance(self, spec: Any, world: int, count: int, inputs: dict) -> dict | None:
        """Allowed absolute error per output element; None: bit-exact."""
        return None

    def once_per_inputs(self, inputs: dict, key: tuple, compute: Callable[[], Any]) -> Any:
        """`compute()` once for one call's `inputs`: the harness and the bench ask for `reference` and then
        `tolerance` of the same inputs, and both need the same expensive part (a float64 attention, the
        GEMM's products, the dispatched rows). The family keeps the last result only, keyed by the inputs
        dict itself (identity: it stays alive while cached, so no other dict can take its id) and by `key`
        (what else the result depends on, compared by ==: the spec model, world, count, ...). Not for
        inputs changed in place between the two calls."""
        last = self.__dict__.get("_once")
        if last is not None and last[0] is inputs and last[1] == key:
            return last[2]
        value = compute()
        self._once = (inputs, key, value)
        return value

    def poison_survives(self, spec: Any) -> bool:
        """Whether an output element the kernel never writes still holds the harness's poison
        after a call: then an element equal to the poison where the reference differs is
        counted unwritten, even inside the tolerance. False where the launch overwrites every
        output element before its kernels do their work (a missed element shows as a value)."""
        return True


class BenchHooks:
    """How `tsgen bench` times it: sizes, FLOPs and bytes per call, baselines, checks
    (tsgen/ops/conventions.py); families override `bench` next to their reference."""

    bench: ClassVar[BenchConventions] = BenchConventions()

    def bytes_moved(self, spec: Any, world: int, count: int) -> int:
        """Bytes each rank sends over the fabric per call (for GB/s)."""
        return 0


class OpFamily(Selection, SchemaHooks, LoweringHooks, OracleHooks, BenchHooks):
    """One op kind: subclasses set the class attributes and override the hooks of the groups
    above (module docstring). Every hook keeps its name on the family: callers need not know
    which group declares it."""


def fill(dtype: str, n: int, rng: np.random.Generator, pattern: bool, rank: int) -> np.ndarray:
    """Random data, or an integer pattern that makes a misplaced chunk visible."""
    npdt = np.dtype(DTYPES[dtype][1]) if dtype != "bfloat16" else np.dtype("uint16")
    if pattern:
        idx = np.arange(n, dtype=np.uint64)
        if npdt.itemsize == 1:
            # 8 bits cannot hold (rank, index): mix them so a shifted chunk differs.
            return ((idx * 7 + idx // 251 + rank * 101) & 0xFF).astype(np.uint8)
        # Bit patterns, viewed as the dtype (a float conversion would round or overflow
        # them): 16 bits hold rank < 8 over 11 bits of index, no NaN/inf for fp16/bf16.
        if npdt.itemsize == 2:
            bits = (np.uint64(rank) << np.uint64(11)) | (idx & np.uint64(0x7FF))
        else:
            bits = (np.uint64(rank + 1) << np.uint64(24)) | (idx & np.uint64(0xFFFFFF))
        return bits.astype(np.dtype(f"u{npdt.itemsize}")).view(npdt)
    if npdt.kind == "f":
        return rng.standard_normal(n).astype(npdt)
    info = np.iinfo(npdt)
    return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=npdt)


def with_peers_host(args: tuple[Arg, ...]) -> tuple[Arg, ...]:
    """A host launcher's arguments: the kernel's, with the host copy of the peer table after
    `peers` (for what the host addresses in peers' memory: copies, TMA descriptors)."""
    return args[:1] + (Arg("peers_host", "char* const*", "peers_host"),) + args[1:]


def one_kernel_abi(family: OpFamily, spec: Any, smem: int, constants: dict[str, int],
                   peers_host: bool = False) -> ModuleAbi:
    """The ABI of a module with one kernel per world size taking the calling convention
    (LEADING_ARGS, then one pointer per buffer) on a grid of launch.blocks x launch.threads;
    `peers_host`: its host launcher also takes the host copy of the peer table (with_peers_host)."""
    # Every module's heap starts with its call counter: [0] calls completed,
    # [1] blocks finished (the last block of a call advances [0]).
    buffers = (CALLS,) + tuple(family.buffers(spec))
    args = tuple(Arg(n, t, r) for n, t, r in LEADING_ARGS) + tuple(
        Arg(b.name, f"{b.ctype}*", "buffer") for b in buffers if b is not CALLS
    )
    launcher_args = with_peers_host(args) if peers_host else None
    kernels = tuple(
        Kernel(name=f"{spec.name}_w{w}", world_size=w, grid=spec.launch.blocks, block=spec.launch.threads,
               smem=smem, args=args, launcher_args=launcher_args, prepares=family.prepares(spec))
        for w in spec.world_sizes
    )
    return ModuleAbi(family, spec, buffers, kernels, constants)


def launcher_vars(abi: ModuleAbi) -> dict[str, str]:
    """Template inputs of a host launcher's signature: its parameters and their names."""
    k = abi.kernels[0]
    args = k.launcher_args or k.args
    return {"launcher_params": ", ".join(f"{a.ctype} {a.name}" for a in args),
            "launcher_arg_names": ", ".join(a.name for a in args)}
