"""What a generated module looks like as a torch op: its tensors in and out, read off the manifest.

Pure Python (no torch): the fake kernels, the real op and the CPU tests share it. Two kinds:

`OpSignature`, the plan-based collectives (the family states a `Semantics`: allgather,
reduce_scatter, all_reduce, all_to_all, broadcast): one `input` and one `output` buffer (every
other buffer a `signal` or `scratch`), each holding `units` x count elements, where units =
per_count + per_world_count x W (W: the group's size) and no fixed part. The op takes a tensor of
shape (d0, *rest), solves count = numel / in_units, and returns a tensor of shape
(d0 x out_units / in_units, *rest): the layout of torch.distributed's all_gather_into_tensor
(allgather: in 1, out W), reduce_scatter_tensor (in W, out 1), all_reduce and broadcast (1, 1)
and all_to_all_single (W, W). Which rank's chunk lands where is the op family's semantics
(tsgen/ops/collectives/*.py, SEMANTICS); for the shipped collectives it is torch's.

`ShapedSignature`, families whose tensors have shapes of their own (Ulysses: [batch, S/P, heads,
head_dim] in, [batch, S, heads/P, head_dim] out): the family's `torch_tensors(constants, world)`
hook names each data buffer's dimensions, every one fixed at compile time but one, a multiple of
the run-time count (or all fixed: a GEMM's B). Such an op takes and returns exactly those shapes
(allgather_gemm: A [M/P, K], B [K, N/P] in; C [M, N/P] and the gathered A [M, K] out). Such a
family may also name its local buffers, those only this rank's kernel touches
(`torch_local(constants, world, buffers)`): the op hands the launcher the caller's tensors for
them (tsgen/torch/ops.py plan_call).

Either kind also gives the out= form's schema and checks (`out_schema`, `check_out`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import RuntimeSetupError
from ..manifest import Buffer, Manifest

# manifest dtype -> torch dtype attribute name (the types a data buffer of a collective can have)
TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "int32": "int32",
                "uint8": "uint8"}

# Op kinds whose adjoint (the op their backward runs) is another tsgen op: kind -> adjoint's kind.
# allgather's gradient is the reduce-scatter (sum) of the output gradient, and the other way round;
# Ulysses' pre and post all-to-alls are permutations of the elements, each the other's inverse, so
# each is the other's adjoint (a permutation's adjoint is its inverse).
# The fused GEMMs: allgather_gemm's input gradient dA = reduce_scatter(dC . B^T) is a gemm_reduce_scatter
# with the transposed weight, gemm_reduce_scatter's dA = allgather(dC) . B^T an allgather_gemm (the
# weight gradients are local GEMMs, tsgen/torch/grads.py).
ADJOINT_KINDS = {"allgather": "reduce_scatter", "reduce_scatter": "allgather",
                 "ulysses_pre_a2a": "ulysses_post_a2a", "ulysses_post_a2a": "ulysses_pre_a2a",
                 "allgather_gemm": "gemm_reduce_scatter", "gemm_reduce_scatter": "allgather_gemm",
                 # MoE: dispatch copies each token to its destination ranks, (unweighted) combine sums
                 # the rows back per token: each is the other's adjoint (same routing, same module)
                 "moe_dispatch": "moe_combine", "moe_combine": "moe_dispatch"}


class TsgenTorchError(RuntimeSetupError):
    """A tsgen op cannot be loaded or run in this PyTorch program (the message names the op and rank)."""


class TsgenArgumentError(TsgenTorchError, ValueError):
    """A tensor handed to a tsgen op has the wrong dtype, shape, device or layout."""


def _runs_as_torch_op(family: Any) -> bool:
    return (getattr(family, "semantics", None) is not None or hasattr(family, "torch_tensors")
            or hasattr(family, "torch_entries"))


def kind_problem(op: str) -> str | None:
    """Why op kind `op` is not (yet) a tsgen.torch op, or None. The ops it runs are the collectives
    whose family states what they compute as a `Semantics` (tsgen/ops/collectives/semantics.py):
    their input and output are count-sized chunks along dimension 0, torch's layout; and the
    families that say which tensors their buffers are (a `torch_tensors` hook: Ulysses). Other
    families' tensors have shapes nobody has written down yet (GEMM operands, MoE token lists)."""
    from ..ops import get_family

    family = get_family(op)
    loader = getattr(family, "torch_loader", None)  # a one-GPU op with a loader of its own (attention)
    if loader:
        return f"op kind {op} runs on one GPU, without a process group: load it with {loader}"
    if not _runs_as_torch_op(family):
        return (f"op kind {op} ({family.category}) is not a tsgen.torch op yet; tsgen.torch runs "
                f"{', '.join(supported_kinds())}")
    return None


