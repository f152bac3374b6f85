"""A user script under torchrun, without tsgen launch: a tsgen World of one process per GPU
(ipc or nvshmem backend) whose ranks meet in torch.distributed's store (issue 31, item 2).

    torchrun --standalone --nproc-per-node 2 tools/torchrun_world.py SPEC --backend ipc --group nccl

--group nccl|gloo: initialize the default process group first (the World then meets in its
store); none: no process group (the World meets in torchrun's agent store). Each rank:
  1. checks the store tsgen chose (the group's, or the agent's) and the rank it was given;
  2. runs SPEC against its reference (tsgen.harness.run_test, the code of `tsgen test`);
  3. with a process group: an all_reduce on it after tsgen's run (both share the GPUs);
  4. a World in which the last rank raises: every other rank's wait ends with that rank's
     message within 5 s (abort through the store), not a hang.
Prints `CHECK name PASS|FAIL detail` lines (rank 0 for the shared ones) and exits 1 on a FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--backend", choices=["ipc", "nvshmem"], default="ipc")
    ap.add_argument("--group", choices=["nccl", "gloo", "none"], default="nccl")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()

    from tsgen.env import force_no_multicast

    force_no_multicast()  # before torch or NVSHMEM load
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    dist = None
    if a.group != "none":
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        kw = {"device_id": torch.device("cuda", local)} if a.group == "nccl" else {}
        dist.init_process_group(a.group, **kw)

    from tsgen.errors import TsgenError
    from tsgen.harness import run_test
    from tsgen.runtime import World, store
    from tsgen.runtime.ipc import launcher_world

    name = f"torchrun-{a.backend}-{a.group}"
    failed = []

    def check(what: str, ok: bool, detail: str = "", everyone: bool = False) -> None:
        if not ok:
            failed.append(what)
        if rank == 0 or everyone or not ok:
            print(f"CHECK {name}-{what} {'PASS' if ok else 'FAIL'} rank {rank}: {detail}", flush=True)

    info = launcher_world(os.environ)
    want = "torch group" if dist is not None else "torchrun agent"
    chosen = store.store_choice(os.environ, store.torch_group() is not None)
    check("store", chosen == want and info.launcher == ("torch.distributed" if dist else "torchrun"),
          f"store {chosen!r} (want {want!r}), ranks from {info.launcher}")

    t0 = time.monotonic()
    try:
        ok = run_test(a.spec, backend=a.backend, iters=a.iters, echo=lambda line: print(line, flush=True))
        detail = f"{a.spec}, {a.iters} calls, {time.monotonic() - t0:.1f} s"
    except TsgenError as e:
        ok, detail = False, str(e)
    check("run_test", ok, detail)

    if dist is not None:
        import torch

        x = torch.full((1024,), float(rank + 1), device="cuda" if a.group == "nccl" else "cpu")
        dist.all_reduce(x)
        size = dist.get_world_size()
        check("group-after", bool((x == size * (size + 1) / 2).all()), f"all_reduce on the {a.group} group")

    # the last rank raises inside a World: the others' barrier must end with its message
    last = info.size - 1
    t0 = time.monotonic()
    message = ""
    try:
        with World(backend=a.backend) as world:
            if info.rank == last:
                raise RuntimeError("rank failed on purpose")
            world.barrier("the failing rank never comes")
        message = "the barrier completed"
    except Exception as e:  # noqa: BLE001 -- the StoreError expected, or what went wrong instead
        message = f"{type(e).__name__}: {e}"
    waited = time.monotonic() - t0
    if info.rank != last:
        check("abort", "rank failed on purpose" in message and waited < 5,
              f"{message!r} after {waited:.2f} s", everyone=True)
    print(f"RESULT {name} rank {rank}: {'FAIL ' + ', '.join(failed) if failed else 'PASS'}", flush=True)
    sys.stdout.flush()
    # no process-group or NVSHMEM teardown after an aborted world (its ranks are out of step)
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
