"""The backward of every tsgen.torch op whose adjoint is another tsgen op: which tensors the forward
keeps, and the gradient formula, by op kind. The adjoint comes from `tsgen.torch.pair(op, adjoint)`
(ops.py); `adjoint(*tensors)` below calls it on the same group.

  allgather <-> reduce_scatter     dx = the other op of dy (a sum's adjoint is a copy, and back)
  ulysses_pre <-> ulysses_post     dx = the other op of dy (a permutation's adjoint is its inverse)
  allgather_gemm                   C = allgather(A) . B:
                                   dA = reduce_scatter(dC . B^T)  the gemm_reduce_scatter adjoint, B^T
                                   dB = allgather(A)^T . dC       local, from the gathered A the
                                                                  forward returned (not re-gathered)
  gemm_reduce_scatter              C = rows r of sum_s A_s . B_s:
                                   dA = allgather(dC) . B^T       the allgather_gemm adjoint, B^T
                                   dB = A^T . allgather(dC)       local, from the gathered dC the
                                                                  adjoint returns

What is not differentiable: allgather_gemm's second output (the gathered A, returned for the
weight gradient) carries no gradient; use C. B^T is a transposed copy of the weight at every
backward (K x N elements, local). Pure torch; no tsgen runtime here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Formula:
    """save(inputs, outputs) -> the tensors the backward needs; backward(adjoint, saved, grads, needs)
    -> one gradient (or None) per input; nondiff: indices of outputs without a gradient."""

    save: Callable[[tuple, tuple], tuple]
    backward: Callable[[Callable[..., Any], tuple, tuple, tuple], tuple]
    nondiff: tuple[int, ...] = ()


def _nothing(inputs: tuple, outputs: tuple) -> tuple:
    return ()


def _through_adjoint(adjoint: Callable[..., Any], saved: tuple, grads: tuple, needs: tuple) -> tuple:
    return (adjoint(grads[0].contiguous()),)


def _allgather_gemm(adjoint: Callable[..., Any], saved: tuple, grads: tuple, needs: tuple) -> tuple:
    b, a_full = saved
    dc = grads[0].contiguous()
    da = adjoint(dc, b.t().contiguous()) if needs[0] else None
    db = a_full.t() @ dc if needs[1] else None
    return da, db


def _gemm_reduce_scatter(adjoint: Callable[..., Any], saved: tuple, grads: tuple, needs: tuple) -> tuple:
    a, b = saved
    da, dc_full = adjoint(grads[0].contiguous(), b.t().contiguous())
    db = a.t() @ dc_full if needs[1] else None
    return (da if needs[0] else None), db


FORMULAS: dict[str, Formula] = {
    "allgather": Formula(_nothing, _through_adjoint),
    "reduce_scatter": Formula(_nothing, _through_adjoint),
    "ulysses_pre_a2a": Formula(_nothing, _through_adjoint),
    "ulysses_post_a2a": Formula(_nothing, _through_adjoint),
    # keeps B and the gathered A (output 1, no gradient of its own)
    "allgather_gemm": Formula(lambda i, o: (i[1], o[1]), _allgather_gemm, nondiff=(1,)),
    "gemm_reduce_scatter": Formula(lambda i, o: (i[0], i[1]), _gemm_reduce_scatter),
}


def formula(op: str) -> Formula | None:
    return FORMULAS.get(op)

