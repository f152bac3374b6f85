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


# -- Ulysses: all_to_all_single and the permutes around it (their backward: torch autograd) ------

def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """[W, ...] -> [W, ...]: chunk j goes to rank j, chunk r of the result came from rank r (all_to_all_single)."""
    x = x.contiguous()  # first: empty_like keeps a non-contiguous tensor's strides, all_to_all_single would not
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single with equal chunks; its adjoint is itself (what rank r sent rank j as chunk j
    comes back to r as chunk j of the gradient's all-to-all)."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group), None


def ulysses_pre(x: torch.Tensor, layout: str = "bshd", group=None) -> torch.Tensor:
    """[B, S/P, H, D] -> [B, S, H/P, D] (bshd) or [B, H/P, S, D] (bhsd): rank j gets heads
    [j H/P, (j+1) H/P) of every token, source r's tokens at [r S/P, (r+1) S/P)."""
    w = dist.get_world_size(group)
    b, s, h, d = x.shape
    recv = AllToAll.apply(x.reshape(b, s, w, h // w, d).permute(2, 0, 1, 3, 4).contiguous(), group)  # [W src, B, s, h/W, D]
    if layout == "bhsd":
        return recv.permute(1, 3, 0, 2, 4).reshape(b, h // w, w * s, d)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, w * s, h // w, d)


def ulysses_post(y: torch.Tensor, layout: str = "bshd", group=None) -> torch.Tensor:
    """The inverse of ulysses_pre: [B, S, H/P, D] (or bhsd) -> [B, S/P, H, D]."""
    w = dist.get_world_size(group)
    if layout == "bhsd":
        b, hl, seq, d = y.shape
        send = y.reshape(b, hl, w, seq // w, d).permute(2, 0, 3, 1, 4)
    else:
        b, seq, hl, d = y.shape
        send = y.reshape(b, w, seq // w, hl, d).permute(1, 0, 2, 3, 4)
    recv = AllToAll.apply(send.contiguous(), group)  # [W src, B, s, h/W, D]: source j's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, seq // w, w * hl, d)
