"""Torch-only twins of the tsgen ops, for checking them: the same collectives through
torch.distributed (NCCL), with the same autograd (allgather's backward is a reduce-scatter, and
the other way round). Used by examples/torch/tp_mlp.py and tests/torch_checks.py."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """(n, ...) -> (W n, ...), rank r's input at rows [r n, (r + 1) n): all_gather_into_tensor."""
    w = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] * w, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    """(W n, ...) -> (n, ...): rank r gets the sum over ranks of rows [r n, (r + 1) n)."""
    w = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // w, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group), None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group), None
