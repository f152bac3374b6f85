"""allgather: every rank ends with all ranks' inputs (push, pull, ring, multimem)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ...plan.ir import SignalRef, Slice, Step
from .base import CollectiveFamily, CollectiveParams, _entry, _final, _ring
from .semantics import Semantics, move_values


def _sources(w, r, idx, count):
    return [(idx // count, idx % count)]  # element j of chunk q is rank q's input element j


SEMANTICS = Semantics(_sources, reduces=False, in_units=1, out_units="W", values=move_values,
                      in_unit=lambda r: r)  # in place, rank r's input is its chunk r of dst


class AllgatherParams(CollectiveParams):
    direction: Literal["push", "pull", "ring", "multimem"] = Field(
        "push", description="push: write into peers; pull: read from peers; ring: pass chunks around the "
        "ring r -> r+1 in `pieces` signalled pieces, forwarding each piece as it lands (every GPU writes to "
        "one peer only); multimem: one NVLink-multicast store per element (compiled only: the runtime "
        "refuses it unless explicitly enabled)")


class AllgatherFamily(CollectiveFamily):
    kind = "allgather"
    Params = AllgatherParams
    summary = "every rank ends with all ranks' inputs, rank j's at offset j*count (push or pull)"
    multimem_switch = ("direction", "multimem")
    semantics = SEMANTICS

    def summary_of(self, spec):
        how = {"push": "each rank writes its input into every peer", "pull": "each rank reads every peer's input",
               "ring": "chunks pass around the ring r -> r+1 in pieces",
               "multimem": "one NVLink-multicast store per element"}[spec.params.direction]
        return f"every rank ends with all ranks' inputs, rank j's at offset j*count ({spec.params.direction}: {how})"

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", "W")}
        return {"src": ("input", 1), "dst": ("output", "W")}

    def signal_sizes(self, spec, w):
        if self.is_multimem(spec):
            return {"barrier": 1}
        if spec.params.direction == "ring":
            return {"entry": w, "arrive": w * spec.params.pieces}
        return {"entry": w, ("arrive" if spec.params.direction == "push" else "done"): w}

    def _ring_plan(self, spec, w):
        """Rank r sends chunk r, then forwards chunks r-1, r-2, ... to r+1, piece by piece,
        each as soon as it has landed; chunk r+1 arrives last and goes no further."""
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        steps = []
        for r in range(w):
            left, right = (r - 1) % w, (r + 1) % w
            own = (lambda i: Slice("dst", r, i, P)) if p.in_place else (lambda i: Slice("src", 0, i, P))
            s = [_entry(r, w, to=[left])]  # only our left neighbour writes into us
            for hop in range(w - 1):
                c = (r - hop) % w
                for i in range(P):
                    waits = (("entry", right),) + ((("arrive", c * P + i),) if hop else ())
                    s.append(Step("copy", dst=(right, Slice("dst", c, i, P)),
                                  srcs=((r, own(i) if hop == 0 else Slice("dst", c, i, P)),), waits=waits,
                                  signals=(SignalRef(right, "arrive", c * P + i),), blocks=bpp, lane="ring",
                                  note=f"chunk {c} piece {i} to rank {right}"))
            if not p.in_place:
                s += [Step("copy", dst=(r, Slice("dst", r, i, P)), srcs=((r, own(i)),), blocks=bpp, lane="local",
                           note=f"local copy, piece {i}") for i in range(P)]
            s += _final([("arrive", c * P + i) for c in range(w) if c != r for i in range(P)],
                        "wait for every chunk")
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, P))

    def comm_plan(self, spec, w):
        p = spec.params
        if self.is_multimem(spec):
            raise ValueError("multimem variants are not plans: they have no CPU verification")
        if p.direction == "ring":
            return self._ring_plan(spec, w)
        bpp = self._bpp(spec)
        steps = []
        for r in range(w):
            src = (r, Slice("dst", r)) if p.in_place else (r, Slice("src", 0))
            s = [_entry(r, w)]
            lane = self._peer_lane(spec)
            for q in _ring(r, w):
                if p.direction == "push":
                    s.append(Step("copy", dst=(q, Slice("dst", r)), srcs=(src,), waits=(("entry", q),),
                                  signals=(SignalRef(q, "arrive", r),), blocks=bpp, lane=lane,
                                  note=f"put to rank {q}"))
                else:
                    qsrc = (q, Slice("dst", q)) if p.in_place else (q, Slice("src", 0))
                    s.append(Step("copy", dst=(r, Slice("dst", q)), srcs=(qsrc,), waits=(("entry", q),),
                                  signals=(SignalRef(q, "done", r),), blocks=bpp, lane=lane,
                                  note=f"get from rank {q}"))
            if not p.in_place:
                s.append(Step("copy", dst=(r, Slice("dst", r)), srcs=(src,), blocks=bpp, note="local copy"))
            name = "arrive" if p.direction == "push" else "done"
            s += (_final([(name, q) for q in range(w) if q != r],
                            "wait for every peer's data" if p.direction == "push" else "wait until every peer has read our input"))
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, 1))

    def bytes_moved(self, spec, world, count):
        return count * np.dtype("uint16" if spec.dtype == "bfloat16" else spec.dtype).itemsize * world
