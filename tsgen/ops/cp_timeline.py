"""The call timeline of cp_attention (issue 33, "Outside the tiles" in docs/design/cp_attention.md): what a
trace variant (params.trace) records of every stream operation of a call, read back and put in phases.
Pure: no GPU (tools/cp_call_timeline.py runs the calls and reads the buffers; tests/test_cp_timeline_cpu.py).

Three sources, on two clocks:
  stamps   (device, globaltimer ns) tsgen/cp.cuh stamp_sync: at sig + SIGNALS, STAMP_CALLS slots of STAMP_SLOT
           words, call (epoch) e in slot e % STAMP_CALLS: [0] e, [1, 2] the entry kernel's start / end, [3, 4]
           WAIT_FREE's, [5 + 2 i, 6 + 2 i] the signal kernel's after the copies to the i-th receiver in copy
           order (ourselves first; local_kv: no i = 0). A signal kernel starts after its copies completed (an
           event, then a launch: a few us late), so the copies' ends are the signal kernels' starts.
  records  (device, globaltimer ns) tsgen/attention.cuh's per-tile trace (tsgen.ops.cp_attention.trace_table):
           call k since the count was reset made records k x tiles .. (k + 1) x tiles - 1.
  host     (host, CLOCK_REALTIME ns) tsgen/cp.cuh host_call: per rank the last HOST_CALLS launcher calls, when
           each step was enqueued (the module's NAME_host_timeline copies them out).
globaltimer is set from the host's clock by the driver: where the two agree (|host lead| well under a
millisecond) the host's enqueue times can be read on the device's axis; `clock_checks` says how well the
two GPUs' globaltimers agree (a READY seen before it was raised means they do not).
"""

from __future__ import annotations

from statistics import median

# tsgen/cp.cuh (the template static_asserts STAMP_WORDS; tests/test_cp_timeline_cpu.py reads the header)
MAX_WORLD = 8
STAMP_CALLS, STAMP_SLOT = 8, 24
STAMP_WORDS = STAMP_CALLS * STAMP_SLOT
STAMP_ENTRY, STAMP_WAIT_FREE, STAMP_SIGNAL = 1, 3, 5
HOST_CALLS, HOST_STEPS = 8, 24
HOST_ATTENTION = 4 + 2 * MAX_WORLD
HOST_RETURN = HOST_ATTENTION + 1
HOST_WORDS = 1 + HOST_CALLS * HOST_STEPS
US = 1e-3  # us per ns


def _pair(slot, at):
    s, e = int(slot[at]), int(slot[at + 1])
    return (s, e) if s and e else None


def stamp_table(words, world: int) -> dict[int, dict]:
    """The stamps (STAMP_WORDS u64) -> {epoch: {"entry": (start, end), "wait_free": (start, end) or None,
    "signals": [(start, end) or None per copy index i]}} for every slot that holds a call."""
    out = {}
    for c in range(STAMP_CALLS):
        slot = [int(x) for x in words[c * STAMP_SLOT:(c + 1) * STAMP_SLOT]]
        epoch = slot[0]
        if not epoch:
            continue
        out[epoch] = {"entry": _pair(slot, STAMP_ENTRY), "wait_free": _pair(slot, STAMP_WAIT_FREE),
                      "signals": [_pair(slot, STAMP_SIGNAL + 2 * i) for i in range(world)]}
    return out


def host_table(words, world: int) -> list[dict]:
    """NAME_host_timeline's words (HOST_WORDS) -> the launcher's calls held, by call number: [{"call", "enter",
    "entry", "wait_free", "copies": [t or None per copy index], "signals": [...], "attention", "return"}]
    (CLOCK_REALTIME ns; None: not reached)."""
    rows = []
    for c in range(HOST_CALLS):
        row = [int(x) for x in words[1 + c * HOST_STEPS:1 + (c + 1) * HOST_STEPS]]
        if not row[0]:
            continue
        at = [x or None for x in row]
        rows.append({"call": row[0], "enter": at[1], "entry": at[2], "wait_free": at[3],
                     "copies": [at[4 + 2 * i] for i in range(world)], "signals": [at[5 + 2 * i] for i in range(world)],
                     "attention": at[HOST_ATTENTION], "return": at[HOST_RETURN]})
    return sorted(rows, key=lambda r: r["call"])


