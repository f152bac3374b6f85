"""Tables and plots of benchmark rows (tsgen/bench/runner.py's), for the terminal and Markdown.

One table per group of rows that time the same work (op, dtype, world; for GEMMs N and K):
for every size, tsgen's rows (one per spec or variant) and then the baselines', with the time
per call (median) and its spread over the samples, the op's headline metric (busbw or algbw
in GB/s, TFLOP/s), one ratio column per compared baseline (t_baseline / t_tsgen: > 1 means
tsgen is faster), the overlap efficiency max(t_gemm, t_comm) / t where the baselines time
the GEMM and the communication alone, and what the check of the timed outputs found.
"""

from __future__ import annotations

from ..errors import RuntimeSetupError
from .sizes import human

METRICS = (("TFLOPs", "TFLOP/s"), ("busbw_GBps", "busbw GB/s"), ("algbw_GBps", "GB/s"))


def metric_of(rows: list[dict]) -> tuple[str, str] | None:
    """The headline metric the rows share (None: time only)."""
    return next(((k, title) for k, title in METRICS if any(r.get(k) for r in rows)), None)


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r.get("group") or r.get("op", "?"), []).append(r)
    return out


def _check_cell(r: dict) -> str:
    if r.get("baseline"):
        return f"rel err {r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
    if r.get("wrong") is not None:
        return f"{r['wrong']} wrong"
    if r.get("rel_err") is not None:
        return f"rel err {r['rel_err']:.1e}"
    return r.get("check", "")[:40]


def _ratio_cell(r: dict, c: str) -> str:
    """The ratio against c; timed in the same interleaved rounds: the median over rounds and, in
    brackets, the quartiles of the per-round ratios."""
    if c not in (r.get("ratios") or {}):
        return ""
    s = (r.get("ratio_spread") or {}).get(c)
    return f"{r['ratios'][c]:.2f}" + (f" [{s['q1']:.2f}, {s['q3']:.2f}]" if s else "")


def table_cells(rows: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, lines) per group of rows."""
    out = []
    for group, rs in _groups(rows).items():
        metric = metric_of(rs)
        compared = list(dict.fromkeys(k for r in rs for k in (r.get("ratios") or {})))
        overlap = any("overlap" in r for r in rs)
        clocks = any(r.get("sm_mhz_median") for r in rs)
        head = ["impl", "size", "pattern", "time us", "+-%"] + ([metric[1]] if metric else []) + \
            (["SM MHz"] if clocks else [])
        head += [f"vs {c}" for c in compared] + (["overlap"] if overlap else []) + ["% of ceiling", "check"]
        if not any(r.get("pattern") for r in rs):
            head.remove("pattern")
        lines = []
        for size in sorted({r["size"] for r in rs}):
            for r in sorted((r for r in rs if r["size"] == size), key=lambda r: (bool(r.get("baseline")), r.get("pattern", ""))):
                name = r["impl"] if r.get("baseline") else f"tsgen {r.get('label') or r.get('spec')}"
                cells = [name, human(size)] + ([r.get("pattern", "")] if "pattern" in head else [])
                cells += [f"{r['time_us']:.1f}", f"{r['spread_pct']:.1f}" if r.get("spread_pct") is not None else ""]
                if metric:
                    cells.append(f"{r[metric[0]]:.1f}" if r.get(metric[0]) else "")
                if clocks:
                    cells.append(f"{r['sm_mhz_median']:.0f}" if r.get("sm_mhz_median") else "")
                cells += [_ratio_cell(r, c) for c in compared]
                if overlap:
                    cells.append(f"{r['overlap']:.2f}" if "overlap" in r else "")
                cells.append(f"{100 * r['ceiling_frac']:.0f}" if r.get("ceiling_frac") else "")
                cells.append(_check_cell(r) + (f" [{r['note']}]" if r.get("note") else ""))
                lines.append(cells)
        first = rs[0]
        title = (f"{first.get('op')} ({first.get('dtype')}, world {first.get('world')}, "
                 f"size in {first.get('size_unit', '?')})")
        out.append((title, head, lines))
    return out


def text_table(rows: list[dict]) -> str:
    parts = []
    for title, head, lines in table_cells(rows):
        widths = [max(len(x) for x in col) for col in zip(head, *lines)]
        fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
        parts.append("\n".join([f"== {title}", fmt(head), "-" * len(fmt(head))] + [fmt(c) for c in lines]))
    if parts:
        parts.append("vs X = t_X / t_tsgen (> 1: tsgen faster; [q1, q3]: timed in interleaved rounds, the median "
                     "and quartiles of the per-round ratios); vs ideal: X = tsgen's FLOP rate per GPU over the ideal "
                     "X's (< 1: short of it); % of ceiling = the ceilings' floor / time")
    return "\n\n".join(parts)


def method_controls(rows: list[dict]) -> list[str]:
    """One line per group whose tsgen rows carry runner.add_ratios' method control: two baselines that
    call one kernel, timed in tsgen's rounds, their paired ratio per size (1.00 unless the method
    favours one of them; docs/benchmarks.md)."""
    out = []
    for rs in _groups(rows).values():
        found = [r for r in rs if r.get("method_control") and not r.get("baseline")]
        if not found:
            continue
        a, b = found[0]["method_control"]["pair"]
        out.append(method_control_line(a, b, [(f"{r.get('label') or r.get('spec')} {human(r['size'])}",
                                               r["method_control"]) for r in found]))
    return out


def method_control_line(a: str, b: str, cases: list[tuple[str, dict]]) -> str:
    """The sentence of the method's control (the bench reports' and tools/gpu_attention_bwd.py's): `a` and `b`
    call one kernel; `cases` (where, paired_ratio of b's samples over a's)."""
    cells = ", ".join(f"{where} {c['ratio']:.3f} ({c['min']:.3f} - {c['max']:.3f})" for where, c in cases)
    return (f"The method's control: {a} and {b} call one kernel, so their paired ratio ({b}'s time / {a}'s) is "
            f"1.00 unless the timing favours one of them: {cells}.")


def markdown_table(rows: list[dict]) -> str:
    parts = []
    for title, head, lines in table_cells(rows):
        md = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in lines]
        parts.append("\n".join(md))
    parts += method_controls(rows)
    return "\n\n".join(parts)


def plot(rows: list[dict], path) -> None:
    """The headline metric (or time) against size, one line per tsgen spec and per baseline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeSetupError("--plot needs matplotlib: pip install matplotlib") from None
    metric = metric_of(rows) or ("time_us", "time per call (us)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list] = {}
    for r in rows:
        if r.get(metric[0]):
            name = r["impl"] if r.get("baseline") else f"tsgen {r.get('label') or r.get('spec')}"
            lines.setdefault(name + (f" {r['pattern']}" if r.get("pattern") else ""), []).append((r["size"], r[metric[0]]))
    for name, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"size ({rows[0].get('size_unit', '') if rows else ''})")
    ax.set_ylabel(metric[1])
    ax.set_title(f"{rows[0].get('op', '') if rows else ''}: tsgen vs baselines")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
