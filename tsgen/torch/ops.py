"""Generated modules as torch ops: one custom op `tsgen::<module>` per module, launched on the
current stream through the module's own host launcher.

`load` reads a module (a spec, or a manifest and its source), checks it against the group, and
returns this rank's `TorchOp`. The op is a `torch.library` custom op with the schema
`(Tensor x, str group_name) -> Tensor`, so torch.compile sees one opaque call per op (no graph
break) whose output shape comes from a fake kernel (FakeTensor shape propagation needs no GPU).
Which loaded op a call means is looked up by (module, group name): that is how the group
travels through a traced graph, as it does for torch's own symm_mem and functional collectives.

Launching reuses the runtime's pieces: the source compiles to the shared library with the host
launchers (toolchain.compile_source mode "shared", the form a C++ user vendors), `<kernel>_launch`
comes through ctypes (runtime.world._host_launcher), and the arguments follow the manifest's roles
(runtime.world.arg_values). Every call: check the tensors; hand the launcher each local buffer's
tensor by address (a buffer only this rank's kernel touches, the family's `torch_local`: the fused
GEMMs' A, B, C) and copy every other input into its heap slot (skipped when it is that slot:
`op.empty`); launch on torch.cuda.current_stream(); copy every other output out of its heap slot
(skipped when the out= tensor is that slot: `op.empty_out`). The outputs are new tensors, or the
caller's in the out= form, `tsgen::<module>_out` (a mutating op: no autograd). Nothing here waits
on the host, so the op is capturable in a CUDA graph once each shape has been called before (the
first call of a shape makes its heap, a collective).
"""

from __future__ import annotations

import ctypes
import os
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..env import force_no_multicast
from ..errors import TsgenError
from ..manifest import Manifest, Slot
from ..printed import device_output
from ..runtime.ipc import join_problem
from ..runtime.placement import mps_active, ranks_per_gpu, residency_problem, share_from_env
from ..runtime.world import (_host_launcher, arg_values, launcher_cargs, module_files, multimem_refusal,
                             own_symbol, prepare_ranks)
from . import grads as grads_mod
from . import heap as heap_mod
from .signature import TORCH_DTYPES, TsgenArgumentError, TsgenTorchError, entries_of, signature_of

_LIB: Any = None  # the torch.library.Library fragment that holds every tsgen op (kept alive)
_DEFINED: dict[str, str] = {}  # module name -> spec sha256 of the module that defined tsgen::<name>
_OPS: dict[tuple[str, str], "TorchOp"] = {}  # (module name, group name) -> the op loaded on that group
# what close_all() calls before it closes the ops: other holders of symmetric heaps (cp_attention's push= heaps)
AT_CLOSE_ALL: list[Callable[[], None]] = []


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _lookup(name: str, group_name: str) -> "TorchOp":
    op = _OPS.get((name, group_name))
    if op is None:
        loaded = sorted(g for n, g in _OPS if n == name)
        raise TsgenTorchError(f"tsgen::{name} is not loaded on process group {group_name!r} in this process "
                              f"(loaded on: {loaded or 'none'}); call tsgen.torch.load(...) on every rank first")
    return op


