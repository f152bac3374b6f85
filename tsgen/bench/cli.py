"""`tsgen bench` and `tsgen results`: tsgen/cli.py adds them to the main command group (and turns
TsgenError into its message and exit code, as for every command)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import click

from ..env import shared_gpu_env
from ..runtime.placement import share_from_env

from ..errors import CheckFailed, RuntimeSetupError
from ..files import checkout_folder

TIMING = ("tsgen: one World across all sizes; per size, buffer sets rotated so that they exceed 2x the L2; warm-up, "
          "then `reps` samples of back-to-back calls (a CUDA graph per GPU where the op allows) between events on "
          "the streams the calls run on, time per call = the slowest GPU's; median and spread over the samples; "
          "the timed outputs checked once; results above the device's ceilings, regions shorter than a kernel "
          "launch, events that do not bracket the calls, missing calls and wrong outputs are errors. Baselines: "
          "the same timing core, in this process on the same streams (copy engine, cuBLAS) or one process per GPU "
          "(NCCL, torch).")


def _is_root(backend: str) -> bool:
    """Whether this process prints and writes: always with one process; rank 0's with one per GPU."""
    if backend == "single":
        return True
    from ..runtime.ipc import process_env

    return process_env(os.environ).rank == 0


def _markdown(title: str, meta: dict, rows: list[dict], errors: list[str], notes: list[str]) -> str:
    from .report import markdown_table

    dev = meta.get("device") or {}
    lines = [f"# {title}", "", f"{meta.get('date', '?')}, commit {meta.get('commit', '?')}; "
             f"{dev.get('gpus', '?')} x {dev.get('name', '?')} (driver {meta.get('driver')}, CUDA runtime "
             f"{meta.get('cuda_runtime')}, CuPy {meta.get('cupy')}, torch {meta.get('torch')}, NCCL {meta.get('nccl')}).",
             "", f"Command: `{meta.get('command', '')}`", "", TIMING, ""]
    lines += [markdown_table(rows) or "(no rows)", ""]
    lines += [f"Note: {n}" for n in dict.fromkeys(notes)]
    if errors:
        lines += ["", "## Errors (these results are not in the table)", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines).rstrip() + "\n"


@click.command("bench")
@click.argument("spec", required=False, type=click.Path(path_type=Path))
@click.option("--suite", default=None, help="run suites/NAME.yaml (a list of specs x variants x sizes) and write "
              "its result under --results")
@click.option("--gpus", type=int, default=None, help="world size (default: the spec's, where it has one)")
@click.option("--backend", type=click.Choice(["single", "ipc", "nvshmem"]), default="single", show_default=True,
              help="ipc / nvshmem: one process per GPU under `tsgen launch` (tsgen alone, no baselines)")
@click.option("--sizes", default=None, help="LO:HI[:FACTOR] or a comma list (K, M, G suffixes); bytes for "
              "communication, rows M for GEMMs (default: the op's)")
@click.option("--iters", type=int, default=20, show_default=True, help="calls per sample (at least)")
@click.option("--reps", type=int, default=7, show_default=True, help="samples; the median is reported")
@click.option("--warmup", type=int, default=3, show_default=True, help="untimed calls before the samples")
@click.option("--pattern", "patterns", multiple=True, type=click.Choice(["pair", "ring"]),
              help="copies: pair (rank 0 only) and/or ring (every rank); default both")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="also write the rows and errors (and the run's meta) to this JSON file")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="draw busbw / GB/s / TFLOP/s against size, tsgen and the baselines (needs matplotlib)")
@click.option("--no-baselines", is_flag=True, help="time tsgen only")
@click.option("--share-gpus", is_flag=True, default=None,
              help="ranks share the visible GPUs (rank r on GPU r % G): every code path runs, timings are labelled "
                   "not comparable, no baselines, no ratios")