def supported_kinds() -> list[str]:
    """The op kinds tsgen.torch runs (see kind_problem)."""
    from ..ops import families

    return sorted(f.kind for f in families() if _runs_as_torch_op(f))


def units(buffer: Buffer, world: int) -> int:
    """Elements of `buffer` per unit of count at world size `world`."""
    return buffer.per_count + buffer.per_world_count * world


def _compiled_problem(manifest: Manifest, world: int, rank: int) -> str | None:
    """Why `manifest` cannot be a torch op on a group of `world` ranks, or None (the checks every kind shares)."""
    where = f"tsgen::{manifest.name} on rank {rank}"
    problem = kind_problem(manifest.op)
    if problem:
        return f"{where}: {problem}"
    if world not in manifest.world_sizes:
        return (f"{where}: the process group has {world} ranks, but {manifest.spec} was compiled for world sizes "
                f"{list(manifest.world_sizes)}; add {world} to world_sizes in the spec (or use a group of "
                f"{' / '.join(map(str, manifest.world_sizes))} ranks)")
    return None


def _data_buffers(manifest: Manifest) -> tuple[list[Buffer], list[Buffer], list[Buffer]]:
    data = [b for b in manifest.buffers if b.role not in ("signal", "scratch")]
    return data, [b for b in data if b.role == "input"], [b for b in data if b.role == "output"]


def _dtype_problem(where: str, b: Buffer) -> str | None:
    if b.dtype not in TORCH_DTYPES:
        return f"{where}: buffer {b.name} has dtype {b.dtype}, which has no torch dtype here"
    return None


def entries_of(manifest: Manifest, world: int, rank: int = 0) -> dict | None:
    """The family's torch entries of a module (`torch_entries`: several ops on one heap, MoE's dispatch
    and combine), or None where the module is one op; TsgenTorchError where the family refuses it."""
    from ..ops import get_family

    if kind_problem(manifest.op) is not None:
        return None
    family = get_family(manifest.op)
    if not hasattr(family, "torch_entries"):
        return None
    got = family.torch_entries(dict(manifest.constants), world, {b.name for b in manifest.buffers})
    if isinstance(got, str):
        raise TsgenTorchError(f"tsgen::{manifest.name} on rank {rank}: {manifest.spec} is not a tsgen.torch op: {got}")
    return got


def signature_of(manifest: Manifest, world: int, rank: int, entry: str | None = None
                 ) -> "OpSignature | ShapedSignature":
    """The signature of `manifest` (of its `entry`, for a module of several ops) for a group of
    `world` ranks, seen from `rank`: a ShapedSignature where the family says which tensors its
    buffers are (`torch_tensors`, `torch_entries`), else an OpSignature."""
    from ..ops import get_family

    if kind_problem(manifest.op) is None:
        family = get_family(manifest.op)
        if hasattr(family, "torch_tensors") or hasattr(family, "torch_entries"):
            return ShapedSignature.of(manifest, world, rank, entry)
    return OpSignature.of(manifest, world, rank)


