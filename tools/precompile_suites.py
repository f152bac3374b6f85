"""Compile every entry of the named suites into the compile cache, in parallel, so that a device
call's benchmark steps spend their time timing rather than compiling one spec after another.

Usage: python tools/precompile_suites.py SUITE... [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def compile_entry(job: tuple[str, dict]) -> str:
    from tsgen.harness import render_to_cache
    from tsgen.spec import load_spec, spec_variant
    from tsgen.toolchain import compile_for

    spec, variant = job
    loaded = spec_variant(load_spec(spec), variant)
    cached = render_to_cache(loaded)
    compile_for(cached.manifest, cached.source)
    return f"{loaded.model.name}: compiled"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="+")
    ap.add_argument("--jobs", type=int, default=8)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tsgen.bench.suites import load_suite

    jobs = list(dict.fromkeys((str(e.spec), json.dumps(e.variant, sort_keys=True)) for s in args.suites for e in load_suite(s).entries))
    failed = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(compile_entry, (spec, json.loads(variant))) for spec, variant in jobs]
        for f in futures:
            try:
                print(f.result(), flush=True)
            except Exception as e:  # report every entry, then fail
                failed += 1
                print(f"FAILED: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