@click.option("--results", "results_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results"),
              show_default=True, help="--suite: where results/<op>/<suite>/<date>-<commit>.{json,md} go")
@click.option("--negative-control", "control", type=click.Choice(["skip-launch", "other-stream"]), default=None,
              help="break the timing on purpose (no launch after the warm-up / events on other streams): exit 0 "
                   "when the guard turns every result into an error, 1 when a number got through")
@click.option("--list-suites", is_flag=True, help="list suites/*.yaml and exit")
@click.option("--arch", default="sm_90a", show_default=True, help="GPU architecture the sources are compiled for")
@click.option("--sm-clocks", is_flag=True, help="also read every GPU's SM clock from NVML while timing (needs "
              "nvidia-ml-py): each row of this process's timings gets the median clock of its samples (the SM MHz "
              "column; tsgen/bench/clocks.py)")
def bench(spec, suite, gpus, backend, sizes, iters, reps, warmup, patterns, json_path, plot_path, no_baselines,
          share_gpus, results_dir, control, list_suites, arch, sm_clocks):
    """Time SPEC (or a --suite) against its baselines in the same run: copies against
    cudaMemcpyPeer, collectives against NCCL (and PyTorch SymmetricMemory for all_reduce),
    nccl-tests style; gemm against cuBLAS; allgather_gemm / gemm_reduce_scatter against cuBLAS +
    NCCL one after the other and PyTorch's fused ops, with the overlap efficiency; cannon / summa
    against cuBLAS of the whole matrix on one GPU. Each op states its conventions (sizes, FLOPs,
    bytes, bus factor, baselines) in its own module (family.bench)."""
    from .suites import Entry, list_suites as suites_list, load_suite, run_entries, stop_on_signals

    if list_suites:
        folder = checkout_folder("suites", "the benchmark suites are suites/*.yaml of a tsgen checkout: "
                                           "run tsgen in one")
        listed = suites_list(folder)
        if not listed:
            raise RuntimeSetupError(f"no suites (*.yaml) in {folder.resolve()}")
        for name, desc in listed:
            click.echo(f"{name:24s} {desc}")
        return
    if (spec is None) == (suite is None):
        raise click.UsageError("give a SPEC or --suite NAME (not both)")
    if suite:
        s = load_suite(suite)
        entries, title = s.entries, f"suite {s.name}: {s.model.description}"
        iters, reps = s.model.iters if iters == 20 else iters, s.model.reps if reps == 7 else reps
        share_gpus = share_gpus or s.model.share_gpus or None
        if gpus:
            entries = [dataclasses.replace(e, gpus=gpus) for e in entries]
    else:
        entries, title = [Entry(spec, gpus, sizes, None, {}, tuple(patterns) or None)], f"tsgen bench {spec}"
    if sizes and suite:
        entries = [dataclasses.replace(e, sizes=sizes) for e in entries]
    if share_gpus or (share_gpus is None and share_from_env()):
        shared_gpu_env(rank_per_process=backend != "single")  # before any CUDA call (tsgen/env.py says why)
    if suite:
        stop_on_signals()  # a suite stopped by its time limit still writes what it finished
    total = sum(_steps(e) for e in entries)
    log = lambda line: click.echo(line, err=True)  # noqa: E731 - the table goes to stdout at the end
    with click.progressbar(length=total, label="tsgen bench", file=sys.stderr, show_pos=True) as bar:
        def progress(what):
            bar.label = what
            bar.update(1)

        chosen = dict(only_baselines=tuple(s.model.baselines) if s.model.baselines else None,
                      baselines_per_entry=s.model.baselines_per_entry) if suite else {}
        with _clocks(sm_clocks, log) as clocks_note:
            outcomes, env = run_entries(entries, iters=iters, reps=reps, warmup=warmup, backend=backend,
                                        share_gpus=share_gpus, baselines=not no_baselines, control=control,
                                        arch=arch, echo=log, progress=progress, **chosen)
    rows = [r for o in outcomes for r in o.rows]
    errors = [e for o in outcomes for e in o.errors]
    notes = [n for o in outcomes for n in o.notes] + ([clocks_note] if clocks_note else [])
    if env.get("stopped"):
        notes.append(f"incomplete run: {env['stopped']}")
        errors.append(f"incomplete run: {env['stopped']}")  # the exit status says so too
    if not _is_root(backend):
        _finish(rows, errors, control)
        return
    from .report import plot, text_table

    click.echo(text_table(rows) or "(no rows)")
    for n in dict.fromkeys(notes):
        click.echo(f"note: {n}")
    meta = dict(env, title=title, timing=TIMING, ceilings=outcomes[0].ceilings if outcomes else {},
                ops=sorted({o.op for o in outcomes}), suite=suite,
                entries=[{"spec": str(e.spec), "gpus": e.gpus, "sizes": e.sizes, "label": e.label, "variant": e.variant}
                         for e in entries], backend=backend, control=control,
                notes=list(dict.fromkeys(notes)))  # what was not timed, and why (the .md's Note lines)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1, default=str) + "\n")
    if suite and control is None and rows:
        from .results import write_result

        path = write_result(results_dir, s.name, meta, rows, errors, _markdown(title, meta, rows, errors, notes))
        click.echo(f"tsgen: results written to {path} (and .md); `tsgen results` updates results/latest.md")
    if plot_path and rows:
        plot(rows, plot_path)
        click.echo(f"tsgen: plot written to {plot_path}")
    _finish(rows, errors, control)


