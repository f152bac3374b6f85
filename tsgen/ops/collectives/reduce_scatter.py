"""reduce_scatter: push each peer's chunk into its inbox, reduce locally (direct), or a ring."""

from __future__ import annotations

import dataclasses
from typing import Literal
from pydantic import Field

from ...plan.ir import SignalRef, Slice, Step
from .base import CollectiveFamily, CollectiveParams, _entry, _ring
from .semantics import Semantics, reduce_values


def _sources(w, r, idx, count):
    return [(q, r * count + idx) for q in range(w)]  # rank r's output: the sum of every rank's chunk r


SEMANTICS = Semantics(_sources, reduces=True, in_units="W", out_units=1, values=reduce_values,
                      out_unit=lambda r: r)  # in place, rank r's output is its chunk r of dst


class ReduceScatterParams(CollectiveParams):
    algorithm: Literal["direct", "ring"] = Field(
        "direct", description="direct: push each peer's chunk into its inbox, every rank reduces its own; "
        "ring: partial sums travel r -> r+1, each rank adds its part and forwards (one outgoing peer per "
        "GPU; a rounding to dtype per hop)")


class ReduceScatterFamily(CollectiveFamily):
    kind = "reduce_scatter"
    Params = ReduceScatterParams
    summary = ("rank r ends with the sum over ranks of chunk r (push chunks into peers' inboxes, "
               "pipelined in pieces, reduce locally in fp32)")
    semantics = SEMANTICS

    def summary_of(self, spec):
        if spec.params.algorithm == "ring":
            return ("rank r ends with the sum over ranks of chunk r (ring: partial sums travel r -> r+1, each "
                    "rank adds its part and forwards)")
        return self.summary

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", "W"), "inbox": ("scratch", "W")}
        return {"src": ("input", "W"), "dst": ("output", 1), "inbox": ("scratch", "W")}

    def signal_sizes(self, spec, w):
        return {"entry": w, "arrive": w * spec.params.pieces}

    def comm_plan(self, spec, w):
        if spec.params.algorithm == "ring":
            return self._ring(spec, w)
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        src_buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for q in _ring(r, w):  # one lane per peer (or one for all, pairwise): pieces go out in order
                for i in range(P):
                    s.append(Step("copy", dst=(q, Slice("inbox", r, i, P)), srcs=((r, Slice(src_buf, q, i, P)),),
                                  waits=(("entry", q),), signals=(SignalRef(q, "arrive", r * P + i),),
                                  blocks=bpp, lane=self._peer_lane(spec) or f"to{q}",
                                  note=f"piece {i} of chunk {q} to rank {q}'s inbox"))
            for i in range(P):  # the reduce lane follows the pieces as they arrive
                dst = (r, Slice("dst", r, i, P)) if p.in_place else (r, Slice("dst", 0, i, P))
                srcs = ((r, Slice(src_buf, r, i, P)),) + tuple((r, Slice("inbox", q, i, P)) for q in range(w) if q != r)
                s.append(Step("reduce", dst=dst, srcs=srcs,
                              waits=tuple(("arrive", q * P + i) for q in range(w) if q != r),
                              blocks=bpp, lane="reduce", note=f"reduce piece {i}"))
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, P))

    def _ring(self, spec, w):
        """Chunk c starts at rank c+1 and ends at rank c: at hop h rank r adds its part of
        chunk r-h-1 to the partial sum that arrived in its inbox and writes the result
        into rank r+1's inbox; the last hop's sum is the output."""
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        src_buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            right = (r + 1) % w
            s = [_entry(r, w, to=[(r - 1) % w])]  # only our left neighbour writes into us
            for hop in range(w - 1):
                c = (r - hop - 1) % w
                for i in range(P):
                    mine = (r, Slice(src_buf, c, i, P))
                    dst = (right, Slice("inbox", c, i, P))
                    if hop == 0:
                        step = Step("copy", dst=dst, srcs=(mine,), waits=(("entry", right),),
                                    note=f"chunk {c} piece {i}: our part to rank {right}")
                    else:
                        step = Step("reduce", dst=dst, srcs=((r, Slice("inbox", c, i, P)), mine),
                                    waits=(("arrive", c * P + i), ("entry", right)),
                                    note=f"chunk {c} piece {i}: partial sum + our part to rank {right}")
                    s.append(dataclasses.replace(step, signals=(SignalRef(right, "arrive", c * P + i),),
                                                 blocks=bpp, lane="ring"))
            for i in range(P):
                dst = (r, Slice("dst", r, i, P)) if p.in_place else (r, Slice("dst", 0, i, P))
                s.append(Step("reduce", dst=dst, srcs=((r, Slice("inbox", r, i, P)), (r, Slice(src_buf, r, i, P))),
                              waits=(("arrive", r * P + i),), blocks=bpp, lane="final",
                              note=f"our chunk, piece {i}: last partial sum + our part"))
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, P))
