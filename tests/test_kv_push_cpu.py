"""params.kv_push (the backward of context-parallel attention with its dK / dV reduce-scatter overlapped,
issue 35): the spec's refusals and render, the header's owner map and table layout against tsgen.torch's
Python twins (host-compiled), the owner map against the composed backward's reduce-scatter order, and the
example specs compiled without spills. The GPU check is tests/torch_checks.py --cp (labels *_push)."""

from __future__ import annotations

import struct
import subprocess

import pytest

from conftest import ROOT, compile_test, host_program, missing_tool, rendered_source
from test_attention_backward_wgmma_cpu import variant
from tsgen.ops import get_family
from tsgen.spec import SpecError
from tsgen.toolchain import compile_source, find_nvcc

NO_NVCC = missing_tool(find_nvcc)
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
PUSH_SPECS = ("attention_backward_hd128_causal_gqa_push", "attention_backward_hd128_push")


def _cp():
    """tsgen.torch.cp_attention_op's pure-Python pieces without importing torch (skip where it is missing)."""
    pytest.importorskip("torch")
    from tsgen.torch import cp_attention_op
    return cp_attention_op


def test_kv_push_refusals_and_render(tmp_path):
    """kv_push renders the push entry, its two kernels and KV_PUSH; absent, none of them; it is refused with
    impl mma_sync and with tail_split, each with the reason."""
    on = variant("on", params={"kv_push": True})
    assert get_family("attention_backward").constants(on.model)["KV_PUSH"] == 1
    source = rendered_source(on, tmp_path).read_text()
    for text in ("static constexpr bool KV_PUSH = on::KV_PUSH != 0;", "on_w1_push_wait(", "on_w1_push_reduce(",
                 "on_w1_push_signal(", 'extern "C" cudaError_t on_w1_backward_push(',
                 "if (control == 2) on_w1_push_signal<<<1, 32, 0, stream>>>(push);",
                 "if (control != 2) on_w1_push_signal<<<1, 32, 0, stream>>>(push);\n"
                 "  if (control != 1) on_w1_push_wait<<<1, 32, 0, stream>>>(push);"):
        assert text in source, text
    off = rendered_source(variant("off"), tmp_path).read_text()
    assert "KV_PUSH" not in off and "_push" not in off
    with pytest.raises(SpecError, match="kv_push with tail_split is not built"):
        variant("v", params={"kv_push": True, "tail_split": True})
    with pytest.raises(SpecError, match="kv_push needs params.impl wgmma"):
        variant("v", params={"kv_push": True, "impl": "mma_sync"}, launch={"threads": 128})


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("zigzag", False), ("contiguous", True),
                                           ("contiguous", False)])
def test_owner_map_is_the_reduce_scatters(world, layout, causal):
    """Where the pushed backward sends a gathered key's partial sums (push_owner, the table's zigzag flag =
    the composed backward reorders) is where the composed backward's reduce-scatter puts them: the rank and
    row of the all-gather's output that the key's position came from (gather_order), for every key; so every
    rank's rows receive exactly one partial from each rank."""
    cp = _cp()
    rows = 256
    order = cp.gather_order(layout, causal, world, rows)
    zigzag = order is not None
    seen = set()
    for key in range(world * rows):
        want = divmod(order[key] if zigzag else key, rows)
        assert cp.push_owner(zigzag, world, rows, key) == want, (key, want)
        seen.add(want)
    assert len(seen) == world * rows


HOST = r"""
#include "SOURCE"
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
namespace ab = tsgen::attention_bwd;
int main(int argc, char** argv) {
  (void)argc;
  ab::KvPush t = {};
  t.world = atoi(argv[1]), t.rows = atoi(argv[2]), t.zigzag = atoi(argv[3]);
  printf("layout %zu %zu %zu %zu %zu %zu\n", sizeof(ab::KvPush), offsetof(ab::KvPush, calls),
         offsetof(ab::KvPush, arrived), offsetof(ab::KvPush, area), offsetof(ab::KvPush, arrived_at),
         (size_t)ab::PUSH_AREA);
  printf("slots %zu senders %u %u\n", ab::push_slot(t.world, 5, 1, 1, 1000), ab::push_sender(0, 1),
         ab::push_sender(2, 1));
  printf("all_slots");  // every (parity, sender slot, dK / dV) of 1000 elements
  for (uint32_t e = 0; e < 2; ++e)
    for (uint32_t slot = 0; slot + 1 < t.world; ++slot)
      for (uint32_t which = 0; which < 2; ++which) printf(" %zu", ab::push_slot(t.world, e, slot, which, 1000));
  printf("\nall_senders");  // push_sender(sender, owner) for every owner, every other sender
  for (uint32_t owner = 0; owner < t.world; ++owner)
    for (uint32_t sender = 0; sender < t.world; ++sender)
      if (sender != owner) printf(" %u", ab::push_sender(sender, owner));
  printf("\n");
  for (uint32_t key = 0; key < t.world * t.rows; ++key) {
    uint32_t row = 0;
    const uint32_t owner = ab::push_owner(t, key, row);
    printf("%u %u\n", owner, row);
  }
}
"""


