"""tsgen collectives against NCCL (and PyTorch symm-mem for all_reduce), same run.

Usage: python tools/bench_collectives.py OUT_DIR [--gpus 4] [--sizes 64K,256K,1M,256M,1G]
       [--ops allgather,reduce_scatter,...] [--variants default|tune]
Writes OUT_DIR/collectives_bench_w{gpus}.json and .md and prints the table.
"""

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tsgen.bench import bench_collective, best_baselines, human, parse_sizes  # noqa: E402

# op -> list of (spec file, param overrides, launch.blocks[, other launch overrides])
SHIPPED = {
    "allgather": [("allgather", {}, None), ("allgather_ring", {}, None), ("allgather_ce", {}, None)],
    "reduce_scatter": [("reduce_scatter", {}, None), ("reduce_scatter_large", {}, None),
                       ("reduce_scatter_ring", {}, None), ("reduce_scatter_ce", {}, None)],
    "all_to_all": [("all_to_all", {}, None), ("all_to_all_ce", {}, None)],
    "all_reduce": [("all_reduce_one_shot", {}, None), ("all_reduce_two_shot_pull", {}, None),
                   ("all_reduce_two_shot", {}, None), ("all_reduce_ring", {}, None),
                   ("all_reduce_two_shot_ce", {}, None)],
    "broadcast": [("broadcast", {}, None), ("broadcast_ring", {}, None)],
}
def tables(*names: str) -> list[tuple]:
    """The table interpreter instead of straight-line code (the A/B of launch.plan_code)."""
    return [(name, {}, None, {"plan_code": "tables"}) for name in names]


TUNE = {
    "allgather": [("allgather", {"blocks_per_peer": b}, min(132, 4 * b + 1)) for b in (4, 24, 32)]
    + [("allgather_pull", {"blocks_per_peer": 32}, 128)]
    + [("allgather", {"peer_order": "pairwise", "blocks_per_peer": b}, b + 1) for b in (32, 64, 96)]
    + [("allgather_ring", {"blocks_per_peer": b, "pieces": p}, min(132, 2 * b)) for b, p in ((64, 4), (64, 12))]
    + tables("allgather_ring"),
    "reduce_scatter": [("reduce_scatter", {"blocks_per_peer": b, "pieces": p}, min(132, 4 * b + 1))
                       for b, p in ((16, 4), (24, 4), (24, 8), (32, 8))]
    + [("reduce_scatter_ring", {"blocks_per_peer": 64, "pieces": p}, 128) for p in (4, 16)]
    + tables("reduce_scatter_ring"),
    "all_to_all": [("all_to_all", {"blocks_per_peer": b}, min(132, 4 * b + 1)) for b in (24, 32)]
    + [("all_to_all", {"peer_order": "pairwise", "blocks_per_peer": b}, b + 1) for b in (32, 64, 96)],
    "all_reduce": [("all_reduce_two_shot_pull", {"blocks_per_peer": b}, b + 8) for b in (8, 16, 64)]
    + [("all_reduce_one_shot", {"blocks_per_peer": b}, b + 1) for b in (4, 8, 16)]
    + tables("all_reduce_one_shot", "all_reduce_two_shot_pull", "all_reduce_ring")
    + [("all_reduce_ring", {"blocks_per_peer": 64, "pieces": p}, 128) for p in (2, 8)],
    "broadcast": [("broadcast_ring", {"blocks_per_peer": 64, "pieces": p}, 128) for p in (8, 32)],
}