@contextlib.contextmanager
def _clocks(wanted: bool, log):
    """--sm-clocks: the SM clocks open while the entries run (clocks.sm_clocks); yields a note for the results
    (what was read, or why nothing was), None where not asked for."""
    if not wanted:
        yield None
        return
    from . import clocks

    opened, note = None, None
    try:
        opened = clocks.sm_clocks(clocks.visible_bus_ids())
        sm = opened.__enter__()
    except Exception as e:  # noqa: BLE001 - no NVML (nvidia-ml-py) or no driver: the timings still run
        opened, note = None, f"SM clocks not read (--sm-clocks): {type(e).__name__}: {e}"[:300]
        log(f"tsgen: {note}")
    if opened is None:
        yield note
        return
    try:
        yield (f"SM MHz: the median over a row's samples of the SM clock of its slowest rank's GPU (NVML every "
               f"{clocks.PERIOD_S * 1000:.0f} ms, --sm-clocks; sm_readings in the JSON: the readings of each "
               f"sample); rows timed in other processes have none")
    finally:
        opened.__exit__(None, None, None)
        if sm.failures:
            log(f"tsgen: {sm.failures} NVML clock readings failed (skipped)")


def _steps(entry) -> int:
    from ..ops import get_family
    from .sizes import parse_sizes

    spec = entry.loaded.model
    conv = get_family(spec.op).bench
    try:
        return len(parse_sizes(entry.sizes if entry.sizes is not None else (conv.default_sizes or str(spec.test.count))))
    except ValueError:
        return 1


def _finish(rows: list[dict], errors: list[str], control: str | None) -> None:
    if control is not None:
        tsgen_rows = [r for r in rows if r["impl"] == "tsgen"]
        if tsgen_rows or not errors:
            raise CheckFailed(f"negative control {control}: {len(tsgen_rows)} timing(s) got through the guard as "
                              "numbers; the guard failed to see a broken timing")
        click.echo(f"tsgen: negative control {control}: caught, as it must be ({len(errors)} error(s), no row)")
        return
    if errors:
        raise CheckFailed(f"{len(errors)} result(s) failed a check and are not in the table (see ERROR lines): "
                          + errors[0])


@click.command("results")
@click.option("--results", "results_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results"),
              show_default=True, help="the results folder (results/<op>/<suite>/<date>-<commit>.json) to index")