@needs_nvcc
def test_header_push_geometry_matches_python(tmp_path):
    """The header's KvPush layout is push_table_bytes' (size and field offsets), its heap's area starts at
    PUSH_AREA, push_slot and push_sender are the formulas the heap's size assumes, and push_owner (host-compiled)
    gives the Python twin's owner and row for every key, zig-zag and not, at worlds 2, 3 and 8; every slot of the
    receive area (both parities, every sender, dK and dV) is its own and the heap's size covers them exactly, and
    each owner's senders take its world - 1 slots one each (push_sender)."""
    cp = _cp()
    exe = host_program(variant("geo", params={"kv_push": True}), HOST, tmp_path, "push_main")
    for world, rows, zigzag in ((2, 256, 1), (2, 384, 0), (3, 256, 1), (8, 128, 1), (8, 128, 0)):
        out = subprocess.run([str(exe), str(world), str(rows), str(zigzag)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        size, calls, arrived, area, arrived_at, push_area = map(int, out[0].split()[1:])
        table = cp.push_table_bytes(world, 1, rows, bool(zigzag), [4096 * (i + 1) for i in range(world)])
        assert size == len(table) and (calls, arrived, area, arrived_at) == (16, 24, 32, 32 + 8 * cp.PUSH_MAX_WORLD)
        assert push_area == cp.PUSH_AREA
        w, r, n, z = struct.unpack_from("<4I", table)
        assert (w, r, n, z) == (world, 1, rows, zigzag)
        me, arr = struct.unpack_from("<2Q", table, calls)
        assert (me, arr) == (2 * 4096, 2 * 4096 + 16)
        areas = struct.unpack_from(f"<{cp.PUSH_MAX_WORLD}Q", table, area)[:world]
        ats = struct.unpack_from(f"<{cp.PUSH_MAX_WORLD}Q", table, arrived_at)[:world]
        assert areas == tuple(4096 * (i + 1) + cp.PUSH_AREA for i in range(world))
        assert ats == tuple(4096 * (i + 1) + 16 + 8 * 1 for i in range(world))  # rank 1's counter at each owner
        words = out[1].split()
        assert int(words[1]) == ((1 * (world - 1) + 1) * 2 + 1) * 1000  # epoch 5: parity 1, slot 1, dV
        assert (int(words[3]), int(words[4])) == (0, 1)  # the other ranks in rank order: rank 0, then rank 2
        # the receive area: every slot its own 1000 elements, together exactly what push_heap_bytes sizes
        slots = sorted(map(int, out[2].split()[1:]))
        assert slots == [1000 * i for i in range(2 * (world - 1) * 2)]
        assert cp.push_heap_bytes(world, 1000, 2) == cp.PUSH_AREA + (slots[-1] + 1000) * 2
        # each owner's senders fill its world - 1 slots, one each
        senders = list(map(int, out[3].split()[1:]))
        for owner in range(world):
            assert sorted(senders[owner * (world - 1):(owner + 1) * (world - 1)]) == list(range(world - 1)), owner
        got = [tuple(map(int, line.split())) for line in out[4:]]
        assert got == [cp.push_owner(bool(zigzag), world, rows, key) for key in range(world * rows)]


@needs_nvcc
@pytest.mark.parametrize("name", PUSH_SPECS)
def test_push_specs_compile_without_spills(name, tmp_path):
    """The example kv_push specs: every kernel without spills, the main kernel at 168 registers (setmaxnreg's
    share), no serialized wgmma (ptxas C75xx)."""
    from test_attention_cpu import ptxas_problems
    from tsgen.spec import load_spec

    out = rendered_source(load_spec(ROOT / "examples" / "torch" / "specs" / f"{name}.yaml"), tmp_path)
    res = compile_source(out, arch="sm_90a", mode="shared")
    assert not ptxas_problems(res.output)
    for entry, report in res.report.items():
        assert report["spill_stores"] == report["spill_loads"] == 0, (entry, report)
    assert res.report[f"{name}_w1_main"]["registers"] == 168
    assert {f"{name}_w1_push_signal", f"{name}_w1_push_wait", f"{name}_w1_push_reduce"} <= set(res.report)