def call_on_stream(device: int, launcher: Callable[..., int], args: Sequence[Any]) -> int:
    """launcher(*args, the current stream of `device`) with `device` current while it runs (a host launcher
    launches on the current device): the eager path every tsgen.torch op takes a call. Without a device switch
    where `device` is current already, and the stream's handle read straight from torch's C API where it has
    one (a torch.cuda.Stream object and a device context a call are host time the raw handle does not
    take; measured with the op's other trims together, not alone: docs/torch.md)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent where torch has no CUDA (the CPU tests)
    if raw is not None and torch.cuda.current_device() == device:
        return launcher(*args, ctypes.c_void_p(raw(device)))
    with torch.cuda.device(device):
        return launcher(*args, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))


def _library() -> Any:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("tsgen", "FRAGMENT")
    return _LIB


def _metas(tensors: tuple) -> list[tuple]:
    return [(t.shape, _dtype_name(t.dtype), t.is_contiguous()) for t in tensors]


def _define(name: str, signature: Any) -> None:
    """Register tsgen::<name>: schema (the signature's: its tensors, then the group's name), the real
    kernel (any device: it names a wrong one itself), the fake kernel, and the autograd formula
    (the adjoint op, see pair); and its out= form (_define_out)."""
    if name in _DEFINED:
        return
    lib = _library()
    qual = f"tsgen::{name}"
    lib.define(signature.schema())
    if getattr(signature, "entry", None) is None:
        _define_out(name, signature)

    def real(*args: Any) -> Any:
        return _lookup(name, args[-1])._forward(*args[:-1])

    def fake(*args: Any) -> Any:
        sig = _lookup(name, args[-1]).signature
        tensors = args[:-1]
        sig.check(_metas(tensors))
        outs = [tensors[0].new_empty(shape, dtype=getattr(torch, TORCH_DTYPES[b.dtype]))
                for shape, b in zip(sig.out_shapes([t.shape for t in tensors]), sig.outputs)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.group_name = inputs[-1]
        f = grads_mod.formula(_lookup(name, ctx.group_name).signature.op)
        if f is not None:
            outs = output if isinstance(output, tuple) else (output,)
            ctx.save_for_backward(*f.save(inputs[:-1], outs))
            if f.nondiff:
                ctx.mark_non_differentiable(*(outs[i] for i in f.nondiff))

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op = _lookup(name, ctx.group_name)
        f = grads_mod.formula(op.signature.op)
        if op.adjoint is None or f is None:
            from .signature import ADJOINT_KINDS

            want = ADJOINT_KINDS.get(op.signature.op)
            how = (f"load the {want} spec on the same group and call tsgen.torch.pair(op, adjoint)" if want else
                   f"{op.signature.op} has no adjoint op in tsgen.torch")
            raise TsgenTorchError(f"{qual} on rank {op.rank}: no adjoint op for its backward; {how}")
        adjoint = getattr(torch.ops.tsgen, op.adjoint.name)
        needs = tuple(ctx.needs_input_grad[:-1])
        return (*f.backward(lambda *t: adjoint(*t, ctx.group_name), ctx.saved_tensors, grads, needs), None)

    torch.library.impl(qual, "default", real, lib=lib)
    torch.library.register_fake(qual, fake, lib=lib)
    torch.library.register_autograd(qual, backward, setup_context=setup_context, lib=lib)


def _define_out(name: str, signature: Any) -> None:
    """Register tsgen::<name>_out, the out= form: the inputs, then the outputs as mutated arguments
    (`Tensor(a!) c, Tensor(b!) a_full`), then the group's name; returns nothing. A mutating op:
    torch.compile functionalizes it (auto_functionalized) and the fake kernel only checks the
    tensors. No autograd formula (as for torch's own out= variants): TorchOp.__call__ refuses
    inputs that require a gradient."""
    lib = _library()
    qual = f"tsgen::{name}_out"
    lib.define(signature.out_schema())
    n = len(signature.arg_names)

    def real(*args: Any) -> None:
        _lookup(name, args[-1])._forward(*args[:n], out=args[n:-1])

    def fake(*args: Any) -> None:
        sig = _lookup(name, args[-1]).signature
        tensors, outs = args[:n], args[n:-1]
        sig.check(_metas(tensors))
        sig.check_out([t.shape for t in tensors], _metas(outs))

    torch.library.impl(qual, "default", real, lib=lib)
    torch.library.register_fake(qual, fake, lib=lib)


# The address alignment a buffer handed to a launcher in place of its heap slot must have: TMA's
# (cuTensorMapEncodeTiled wants 16 bytes; the local buffers of the shipped families are tensor maps).
# A tensor at another address goes through its heap slot, as a buffer that is not local does.
ALIGN = 16


@dataclass
class CallPlan:
    """How one call moves its tensors: `pointers`, buffer name -> the address of the caller's tensor
    the launcher gets in place of the buffer's heap slot (a local buffer); `copy_in`, (heap slot,
    tensor) pairs copied before the launch; `copy_out`, (tensor, heap slot) pairs copied after."""

    pointers: dict[str, int]
    copy_in: list[tuple[torch.Tensor, torch.Tensor]]
    copy_out: list[tuple[torch.Tensor, torch.Tensor]]


def plan_call(sig: Any, tensors: tuple, outs: Sequence[torch.Tensor], view: Callable[[str], torch.Tensor]) -> CallPlan:
    """The CallPlan of a call on `tensors` writing `outs` (both checked), `view(buffer)` being the
    buffer's heap slot (1-d, its dtype). A local buffer (sig.local(): only this rank's kernel
    touches it) at an ALIGN-aligned address is passed by the tensor's address: no copy. Any other
    input is copied into its slot unless it is that slot (op.empty); any other output is copied out
    of its slot unless it is that slot (op.empty_out)."""
    local = sig.local()
    ins = getattr(sig, "ins", None)
    pointers: dict[str, int] = {}
    copy_in, copy_out = [], []
    for i, (b, t) in enumerate(zip(sig.inputs, tensors)):
        if ins is not None and ins[i].how != "in":  # "arg": passed after the buffers; "shape": checked only
            continue
        if b.name in local and t.data_ptr() % ALIGN == 0:
            pointers[b.name] = t.data_ptr()
            continue
        slot = view(b.name)
        if t.data_ptr() != slot.data_ptr():
            copy_in.append((slot[:t.numel()], t.reshape(-1)))
    for b, o in zip(sig.outputs, outs):
        if b.name in local and o.data_ptr() % ALIGN == 0:
            pointers[b.name] = o.data_ptr()
            continue
        slot = view(b.name)
        if o.data_ptr() != slot.data_ptr():
            copy_out.append((o.view(-1), slot[:o.numel()]))
    return CallPlan(pointers, copy_in, copy_out)


def overlap_problem(arg_names: Sequence[str], tensors: Sequence[torch.Tensor], out_names: Sequence[str],
                    outs: Sequence[torch.Tensor]) -> str | None:
    """Which out= output overlaps an input or an earlier output in memory (contiguous tensors: their
    bytes from data_ptr), or None: the kernel reads its inputs while it writes, and an output
    written twice holds one of the two."""
    seen = [(f"argument {a}", t) for a, t in zip(arg_names, tensors)]
    for name, o in zip(out_names, outs):
        lo, hi = o.data_ptr(), o.data_ptr() + o.numel() * o.element_size()
        for what, t in seen:
            a, b = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            if lo < b and a < hi and lo < hi and a < b:
                return (f"out {name} overlaps {what} in memory (the kernel reads its inputs while it writes its "
                        "outputs); pass a tensor of its own")
        seen.append((f"out {name}", o))
    return None


def _resolve(spec_or_manifest: Any, source: Any) -> tuple[Manifest, Path]:
    """(manifest, source path) of a spec file or a tsgen.spec.LoadedSpec (spec_variant's; rendered
    into the compile cache), a NAME.json manifest (its NAME.cu beside it unless `source`), or a
    Manifest with `source`."""
    from ..spec import LoadedSpec

    if isinstance(spec_or_manifest, Manifest):
        return module_files(spec_or_manifest, source)
    if isinstance(spec_or_manifest, LoadedSpec):
        from ..harness import render_to_cache

        module = render_to_cache(spec_or_manifest)
        return module.manifest, module.source
    path = Path(spec_or_manifest)
    if path.suffix in (".yaml", ".yml"):
        from ..harness import render_to_cache
        from ..spec import load_spec

        module = render_to_cache(load_spec(path))
        return module.manifest, module.source
    if path.suffix == ".json":
        return module_files(path, source)
    raise TsgenTorchError(f"{path}: give a spec (.yaml), a manifest (NAME.json), a tsgen.manifest.Manifest or a "
                          "tsgen.spec.LoadedSpec")


def _bus(dev: int) -> str:
    """This rank's GPU as the group compares them: its PCI bus id, else its index and UUID."""
    return _bus_id(dev) or f"cuda:{dev} {torch.cuda.get_device_properties(dev).uuid}"


