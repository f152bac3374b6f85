"""Rows of result files written before this bench (2026-11-21 and earlier), in today's shape.

The migrated files keep their content (results/README.md); the index (tsgen/bench/index.py)
reads them through `normalize`, which knows the five shapes the retired tools wrote:
tools/bench_collectives.py ({meta, rows} with `backend`), tools/bench_primitives.py
({meta, rows} with `kernel_GBps`), tools/gpu_gemm.py (`bench`), tools/gpu_fused.py's
allgather_gemm / gemm_reduce_scatter part (`table`) and its cannon / summa part (`rows` with
`tflops`). Anything else has no rows (its Markdown file is shown as it is).
"""

from __future__ import annotations


def _collective(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if not r.get("time_us") or "op" not in r:
            continue
        tsgen = r.get("backend") == "tsgen"
        group = f"{r['op']}/{r.get('dtype', '?')}/w{r.get('world', '?')}"
        out.append({"impl": "tsgen" if tsgen else r["backend"], "label": r.get("variant") or r.get("spec"),
                    "op": r["op"], "dtype": r.get("dtype"), "world": r.get("world"), "group": group,
                    "size": r["bytes"], "size_unit": "bytes", "time_us": r["time_us"],
                    "algbw_GBps": r.get("algbw_GBps"), "busbw_GBps": r.get("busbw_GBps"), "wrong": r.get("wrong"),
                    **({} if tsgen else {"baseline": True, "compare": True})})
    return out


def _primitives(rows: list[dict], world) -> list[dict]:
    out = []
    for r in rows:
        base = {"op": r["op"], "dtype": "uint8", "world": world, "group": f"{r['op']}/{r.get('variant', r['spec'])}",
                "size": r["bytes"], "size_unit": "bytes", "pattern": r["pattern"]}
        out.append({"impl": "tsgen", "label": r.get("variant") or r["spec"], **base, "time_us": r["kernel_us"],
                    "algbw_GBps": r["kernel_GBps"]})
        out.append({"impl": "memcpyPeer", **base, "time_us": r["copy_engine_us"],
                    "algbw_GBps": r["copy_engine_GBps"], "baseline": True, "compare": True})
    return out


def _gemm(data: dict) -> list[dict]:
    size = (data.get("size") or [0])[0]
    out = []
    for r in data["bench"]:
        tsgen = r["impl"].startswith("tsgen")
        out.append({"impl": "tsgen" if tsgen else r["impl"], "label": r["impl"].removeprefix("tsgen ") if tsgen else None,
                    "op": "gemm", "dtype": r.get("dtype"), "world": 1, "group": "gemm", "size": size,
                    "size_unit": "rows", "time_us": r["ms"] * 1e3, "TFLOPs": r["tflops"], "rel_err": r.get("rel_err"),
                    **({} if tsgen else {"baseline": True, "compare": True})})
    return out


def _fused(data: dict, op: str) -> list[dict]:
    out = []
    for r in data["table"]:
        tsgen = r["impl"].startswith("tsgen")
        out.append({"impl": "tsgen" if tsgen else r["impl"], "label": r["impl"].removeprefix("tsgen ") if tsgen else None,
                    "op": op, "dtype": "bfloat16", "world": 4, "group": op, "size": r["m"], "size_unit": "rows", "time_us": r["us"],
                    "TFLOPs": r["tflops"], "overlap": r.get("overlap_efficiency"),
                    **({} if tsgen else {"baseline": True, "compare": True})})
    return out


def _grid(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        tsgen = r["impl"].startswith("tsgen")
        out.append({"impl": "tsgen" if tsgen else r["impl"], "label": r["impl"].removeprefix("tsgen ") if tsgen else None,
                    "op": "cannon/summa", "dtype": "bfloat16", "world": 4, "group": "grid", "size": r["size"], "size_unit": "rows (M = N = K)",
                    "time_us": r["us"], "TFLOPs": r["tflops"], "rel_err": r.get("rel_err"),
                    **({} if tsgen else {"baseline": True, "compare": True})})
    return out


def normalize(data) -> tuple[dict, list[dict]]:
    """(meta, rows) of a result file of any known shape; rows get today's fields and ratios."""
    from .runner import add_ratios

    if isinstance(data, dict) and "meta" in data and "rows" in data and "errors" in data:
        return data["meta"], data["rows"]  # written by this bench
    if not isinstance(data, dict):
        return {}, []
    meta = data.get("meta") or {k: data[k] for k in ("device", "date", "command", "commit") if k in data}
    rows: list[dict] = []
    if "rows" in data and data["rows"] and "backend" in data["rows"][0]:
        rows = _collective(data["rows"])
    elif "rows" in data and data["rows"] and "kernel_GBps" in data["rows"][0]:
        rows = _primitives(data["rows"], meta.get("gpus"))
    elif "bench" in data and isinstance(data["bench"], list):
        rows = _gemm(data)
    elif "table" in data:
        rs = any("gemm_rs" in r["impl"] or "reduce_scatter" in r["impl"] for r in data["table"])
        rows = _fused(data, "gemm_reduce_scatter" if rs else "allgather_gemm")
    elif "rows" in data and data["rows"] and "tflops" in data["rows"][0]:
        rows = _grid(data["rows"])
    for r in rows:
        r["impl"] = r["impl"] or "?"
        if r.get("label") is None:
            r.pop("label", None)
    add_ratios(rows)
    return meta, rows
