"""Each collective states what it computes once (its family's `semantics`,
tsgen/ops/collectives/semantics.py); the NumPy reference, the plans' expectations and the
NCCL baseline's expected values are derived from it. Here the statement is checked against
a simulation written independently of it, and the three derivations against each other, on
small worlds and odd counts, in and out of place."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tsgen.bench import nccl as bl
from tsgen.ops import get_family

WORLDS = (2, 3, 4, 8)
COUNTS = (1, 5, 7, 12)

VARIANTS = [("allgather", {}), ("reduce_scatter", {}), ("all_to_all", {}), ("all_reduce", {}),
            ("broadcast", {"root": 0}), ("broadcast", {"root": 1})]


def _spec(op, params, in_place, w, dtype="int32", pieces=1):
    fam = get_family(op)
    return fam, fam.Spec(name="x", op=op, world_sizes=[w], dtype=dtype,
                         params=dict(params, in_place=in_place, pieces=pieces))


def _simulate(op, params, w, count, ins):
    """Every rank's output from every rank's input, written per op without the statement."""
    if op == "allgather":
        return [np.concatenate(ins) for _ in range(w)]
    if op == "reduce_scatter":
        total = sum(x.astype(np.int64) for x in ins)
        return [total[r * count:(r + 1) * count] for r in range(w)]
    if op == "all_to_all":
        return [np.concatenate([ins[j][r * count:(r + 1) * count] for j in range(w)]) for r in range(w)]
    if op == "all_reduce":
        return [sum(x.astype(np.int64) for x in ins) for _ in range(w)]
    return [ins[params["root"]].copy() for _ in range(w)]


def _inputs(fam, spec, w, count, seed):
    return fam.make_inputs(spec, w, count, np.random.default_rng(seed), pattern=False)


@pytest.mark.parametrize("op,params", VARIANTS)
@pytest.mark.parametrize("w", WORLDS)
@pytest.mark.parametrize("in_place", [False, True])
def test_reference_matches_a_simulation(op, params, w, in_place):
    if op == "broadcast" and params["root"] >= w:
        pytest.skip("root outside the world")
    fam, spec = _spec(op, params, in_place, w)
    for count in COUNTS:
        inputs = _inputs(fam, spec, w, count, seed=w * 31 + count)
        got = fam.reference(spec, w, count, inputs)["dst"]
        if not in_place:
            ins = inputs["src"]
        elif op == "allgather":  # rank r's input is its chunk r of dst
            ins = [inputs["dst"][r][r * count:(r + 1) * count] for r in range(w)]
        else:
            ins = inputs["dst"]
        want = _simulate(op, params, w, count, ins)
        for r in range(w):
            if in_place and op == "reduce_scatter":  # the rest of dst keeps the input
                full = inputs["dst"][r].astype(np.int64)
                full[r * count:(r + 1) * count] = want[r]
                want[r] = full
            np.testing.assert_array_equal(np.asarray(got[r], dtype=np.int64), np.asarray(want[r], dtype=np.int64))


@pytest.mark.parametrize("op", bl.OPS)
@pytest.mark.parametrize("w", WORLDS)
def test_baseline_values_match_the_reference(op, w):
    """The NCCL worker's expected values (the statement evaluated arithmetically) are the
    family's reference (the statement evaluated by gathering) of the worker's inputs."""
    fam, spec = _spec(op, {"root": 0} if op == "broadcast" else {}, False, w)
    for nbytes in (4 * w * 7, 4 * w * 96):
        counts = bl.elem_counts(op, nbytes, "int32", w)
        count = counts.n_out // fam.semantics.n_out(w)
        src = [np.asarray(bl.input_values(op, r, w, np.arange(counts.n_in), counts.n_in)).astype(np.int32)
               for r in range(w)]
        ref = fam.reference(spec, w, count, {"src": src})["dst"]
        for r in range(w):
            want = np.asarray(bl.expected_values(op, r, w, np.arange(counts.n_out), counts.n_out))
            np.testing.assert_array_equal(ref[r], want)


@pytest.mark.parametrize("op,params", VARIANTS)
@pytest.mark.parametrize("w", WORLDS)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("pieces", [1, 3])
def test_plan_expectations_compute_the_reference(op, params, w, in_place, pieces):
    """Summing what plan_expected says every output slice receives (one element per piece)
    gives the reference; every output element that has to change is expected."""
    if op == "broadcast" and params["root"] >= w:
        pytest.skip("root outside the world")
    fam, spec = _spec(op, params, in_place, w, pieces=pieces)
    sem = fam.semantics_of(spec)
    expected = sem.plan_expected(w, pieces, in_place)
    inputs = _inputs(fam, spec, w, pieces, seed=w + pieces)
    ref = fam.reference(spec, w, pieces, inputs)["dst"]
    for r in range(w):
        out = inputs["dst"][r].astype(np.int64) if in_place else np.full(sem.n_out(w) * pieces, -1 << 40)
        for (rank, sl), contributions in expected.items():
            assert sl.buffer == "dst" and sl.pieces == pieces
            if rank != r:
                continue
            assert all(n == 1 for n in contributions.values())
            out[sl.unit * pieces + sl.piece] = sum(int(inputs[b][q][u * pieces + i]) for q, b, u, i in contributions)
        np.testing.assert_array_equal(out, ref[r].astype(np.int64))
    assert isinstance(expected, dict) and all(isinstance(c, Counter) for c in expected.values())


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("algorithm", ["ring", None])
def test_tolerance_bounds_the_reduced_elements_only(op, in_place, algorithm):
    w, count = 3, 7
    params = {"algorithm": algorithm} if algorithm else {}
    fam, spec = _spec(op, params, in_place, w, dtype="bfloat16")
    inputs = fam.make_inputs(spec, w, count, np.random.default_rng(5), pattern=False)
    ref, tol = fam.reference(spec, w, count, inputs)["dst"], fam.tolerance(spec, w, count, inputs)["dst"]
    for r in range(w):
        assert tol[r].shape == ref[r].shape
        mine = slice(r * count, (r + 1) * count) if op == "reduce_scatter" and in_place else slice(None)
        assert (tol[r][mine] > 0).all() and tol[r].sum() == tol[r][mine].sum()
