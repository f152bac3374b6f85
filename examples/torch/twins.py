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


def with_adjoint(name: str, forward, adjoint) -> type:
    """An autograd Function `name` whose apply(x, group=None) is forward(x, group) and whose backward
    is adjoint(grad, group)."""

    def fwd(ctx, x, group=None):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return adjoint(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


AllGather = with_adjoint("AllGather", all_gather, reduce_scatter)
ReduceScatter = with_adjoint("ReduceScatter", reduce_scatter, all_gather)


# -- Ulysses: all_to_all_single and the permutes around it (their backward: torch autograd) ------

def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """[W, ...] -> [W, ...]: chunk j goes to rank j, chunk r of the result came from rank r (all_to_all_single)."""
    x = x.contiguous()  # first: empty_like keeps a non-contiguous tensor's strides, all_to_all_single would not
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


# all_to_all_single with equal chunks is its own adjoint (what rank r sent rank j as chunk j comes
# back to r as chunk j of the gradient's all-to-all)
AllToAll = with_adjoint("AllToAll", all_to_all, all_to_all)


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


# -- MoE: dispatch and combine through all_to_all_single with the routing's splits ----------------

class AllToAllV(torch.autograd.Function):
    """all_to_all_single with per-rank splits (lists); its adjoint is the all-to-all back, splits swapped."""

    @staticmethod
    def forward(ctx, x, send: list, recv: list, group=None):
        ctx.splits, ctx.group = (send, recv), group
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x, recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return AllToAllV.apply(grad, recv, send, ctx.group), None, None, None


class MoeRoute:
    """One rank's routing for the MoE twin: experts in runs of L = E / W per rank, topk_idx [tokens,
    topk] (-1: none); a token goes once to each rank holding one of its experts. The rows a rank
    receives are grouped by source rank, in source token order, as tsgen's dispatch delivers them."""

    def __init__(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: int, group=None):
        w, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.world, self.local = group, w, experts // w
        tokens = topk_idx.shape[0]
        dest = torch.where((topk_idx >= 0) & (topk_idx < experts), topk_idx.long() // self.local, w)
        mask = torch.zeros(tokens, w + 1, dtype=torch.bool, device=topk_idx.device)
        mask.scatter_(1, dest, True)
        d, self.token = mask[:, :w].t().nonzero(as_tuple=True)  # by destination, then token
        send = torch.bincount(d, minlength=w)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        self.send, self.recv = send.tolist(), recv.tolist()  # the host waits for the counts
        # what travels with each row: the top-k ids and weights, made local on the receiver
        ids = AllToAllV.apply(topk_idx.index_select(0, self.token), self.send, self.recv, group)
        wts = AllToAllV.apply(topk_weights.index_select(0, self.token), self.send, self.recv, group)
        lo = self.rank * self.local
        here = (ids >= lo) & (ids < lo + self.local)
        self.recv_idx = torch.where(here, ids - lo, -1).to(torch.int32)
        self.recv_w = torch.where(here, wts, 0.0)
        self.tokens = tokens

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> the received rows [sum(recv), hidden] (differentiable)."""
        return AllToAllV.apply(x.index_select(0, self.token), self.send, self.recv, self.group)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The received rows' results [sum(recv), hidden] -> [tokens, hidden]: each token's rows from
        its destination ranks summed in fp32, rounded once (differentiable)."""
        back = AllToAllV.apply(y, self.recv, self.send, self.group).float()
        out = torch.zeros(self.tokens, y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add(0, self.token, back).to(y.dtype)
