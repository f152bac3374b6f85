"""Collectives as plans: allgather, reduce_scatter, all_to_all, all_reduce, broadcast.

One module per collective (its params, family and SEMANTICS: what it computes, stated once),
what they share in base.py, the derivations from a SEMANTICS in semantics.py.

Each family builds, for every world size, a CommPlan (tsgen/plan/ir.py): the
steps every rank takes, the signals between them, and the contributions
every output slice must end up with. The template renders the plan as
tables that one interpreter kernel executes (templates/include/
tsgen/plan.cuh) -- a small plan also as straight-line code making the same
share calls --, and `tsgen verify` executes the same plan on the CPU.

Conventions (as NCCL's): `count` is elements per rank of the smaller side:
allgather takes count and returns world x count; reduce_scatter takes
world x count and returns count; all_to_all moves world x count each way,
count to each peer; all_reduce and broadcast take and return count.
Every call begins with an entry signal to every peer ("I am in call e: my
inputs are ready and my outputs from call e-1 have been consumed"), and no
rank writes into a peer or reads a peer's memory before that peer's entry.
"""

from __future__ import annotations

from ..base import OpFamily
from .all_reduce import AllReduceFamily, AllReduceParams
from .all_to_all import AllToAllFamily
from .allgather import AllgatherFamily, AllgatherParams
from .base import CollectiveDtype, CollectiveFamily, CollectiveLaunch, CollectiveParams, _values, from_f64, to_f64
from .broadcast import BroadcastFamily, BroadcastParams
from .reduce_scatter import ReduceScatterFamily, ReduceScatterParams

# what other modules import from here (tsgen.ops.collectives), as before the split
__all__ = ["CollectiveDtype", "CollectiveFamily", "CollectiveLaunch", "CollectiveParams", "_values", "from_f64",
           "to_f64", "AllgatherFamily", "AllgatherParams", "ReduceScatterFamily", "ReduceScatterParams",
           "AllToAllFamily", "AllReduceFamily", "AllReduceParams", "BroadcastFamily", "BroadcastParams", "FAMILIES"]

FAMILIES: list[OpFamily] = [AllgatherFamily(), ReduceScatterFamily(), AllToAllFamily(), AllReduceFamily(),
                            BroadcastFamily()]