def records_by_call(records: list[dict], tiles: int, epochs: list[int]) -> dict[int, list[dict]]:
    """A trace's records (trace_table's, each with its "index") of the calls `epochs` made in that order since
    the count was reset -> {epoch: its records}; records past the calls (none, if the room was right) dropped."""
    out = {e: [] for e in epochs}
    for r in records:
        k = r["index"] // tiles
        if k < len(epochs):
            out[epochs[k]].append(r)
    return out


def kernel_of(records: list[dict]) -> dict | None:
    """One call's records -> its kernel on this GPU: start (the first CTA's first tile), end (the last tile's
    end), ns; each CTA's first tile, medians over CTAs, us after that tile's start: "first_ready" / "last_ready"
    (its first / last chunk wait returned: not causal at W 2, its own chunk then the peer's; local_kv: the own
    chunk is not waited for, so first_ready is the block loop's start), "duration", "waited" (the summed
    wait_chunks time, mostly the producer's own work beside the consumers'); the median later tile, us, and the
    SM clock over the later tiles and over the first ones (GHz: %clock cycles over globaltimer ns)."""
    if not records:
        return None
    firsts, later, clocks = {}, [], []
    for r in sorted(records, key=lambda x: x["start"]):
        if r["cta"] in firsts:
            later.append(r["end"] - r["start"])
            if r.get("cycles") and r["end"] > r["start"]:
                clocks.append(r["cycles"] / (r["end"] - r["start"]))
        else:
            firsts[r["cta"]] = r
    f = list(firsts.values())

    def after(key):
        xs = [r[key] - r["start"] for r in f if r.get(key)]
        return median(xs) * US if xs else None

    return {"start": min(r["start"] for r in records), "end": max(r["end"] for r in records), "tiles": len(records),
            "ctas": len(f), "first_ready": after("first_ready"), "last_ready": after("last_ready"),
            "first_duration": median([r["end"] - r["start"] for r in f]) * US,
            "first_waited": median([r["waited"] for r in f]) * US,
            "later_tile": median(later) * US if later else None,
            "later_clock_ghz": median(clocks) if clocks else None,
            "first_clock_ghz": median([r["cycles"] / (r["end"] - r["start"]) for r in f
                                       if r.get("cycles") and r["end"] > r["start"]] or [0]) or None,
            "last_ready_min": min((r["last_ready"] for r in f if r.get("last_ready")), default=None)}


# The phases of one call on one rank, in the order they happen (us): name -> (from, to), each a key of
# `points` below; a phase whose end points are missing is None.
PHASES = [
    ("previous kernel end -> entry kernel start", "prev_end", "entry_start"),
    ("entry kernel (epoch, FREE to the peers)", "entry_start", "entry_end"),
    ("entry end -> attention kernel start", "entry_end", "kernel_start"),
    ("entry end -> WAIT_FREE start (copy stream)", "entry_end", "wait_free_start"),
    ("WAIT_FREE (every peer's FREE)", "wait_free_start", "wait_free_end"),
    ("WAIT_FREE end -> own copy signalled (signal 0 start)", "wait_free_end", "signal0_start"),
    ("own signal 0 start -> peer copy signalled (signal 1 start)", "signal0_start", "signal1_start"),
    ("WAIT_FREE end -> peer copy signalled (local_kv)", "wait_free_end", "signal1_start_local"),
    ("first tile start -> its first chunk ready (median CTA)", "kernel_start", "first_ready"),  # per CTA
    ("first tile start -> its last chunk ready (median CTA)", "kernel_start", "last_ready"),
    ("attention kernel span (first tile start -> last tile end)", "kernel_start", "kernel_end"),
    ("call: previous kernel end -> kernel end", "prev_end", "kernel_end"),
    ("outside the tiles: call - span", None, None),
]


