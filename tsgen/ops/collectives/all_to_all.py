"""all_to_all: chunk q of rank r's input lands as chunk r of rank q's output (push)."""

from __future__ import annotations

from ...plan.ir import SignalRef, Slice, Step
from .base import CollectiveFamily, CollectiveParams, _entry, _final, _ring
from .semantics import Semantics, a2a_values


def _sources(w, r, idx, count):
    return [(idx // count, r * count + idx % count)]  # chunk j of rank r's output: chunk r of rank j's input


SEMANTICS = Semantics(_sources, reduces=False, in_units="W", out_units="W", values=a2a_values)


class AllToAllFamily(CollectiveFamily):
    kind = "all_to_all"
    Params = CollectiveParams
    summary = "chunk q of rank r's input lands as chunk r of rank q's output (push)"
    semantics = SEMANTICS

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", "W"), "inbox": ("scratch", "W")}
        return {"src": ("input", "W"), "dst": ("output", "W")}

    def signal_sizes(self, spec, w):
        return {"entry": w, "arrive": w} | ({"sent": w} if spec.params.in_place else {})

    def comm_plan(self, spec, w):
        p = spec.params
        bpp = self._bpp(spec)
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for q in _ring(r, w):
                if p.in_place:
                    # into q's inbox; our own chunk q is overwritten only after it has been sent
                    s.append(Step("copy", dst=(q, Slice("inbox", r)), srcs=((r, Slice("dst", q)),),
                                  waits=(("entry", q),),
                                  signals=(SignalRef(q, "arrive", r), SignalRef(r, "sent", q)),
                                  blocks=bpp, note=f"chunk {q} to rank {q}'s inbox"))
                else:
                    s.append(Step("copy", dst=(q, Slice("dst", r)), srcs=((r, Slice("src", q)),),
                                  waits=(("entry", q),), signals=(SignalRef(q, "arrive", r),),
                                  blocks=bpp, lane=self._peer_lane(spec), note=f"chunk {q} to rank {q}"))
            if p.in_place:
                for q in _ring(r, w):
                    s.append(Step("copy", dst=(r, Slice("dst", q)), srcs=((r, Slice("inbox", q)),),
                                  waits=(("arrive", q), ("sent", q)), blocks=bpp,
                                  note=f"rank {q}'s chunk from the inbox"))
            else:
                s.append(Step("copy", dst=(r, Slice("dst", r)), srcs=((r, Slice("src", r)),), blocks=bpp,
                              note="own chunk"))
                s += (_final([("arrive", q) for q in range(w) if q != r], "wait for every peer's chunk"))
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, 1))