class _Signature:
    """What the torch op needs of either kind of signature (module, op, spec, world, rank and the
    data buffers come from the dataclasses below)."""

    module: str
    op: str
    spec: str
    world: int
    rank: int

    @property
    def qualname(self) -> str:
        return f"tsgen::{self.module}"

    def where(self, arg: str = "x") -> str:
        return f"{self.qualname} on rank {self.rank}: argument {arg}"

    def schema(self) -> str:
        """The custom op's schema: its tensors by name, the group's name; one tensor or a tuple back."""
        args = ", ".join(f"Tensor {a}" for a in self.arg_names)
        outs = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join("Tensor" for _ in self.outputs) + ")"
        return f"{self.module}({args}, str group_name) -> {outs}"

    def check(self, args: Sequence[tuple[Sequence[Any], str, bool]]) -> Any:
        """The kernel's count for arguments given as (shape, torch dtype name, contiguous) in order;
        a TsgenArgumentError naming the argument and rank when the op cannot take them."""
        count = None
        for name, (shape, dtype, contiguous) in zip(self.arg_names, args):
            c = self.count_of(name, shape, dtype, contiguous)
            if c is None:
                continue
            if count is None:
                count = c
            elif c != count:
                raise TsgenArgumentError(f"{self.where(name)}: shape {tuple(shape)} means count {c}, but "
                                         f"argument {self.arg_names[0]} means {count}")
        return count

    def own_blocks(self) -> list[tuple[int, int, int]]:
        """(output index, dimension, input index) of each output whose block of this rank (count
        along that dimension, at rank x count) the kernel does not write: the caller copies that
        input there (TensorLayout.own_from)."""
        return []

    def local(self) -> frozenset[str]:
        """The data buffers only this rank's kernel reads or writes (no peer addresses them): the
        launcher may be handed any tensor on this GPU for them, so the op reads such an input where
        it is and writes such an output straight into the caller's tensor (the family's
        `torch_local`; none for the collectives, whose plans address peers' buffers)."""
        return frozenset()

    @property
    def out_names(self) -> tuple[str, ...]:
        """The out= form's output arguments: the output buffers' names."""
        return tuple(b.name for b in self.outputs)

    def out_schema(self) -> str:
        """The schema of the out= form, tsgen::<module>_out: the inputs, then each output as a mutated
        argument (Tensor(a!) c, ...), then the group's name; returns nothing (the caller's tensors hold
        the results)."""
        clash = set(self.out_names) & {*self.arg_names, "group_name", "out"}
        if clash:  # a family bug: caught at load, not as a broken schema
            raise TsgenTorchError(f"{self.qualname}: output buffer names {sorted(clash)} clash with its arguments")
        args = ", ".join(f"Tensor {a}" for a in self.arg_names)
        outs = ", ".join(f"Tensor({chr(ord('a') + i)}!) {n}" for i, n in enumerate(self.out_names))
        return f"{self.module}_out({args}, {outs}, str group_name) -> ()"

    def check_out(self, shapes: Sequence[Sequence[Any]], outs: Sequence[tuple[Sequence[Any], str, bool]]) -> None:
        """Check the out= form's outputs, given as (shape, torch dtype name, contiguous), against what a
        call on inputs of `shapes` (already checked) writes; a TsgenArgumentError naming the output."""
        names = self.out_names
        if len(outs) != len(names):
            raise TsgenArgumentError(f"{self.qualname} on rank {self.rank}: out= has {len(outs)} tensors, but the op "
                                     f"writes {len(names)} ({', '.join(names)})")
        for i, (name, b, want, (shape, dtype, contiguous)) in enumerate(zip(names, self.outputs,
                                                                            self.out_shapes(shapes), outs)):
            where = f"{self.qualname} on rank {self.rank}: out {name}"
            if dtype != TORCH_DTYPES[b.dtype]:
                raise TsgenArgumentError(f"{where}: dtype {dtype}, but {self.spec} writes {b.dtype}")
            if len(shape) != len(want) or any(g != w for g, w in zip(shape, want)):
                raise TsgenArgumentError(f"{where}: shape {tuple(shape)}, but this call writes {tuple(want)} "
                                         f"({self._out_described(i)})")
            if not contiguous:
                raise TsgenArgumentError(f"{where}: not contiguous (shape {tuple(shape)}); the kernel writes one "
                                         "dense buffer")

    def input_shape_for(self, shape: Sequence[Any]) -> tuple:
        """`shape` as given to op.empty (a tuple, or the sizes as separate arguments)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            return tuple(shape[0])
        return tuple(shape)

    def adjoint_problem(self, other: "_Signature") -> str | None:
        """Why `other` cannot be this op's adjoint (run by its backward), or None."""
        want = ADJOINT_KINDS.get(self.op)
        if want is None or (len(self.inputs) == 1 and len(self.outputs) != 1):
            return (f"{self.qualname} ({self.op}) has no adjoint op in tsgen.torch (adjoints: "
                    + ", ".join(f"{a} <-> {b}" for a, b in ADJOINT_KINDS.items() if a < b)
                    + "; one tensor in and one out, or a GEMM's A and B in)")
        if other.op != want:
            return f"{self.qualname} ({self.op}) needs a {want} op as its adjoint, not {other.qualname} ({other.op})"
        if other.dtype != self.dtype:
            return f"{self.qualname} is {self.dtype} but {other.qualname} is {other.dtype}"
        return self._mirror_problem(other)


