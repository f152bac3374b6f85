"""broadcast: every rank ends with the root's input (push, scatter_allgather, ring)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...plan.ir import SignalRef, Slice, Step
from .base import CollectiveFamily, CollectiveParams, _entry, _final, _ring
from .semantics import Semantics, move_values


def broadcast_semantics(root: int) -> Semantics:
    """Every rank's output: the root's input."""
    return Semantics(lambda w, r, idx, count: [(root, idx)], reduces=False, in_units=1, out_units=1,
                     values=move_values)


class BroadcastParams(CollectiveParams):
    root: int = Field(0, ge=0, le=7, description="rank whose input every rank receives")
    algorithm: Literal["push", "scatter_allgather", "ring"] = Field(
        "push", description="push: the root writes the whole message into every peer (small sizes); "
        "scatter_allgather: the root writes part j into rank j, then every rank writes its part into "
        "every other non-root rank (the root sends each byte once); ring: a chain root -> root+1 -> ... "
        "in signalled pieces, each forwarded as it lands (large sizes)")


class BroadcastFamily(CollectiveFamily):
    kind = "broadcast"
    Params = BroadcastParams
    summary = "every rank ends with the root's input (the root pushes to every peer)"
    semantics = broadcast_semantics(0)  # NCCL's baseline broadcasts from rank 0

    def semantics_of(self, spec):
        return broadcast_semantics(spec.params.root)

    def summary_of(self, spec):
        how = {"push": "the root pushes to every peer",
               "scatter_allgather": "the root writes part j into rank j, then every rank writes its part into "
                                    "the other non-root ranks",
               "ring": "a chain root -> root+1 -> ... in signalled pieces"}[spec.params.algorithm]
        return f"every rank ends with the root's input ({spec.params.algorithm}: {how})"

    def extra_check(self, spec):
        bad = [w for w in spec.world_sizes if spec.params.root >= w]
        if bad:
            return [(("params", "root"), f"root {spec.params.root} is not a rank at world size {bad[0]}")]
        return []

    def data_buffers(self, spec):
        if spec.params.in_place:
            return {"dst": ("inout", 1)}
        return {"src": ("input", 1), "dst": ("output", 1)}

    def signal_sizes(self, spec, w):
        if spec.params.algorithm == "scatter_allgather":
            return {"entry": w, "scattered": 1, "gathered": w}
        if spec.params.algorithm == "ring":
            return {"entry": w, "arrive": spec.params.pieces}
        return {"entry": w, "arrive": 1}

    def comm_plan(self, spec, w):
        if spec.params.algorithm == "scatter_allgather":
            return self._scatter_allgather(spec, w)
        if spec.params.algorithm == "ring":
            return self._chain(spec, w)
        p = spec.params
        root, bpp = p.root, self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            if r != root:
                steps.append([_entry(r, w, to=[root])] + _final([("arrive", 0)], "wait for the root's data"))
                continue
            s = []
            for q in _ring(r, w):
                s.append(Step("copy", dst=(q, Slice("dst", 0)), srcs=((r, Slice(buf, 0)),), waits=(("entry", q),),
                              signals=(SignalRef(q, "arrive", 0),), blocks=bpp, note=f"put to rank {q}"))
            if not p.in_place:
                s.append(Step("copy", dst=(r, Slice("dst", 0)), srcs=((r, Slice("src", 0)),), blocks=bpp,
                              note="local copy"))
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, 1))

    def _chain(self, spec, w):
        """root -> root+1 -> ... -> root-1, piece by piece, each forwarded as it lands."""
        p = spec.params
        root, P, bpp = p.root, p.pieces, self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        steps = []
        for r in range(w):
            right, last = (r + 1) % w, (root - 1) % w
            s = [] if r == root else [_entry(r, w, to=[(r - 1) % w])]  # our left neighbour writes into us
            if r != last:
                for i in range(P):
                    src = (r, Slice(buf if r == root else "dst", 0, i, P))
                    waits = (("entry", right),) + (() if r == root else (("arrive", i),))
                    s.append(Step("copy", dst=(right, Slice("dst", 0, i, P)), srcs=(src,), waits=waits,
                                  signals=(SignalRef(right, "arrive", i),), blocks=bpp, lane="chain",
                                  note=f"piece {i} to rank {right}"))
            else:
                s += _final([("arrive", i) for i in range(P)], "wait for every piece")
            if r == root and not p.in_place:
                s += [Step("copy", dst=(r, Slice("dst", 0, i, P)), srcs=((r, Slice("src", 0, i, P)),), blocks=bpp,
                           lane="local", note=f"local copy, piece {i}") for i in range(P)]
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, P))

    def _scatter_allgather(self, spec, w):
        """The message is cut into w - 1 parts, one per non-root rank: part k travels
        root -> its owner -> every other non-root rank, so the root sends each byte once."""
        p = spec.params
        root, bpp = p.root, self._bpp(spec)
        buf = "dst" if p.in_place else "src"
        others = [q for q in range(w) if q != root]
        n = len(others)
        part = {q: k for k, q in enumerate(others)}  # rank -> the part it owns
        steps = []
        for r in range(w):
            if r == root:  # nobody writes into the root, so it signals no entry
                s = [Step("copy", dst=(q, Slice("dst", 0, part[q], n)), srcs=((r, Slice(buf, 0, part[q], n)),),
                          waits=(("entry", q),), signals=(SignalRef(q, "scattered", 0),), blocks=bpp,
                          note=f"part {part[q]} to its owner, rank {q}") for q in _ring(r, w)]
                if not p.in_place:
                    s += [Step("copy", dst=(r, Slice("dst", 0, k, n)), srcs=((r, Slice("src", 0, k, n)),),
                               blocks=bpp, lane="local", note=f"local copy of part {k}") for k in range(n)]
            else:
                s = [_entry(r, w)]
                mine = Slice("dst", 0, part[r], n)
                for q in _ring(r, w):  # allgather among the non-root ranks: our part to each
                    if q != root:
                        s.append(Step("copy", dst=(q, mine), srcs=((r, mine),),
                                      waits=(("scattered", 0), ("entry", q)),
                                      signals=(SignalRef(q, "gathered", r),), blocks=bpp,
                                      note=f"our part {part[r]} to rank {q}"))
                waits = [("scattered", 0)] + [("gathered", q) for q in others if q != r]
                s += _final(waits, "wait for our part from the root and every other part from its owner")
            steps.append(s)
        return self._schedule(spec, w, steps, self._expected(spec, w, n))
