"""The Ulysses all-to-alls on GPUs (tests/test_gpu.py also runs the shipped specs through
`tsgen test` at their world sizes and 8): variants (fp16, bhsd, packed QKV with split and with
replicated KV heads, world size 3), each checked by a consumer on the rank's own stream, and the
negative control without the arrival wait, which must fail.

The harness (`tsgen test`) compares outputs after every rank's kernel has finished, which cannot
tell whether a rank's output was complete when ITS kernel returned -- the promise that lets the
attention kernel run next on the same stream. Here each rank's outputs are copied into snapshot
arrays by a copy enqueued on the rank's stream right after its launch, and the snapshots are
compared bit for bit with the NumPy reference (outputs poisoned before every call, fresh data
every call, the (rank, index) pattern on the first). With TSGEN_SHARE_GPUS=1 every world runs on
one GPU (the fitted spec variant is printed), with the test-only rank skew where asked.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ROOT, need_gpus
from results_rows import CONTROL_CALLS, record_control

pytestmark = pytest.mark.gpu

SKEW_SEED = 7


def stream_check(spec_path, world, variant=None, skew=None, iters=20, count=None, seed=0):
    """(wrong elements over every snapshot, checked elements, log lines); the log's last line counts
    the calls with a wrong element ('calls wrong: K of N')."""
    from tsgen.harness import _poison_value, as_bits, gpu_turn, load_call, materialize, shared_gpu_variant
    from tsgen.ops import get_family
    from tsgen.runtime import World
    from tsgen.spec import load_spec, spec_variant

    loaded = spec_variant(load_spec(spec_path), {"world_sizes": [world]} | (variant or {}))
    lines = []
    with World(world) as w:
        loaded = shared_gpu_variant(loaded, w, lines.append)
        spec, family, cp = loaded.model, get_family(loaded.model.op), w.cp
        count = count or spec.test.count
        module = w.load(materialize(loaded, skew=skew))
        bufs = module.alloc(count)
        outputs = [s.name for s in bufs.slots if s.role == "output"]
        snaps = {}
        for r in w.ranks:
            with cp.cuda.Device(w.devices[r]):
                snaps.update({(r, n): cp.empty_like(bufs.array(n, r)) for n in outputs})
        wrong = checked = 0
        bad_calls = set()
        try:
            for call in range(iters):
                inputs = family.make_inputs(spec, world, count, np.random.default_rng([seed, call]), call == 0)
                expected = family.reference(spec, world, count, inputs)
                load_call(w, bufs, inputs, call)
                w.synchronize()
                with gpu_turn(w):
                    module.launch(bufs)
                    for r in w.ranks:  # the consumer: right behind the rank's own kernel on its stream
                        with cp.cuda.Device(w.devices[r]), w.streams[r]:
                            for n in outputs:
                                cp.copyto(snaps[r, n], bufs.array(n, r))
                    w.synchronize()
                for (r, n), snap in snaps.items():
                    got, want = as_bits(snap.get()), as_bits(np.ascontiguousarray(expected[n][r]))
                    bad = int((got != want).sum())
                    if bad and len(lines) < 12:
                        left = int((got == _poison_value(got.dtype, call)).sum())
                        lines.append(f"call {call}: rank {r} {n}: {bad} of {got.size} wrong ({left} still poison)")
                    wrong, checked = wrong + bad, checked + got.size
                    if bad:
                        bad_calls.add(call)
        finally:
            bufs.free()
    lines.append(f"calls wrong: {len(bad_calls)} of {iters}")
    return wrong, checked, lines


CASES = [
    ("ulysses_pre_a2a", 2, None),
    ("ulysses_pre_a2a", 3, {"dtype": "float16", "params": {"layout": "bhsd"}}),
    ("ulysses_pre_a2a", 4, {"params": {"layout": "bhsd"}}),
    ("ulysses_pre_a2a", 8, {"dtype": "float16"}),
    ("ulysses_pre_a2a_gqa", 2, None),  # 2 KV heads over 2 ranks: split
    ("ulysses_pre_a2a_gqa", 4, {"params": {"layout": "bshd"}}),  # replicated twice
    ("ulysses_pre_a2a_gqa", 8, None),  # replicated 4 times
    ("ulysses_pre_a2a_gqa", 4, {"params": {"kv_heads": 8}, "test": {"count": 257}}),  # 8 KV heads: 2 per rank
    ("ulysses_post_a2a", 2, {"params": {"layout": "bhsd"}}),
    ("ulysses_post_a2a", 3, None),
    ("ulysses_post_a2a", 4, {"dtype": "float16"}),
    ("ulysses_post_a2a", 8, {"params": {"layout": "bhsd"}}),
]


@pytest.mark.parametrize("name,world,variant", CASES,
                         ids=[f"{n}-w{w}-{i}" for i, (n, w, _) in enumerate(CASES)])
def test_output_is_complete_when_the_kernel_returns(name, world, variant):
    need_gpus(world)
    wrong, checked, lines = stream_check(ROOT / "specs" / f"{name}.yaml", world, variant)
    assert checked and not wrong, "\n".join(lines)


@pytest.mark.parametrize("skew", [SKEW_SEED, "lag_blocks"], ids=["seeded", "lag_blocks"])
@pytest.mark.parametrize("name", ["ulysses_pre_a2a", "ulysses_post_a2a"])
def test_skewed_ranks_still_complete(name, skew):
    """The positive twin of the negative control: the same skew (and the seeded one), the wait
    compiled in."""
    need_gpus(4)
    wrong, checked, lines = stream_check(ROOT / "specs" / f"{name}.yaml", 4, skew=skew, count=301)
    assert checked and not wrong, "\n".join(lines)


@pytest.mark.parametrize("name", ["ulysses_pre_a2a", "ulysses_post_a2a"])
def test_negative_control_without_the_arrival_wait_fails(name):
    """params.arrival_wait false: the kernel returns before the peers' pushes have landed, so
    the consumer on the stream must see holes at every call, under the lag_blocks schedule (the
    entry handshake runs on time, then the peers' pushing blocks lag: rank 0 has returned before
    they write to it). Measured on one H200 (2026-11-26): with the seeded skew, 1 run in 16 missed;
    under "lag" (every peer block late) 0 of 50 calls caught: the entry wait lines the ranks up."""
    need_gpus(4)
    wrong, checked, lines = stream_check(ROOT / "specs" / f"{name}.yaml", 4, {"params": {"arrival_wait": False}},
                                         skew="lag_blocks", count=301, iters=CONTROL_CALLS)
    caught = int(lines[-1].split()[2])
    record_control(f"{name} arrival wait", CONTROL_CALLS, caught, world=4, skew="lag_blocks")
    assert checked and wrong, "broken kernel passed:\n" + "\n".join(lines)


def test_wait_that_never_completes_times_out():
    """Only rank 0 runs: its blocks wait for the entry signal of a peer that never starts, so the
    kernel must print the diagnosis and trap within the timeout. A subprocess: a trap ends the
    CUDA context."""
    import sys

    from tsgen.harness import run_in_turn

    need_gpus(2)
    proc = run_in_turn([sys.executable, "-m", "tsgen", "test", "specs/ulysses_pre_a2a.yaml", "--gpus", "2",
                        "--probe-timeout"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "tsgen: timeout: rank 0" in out and "on entry[1]" in out, out