@dataclass(frozen=True)
class OpSignature(_Signature):
    """A plan-based collective as a torch op at one group size, seen from one rank (module doc)."""

    module: str
    op: str  # the op kind (manifest `op`)
    spec: str  # the spec's path, for messages
    world: int
    rank: int
    input: Buffer
    output: Buffer

    arg_names = ("x",)

    @property
    def inputs(self) -> tuple[Buffer, ...]:
        return (self.input,)

    @property
    def outputs(self) -> tuple[Buffer, ...]:
        return (self.output,)

    @property
    def dtype(self) -> str:
        return self.input.dtype

    @property
    def in_units(self) -> int:
        return units(self.input, self.world)

    @property
    def out_units(self) -> int:
        return units(self.output, self.world)

    @classmethod
    def of(cls, manifest: Manifest, world: int, rank: int) -> "OpSignature":
        """The signature of `manifest` for a group of `world` ranks; TsgenTorchError when it was not
        compiled for that size (naming the sizes it was), or is not one tensor in, one tensor out."""
        where = f"tsgen::{manifest.name} on rank {rank}"
        problem = _compiled_problem(manifest, world, rank)
        if problem:
            raise TsgenTorchError(problem)
        data, ins, outs = _data_buffers(manifest)
        if len(ins) != 1 or len(outs) != 1 or len(data) != 2:
            roles = ", ".join(f"{b.name} ({b.role})" for b in data) or "none"
            raise TsgenTorchError(
                f"{where}: tsgen.torch runs modules with one input and one output buffer; {manifest.spec} has "
                f"{roles} (in-place and multi-input ops are not supported yet)")
        (i,), (o,) = ins, outs
        for b in (i, o):
            if b.fixed or units(b, world) == 0:
                raise TsgenTorchError(f"{where}: buffer {b.name} holds {b.per_count} x count + "
                                      f"{b.per_world_count} x world x count + {b.fixed} elements; tsgen.torch needs "
                                      "a whole number of count-sized chunks")
            problem = _dtype_problem(where, b)
            if problem:
                raise TsgenTorchError(problem)
        if i.dtype != o.dtype:
            raise TsgenTorchError(f"{where}: input {i.name} is {i.dtype} but output {o.name} is {o.dtype}")
        return cls(manifest.name, manifest.op, manifest.spec, world, rank, i, o)

    def count_of(self, arg: str, shape: Sequence[Any], dtype: str, contiguous: bool = True) -> Any:
        return self.count(shape, dtype, contiguous, arg)

    def count(self, shape: Sequence[Any], dtype: str, contiguous: bool = True, arg: str = "x") -> Any:
        """The kernel's count for an argument of this `shape` and torch `dtype` name; a
        TsgenArgumentError naming the argument and rank when the op cannot take it. Works on
        symbolic sizes (torch.compile's dynamic shapes), where the checks become guards."""
        if dtype != TORCH_DTYPES[self.dtype]:
            raise TsgenArgumentError(f"{self.where(arg)}: dtype {dtype}, but {self.spec} was compiled for "
                                     f"{self.dtype}")
        if len(shape) == 0:
            raise TsgenArgumentError(f"{self.where(arg)}: a 0-dimensional tensor; the op splits and joins along "
                                     "dimension 0")
        if not contiguous:
            raise TsgenArgumentError(f"{self.where(arg)}: not contiguous (shape {tuple(shape)}); call "
                                     ".contiguous() first (the kernel reads one dense buffer)")
        d0 = shape[0]
        if d0 % self.in_units != 0:
            what = ("the group size" if self.in_units == self.world else f"{self.in_units} (the input's chunks)")
            raise TsgenArgumentError(
                f"{self.where(arg)}: dimension 0 is {d0} (shape {tuple(shape)}), not a multiple of {what}: "
                f"{self.qualname} splits dimension 0 into {self.in_units} equal chunks")
        rest = 1
        for s in shape[1:]:
            rest = rest * s
        return d0 * rest // self.in_units

    def out_shape(self, shape: Sequence[Any]) -> tuple:
        """The output's shape for an input of `shape` (already checked by `count`)."""
        return (shape[0] * self.out_units // self.in_units, *shape[1:])

    def out_shapes(self, shapes: Sequence[Sequence[Any]]) -> list[tuple]:
        return [self.out_shape(shapes[0])]

    def _out_described(self, i: int) -> str:
        return f"{self.out_units}/{self.in_units} of the input's dimension 0, the rest as the input"

    def _mirror_problem(self, other: "_Signature") -> str | None:
        if (other.in_units, other.out_units) != (self.out_units, self.in_units):
            return (f"{other.qualname} maps {other.in_units} chunks to {other.out_units}; the adjoint of "
                    f"{self.qualname} must map {self.out_units} to {self.in_units}")
        return None


@dataclass(frozen=True)
class TensorLayout:
    """One data buffer as a tensor: its dimensions (name, size), every size fixed at compile time but
    the count dimension's (`count_dim`), whose size is `size` x count; count_dim None: the whole
    shape is fixed. The tensor is the buffer's first numel elements (a buffer may be sized for
    the largest world size)."""

    buffer: Buffer
    dims: tuple[tuple[str, int], ...]
    count_dim: int | None
    # an output whose block of this rank (count rows at rank x count along count_dim) the kernel
    # leaves to the caller: it is the input of this name (allgather_gemm's gathered A)
    own_from: str | None = None
    # an input: "in" (copied into its buffer), "shape" (only checked) or "arg" (passed by pointer,
    # after the buffers: `buffer` then describes it, in no heap); an output: "out"
    how: str = "in"
    # only this rank's kernel touches the buffer (the family's torch_local): the launcher takes the
    # caller's tensor for it (an input read where it is, an output written in place)
    local: bool = False

    @property
    def name(self) -> str:
        return self.buffer.name

    def shape(self, count: Any) -> tuple:
        return tuple(n * count if i == self.count_dim else n for i, (_, n) in enumerate(self.dims))

    def described(self) -> str:
        """The shape in words: [batch 2, S/P, heads 24, head_dim 128] (the count dimension by name)."""
        parts = [name if i == self.count_dim else f"{name} {n}" for i, (name, n) in enumerate(self.dims)]
        return "[" + ", ".join(parts) + "]"


@dataclass(frozen=True)
class ShapedSignature(_Signature):
    """A module whose family names its tensors' shapes (`torch_tensors`), at one group size, seen from one rank."""

    module: str
    op: str
    spec: str
    world: int
    rank: int
    ins: tuple[TensorLayout, ...]
    outs: tuple[TensorLayout, ...]
    entry: str | None = None  # one op of a module of several (MoE's dispatch, combine)
    order: tuple[str, ...] = ()  # the entries' cyclic call order
    pairable: bool = True  # whether the entries are each other's adjoint
    max_count: tuple[int, str] | None = None  # the most count per rank, and the spec field that sets it

    @property
    def arg_names(self) -> tuple[str, ...]:
        """One input is `x` (as for the collectives); several go by their buffers' names."""
        return ("x",) if len(self.ins) == 1 else tuple(t.name for t in self.ins)

    @property
    def inputs(self) -> tuple[Buffer, ...]:
        return tuple(t.buffer for t in self.ins)

    @property
    def outputs(self) -> tuple[Buffer, ...]:
        return tuple(t.buffer for t in self.outs)

    @property
    def input(self) -> Buffer:
        return self.ins[0].buffer

    @property
    def output(self) -> Buffer:
        return self.outs[0].buffer

    @property
    def dtype(self) -> str:
        return self.ins[0].buffer.dtype

    @classmethod
    def of(cls, manifest: Manifest, world: int, rank: int, entry: str | None = None) -> "ShapedSignature":
        """The signature from the family's `torch_tensors(constants, world)` (or of `entry` of its
        `torch_entries`); TsgenTorchError for a group size the spec was not compiled for, an in-place
        buffer, or a layout that does not fit its buffer (a family bug, caught here rather than as a
        wrong result)."""
        from ..ops import get_family

        where = f"tsgen::{manifest.name} on rank {rank}"
        problem = _compiled_problem(manifest, world, rank)
        if problem:
            raise TsgenTorchError(problem)
        entries = entries_of(manifest, world, rank)
        if entries is not None:
            return cls._of_entry(manifest, world, rank, entries, entry)
        data, ins, outs = _data_buffers(manifest)
        if len(ins) + len(outs) != len(data):
            roles = ", ".join(f"{b.name} ({b.role})" for b in data)
            raise TsgenTorchError(f"{where}: {manifest.spec} has {roles}; in-place buffers are not supported yet")
        family = get_family(manifest.op)
        tensors = family.torch_tensors(dict(manifest.constants), world)
        local = (family.torch_local(dict(manifest.constants), world, {b.name for b in manifest.buffers})
                 if hasattr(family, "torch_local") else ())
        # a scratch buffer the family names is returned too (after the outputs, in buffer order)
        outs = [b for b in manifest.buffers if b.role == "output" or (b.role == "scratch" and b.name in tensors)]
        layouts = []
        for b in ins + outs:
            if b.name not in tensors:
                raise TsgenTorchError(f"{where}: the {manifest.op} family names no tensor for buffer {b.name}")
            problem = _dtype_problem(where, b)
            if problem:
                raise TsgenTorchError(problem)
            dims, count_dim, *own = tensors[b.name]
            t = TensorLayout(b, tuple((str(n), int(v)) for n, v in dims), count_dim, own[0] if own else None,
                             "out" if b in outs else "in", b.name in local)
            if t.own_from is not None and (t.own_from not in [i.name for i in ins] or count_dim is None
                                           or t.dims[count_dim][1] != world):
                raise TsgenTorchError(f"{where}: tensor {t.described()} of buffer {b.name} takes its own rows from "
                                      f"{t.own_from}, which is not an input of its rows")
            for count in (1, 7):  # the tensor fits its buffer at every count
                numel = 1
                for n in t.shape(count):
                    numel *= n
                if numel > b.elems(count, world) or (count_dim is not None and numel == 0):
                    raise TsgenTorchError(f"{where}: tensor {t.described()} of buffer {b.name} does not fit its "
                                          f"{b.elems(count, world)} elements at count {count}")
            layouts.append(t)
        if not any(t.count_dim is not None for t in layouts[:len(ins)]):
            raise TsgenTorchError(f"{where}: no input of {manifest.spec} has a dimension the run-time count sizes")
        return cls(manifest.name, manifest.op, manifest.spec, world, rank, tuple(layouts[:len(ins)]),
                   tuple(layouts[len(ins):]))

    def local(self) -> frozenset[str]:
        return frozenset(t.name for t in (*self.ins, *self.outs) if t.local)

    def _out_described(self, i: int) -> str:
        return self.outs[i].described()

    def own_blocks(self) -> list[tuple[int, int, int]]:
        names = [t.name for t in self.ins]
        return [(o, t.count_dim, names.index(t.own_from)) for o, t in enumerate(self.outs) if t.own_from is not None]

    @classmethod
    def _of_entry(cls, manifest: Manifest, world: int, rank: int, entries: dict, entry: str | None
                  ) -> "ShapedSignature":
        where = f"tsgen::{manifest.name} on rank {rank}"
        if entry not in entries["entries"]:
            raise TsgenTorchError(f"{where}: {manifest.spec} is {len(entries['entries'])} ops "
                                  f"({', '.join(entries['entries'])}); name one (tsgen.torch.load gives them all)")
        buffers = {b.name: b for b in manifest.buffers}
        ins, outs = [], []
        for name, (dims, count_dim, how) in entries["entries"][entry].items():
            dims = tuple((str(n), int(v)) for n, v in dims)
            if how.startswith("arg:"):  # a pointer argument: no buffer; its elements and dtype described here
                numel = 1
                for _, v in dims:
                    numel *= v
                b = Buffer(name, how[4:], "input", per_count=0, fixed=numel)
                how = "arg"
            elif name in buffers:
                b = buffers[name]
            else:
                raise TsgenTorchError(f"{where}: entry {entry} names tensor {name}, which is no buffer of {manifest.spec}")
            problem = _dtype_problem(where, b)
            if problem:
                raise TsgenTorchError(problem)
            t = TensorLayout(b, dims, count_dim, how=how)
            (outs if how == "out" else ins).append(t)
        cap = entries.get("max_count")
        return cls(f"{manifest.name}_{entry}", f"{manifest.op}_{entry}", manifest.spec, world, rank, tuple(ins),
                   tuple(outs), entry, tuple(entries["order"]), bool(entries["adjoint"]),
                   (int(cap[0]), str(cap[1])) if cap else None)

    def layout_of(self, arg: str) -> TensorLayout:
        return self.ins[self.arg_names.index(arg)]

    def count_of(self, arg: str, shape: Sequence[Any], dtype: str, contiguous: bool = True) -> Any:
        """The count an argument of this shape means (None for a fixed-shape argument), checking its
        dtype, rank, fixed sizes and layout. Works on symbolic sizes (the checks become guards)."""
        t = self.layout_of(arg)
        if dtype != TORCH_DTYPES[t.buffer.dtype]:
            raise TsgenArgumentError(f"{self.where(arg)}: dtype {dtype}, but {self.spec} was compiled for "
                                     f"{t.buffer.dtype}")
        want = t.described()
        if len(shape) != len(t.dims):
            raise TsgenArgumentError(f"{self.where(arg)}: {len(shape)} dimensions (shape {tuple(shape)}), but "
                                     f"{self.qualname} takes {want} ({len(t.dims)} dimensions)")
        for i, ((name, n), got) in enumerate(zip(t.dims, shape)):
            if i != t.count_dim and got != n:
                raise TsgenArgumentError(
                    f"{self.where(arg)}: dimension {i} ({name}) is {got} (shape {tuple(shape)}), but {self.spec} "
                    f"was compiled for {name} {n}: {self.qualname} takes {want} at world size {self.world}")
        if not contiguous:
            raise TsgenArgumentError(f"{self.where(arg)}: not contiguous (shape {tuple(shape)}); call "
                                     ".contiguous() first (the kernel reads one dense buffer)")
        if t.count_dim is None:
            return None
        name, n = t.dims[t.count_dim]
        got = shape[t.count_dim]
        if got % n != 0:
            raise TsgenArgumentError(f"{self.where(arg)}: dimension {t.count_dim} ({name}) is {got} (shape "
                                     f"{tuple(shape)}), not a multiple of {n} (the group size)")
        return got // n

    def check(self, args: Sequence[tuple[Sequence[Any], str, bool]]) -> Any:
        count = super().check(args)
        if self.max_count is not None and count is not None and count > self.max_count[0]:
            t = next(t for t in self.ins if t.count_dim is not None)
            name = t.dims[t.count_dim][0]
            raise TsgenArgumentError(f"{self.where(t.name if len(self.ins) > 1 else 'x')}: {count} {name}, but "
                                     f"{self.spec} was compiled for at most {self.max_count[0]} ({self.max_count[1]})")
        return count

    def out_shapes(self, shapes: Sequence[Sequence[Any]]) -> list[tuple]:
        """The outputs' shapes for inputs of these shapes (already checked)."""
        t = next(t for t in self.ins if t.count_dim is not None)
        shape = shapes[self.ins.index(t)]
        count = shape[t.count_dim] // t.dims[t.count_dim][1]
        return [o.shape(count) for o in self.outs]

    def _mirror_problem(self, other: "_Signature") -> str | None:
        if self.entry is not None:  # two ops of one module (MoE dispatch and combine)
            if getattr(other, "spec", None) != self.spec or getattr(other, "entry", None) is None:
                return f"{other.qualname} is not another op of {self.spec}: {self.qualname}'s adjoint is its own module's"
            if not self.pairable:
                return (f"{self.qualname}: {self.spec} combines weighted (rows scaled by the routing weights), so "
                        "dispatch and combine are not each other's adjoint; use an unweighted spec")
            return None
        if len(self.ins) == 2:  # a GEMM's (A, B): the adjoint's B is this op's B transposed
            mine, theirs = self.ins[1], getattr(other, "ins", ())[1:2]
            want = [n for _, n in reversed(mine.dims)]
            if not theirs or [n for _, n in theirs[0].dims] != want:
                got = theirs[0].described() if theirs else "none"
                return (f"{other.qualname}'s weight b is {got} at world size {self.world}; the adjoint of "
                        f"{self.qualname} (b {mine.described()}) needs b^T, {want[0]} x {want[1]}: compile the two "
                        "specs for mirrored shapes")
            return None
        mine = (self.ins[0].dims, self.outs[0].dims)
        theirs = (getattr(other, "outs", (None,))[0], getattr(other, "ins", (None,))[0])
        if theirs[0] is None or (theirs[0].dims, theirs[1].dims) != mine:
            return (f"{other.qualname} does not map {self.outs[0].described()} back to {self.ins[0].described()}: "
                    f"not the adjoint of {self.qualname} (compile both for the same shapes)")
        return None
