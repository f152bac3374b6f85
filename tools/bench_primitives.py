"""Bandwidth of put/get primitives against cudaMemcpyPeer in the same run.

Usage: python tools/bench_primitives.py OUT_DIR [--gpus 2] [--sizes 256M,1G]
Writes OUT_DIR/primitives_bench.json and .md and prints the table.
Tuning variants are temporary copies of the shipped specs with other launch
shapes, so the shipped defaults can be chosen from measurement.
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

from tsgen.bench import bench_copy, parse_sizes  # noqa: E402

VARIANTS = [  # (spec, blocks, threads, unroll); None = as shipped
    ("put_block", None, None, None),
    ("put_warp", None, None, None),
    ("get_block", None, None, None),
    ("get_warp", None, None, None),
    ("put_block", 132, 512, 4),  # the first default, kept to show why it changed
    ("put_block", 32, 512, 4),
    ("put_warp", 64, 512, 4),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--sizes", default="256M,1G")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name, blocks, threads, unroll in VARIANTS:
        path = ROOT / "specs" / f"{name}.yaml"
        label = name
        if blocks is not None:
            data = yaml.safe_load(path.read_text())
            data["launch"] = {"blocks": blocks, "threads": threads, "unroll": unroll}
            label = f"{name}_b{blocks}_t{threads}_u{unroll}"
            data["name"] = label
            path = tmp / f"{label}.yaml"
            path.write_text(yaml.safe_dump(data))
        patterns = ("pair", "ring") if blocks is None else ("pair",)
        for row in bench_copy(path, args.gpus, sizes, patterns=patterns):
            row["variant"] = label
            rows.append(row)
    dev = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
    meta = {
        "command": "python tools/bench_primitives.py $OUT " + " ".join(sys.argv[2:]),
        "device": dev,
        "date": datetime.date.today().isoformat(),
        "gpus": args.gpus,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "primitives_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# put/get vs cudaMemcpyPeer ({meta['date']}, {dev[0] if dev else '?'} x{args.gpus})",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| variant | pattern | bytes | kernel GB/s | memcpyPeer GB/s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['pattern']} | {r['bytes'] >> 20} MiB | {r['kernel_GBps']:.1f} | "
                     f"{r['copy_engine_GBps']:.1f} | {r['ratio']:.3f} |")
    (args.out / "primitives_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