def _fit_shared(given: Any, group: Any) -> Any:
    """Ranks sharing GPUs (TSGEN_SHARE_GPUS=1, a collective on `group`): a spec (file or LoadedSpec)
    becomes its variant whose co-located grids are all resident at once, as `tsgen test
    --share-gpus` runs it (tsgen.harness.fit_shared: one block per SM, whatever the occupancy; under
    MPS the ranks' grids did not share SMs: at W 8 on one H200, three ranks' 64-block allgathers
    held 132 blocks, one per SM, waiting for five ranks whose grids never started). Anything else,
    or one rank per GPU: `given` unchanged (a prebuilt manifest that does not fit is refused by name
    in _local_problem). A collective whenever it fits, the op already loaded or not: every rank
    loads the same specs in the same order, as for any tsgen.torch.load."""
    if not share_from_env() or not torch.cuda.is_available():  # without CUDA the ops only trace
        return given
    if dist.get_backend(group) == "fake":  # torch's fake backend: the op only traces (TorchOp.trace_only)
        return given
    from ..harness import fit_shared
    from ..spec import LoadedSpec, load_spec

    if isinstance(given, (str, Path)) and Path(given).suffix in (".yaml", ".yml"):
        given = load_spec(Path(given))
    if not isinstance(given, LoadedSpec):
        return given
    dev = torch.cuda.current_device()
    members = heap_mod.all_gather(group, (_bus(dev), torch.cuda.get_device_properties(dev).multi_processor_count))
    colocated = ranks_per_gpu([bus for bus, _ in members])
    if colocated == 1:
        return given
    sms = min(n for _, n in members)  # the same variant on every rank, fitted to the smallest GPU
    try:
        return fit_shared(given, colocated, sms, dist.get_world_size(group))[0]
    except TsgenError as e:  # the family refuses shared GPUs, or the fitted plan fails
        raise TsgenTorchError(f"tsgen.torch.load on rank {dist.get_rank(group)}, {colocated} ranks per GPU: {e}") from e


def colocated_heap_mode(mode: str, bus_ids: list) -> str:
    """The heap mode for ranks on these GPUs: auto means CUDA IPC heaps where ranks share a GPU, since
    torch's symmetric memory refuses allocations of several ranks on one device (its rendezvous:
    "detected allocations from overlapping devices") and each op would warn and fall back at its
    first call; an explicit mode is kept (symm_mem then fails by name)."""
    return "ipc" if mode == "auto" and ranks_per_gpu(bus_ids) > 1 else mode


def _arch(device: int) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def _bus_id(device: int) -> str | None:
    """The PCI bus id of a torch device, as cudaDeviceGetPCIBusId writes it; None if torch does not say."""
    p = torch.cuda.get_device_properties(device)
    try:
        return f"{p.pci_domain_id:04X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    except AttributeError:
        return None


