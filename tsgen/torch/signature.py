"""What a generated module looks like as a torch op: one tensor in, one tensor out, read off the manifest.

Pure Python (no torch): the fake kernels, the real op and the CPU tests share it.

A module qualifies when its op kind is a plan-based collective (its family states a `Semantics`:
allgather, reduce_scatter, all_reduce, all_to_all, broadcast) and its manifest has exactly one
`input` buffer and one `output` buffer (every other buffer a `signal` or `scratch`), each holding
`units` x count elements, where units = per_count + per_world_count x W (W: the group's size) and
no fixed part. The op takes a tensor of shape (d0, *rest), solves count = numel / in_units, and
returns a tensor of shape (d0 x out_units / in_units, *rest): the layout of torch.distributed's
all_gather_into_tensor (allgather: in 1, out W), reduce_scatter_tensor (in W, out 1), all_reduce
and broadcast (1, 1) and all_to_all_single (W, W). Which rank's chunk lands where is the op
family's semantics (tsgen/ops/collectives/*.py, SEMANTICS); for the shipped collectives it is
torch's.
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
# allgather's gradient is the reduce-scatter (sum) of the output gradient, and the other way round.
ADJOINT_KINDS = {"allgather": "reduce_scatter", "reduce_scatter": "allgather"}


class TsgenTorchError(RuntimeSetupError):
    """A tsgen op cannot be loaded or run in this PyTorch program (the message names the op and rank)."""


class TsgenArgumentError(TsgenTorchError, ValueError):
    """A tensor handed to a tsgen op has the wrong dtype, shape, device or layout."""


def kind_problem(op: str) -> str | None:
    """Why op kind `op` is not (yet) a tsgen.torch op, or None. The ops it runs are the collectives
    whose family states what they compute as a `Semantics` (tsgen/ops/collectives/semantics.py):
    their input and output are count-sized chunks along dimension 0, torch's layout. Other families'
    tensors have shapes of their own (GEMM operands, attention heads, MoE token lists)."""
    from ..ops import get_family

    family = get_family(op)
    if getattr(family, "semantics", None) is None:
        return (f"op kind {op} ({family.category}) is not a tsgen.torch op yet; tsgen.torch runs the plan-based "
                f"collectives ({', '.join(supported_kinds())})")
    return None


def supported_kinds() -> list[str]:
    """The op kinds tsgen.torch runs (see kind_problem)."""
    from ..ops import families

    return sorted(f.kind for f in families() if getattr(f, "semantics", None) is not None)


def units(buffer: Buffer, world: int) -> int:
    """Elements of `buffer` per unit of count at world size `world`."""
    return buffer.per_count + buffer.per_world_count * world


@dataclass(frozen=True)
class OpSignature:
    """A module as a torch op at one group size, seen from one rank."""

    module: str
    op: str  # the op kind (manifest `op`)
    spec: str  # the spec's path, for messages
    world: int
    rank: int
    input: Buffer
    output: Buffer

    @property
    def qualname(self) -> str:
        return f"tsgen::{self.module}"

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
        problem = kind_problem(manifest.op)
        if problem:
            raise TsgenTorchError(f"{where}: {problem}")
        if world not in manifest.world_sizes:
            raise TsgenTorchError(
                f"{where}: the process group has {world} ranks, but {manifest.spec} was compiled for world sizes "
                f"{list(manifest.world_sizes)}; add {world} to world_sizes in the spec (or use a group of "
                f"{' / '.join(map(str, manifest.world_sizes))} ranks)")
        data = [b for b in manifest.buffers if b.role not in ("signal", "scratch")]
        ins = [b for b in data if b.role == "input"]
        outs = [b for b in data if b.role == "output"]
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
            if b.dtype not in TORCH_DTYPES:
                raise TsgenTorchError(f"{where}: buffer {b.name} has dtype {b.dtype}, which has no torch dtype here")
        if i.dtype != o.dtype:
            raise TsgenTorchError(f"{where}: input {i.name} is {i.dtype} but output {o.name} is {o.dtype}")
        return cls(manifest.name, manifest.op, manifest.spec, world, rank, i, o)

    def where(self, arg: str = "x") -> str:
        return f"{self.qualname} on rank {self.rank}: argument {arg}"

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

    def input_shape_for(self, shape: Sequence[Any]) -> tuple:
        """`shape` as given to op.empty (a tuple, or the sizes as separate arguments)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            return tuple(shape[0])
        return tuple(shape)

    def adjoint_problem(self, other: "OpSignature") -> str | None:
        """Why `other` cannot be this op's adjoint (run by its backward), or None."""
        want = ADJOINT_KINDS.get(self.op)
        if want is None:
            return (f"{self.qualname} ({self.op}) has no adjoint op in tsgen.torch (adjoints: "
                    + ", ".join(f"{a} <-> {b}" for a, b in ADJOINT_KINDS.items() if a < b) + ")")
        if other.op != want:
            return f"{self.qualname} ({self.op}) needs a {want} op as its adjoint, not {other.qualname} ({other.op})"
        if other.dtype != self.dtype:
            return f"{self.qualname} is {self.dtype} but {other.qualname} is {other.dtype}"
        if (other.in_units, other.out_units) != (self.out_units, self.in_units):
            return (f"{other.qualname} maps {other.in_units} chunks to {other.out_units}; the adjoint of "
                    f"{self.qualname} must map {self.out_units} to {self.in_units}")
        return None