def variant_spec(tmp: Path, name: str, params: dict, blocks, dtype: str | None,
                 launch: dict | None = None) -> tuple[str, Path]:
    path = ROOT / "specs" / f"{name}.yaml"
    if not params and blocks is None and dtype is None and not launch:
        return name, path
    data = yaml.safe_load(path.read_text())
    data["params"] = {**data.get("params", {}), **params}
    data["launch"] = {**data.get("launch", {}), **(launch or {})}
    if blocks is not None:
        data["launch"]["blocks"] = blocks
    if dtype is not None:
        data["dtype"] = dtype
    label = (name + "".join(f"_{k[:1]}{v}" for k, v in params.items()) + (f"_B{blocks}" if blocks else "")
             + "".join(f"_{v}" for v in (launch or {}).values()))
    data["name"] = label
    out = tmp / f"{label}.yaml"
    out.write_text(yaml.safe_dump(data))
    return label, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--sizes", default="64K,256K,1M,256M,1G")
    ap.add_argument("--ops", default="allgather,reduce_scatter,all_to_all,all_reduce,broadcast")
    ap.add_argument("--tune", action="store_true", help="also time tuning variants")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--only", default=None,
                    help="comma-separated variant labels (a shipped spec's is its name; a tuning variant's "
                    "adds its overrides, e.g. all_reduce_one_shot_b8_B9, all_reduce_one_shot_tables): time just these")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for op in args.ops.split(","):
        variants = SHIPPED[op] + (TUNE[op] if args.tune else [])
        dtype = args.dtype
        labelled = [(v[0], *variant_spec(tmp, *v[:3], dtype, *v[3:])) for v in variants]
        if args.only:
            only = args.only.split(",")
            labelled = [v for v in labelled if v[1] in only] or labelled[:1]
        for name, label, path in labelled:
            try:
                for r in bench_collective(path, args.gpus, sizes):
                    r["variant"] = label
                    rows.append(r)
            except Exception as e:  # keep the run going; report the failure in the table
                print(f"{label}: FAILED: {e}", flush=True)
                rows.append({"backend": "tsgen", "variant": label, "op": op, "error": str(e)[:500]})
        dt = dtype or yaml.safe_load((ROOT / "specs" / f"{variants[0][0]}.yaml").read_text())["dtype"]
        try:
            # Baselines get their best case (see tsgen.bench.best_baselines).
            for r in best_baselines(op, dt, sizes, args.gpus):
                r["variant"] = r["backend"]
                rows.append(r)
                print(f"{r['backend']:28s} {human(r['bytes']):>6s}  "
                      f"{(r['time_us'] or float('nan')):9.1f} us  busbw {(r['busbw_GBps'] or float('nan')):7.1f} GB/s"
                      f"{'  ' + str(r['skipped']) if r.get('skipped') else ''}", flush=True)
        except Exception as e:
            print(f"baselines for {op}: FAILED: {e}", flush=True)
            rows.append({"backend": "nccl", "variant": "nccl", "op": op, "error": str(e)[:2000]})
        write(args, rows)  # after every op, so a run cut short still leaves its numbers
    md = write(args, rows)
    print(md)


def write(args, rows) -> str:
    dev = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
    meta = {"command": "python tools/bench_collectives.py $OUT " + " ".join(sys.argv[2:]),
            "device": dev, "date": datetime.date.today().isoformat(), "gpus": args.gpus,
            "timing": "tsgen: one process, a CUDA graph of back-to-back calls per GPU, time per call = "
                      "max over GPUs of graph time / calls, median of 7; buffers rotate below 64 MiB. "
                      "NCCL / symm-mem: one process per GPU, max over ranks, median; the better of CUDA "
                      "graphs over rotated buffers and an eager loop on one buffer."}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"collectives_bench_w{args.gpus}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = render_md(rows, meta)
    (args.out / f"{stem}.md").write_text(md)
    return md


def render_md(rows, meta) -> str:
    lines = [f"# tsgen collectives vs NCCL ({meta['date']}, {meta['device'][0] if meta['device'] else '?'} x{meta['gpus']})",
             "", f"Command: `{meta['command']}`", "", meta["timing"], "",
             "| op | variant | size | time us | busbw GB/s | NCCL us | NCCL busbw | busbw ratio | time ratio | wrong |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nccl = {(r["op"], r["bytes"]): r for r in rows if r.get("backend") == "nccl" and r.get("time_us")}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['variant']} | - | FAILED: {r['error'][:120]} | | | | | | |")
            continue
        if not r.get("time_us"):
            continue
        n = nccl.get((r["op"], r["bytes"]))
        ratio = f"{r['busbw_GBps'] / n['busbw_GBps']:.2f}" if n else "-"
        tratio = f"{r['time_us'] / n['time_us']:.2f}" if n else "-"
        lines.append(f"| {r['op']} | {r['variant']} | {human(r['bytes'])} | {r['time_us']:.1f} | {r['busbw_GBps']:.1f} | "
                     f"{n['time_us']:.1f} | {n['busbw_GBps']:.1f} | {ratio} | {tratio} | {r.get('wrong', '-')} |"
                     if n else f"| {r['op']} | {r['variant']} | {human(r['bytes'])} | {r['time_us']:.1f} | "
                     f"{r['busbw_GBps']:.1f} | - | - | - | - | {r.get('wrong', '-')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
