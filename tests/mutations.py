"""Edits of rendered sources that break one synchronization or one plan entry, for the negative
controls of the GPU tests (tests/test_gpu.py) and of tests/torch_checks.py (imported there without
pytest's conftest). tests/test_gpu_controls_cpu.py applies each to the source it edits, on the CPU:
an edit that no longer matches would make a control fail for the wrong reason, or prove nothing."""

from __future__ import annotations

import re


def wrong_chunk_offset(text: str) -> str:
    """allgather's W 2 plan with rank 1's put landing at offset 0 of rank 0's output instead of 1:
    the step entry (its description trails it as a comment) gets its destination offset changed."""
    head, tail = text.split("static __device__ const tsgen::step steps_w2[]", 1)
    tail = re.sub(r"(\{TSGEN_OP_COPY, 1, 1, 1, 0, )\{0, 2, 0, 1, 1, 0\}(.*// rank 1 step 1: put to rank 0;)",
                  r"\1{0, 2, 0, 1, 0, 0}\2", tail, count=1)
    return head + "static __device__ const tsgen::step steps_w2[]" + tail


def reduce_without_waits(text: str) -> str:
    """reduce_scatter's plan tables with every reduce step's waits dropped (nwait 0: the `arrive`
    counters its peers' copies raise): a rank sums its inbox before the peers' pieces are in it."""
    out, n = re.subn(r"\{TSGEN_OP_REDUCE, (\d+), \d+, ", r"{TSGEN_OP_REDUCE, \1, 0, ", text)
    assert n, "no reduce step in the source"
    return out
