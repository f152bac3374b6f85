"""What a collective computes, stated once per op, and what is derived from that statement.

Every collective here maps the ranks' inputs to their outputs so that each output element is
one input element (a movement: allgather, all_to_all, broadcast) or the sum of several (a
reduction: reduce_scatter, all_reduce). Each family module states its op as a `Semantics`:
`sources(w, r, idx, count)` names, for rank r's output elements `idx` (per-rank count
`count`, the package's convention), the (rank, input index) pairs summed -- or the one copied.
Ranks and indices may be ints or index arrays; the statement uses only + - * // %, so it
evaluates on NumPy arrays and torch tensors alike.

Derived from it, and nowhere else written down:
  * `outputs` / `parts`: the NumPy reference and the reductions' tolerance (the families'
    `reference` / `tolerance`, CollectiveFamily);
  * `plan_expected`: what a plan's every output slice must receive, which `tsgen verify`
    checks the plan against (the statement at one element per piece);
  * `expected_values`: what the NCCL baseline's outputs must hold for the rank-seeded inputs
    `values` (tsgen/bench/nccl.py, which passes torch tensors).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...plan.ir import Slice

Sources = Callable[[int, int, Any, int], list[tuple[Any, Any]]]


@dataclass(frozen=True)
class Semantics:
    """One collective's meaning.

    sources(w, r, idx, count): rank r's output elements idx are the sum (reduces) of -- or a copy
        of the one -- input elements [(rank, index), ...], in rank order.
    in_units / out_units: each rank's input / output length in counts (1 or "W": world counts).
    in_unit / out_unit(r): in place, the count-sized unit of rank r's buffer where its input /
        output begins (allgather's input is its chunk r, reduce_scatter's output its chunk r).
    values(w, r, idx, count): the rank-seeded inputs the NCCL baseline fills (small integers,
        exact in every dtype, sums over <= 36 ranks <= 252).
    """

    sources: Sources
    reduces: bool
    in_units: int | str
    out_units: int | str
    values: Callable[[int, Any, Any, int], Any]
    in_unit: Callable[[int], int] = lambda r: 0
    out_unit: Callable[[int], int] = lambda r: 0

    def n_in(self, w: int) -> int:
        return w if self.in_units == "W" else 1

    def n_out(self, w: int) -> int:
        return w if self.out_units == "W" else 1

    def combine(self, terms: list):
        """The sum of the terms (a reduction), or the one term (a movement)."""
        if not self.reduces:
            (one,) = terms
            return one
        return sum(terms[1:], terms[0])

    # -- the NumPy reference --------------------------------------------------
    def inputs_of(self, w: int, count: int, inputs: dict, in_place: bool) -> list[np.ndarray]:
        """Each rank's input (in place: its part of dst)."""
        if not in_place:
            return [a[: self.n_in(w) * count] for a in inputs["src"]]
        return [inputs["dst"][r][self.in_unit(r) * count:(self.in_unit(r) + self.n_in(w)) * count] for r in range(w)]

    def parts(self, w: int, count: int, ins: list[np.ndarray], r: int) -> list[np.ndarray]:
        """The input values rank r's output is made of, one array per source, in rank order."""
        idx = np.arange(self.n_out(w) * count)
        out = []
        for q, s in self.sources(w, r, idx, count):
            out.append(ins[q][s] if isinstance(q, int) else np.stack(ins)[q, s])
        return out

    def place(self, w: int, count: int, inputs: dict, in_place: bool, r: int, values: np.ndarray,
              zeros: bool = False) -> np.ndarray:
        """Rank r's whole output buffer with `values` as its output: in place, the rest of dst
        keeps the input (or, `zeros`, is 0: a tolerance)."""
        if not in_place or self.n_out(w) * count == len(inputs["dst"][r]):
            return values
        full = np.zeros(len(inputs["dst"][r])) if zeros else inputs["dst"][r].copy()
        full[self.out_unit(r) * count:(self.out_unit(r) + self.n_out(w)) * count] = values
        return full

    def outputs(self, w: int, count: int, inputs: dict, in_place: bool,
                combine: Callable[[list[np.ndarray]], np.ndarray]) -> list[np.ndarray]:
        """Every rank's dst after the call; `combine` sums the parts (in the dtype's arithmetic)."""
        ins = self.inputs_of(w, count, inputs, in_place)
        return [self.place(w, count, inputs, in_place, r, combine(self.parts(w, count, ins, r))) for r in range(w)]

    # -- the plans' expectations ----------------------------------------------
    def plan_expected(self, w: int, pieces: int, in_place: bool) -> dict:
        """{(rank, Slice of dst): Counter of (rank, buffer, unit, piece)} for a plan that cuts
        every count into `pieces` pieces: the statement at count = pieces, one element per
        piece. In place, an element already where it belongs (a copy of itself) is not
        written, so it has no expectation."""
        inb = "dst" if in_place else "src"
        idx = np.arange(self.n_out(w) * pieces)
        expected = {}
        for r in range(w):
            srcs = [(np.broadcast_to(q, idx.shape), s) for q, s in self.sources(w, r, idx, pieces)]
            base = self.out_unit(r) * pieces if in_place else 0
            for e in idx:
                got = Counter()
                for q, s in srcs:
                    qe = int(q[e])
                    unit, piece = divmod(int(s[e]) + (self.in_unit(qe) * pieces if in_place else 0), pieces)
                    got[(qe, inb, unit, piece)] += 1
                unit, piece = divmod(int(e) + base, pieces)
                if in_place and got == Counter({(r, "dst", unit, piece): 1}):
                    continue
                expected[(r, Slice("dst", unit, piece, pieces))] = got
        return expected

    # -- the NCCL baseline's check ---------------------------------------------
    def expected_values(self, w: int, r: int, idx, count: int):
        """What rank r's output must hold at idx when every rank's input holds `values`."""
        return self.combine([self.values(w, q, s, count) for q, s in self.sources(w, r, idx, count)])


# The rank-seeded values of the NCCL baseline (tsgen/bench/nccl.py)

def reduce_values(w, rank, idx, count):
    return (idx + rank) % 8  # sums over <= 36 ranks stay <= 252: exact in bf16


def move_values(w, rank, idx, count):
    return (idx % 16 + 16 * rank) % 251


def a2a_values(w, rank, idx, count):
    """Rank `rank`'s chunk d (the one for rank d) names both ends."""
    return ((rank * w + idx // count) * 2 + idx % count % 2) % 251