def call_phases(stamps: dict, kernel: dict | None, prev_kernel_end: int | None, local_kv: bool = False) -> dict:
    """One call on one rank -> {"points": {name: ns}, "phases": {phase: us or None}, "first_duration",
    "first_waited", "later_tile"}. `stamps`: stamp_table's entry for this epoch; `kernel`: kernel_of this
    call's records; `prev_kernel_end`: the previous call's kernel end on this rank (ns; None: unknown)."""
    pts = {"prev_end": prev_kernel_end}
    entry, wf = (stamps or {}).get("entry"), (stamps or {}).get("wait_free")
    sig = (stamps or {}).get("signals") or []
    pts["entry_start"], pts["entry_end"] = (entry or (None, None))
    pts["wait_free_start"], pts["wait_free_end"] = (wf or (None, None))
    s0 = sig[0] if len(sig) > 0 else None
    s1 = sig[1] if len(sig) > 1 else None
    pts["signal0_start"] = s0[0] if s0 else None
    pts["signal1_start"] = s1[0] if s1 and s0 else None
    pts["signal1_start_local"] = s1[0] if s1 and local_kv else None
    if kernel:
        pts["kernel_start"], pts["kernel_end"] = kernel["start"], kernel["end"]
    else:
        pts["kernel_start"] = pts["kernel_end"] = None
    phases = {}
    for name, a, b in PHASES:
        if a is None:
            continue
        if b in ("first_ready", "last_ready"):
            phases[name] = kernel.get(b) if kernel else None  # already after the tile's start (~ the kernel's)
            continue
        x, y = pts.get(a), pts.get(b)
        phases[name] = (y - x) * US if x is not None and y is not None else None
    call, span = phases["call: previous kernel end -> kernel end"], phases[
        "attention kernel span (first tile start -> last tile end)"]
    phases["outside the tiles: call - span"] = call - span if call is not None and span is not None else None
    out = {"points": pts, "phases": phases}
    if kernel:
        out.update({k: kernel.get(k) for k in ("first_duration", "first_waited", "later_tile", "later_clock_ghz",
                                               "first_clock_ghz")})
    return out


def host_lead(host_row: dict | None, stamps: dict | None) -> dict | None:
    """The host's enqueue of one call against the device's run of it, us: "launcher" (its time on the host:
    enter -> return), "slowest step" (name, us) and "lead" (the entry kernel's start on the device minus the
    launcher's return on the host: > 0, the host was ahead; comparable only where globaltimer follows the host's
    clock, which `comparable` says: |lead| < 1 s)."""
    if not host_row:
        return None
    times = {"enter": host_row["enter"], "entry": host_row["entry"], "wait_free": host_row["wait_free"],
             "attention": host_row["attention"], "return": host_row["return"]}
    for i, t in enumerate(host_row["copies"]):
        times[f"copies {i}"] = t
    for i, t in enumerate(host_row["signals"]):
        times[f"signal {i}"] = t
    seq = sorted((t, n) for n, t in times.items() if t)
    steps = [((b - a) * US, n) for (a, _), (b, n) in zip(seq, seq[1:])]
    slowest = max(steps) if steps else (0.0, None)
    out = {"launcher": (host_row["return"] - host_row["enter"]) * US if host_row["return"] and host_row["enter"]
           else None, "slowest_step": [slowest[1], slowest[0]], "lead": None, "comparable": False}
    entry = (stamps or {}).get("entry")
    if entry and host_row["return"]:
        lead = (entry[0] - host_row["return"]) * US
        out["lead"], out["comparable"] = lead, abs(lead) < 1e6
    return out


def clock_checks(per_rank: dict[int, dict], world: int) -> list[dict]:
    """Whether the GPUs' globaltimers agree, from causality, per call and ordered pair (r, p): the earliest
    READY of p's rows that r's kernel saw (its first tiles' last chunk, the peer's at W 2) minus the start of
    p's signal kernel that raised it (>= 0 if the clocks agree; a few us more: the signal kernel's body);
    and r's WAIT_FREE end minus p's entry start (p raised FREE inside its entry kernel: >= 0). `per_rank`:
    {rank: {"stamps": {epoch: ...}, "kernels": {epoch: kernel_of}}}."""
    out = []
    for r, x in per_rank.items():
        for p, y in per_rank.items():
            if p == r:
                continue
            i = (r - p) % world  # r is p's i-th receiver in copy order
            for e, k in x["kernels"].items():
                sp, sr = y["stamps"].get(e) or {}, x["stamps"].get(e) or {}
                row = {"rank": r, "peer": p, "epoch": e, "ready_margin_us": None, "free_margin_us": None}
                sig = (sp.get("signals") or [None] * world)[i]
                if k and k.get("last_ready_min") and sig and world == 2:
                    row["ready_margin_us"] = (k["last_ready_min"] - sig[0]) * US
                if sr.get("wait_free") and sp.get("entry"):
                    row["free_margin_us"] = (sr["wait_free"][1] - sp["entry"][0]) * US
                out.append(row)
    return out


