"""all_reduce: every rank ends with the sum of all ranks' inputs (one_shot, two_shot, two_shot_pull, ring, multimem)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from ...plan.ir import SignalRef, Slice, Step
from .bench import AllReduceBench
from .base import CollectiveFamily, CollectiveParams, _entry, _final, _ring
from .semantics import Semantics, reduce_values


def _sources(w, r, idx, count):
    return [(q, idx) for q in range(w)]  # every rank's output: the sum of every rank's input


SEMANTICS = Semantics(_sources, reduces=True, in_units=1, out_units=1, values=reduce_values)


class AllReduceParams(CollectiveParams):
    algorithm: Literal["one_shot", "two_shot", "two_shot_pull", "ring", "multimem"] = Field(
        "two_shot", description="one_shot: every rank reads every peer's input and reduces all of it; "
        "ring: ring reduce-scatter then ring allgather, r -> r+1 only, in signalled pieces; "
        "two_shot: reduce-scatter by push into inboxes, then allgather by push (large sizes); "
        "two_shot_pull: each rank reads and reduces its part from every peer, then pushes it (small sizes); "
        "multimem: two-shot with multimem.ld_reduce + multimem.st and a multimem.red barrier (compiled only: "
        "the runtime refuses it unless explicitly enabled)")


class AllReduceFamily(CollectiveFamily):
    kind = "all_reduce"
    Params = AllReduceParams
    bench = AllReduceBench()  # + PyTorch SymmetricMemory's one- and two-shot all-reduce
    summary = "every rank ends with the sum of all ranks' inputs (one_shot pull, or two_shot push RS + push AG)"
    multimem_switch = ("algorithm", "multimem")
    semantics = SEMANTICS

    def summary_of(self, spec):
        how = {"one_shot": "every rank reads and reduces every peer's input",
               "two_shot": "reduce-scatter by push into inboxes, then allgather by push",
               "two_shot_pull": "each rank reads and reduces its part from every peer, then pushes it",
               "ring": "ring reduce-scatter then ring allgather, r -> r+1 in pieces",
               "multimem": "two-shot with multimem.ld_reduce + multimem.st"}[spec.params.algorithm]
        return f"every rank ends with the sum of all ranks' inputs ({spec.params.algorithm}: {how})"

    def data_buffers(self, spec):
        if spec.params.algorithm == "ring":  # the inbox holds one partial sum per part
            io = {"dst": ("inout", 1)} if spec.params.in_place else {"src": ("input", 1), "dst": ("output", 1)}
            return io | {"inbox": ("scratch", 1)}
        two = spec.params.algorithm == "two_shot"
        if spec.params.algorithm in ("two_shot_pull", "multimem"):
            return {"dst": ("inout", 1)} if spec.params.in_place else {"src": ("input", 1), "dst": ("output", 1)}
        if spec.params.in_place:
            return {"dst": ("inout", 1)} | ({"inbox": ("scratch", "W")} if two else {"scratch": ("scratch", 1)})
        return {"src": ("input", 1), "dst": ("output", 1)} | ({"inbox": ("scratch", "W")} if two else {})

    def signal_sizes(self, spec, w):
        P = spec.params.pieces
        if spec.params.algorithm == "one_shot":
            return {"entry": w, "done": w} | ({"reduced": 1} if spec.params.in_place else {})
        if spec.params.algorithm == "two_shot_pull":
            return {"entry": w, "gathered": w * P}
        if spec.params.algorithm == "ring":
            return {"entry": w, "arrive": w * P, "gathered": w * P}
        if spec.params.algorithm == "multimem":
            return {"barrier": 1}
        return {"entry": w, "arrive": w * P, "reduced": P, "gathered": w * P}

    def comm_plan(self, spec, w):
        return {"one_shot": self._one_shot, "two_shot": self._two_shot, "two_shot_pull": self._two_shot_pull,
                "ring": self._ring}[spec.params.algorithm](spec, w)

    def _ring(self, spec, w):
        """Ring reduce-scatter of the w parts (part c ends reduced at rank c), then a ring
        allgather of the reduced parts; every GPU writes only into rank r+1."""
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        n = w * P  # part c, piece i = piece c*P + i of the count
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            right = (r + 1) % w
            s = [_entry(r, w, to=[(r - 1) % w])]  # only our left neighbour writes into us
            for hop in range(w - 1):  # reduce-scatter: partial sums of part r-hop-1 go right
                c = (r - hop - 1) % w
                for i in range(P):
                    k = c * P + i
                    mine, dst = (r, Slice(buf, 0, k, n)), (right, Slice("inbox", 0, k, n))
                    if hop == 0:
                        step = Step("copy", dst=dst, srcs=(mine,), waits=(("entry", right),),
                                    note=f"part {c} piece {i}: our input to rank {right}")
                    else:
                        step = Step("reduce", dst=dst, srcs=((r, Slice("inbox", 0, k, n)), mine),
                                    waits=(("arrive", k), ("entry", right)),
                                    note=f"part {c} piece {i}: partial sum + our input to rank {right}")
                    s.append(dataclasses.replace(step, signals=(SignalRef(right, "arrive", k),),
                                                 blocks=bpp, lane="rs"))
            # One lane: each block reduces its share of a piece of our part, then sends that
            # same share on (it wrote it itself, so no signal is needed in between).
            for i in range(P):
                k = r * P + i
                s.append(Step("reduce", dst=(r, Slice("dst", 0, k, n)),
                              srcs=((r, Slice("inbox", 0, k, n)), (r, Slice(buf, 0, k, n))),
                              waits=(("arrive", k),), blocks=bpp, lane="ag",
                              note=f"our part, piece {i}: last partial sum + our input"))
            for hop in range(w - 1):  # allgather: reduced part r-hop goes right
                c = (r - hop) % w
                for i in range(P):
                    k = c * P + i
                    waits = (("entry", right),) + ((("gathered", k),) if hop else ())
                    s.append(Step("copy", dst=(right, Slice("dst", 0, k, n)), srcs=((r, Slice("dst", 0, k, n)),),
                                  waits=waits, signals=(SignalRef(right, "gathered", k),), blocks=bpp, lane="ag",
                                  note=f"reduced part {c} piece {i} to rank {right}"))
            s += _final([("gathered", c * P + i) for c in range(w) if c != r for i in range(P)],
                        "wait for every reduced part")
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, n))

    def _two_shot_pull(self, spec, w):
        """Entry; reduce our part straight from every rank's input (peer reads), storing
        the sums into every rank's output at once. A peer's `gathered` signal also says it
        has finished reading our input (it read before it stored), so waiting for all of
        them is the exit barrier too."""
        p = spec.params
        P, nb = p.pieces, self._bpp(spec)
        n = w * P
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for i in range(P):
                # Each block reduces its share of our part and stores the sums to every rank
                # at once (dst and `also`): nothing is re-read to be pushed. Every peer's
                # signal is raised after the stores (one round of release fences).
                mine = r * P + i
                s.append(Step("reduce", dst=(r, Slice("dst", 0, mine, n)),
                              also=tuple((q, Slice("dst", 0, mine, n)) for q in _ring(r, w)),
                              srcs=tuple((q, Slice(buf, 0, mine, n)) for q in [r] + _ring(r, w)),
                              waits=tuple(("entry", q) for q in range(w) if q != r),
                              signals=tuple(SignalRef(q, "gathered", mine) for q in _ring(r, w)),
                              blocks=nb, lane="part", note=f"reduce our part, piece {i}, reading every rank; "
                              "the sums to every rank"))
            s += _final([("gathered", q * P + i) for q in range(w) if q != r for i in range(P)],
                        "wait for every peer's reduced parts (and their reads of our input)")
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, n))

    def _one_shot(self, spec, w):
        p = spec.params
        nb = self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            srcs = tuple((q, Slice(buf, 0)) for q in [r] + _ring(r, w))
            done = tuple(SignalRef(q, "done", r) for q in range(w) if q != r)
            if p.in_place:  # our result may overwrite our input only once every peer has read it
                s.append(Step("reduce", dst=(r, Slice("scratch", 0)), srcs=srcs,
                              waits=tuple(("entry", q) for q in range(w) if q != r),
                              signals=done + (SignalRef(r, "reduced", 0),), blocks=nb, note="sum every rank's input"))
                s.append(Step("copy", dst=(r, Slice("dst", 0)), srcs=((r, Slice("scratch", 0)),),
                              waits=tuple(("done", q) for q in range(w) if q != r) + (("reduced", 0),),
                              blocks=nb, note="result over our input"))
            else:
                s.append(Step("reduce", dst=(r, Slice("dst", 0)), srcs=srcs,
                              waits=tuple(("entry", q) for q in range(w) if q != r),
                              signals=done, blocks=nb, note="sum every rank's input"))
                s += (_final([("done", q) for q in range(w) if q != r], "wait until every peer has read our input"))
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, 1))

    def _two_shot(self, spec, w):
        p = spec.params
        P, bpp = p.pieces, self._bpp(spec)
        n = w * P  # the count is cut into w parts of P pieces: part q (pieces q*P..) is reduced by rank q
        buf = "dst" if p.in_place else "src"
        nb = bpp
        steps = []
        for r in range(w):
            s = [_entry(r, w)]
            for q in _ring(r, w):  # reduce-scatter: push part q to rank q's inbox, piece by piece
                for i in range(P):
                    s.append(Step("copy", dst=(q, Slice("inbox", r, q * P + i, n)),
                                  srcs=((r, Slice(buf, 0, q * P + i, n)),), waits=(("entry", q),),
                                  signals=(SignalRef(q, "arrive", r * P + i),), blocks=nb, lane=f"rs{q}",
                                  note=f"part {q} piece {i} to rank {q}"))
            for i in range(P):
                mine = r * P + i
                srcs = ((r, Slice(buf, 0, mine, n)),) + tuple((r, Slice("inbox", q, mine, n)) for q in range(w) if q != r)
                s.append(Step("reduce", dst=(r, Slice("dst", 0, mine, n)), srcs=srcs,
                              waits=tuple(("arrive", q * P + i) for q in range(w) if q != r),
                              signals=(SignalRef(r, "reduced", i),), blocks=nb, lane="reduce",
                              note=f"reduce our part, piece {i}"))
            for q in _ring(r, w):  # allgather: push each reduced piece to every peer
                for i in range(P):
                    mine = r * P + i
                    s.append(Step("copy", dst=(q, Slice("dst", 0, mine, n)), srcs=((r, Slice("dst", 0, mine, n)),),
                                  waits=(("reduced", i), ("entry", q)), signals=(SignalRef(q, "gathered", r * P + i),),
                                  blocks=nb, lane=f"ag{q}", note=f"reduced piece {i} to rank {q}"))
            s += (_final([("gathered", q * P + i) for q in range(w) if q != r for i in range(P)],
                            "wait for every peer's reduced parts"))
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, n))