@click.option("--readme", type=click.Path(dir_okay=False, path_type=Path), default=Path("README.md"), show_default=True,
              help="the README: its figures are checked, and it holds the generated tables unless a file of --docs "
                   "has the tsgen-results markers")
@click.option("--suites", "suites_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("suites"),
              show_default=True, help="the suites (NAME.yaml) whose readme: sections say which tables to write")
@click.option("--docs", "docs_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="the Markdown files under it: the one with the tsgen-results markers holds the tables; --check "
                   "checks them all with the README (default: docs/ beside the README)")
@click.option("--check", is_flag=True, help="write nothing; exit 1 when latest.md or the generated tables are stale, "
              "when a performance figure in the README or docs/ is in no results file its section cites, or when a "
              "relative link leads nowhere; warn when no GPU test run in results/tests/ has seen the newest change "
              "of templates/, generated/ or tsgen/runtime/")
def results(results_dir, readme, suites_dir, docs_dir, check):
    """Keep the results index: archive superseded runs, write results/latest.md and the
    performance tables (between the tsgen-results markers of the README or a file of docs/:
    docs/benchmarks.md) from the newest run of each suite. --check: also every performance figure
    of the README and docs/ against the results files (tsgen/bench/figures.py says what counts)."""
    from .index import archive_superseded, latest_md, readme_block, scan, superseded, tables_file, update_readme

    if not results_dir.is_dir():
        raise RuntimeSetupError(f"{results_dir}: no such folder")
    if check:
        stale = [f"{top}/{suite}: {len(old)} superseded run(s) not archived"
                 for (top, suite), runs in scan(results_dir).items() if (old := superseded(runs))]
        latest = results_dir / "latest.md"
        if not latest.exists() or latest.read_text() != latest_md(results_dir):
            stale.append(f"{latest} is stale")
        tables = tables_file(readme, docs_dir)
        if tables.exists() and tables.read_text() != update_readme(tables, readme_block(results_dir, suites_dir,
                                                                                       tables.parent)):
            stale.append(f"{tables}'s generated tables are stale")
        unbacked = _check_figures(results_dir, readme, docs_dir)
        if stale or unbacked:
            raise CheckFailed("; ".join(stale + ([f"{unbacked} problem(s) with the figures and links above"]
                                                 if unbacked else []))
                              + (": run `tsgen results`" if stale else ""))
        click.echo("tsgen: results index up to date; every performance figure in the README and docs/ is in a "
                   "results file its section cites")
        return
    for old, new in archive_superseded(results_dir):
        click.echo(f"archived: {old} -> {new}")
    (results_dir / "latest.md").write_text(latest_md(results_dir))
    click.echo(f"tsgen: wrote {results_dir / 'latest.md'}")
    tables = tables_file(readme, docs_dir)
    if tables.exists():
        text = update_readme(tables, readme_block(results_dir, suites_dir, tables.parent))
        if text != tables.read_text():
            tables.write_text(text)
            click.echo(f"tsgen: updated the generated tables in {tables}")


def _check_figures(results_dir: Path, readme: Path, docs_dir: Path) -> int:
    """Print the problems of the figures and links of the README and docs/ (and the figures marked
    as backed by no file, and whether a GPU test run has seen the newest device code); their count."""
    from .figures import check_figures, check_links, markdown_files
    from .index import gate_warning

    paths = markdown_files(readme, docs_dir if docs_dir is not None else readme.parent / "docs")
    root = Path.cwd()
    report = check_figures(paths, root, results_dir)
    problems = report.problems + check_links(paths, root)
    for line in problems:
        click.echo(line, err=True)
    for line in report.unbacked:
        click.echo(f"note: {line}", err=True)
    warning = gate_warning(results_dir)
    if warning:
        click.echo(f"tsgen: warning: {warning}", err=True)
    return len(problems)
