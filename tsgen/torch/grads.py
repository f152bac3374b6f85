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

  moe dispatch <-> combine         (normal mode, unweighted combine) dispatch copies each token's
                                   row to each of its destination ranks, combine sums the rows a
                                   token's destinations hand back: dx = combine(d recv_x) and
                                   dy = the rows dispatch(d out) delivers, with the same routing
                                   (same order of rows: dispatch's order is fixed by the routing)

What is not differentiable: allgather_gemm's second output (the gathered A, returned for the
weight gradient) carries no gradient; use C. MoE's routing is not: topk_idx (integers),
topk_weights (they travel with the rows as recv_w, which carries no gradient: a gate that learns
needs its weights applied where a gradient reaches them), recv_idx, recv_counts. B^T is a
transposed copy of the weight at every backward (K x N elements, local). No tsgen runtime here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


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


def _moe_dispatch(adjoint: Callable[..., Any], saved: tuple, grads: tuple, needs: tuple) -> tuple:
    (topk_idx,) = saved
    return (adjoint(grads[0].contiguous(), topk_idx) if needs[0] else None), None, None


def _moe_combine(adjoint: Callable[..., Any], saved: tuple, grads: tuple, needs: tuple) -> tuple:
    (topk_idx,) = saved
    weights = torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)  # rows only: any weights
    return adjoint(grads[0].contiguous(), topk_idx, weights)[0], None


FORMULAS: dict[str, Formula] = {
    "allgather": Formula(_nothing, _through_adjoint),
    "reduce_scatter": Formula(_nothing, _through_adjoint),
    "ulysses_pre_a2a": Formula(_nothing, _through_adjoint),
    "ulysses_post_a2a": Formula(_nothing, _through_adjoint),
    # keeps B and the gathered A (output 1, no gradient of its own)
    "allgather_gemm": Formula(lambda i, o: (i[1], o[1]), _allgather_gemm, nondiff=(1,)),
    "gemm_reduce_scatter": Formula(lambda i, o: (i[0], i[1]), _gemm_reduce_scatter),
    # both keep topk_idx (the adjoint runs with the same routing)
    "moe_dispatch": Formula(lambda i, o: (i[1],), _moe_dispatch, nondiff=(1, 2, 3)),
    "moe_combine": Formula(lambda i, o: (i[1],), _moe_combine),
}


def formula(op: str) -> Formula | None:
    return FORMULAS.get(op)