@dataclass
class _HeapState:
    heap: heap_mod.Heap
    slots: dict[str, Slot]
    cargs: list[Any]  # the launcher's arguments but the stream
    index: dict[str, int] = field(default_factory=dict)  # buffer name -> its place in cargs
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # made once per slot: calls reuse them
    last: str | None = None  # the entry called last on this heap (modules of several ops, signature.order)

    @classmethod
    def of(cls, heap: heap_mod.Heap, slots: list[Slot], kernel: Any, rank: int, count: int) -> "_HeapState":
        """The state of `heap` laid out as `slots`: the launcher's arguments by the manifest's roles
        (runtime.world.arg_values), each buffer's place among them."""
        values = arg_values(kernel.launcher_args, rank, count, heap.base, {s.name: s.offset for s in slots},
                            heap.peer_table.data_ptr(), ctypes.addressof(heap.host_table))
        return cls(heap, {s.name: s for s in slots}, launcher_cargs(kernel.launcher_args, values),
                   {a.name: i for i, a in enumerate(kernel.launcher_args) if a.role == "buffer"})

    def view(self, slot: str) -> torch.Tensor:
        if slot not in self.views:
            s = self.slots[slot]
            self.views[slot] = self.heap.view(s.offset, s.nbytes, getattr(torch, TORCH_DTYPES[s.dtype]))
        return self.views[slot]