def summarize(per_rank: dict[int, dict], timed: list[int], world: int, local_kv: bool = False) -> dict:
    """Per rank, the phases of every timed call (epochs `timed`, in order; the call before the first is the
    lineup call, whose kernel end starts the first) and their means; the clock checks. `per_rank`: {rank:
    {"stamps": stamp_table, "kernels": {epoch: kernel_of}, "host": {epoch: host_table row}}}."""
    ranks = {}
    for r, x in sorted(per_rank.items()):
        calls = []
        for e in timed:
            prev = x["kernels"].get(e - 1)
            c = call_phases(x["stamps"].get(e), x["kernels"].get(e), prev["end"] if prev else None, local_kv)
            c["epoch"] = e
            c["host"] = host_lead((x.get("host") or {}).get(e), x["stamps"].get(e))
            calls.append(c)
        names = list(calls[0]["phases"]) if calls else []
        mean = {}
        for n in names:
            xs = [c["phases"][n] for c in calls if c["phases"].get(n) is not None]
            mean[n] = sum(xs) / len(xs) if xs else None
        for n in ("first_duration", "first_waited", "later_tile", "later_clock_ghz", "first_clock_ghz"):
            xs = [c[n] for c in calls if c.get(n) is not None]
            mean[n] = sum(xs) / len(xs) if xs else None
        hosts = [c["host"] for c in calls if c.get("host")]
        for n in ("launcher", "lead"):
            xs = [h[n] for h in hosts if h.get(n) is not None and (n != "lead" or h["comparable"])]
            mean[f"host {n}"] = sum(xs) / len(xs) if xs else None
        ranks[r] = {"calls": calls, "mean": mean}
    return {"ranks": ranks, "timed": list(timed), "clock_checks": clock_checks(per_rank, world)}


ROWS = [name for name, _, _ in PHASES] + [
    ("first tile: duration (median CTA)", "first_duration"),
    ("first tile: summed chunk waits (median CTA)", "first_waited"),
    ("later tiles: median tile", "later_tile"),
    ("SM clock over the first tiles (GHz, median CTA)", "first_clock_ghz"),
    ("SM clock over the later tiles (GHz, median tile)", "later_clock_ghz"),
    ("host: launcher time per call (enter -> return)", "host launcher"),
    ("host lead: device entry start - host return", "host lead"),
]


def report(summary: dict, bench_us: float | None = None, title: str = "") -> str:
    """The per-phase table (means over the timed calls, us, a column per rank), the clock checks, and the
    bench's own figure for the same calls (`bench_us`: the Sampler's time per call, slowest rank)."""
    ranks = sorted(summary["ranks"])
    lines = [title] if title else []
    lines.append(f"{'phase (mean over ' + str(len(summary['timed'])) + ' timed calls, us)':62s}" +
                 "".join(f"{'rank ' + str(r):>12s}" for r in ranks))
    for row in ROWS:
        label, key = (row, row) if isinstance(row, str) else row
        cells = []
        for r in ranks:
            v = summary["ranks"][r]["mean"].get(key)
            cells.append(f"{'-':>12s}" if v is None else f"{v:12.3f}" if key.endswith("_ghz") else f"{v:12.1f}")
        if all(c.strip() == "-" for c in cells):
            continue
        lines.append(f"{label:62s}" + "".join(cells))
    if bench_us is not None:
        lines.append(f"{'bench figure for these calls (events, per call, slowest rank)':62s}{bench_us:12.1f}")
    checks = summary["clock_checks"]
    ready = [c["ready_margin_us"] for c in checks if c["ready_margin_us"] is not None]
    free = [c["free_margin_us"] for c in checks if c["free_margin_us"] is not None]
    parts = ([f"READY seen - raised min {min(ready):.1f} us"] if ready else []) + \
        ([f"FREE seen - raising entry's start min {min(free):.1f} us"] if free else [])
    if parts:
        lines.append("clock check (>= 0 where the GPUs' globaltimers agree): " + "; ".join(parts))
    return "\n".join(lines)