class TorchOp:
    """One generated module on one process group, as seen from this rank. Call it with a tensor;
    `empty(shape)` gives an input in the symmetric heap (no copy in); `close()` frees the heaps."""

    def __init__(self, manifest: Manifest, source: Path, group: Any, signature: Any,
                 arch: str | None, heap: str | None, shares: "TorchOp | None" = None):
        self.manifest, self.source, self.group = manifest, Path(source), group
        self.signature = signature
        self.name = signature.module  # the module's name, or module_entry for one op of several
        self.group_name = group.group_name
        self.rank, self.world = signature.rank, signature.world
        self.kernel = manifest.kernel(self.world)
        self.adjoint: TorchOp | None = None
        self.heap_mode = heap_mod.heap_mode(heap)
        self.heap_kind: str | None = None  # what the heaps came from: symm_mem or ipc (after the first)
        # the heaps, by count; an entry of a module of several ops shares its first op's
        self._heaps: dict[int, _HeapState] = shares._heaps if shares is not None else {}
        self._launcher: Any = None
        self.device: int | None = None
        # a group of torch's fake backend (tracing on a machine without GPUs) or no CUDA: trace only
        self.trace_only = dist.get_backend(group) == "fake" or not torch.cuda.is_available()
        if not self.trace_only:
            self._bind(arch)

    def __repr__(self) -> str:
        return (f"<tsgen.torch op {self.signature.qualname} rank {self.rank}/{self.world} group {self.group_name!r} "
                f"{'trace only' if self.trace_only else f'cuda:{self.device}'}>")

    def __call__(self, *tensors: torch.Tensor, out: Any = None) -> Any:
        """The op on `tensors`: new output tensors (differentiable once paired); with `out` (a tensor,
        or a tuple of one per output in order) the out= form, tsgen::<module>_out: the results go
        into those tensors, which it returns. A local output (allgather_gemm's and
        gemm_reduce_scatter's C) is written in place wherever it lives; one a peer writes (a
        collective's output, allgather_gemm's gathered A) is written in place when it is this op's
        heap slot (from empty_out), else copied out of the heap into it. No backward: inputs that
        require a gradient are refused while grad mode is on."""
        if out is None:
            return getattr(torch.ops.tsgen, self.name)(*tensors, self.group_name)
        outs = self._outs_of(out)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*tensors, *outs)):
            raise TsgenArgumentError(
                f"{self.where}: the out= form has no backward (it writes the caller's tensors, as torch's out= "
                "variants do); call it under torch.no_grad() or inside an autograd.Function, or call the "
                "functional form, which pair() makes differentiable")
        getattr(torch.ops.tsgen, f"{self.name}_out")(*tensors, *outs, self.group_name)
        return out

    def _outs_of(self, out: Any) -> tuple:
        """`out` as the tuple the out= form takes; TsgenArgumentError naming what it writes otherwise."""
        sig = self.signature
        names = sig.out_names
        if getattr(sig, "entry", None) is not None:
            raise TsgenArgumentError(f"{self.where}: no out= form for one op of a module of several ops "
                                     f"({self.manifest.spec}: its outputs are the module's receive buffers)")
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else None
        if outs is None or len(outs) != len(names) or not all(isinstance(o, torch.Tensor) for o in outs):
            want = "a tensor" if len(names) == 1 else f"a tuple of {len(names)} tensors"
            raise TsgenArgumentError(f"{self.where}: out= takes {want} ({', '.join(names)}), got "
                                     f"{type(out).__name__}{f' of {len(outs)}' if outs is not None else ''}")
        return outs

    @property
    def where(self) -> str:
        return f"{self.signature.qualname} on rank {self.rank}"

    # -- setup (collective) ---------------------------------------------------------------
    def _bind(self, arch: str | None) -> None:
        """Compile and load the launcher, then check the group as one: every rank on one host, on
        its own GPU (or sharing under MPS with TSGEN_SHARE_GPUS=1), with peer access to every peer's
        GPU, the grid resident. Every rank raises if any rank found a problem."""
        from ..runtime.topology import check_full_mesh
        from ..toolchain import compile_source

        dev = torch.cuda.current_device()
        self.device = dev
        problem, prepare = None, None
        try:
            binary = compile_source(self.source, arch=arch or _arch(dev), mode="shared").output
            self._launcher, prepare = _host_launcher(binary, self.kernel)
            entry = self.signature.entry if hasattr(self.signature, "entry") else None
            if entry is not None:  # one entry of several: <kernel>_<entry>_launch, the same arguments (+ pointers)
                self._launcher = own_symbol(ctypes.CDLL(str(binary)), binary, f"{self.kernel.name}_{entry}_launch")
                self._launcher.restype = ctypes.c_int
        except (TsgenError, OSError, AttributeError) as e:
            problem = f"{self.where}: loading {self.source.name}: {e}"
        me = {"rank": self.rank, "size": self.world, "host": socket.gethostname(), "bus": _bus(dev)}
        members = heap_mod.all_gather(self.group, (me, problem))
        problems = [p for _, p in members if p]
        share = share_from_env()
        joined = join_problem([m for m, _ in members], self.world, one_host=True, share=share, mps=mps_active())
        if joined:
            if "both run on GPU" in joined:
                joined += "; under torchrun: torch.cuda.set_device(LOCAL_RANK) before tsgen.torch.load"
            problems.append(joined)
        if problems:
            raise TsgenTorchError("; ".join(problems))
        bus_ids = [m["bus"] for m, _ in members]
        self.heap_mode = colocated_heap_mode(self.heap_mode, bus_ids)
        heap_mod.agree(self.group, self._local_problem(dev, bus_ids))
        check_full_mesh(list(dict.fromkeys(bus_ids)))  # NVML: a partial NVLink mesh is refused (same on every rank)
        if prepare is not None:  # the launcher's side streams, before the first call (KernelEntry.prepare)
            prepare_ranks(prepare, self.kernel.prepare, {self.rank: dev}, self.name, torch.cuda.device)

    def _local_problem(self, dev: int, bus_ids: list[str]) -> str | None:
        """Peer access from this rank's GPU to every peer's it can see, and the residency of the
        grid (its blocks wait on each other: all must be resident, those of co-located ranks too)."""
        props = torch.cuda.get_device_properties(dev)
        visible = {_bus_id(i): i for i in range(torch.cuda.device_count())}
        for r, bus in enumerate(bus_ids):
            peer = visible.get(bus)
            if r == self.rank or peer is None or peer == dev:
                continue  # a peer GPU this process cannot see: opening its memory is the test
            if not torch.cuda.can_device_access_peer(dev, peer):
                return (f"{self.where}: GPU {bus_ids[self.rank]} has no peer access to rank {r}'s GPU {bus}; tsgen's p2p "
                        "kernels load and store peer memory directly (NVLink or PCIe P2P between every pair)")
        colocated = ranks_per_gpu(bus_ids)
        if self.manifest.blocks_wait or colocated > 1:
            # ranks sharing a GPU: one block per SM, the bound OpFamily.shared_fit (and _fit_shared)
            # fits to; one rank: the threads' bound
            per_sm = 1 if colocated > 1 else max(1, props.max_threads_per_multi_processor // self.kernel.block[0])
            return residency_problem(self.kernel.name, self.kernel.grid[0], colocated, props.multi_processor_count,
                                     per_sm)
        return None

    def _heap(self, count: int) -> _HeapState:
        """The heap for `count` (made on first use: a collective, so every rank calls the op with the
        same shapes in the same order, as for any collective)."""
        state = self._heaps.get(count)
        if state is not None:
            return state
        if torch.cuda.is_current_stream_capturing():
            raise TsgenTorchError(f"{self.where}: the first call with {count} elements per chunk makes its symmetric "
                                  "heap (a collective with host waits), which cannot happen inside CUDA graph capture; "
                                  "call the op once with this shape before capturing (warm-up)")
        slots, nbytes = self.manifest.layout(count, self.world)

        def init(tensor: torch.Tensor) -> None:
            for s in slots:
                if s.role == "signal" and s.init_byte:
                    tensor[s.offset:s.offset + s.nbytes].fill_(s.init_byte)

        with torch.cuda.device(self.device):
            heap, why = heap_mod.make_heap(nbytes, self.group, self.device, self.heap_mode, init)
        if why and self.heap_kind is None:
            warnings.warn(f"{self.where}: torch symmetric memory failed ({why}); using CUDA IPC heaps", stacklevel=3)
        if heap.kind == "ipc":
            self.heap_mode = "ipc"  # decided once: every rank agreed
        self.heap_kind = heap.kind
        state = _HeapState.of(heap, slots, self.kernel, self.rank, count)
        self._heaps[count] = state
        return state

    # -- calls ----------------------------------------------------------------------------
    def _check(self, tensors: tuple) -> int:
        sig = self.signature
        if len(tensors) != len(sig.arg_names):
            raise TsgenArgumentError(f"{sig.qualname} on rank {self.rank}: {len(tensors)} tensors, but it takes "
                                     f"{len(sig.arg_names)} ({', '.join(sig.arg_names)})")
        for arg, x in zip(sig.arg_names, tensors):
            if not isinstance(x, torch.Tensor):
                raise TsgenArgumentError(f"{sig.where(arg)}: got {type(x).__name__}, not a torch.Tensor")
        count = sig.check(_metas(tensors))
        want = "a CUDA device" if self.device is None else f"cuda:{self.device}"
        for arg, x in zip(sig.arg_names, tensors):
            if x.device.type != "cuda" or (self.device is not None and x.device.index != self.device):
                raise TsgenArgumentError(f"{sig.where(arg)}: on {x.device}, but this rank's op runs on {want} "
                                         "(torch.cuda.set_device before tsgen.torch.load picks it)")
        return count

    def _need_gpu(self) -> None:
        if self.trace_only:
            raise TsgenTorchError(f"{self.where}: loaded on a group without GPUs (backend "
                                  f"{dist.get_backend(self.group)!r}, CUDA available: {torch.cuda.is_available()}): it "
                                  "traces (fake kernels) but does not run")

    def _check_out(self, tensors: tuple, outs: tuple) -> None:
        """The out= form's outputs: dtype and shape of what this call writes, contiguous, on this
        rank's GPU, and overlapping neither an input nor each other (the kernel reads the inputs
        while it writes)."""
        sig = self.signature
        sig.check_out([t.shape for t in tensors], _metas(outs))
        for name, o in zip(sig.out_names, outs):
            if o.device.type != "cuda" or (self.device is not None and o.device.index != self.device):
                raise TsgenArgumentError(f"{self.where}: out {name}: on {o.device}, but this rank's op runs on "
                                         f"cuda:{self.device}")
        problem = overlap_problem(sig.arg_names, tensors, sig.out_names, outs)
        if problem:
            raise TsgenArgumentError(f"{self.where}: {problem}")

    def _forward(self, *tensors: torch.Tensor, out: Sequence[torch.Tensor] | None = None) -> Any:
        count = self._check(tensors)
        self._need_gpu()
        sig = self.signature
        x = tensors[0]
        if out is None:  # the functional form: new tensors
            outs = [torch.empty(shape, dtype=getattr(torch, TORCH_DTYPES[b.dtype]), device=x.device)
                    for shape, b in zip(sig.out_shapes([t.shape for t in tensors]), sig.outputs)]
        else:
            outs = list(out)
            self._check_out(tensors, tuple(outs))
        result = outs[0] if len(outs) == 1 else tuple(outs)
        if count == 0:
            return result
        state = self._heap(count)
        self._check_order(state)
        plan = plan_call(sig, tensors, outs, state.view)
        args = list(state.cargs)
        for name, ptr in plan.pointers.items():  # local buffers: the caller's tensors
            args[state.index[name]] = ctypes.c_void_p(ptr)
        for i, t in enumerate(tensors):  # "arg" inputs: read where they are, by the kernel on this GPU
            if hasattr(sig, "ins") and sig.ins[i].how == "arg":
                args.append(ctypes.c_void_p(t.data_ptr()))
        for slot, t in plan.copy_in:  # not op.empty()'s tensor: one copy in
            slot.copy_(t)
        err = call_on_stream(self.device, self._launcher, args)
        if err != 0:
            raise TsgenTorchError(f"{self.where}: {self.kernel.launcher} failed with cudaError {err} "
                                  f"(count {count}); a kernel that trapped before leaves this error: "
                                  "tsgen.torch.synchronize() names it")
        state.last = getattr(sig, "entry", None)
        for o, slot in plan.copy_out:
            o.copy_(slot)
        for o, dim, i in sig.own_blocks():  # this rank's block is the input the kernel read it from
            outs[o].narrow(dim, self.rank * count, count).copy_(tensors[i])
        return result

    def _check_order(self, state: _HeapState) -> None:
        """The ops of one module (MoE's dispatch and combine) run in their cyclic order on a heap: the
        kernels' protocol (each reads what the previous left in the heap, and a dispatch may rewrite
        the receive buffers only after the combine that read them)."""
        order = getattr(self.signature, "order", ())
        if not order:
            return
        me = order.index(self.signature.entry)
        want = order[me - 1]
        if state.last != want and not (state.last is None and me == 0):
            did = f"the last was {state.last}" if state.last else "none was called yet"
            raise TsgenTorchError(f"{self.where}: called out of turn ({did} with this many tokens); "
                                  f"{self.manifest.spec}'s ops run in the order {' -> '.join(order)} -> "
                                  f"{order[0]} ... on the same tokens")

    def empty_out(self, *shape: Any) -> Any:
        """The out= tensors for a call whose first input has `shape` (as `empty` takes it): a tensor, or
        a tuple in output order. An output a peer writes (a collective's, allgather_gemm's gathered
        A) must live in the symmetric heap to be written in place: it is a view of this op's heap
        slot, so the call copies nothing out. It holds the results of the op's latest call with
        this count, and the next such call (a backward's too, where the op is a paired adjoint)
        overwrites it; valid until close(). A local output (allgather_gemm's and
        gemm_reduce_scatter's C) is a new torch.empty: the kernel writes it wherever it lives.
        A collective the first time a count is used (it makes the heap)."""
        sig = self.signature
        if getattr(sig, "entry", None) is not None:
            self._outs_of(None)  # raises: no out= form
        shape, count = self._first_count(shape, "empty_out")
        self._need_gpu()
        local = sig.local()
        outs = []
        for want, b in zip(sig.out_shapes([shape]), sig.outputs):
            dtype = getattr(torch, TORCH_DTYPES[b.dtype])
            if count == 0 or b.name in local:
                outs.append(torch.empty(want, dtype=dtype, device=f"cuda:{self.device}"))
                continue
            numel = 1
            for n in want:
                numel *= n
            outs.append(self._heap(count).view(b.name)[:numel].view(want))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _first_count(self, shape: tuple, what: str) -> tuple[tuple, int]:
        """(shape, count) of the first input `shape` (as `empty` and `empty_out` take it); a
        TsgenArgumentError where the first input sizes no heap."""
        sig = self.signature
        shape = sig.input_shape_for(shape)
        count = sig.count_of(sig.arg_names[0], shape, TORCH_DTYPES[sig.input.dtype], True)
        first = sig.ins[0] if hasattr(sig, "ins") else None
        if first is not None and (first.how != "in" or first.count_dim is None):
            why = ("is read where it is, in no heap (any CUDA tensor of that shape does)" if first.how == "arg" else
                   "sizes no heap (its shape is fixed)")
            does = ("makes the first input in the op's heap" if what == "empty" else
                    "sizes the op's heap by the first input")
            raise TsgenArgumentError(f"{sig.where(sig.arg_names[0])}: op.{what} {does}, but {first.described()} {why}")
        return shape, count

    def empty(self, *shape: Any) -> torch.Tensor:
        """An input tensor of `shape` that lives in this op's symmetric heap: the op reads it where it
        is (no copy in). A collective the first time a shape is used (it makes the heap). Valid until
        close(); the op's next call with this shape reads whatever it holds then. The op's first
        input (x); an op whose first input lives in no heap (MoE combine's y, read where it is) or
        has no run-time count to size one says so (TsgenArgumentError)."""
        sig = self.signature
        shape, count = self._first_count(shape, "empty")
        dtype = TORCH_DTYPES[sig.input.dtype]
        self._need_gpu()
        numel = 1
        for n in shape:
            numel *= n
        if count == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{self.device}")
        return self._heap(count).view(sig.input.name)[:numel].view(shape)

    def close(self) -> None:
        """Free this op's heaps (collective for CUDA IPC heaps) and unregister it; tensors from
        empty() are invalid afterwards."""
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        problems = []
        for count in sorted(self._heaps):
            try:
                self._heaps[count].heap.close()
            except TsgenTorchError as e:
                problems.append(str(e))
        self._heaps.clear()
        if _OPS.get((self.name, self.group_name)) is self:
            del _OPS[(self.name, self.group_name)]
        if problems:
            raise TsgenTorchError("; ".join(problems))


def load(spec_or_manifest: Any, group: Any = None, *, source: Any = None, arch: str | None = None,
         heap: str | None = None) -> "TorchOp | ModuleOps":
    """This rank's op for a generated module on `group` (default: the default process group); for a
    module of several ops (MoE: dispatch and combine on one heap) a ModuleOps of them, paired where
    they are each other's adjoint.

    `spec_or_manifest`: a spec file (.yaml; rendered into the compile cache), a manifest
    (NAME.json, its NAME.cu beside it unless `source`), or a tsgen.manifest.Manifest with `source`.
    `arch`: nvcc's target (default: the GPU's, sm_90a on Hopper). `heap`: "auto" (torch symmetric
    memory, else CUDA IPC), "symm_mem" or "ipc" (default: $TSGEN_TORCH_HEAP or auto).

    Collective on `group` when it has GPUs (every rank compiles the module and checks the group
    together); on torch's "fake" backend, or without CUDA, the op only traces (fake kernels).
    Loading the same module on the same group again returns the same op."""
    force_no_multicast()  # NVLink multicast never: symmetric memory reads this before its first heap
    if not dist.is_available() or not dist.is_initialized():
        raise TsgenTorchError("tsgen.torch.load needs torch.distributed initialised (torchrun + "
                              "torch.distributed.init_process_group); the op runs on a process group")
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise TsgenTorchError(f"this process (global rank {dist.get_rank()}) is not a member of the group it "
                              "loads the op on")
    manifest, src = _resolve(_fit_shared(spec_or_manifest, group), source)
    entries = entries_of(manifest, world, rank) if world in manifest.world_sizes else None
    if entries is None:
        return _load_one(manifest, src, group, signature_of(manifest, world, rank), arch, heap)
    ops: dict[str, TorchOp] = {}
    for entry in entries["entries"]:
        first = next(iter(ops.values()), None)
        ops[entry] = _load_one(manifest, src, group, signature_of(manifest, world, rank, entry), arch, heap, first)
    if entries["adjoint"] and len(ops) == 2:
        pair(*ops.values())
    return ModuleOps(manifest.name, ops)


def _load_one(manifest: Manifest, src: Path, group: Any, signature: Any, arch: str | None, heap: str | None,
              shares: TorchOp | None = None) -> TorchOp:
    """One op (load's body): its refusals, the same op again when loaded before, else a new one."""
    rank = signature.rank
    refusal = multimem_refusal(manifest, os.environ, False)
    if refusal:
        raise TsgenTorchError(f"{signature.qualname} on rank {rank}: {refusal}")
    if manifest.device_libs:
        raise TsgenTorchError(f"{signature.qualname} on rank {rank}: built for the NVSHMEM transport (device libraries "
                              f"{', '.join(manifest.device_libs)}), which tsgen.torch does not load yet; use the p2p "
                              "variant of the spec")
    name = signature.module
    key = (name, group.group_name)
    if key in _OPS:
        op = _OPS[key]
        if op.manifest.spec_sha256 != manifest.spec_sha256:
            raise TsgenTorchError(f"{signature.qualname} on rank {rank}: already loaded on this group from another "
                                  f"spec ({op.manifest.spec}, sha256 {op.manifest.spec_sha256[:12]}); close() it "
                                  "first, or give the new spec another name")
        return op
    if _DEFINED.get(name, manifest.spec_sha256) != manifest.spec_sha256:
        raise TsgenTorchError(f"{signature.qualname}: another spec of this name (sha256 "
                              f"{_DEFINED[name][:12]}) defined the op in this process; one module name is one "
                              "op: give the spec another name")
    op = TorchOp(manifest, src, group, signature, arch, heap, shares)
    _define(name, signature)
    _DEFINED[name] = manifest.spec_sha256
    _OPS[key] = op
    return op


class ModuleOps:
    """A module of several torch ops on one heap (MoE: `.dispatch`, `.combine`), as load returns it;
    each op is a TorchOp, also reachable as ops["dispatch"]. close() frees their heap."""

    def __init__(self, module: str, ops: dict[str, TorchOp]):
        self.module, self.ops = module, ops
        for entry, op in ops.items():
            setattr(self, entry, op)

    def __getitem__(self, entry: str) -> TorchOp:
        return self.ops[entry]

    def __repr__(self) -> str:
        return f"<tsgen.torch module {self.module}: {', '.join(map(repr, self.ops.values()))}>"

    def close(self) -> None:
        for op in self.ops.values():
            op.close()


def pair(op: TorchOp, adjoint: TorchOp) -> None:
    """Make each op the other's backward: allgather's gradient is the reduce-scatter of its output's
    gradient, and the other way round; Ulysses' pre all-to-all's gradient is the post all-to-all of
    its output's gradient (a permutation's adjoint is its inverse), and the other way round. Both on
    the same group, same dtype, mirrored shapes."""
    if op.group_name != adjoint.group_name:
        raise TsgenTorchError(f"{op.signature.qualname} is on group {op.group_name!r}, "
                              f"{adjoint.signature.qualname} on {adjoint.group_name!r}: an adjoint runs on the same group")
    for a, b in ((op, adjoint), (adjoint, op)):
        problem = a.signature.adjoint_problem(b.signature)
        if problem:
            raise TsgenTorchError(problem)
    op.adjoint, adjoint.adjoint = adjoint, op


def loaded() -> list[TorchOp]:
    """Every op loaded in this process."""
    return list(_OPS.values())


def close_all() -> None:
    """close() every loaded op (collective for CUDA IPC heaps), in load order, after the heaps other holders
    registered in AT_CLOSE_ALL (cp_attention's push= heaps)."""
    try:
        for closer in list(AT_CLOSE_ALL):
            closer()
    finally:  # a holder that could not close its heaps leaves the ops still to close
        for op in list(_OPS.values()):
            op.close()


def timeout_lines(printed: str) -> list[str]:
    """The timeout diagnoses a tsgen kernel printed (tsgen/sync.cuh's timeout_trap), in order."""
    return [line.strip() for line in printed.splitlines() if line.lstrip().startswith("tsgen: timeout")]


def synchronize(device: Any = None) -> None:
    """torch.cuda.synchronize(device), turning a failed kernel into a TsgenTorchError that names this
    rank and the diagnosis a tsgen kernel printed when one of its waits timed out (a peer that never
    arrived): who waited for which signal of which rank, for what value, having seen what. The
    device's printf output reaches stdout at such a synchronization; it is captured here, passed
    on to stdout, and read. After a trap the CUDA context is lost: the process must end."""
    error = None
    with device_output() as captured:  # passed on to stdout too
        try:
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or AcceleratorError by version
            error = e
    if error is None:
        return
    printed = captured.text
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    who = f"rank {rank}" if rank is not None else "this process"
    lines = timeout_lines(printed)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if lines:
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        text = f"{who}: a tsgen kernel timed out waiting for a peer: {lines[0]}{more}; CUDA: {first}"
    else:
        text = f"{who}: a kernel failed ({first}); no tsgen timeout diagnosis was printed"
    raise TsgenTorchError(text + "; the CUDA context is lost, end this process") from error
