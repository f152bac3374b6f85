"""The `tsgen` command line.

Exit codes: 0 ok, 1 a check failed (stale outputs, wrong results, a
kernel that failed on the GPU: a timeout trap, a launch failure), 2 bad
input (spec, arguments, environment).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from pathlib import Path

import click

from . import __version__
from .env import env_seconds, force_no_multicast, shared_gpu_env
from .procs import Stopped, stop_on_signals
from .runtime.placement import share_from_env
from .errors import KernelFailed, SpecError, TsgenError
from .files import checkout_folder


def _reports_errors(fn):
    """Turn TsgenError into its message on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecError as e:
            for line in e.problems:
                click.echo(line, err=True)
            n = len(e.problems)
            click.echo(f"tsgen: {n} problem{'s' if n > 1 else ''} in the specs; nothing was written", err=True)
            sys.exit(e.exit_code)
        except TsgenError as e:
            click.echo(f"tsgen: {e}", err=True)
            sys.exit(e.exit_code)

    return wrapper


def _cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_specs() -> Path:
    """specs/ of the checkout, what `build` and `verify` read when given no spec."""
    return checkout_folder("specs", "with no spec given, tsgen reads the shipped specs of a checkout "
                                    "(run it in one, or name spec files or folders)")


def _jobs_option(what: str):
    return click.option("-j", "--jobs", type=click.IntRange(min=1), default=_cpus, show_default="the CPUs", help=what)


class _Commands(click.Group):
    """tsgen's command group: every command runs under procs.stop_on_signals, so SIGTERM, SIGINT
    or SIGHUP ends what it started (nvcc, ranks) and exits 128 + the signal's number."""

    def invoke(self, ctx):
        try:
            with stop_on_signals():
                return super().invoke(ctx)
        except Stopped as e:
            click.echo(f"tsgen: stopped by signal {e.signum}", err=True)
            sys.exit(128 + e.signum)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tsgen")
def main() -> None:
    """Generate readable CUDA sources for multi-GPU communication kernels: each includes tsgen's
    CUDA headers (tsgen passes nvcc their folder); `tsgen build --amalgamate` writes one
    self-contained file per spec instead, to vendor into a C++ project.

    TSGEN_STACKS_AFTER=S: if a command still runs after S seconds, print every
    thread's Python stack to stderr (where a hung rank waits)."""
    force_no_multicast()  # every command, and everything it starts
    try:
        after = env_seconds("TSGEN_STACKS_AFTER", None, ValueError)
    except ValueError as e:
        click.echo(f"tsgen: {e}", err=True)
        sys.exit(2)
    if after is not None:
        import faulthandler

        faulthandler.dump_traceback_later(after, exit=False)


@main.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_dir", default="generated", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="output folder")
@click.option("--check", is_flag=True, help="write nothing; exit 1 with a diff if an output is stale, missing or orphaned")
@click.option("--prune", is_flag=True, help="delete generated files no spec produces any more")
@click.option("--force", is_flag=True, help="overwrite outputs whose banner names another spec file")
@click.option("--amalgamate", is_flag=True,
              help="one self-contained NAME.cu per spec, tsgen's CUDA headers inlined: the file to vendor")
@click.option("--compile", "do_compile", is_flag=True, help="also compile each source with nvcc (cached)")
@click.option("--arch", default="sm_90a", show_default=True, help="GPU architecture for --compile")
@_jobs_option("--compile: sources compiled at a time")
@_reports_errors
def build(paths, out_dir, check, prune, force, amalgamate, do_compile, arch, jobs):
    """Render specs (files or folders; default specs/) into OUT/NAME.cu + NAME.json;
    --compile: then compile them, --jobs at a time.

    A NAME.cu includes tsgen's CUDA library ("tsgen/ptx.cuh", ...; tsgen passes nvcc its folder).
    To vendor one into a C++ project, build it with --amalgamate into a folder of its own:
    `tsgen build --amalgamate specs/allgather.yaml -o vendored` writes one file that needs no
    include path, the headers inlined once each."""
    from .build import build as run_build

    paths = list(paths) or [default_specs()]
    result = run_build(paths, out_dir, check=check, prune=prune, force=force, amalgamated=amalgamate)
    if check:
        click.echo(f"tsgen: {len(result.rendered)} spec(s) up to date in {out_dir}")
    else:
        click.echo(
            f"tsgen: {len(result.rendered)} spec(s): {len(result.written)} file(s) written, "
            f"{len(result.unchanged)} unchanged in {out_dir}"
        )
        for p in result.orphans:
            click.echo(f"tsgen: {'removed' if prune else 'orphan (no spec produces it)'}: {p}")
        for p, why in result.kept:
            click.echo(f"tsgen: kept {p}: {why}")
    if do_compile:
        _compile_all([(r.lowered.manifest, out_dir / f"{r.name}.cu") for r in result.rendered], arch, jobs)


def _compile_all(modules: list, arch: str, jobs: int) -> None:
    """Compile each (manifest, source) as the runtime loads it (toolchain.compile_for), `jobs`
    at a time: a line per source in order (output file in the cache, registers, spills), then
    the totals."""
    from concurrent.futures import ThreadPoolExecutor

    from .toolchain import cache_folder, compile_for

    sources = [source for _, source in modules]

    def timed(manifest, source: Path):
        start = time.monotonic()
        return compile_for(manifest, source, arch), time.monotonic() - start

    start, cached = time.monotonic(), 0
    n = len(sources)
    click.echo(f"tsgen: compiling {n} source(s) for {arch}, {jobs} at a time; outputs in {cache_folder()}")
    pool = ThreadPoolExecutor(jobs)  # the work is in nvcc processes
    try:
        futures = [pool.submit(timed, m, s) for m, s in modules]
        for i, (source, future) in enumerate(zip(sources, futures), 1):
            res, seconds = future.result()
            cached += res.cached
            spills = max((v.get("spill_stores", 0) + v.get("spill_loads", 0) for v in res.own_report.values()),
                         default=0)
            regs = max((v.get("registers", 0) for v in res.own_report.values()), default=0)
            state = "cached" if res.cached else f"compiled in {seconds:.1f} s"
            click.echo(f"[{i:{len(str(n))}}/{n}] {source.name} -> {res.output.name} ({state}; "
                       f"max {regs} registers, {spills} spill bytes)")
            for line in res.serialized:  # right, but slow: said where it cannot be missed
                click.echo(f"tsgen: warning: {source.name}: {line}", err=True)
    finally:
        pool.shutdown(cancel_futures=True)
    click.echo(f"tsgen: {n} source(s): {n - cached} compiled, {cached} cached, in {time.monotonic() - start:.1f} s")


@main.command("list")
def list_ops():
    """Every op kind, one line each."""
    from .ops import families

    for f in families():
        click.echo(f"{f.kind:16s} {f.summary}")


@main.command()
def schema():
    """Print the JSON Schema (draft-07) of spec files."""
    from .schema import json_schema_text

    click.echo(json_schema_text(), nl=False)


BACKEND_OPTION = click.option(
    "--backend", type=click.Choice(["single", "ipc", "nvshmem"]), default="single", show_default=True,
    help="single: this process drives --gpus GPUs; ipc: one process per GPU (CUDA IPC), "
         "nvshmem: one process per GPU (NVSHMEM PE, symmetric heap; needs nvshmem4py), both started by "
         "`torchrun --nproc-per-node N -m tsgen ...` or `tsgen launch --nproc N -- tsgen ...` (or mpirun, srun)")
GPUS_OPTION = click.option("--gpus", type=int, default=None,
                           help="world size: GPUs to run on (--backend ipc/nvshmem: optional, must match the launcher's)")
SHARE_OPTION = click.option(
    "--share-gpus", is_flag=True, default=None,
    help="let ranks share GPUs (rank r on GPU r % G; also TSGEN_SHARE_GPUS=1): tests a world of any size on "
         "fewer GPUs, with the spec's grids fitted so every rank's blocks are resident; timings mean nothing")


@main.command()
@click.argument("spec", type=click.Path(path_type=Path))
@GPUS_OPTION
@BACKEND_OPTION
@click.option("--count", type=int, default=None, help="elements (or bytes) per rank; default from the spec")
@click.option("--iters", type=int, default=None, help="back-to-back calls; default from the spec")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="seed of every call's random inputs (the same on every rank)")
@click.option("--arch", default="sm_90a", show_default=True, help="GPU architecture the source is compiled for")
@click.option("--probe-timeout", is_flag=True,
              help="launch only rank 0 with a signal that never comes; expect the timeout message")
@SHARE_OPTION
@click.option("--skew", type=int, default=None, metavar="SEED",
              help="compile in the test-only rank skew: every block waits a seeded 0-100 us before its work, "
                   "so a missing wait shows up on a shared GPU (ops with their own entry kernels: no effect)")
@_reports_errors
def test(spec, gpus, backend, count, iters, seed, arch, probe_timeout, share_gpus, skew):
    """Run SPEC on GPUs against its NumPy reference; exit 1 on any mismatch.

    With --backend ipc or nvshmem every rank checks its own outputs, rank 0 prints
    the summary, and every rank exits 1 if any rank saw a wrong element."""
    from .harness import leave_now, probe_timeout as run_probe, run_test

    if share_gpus or (share_gpus is None and share_from_env()):
        shared_gpu_env(rank_per_process=backend != "single")  # before any CUDA call (tsgen/env.py says why)
    if backend == "single" and gpus is None:
        raise click.UsageError("--gpus N is required with --backend single")
    if probe_timeout and backend != "single":
        raise click.UsageError("--probe-timeout runs with --backend single (it launches rank 0 alone)")
    if probe_timeout:
        code = run_probe(spec, gpus, arch=arch, share_gpus=share_gpus)
        leave_now(code)  # the trap left this process's CUDA contexts dead
    try:
        ok = run_test(spec, gpus, count=count, iters=iters, seed=seed, arch=arch, echo=click.echo,
                      backend=backend, share_gpus=share_gpus, skew=skew)
    except TsgenError as e:
        if backend == "single" and not isinstance(e, KernelFailed):
            raise
        # After a kernel failed (its wait timed out, or a peer died and a wait timed out) this
        # process's CUDA context is dead: one message, then out without the interpreter's
        # teardown (unloading modules from a dead context fails loudly); with one process per
        # GPU the other ranks were told through the store.
        click.echo(f"tsgen: {e}", err=True)
        leave_now(e.exit_code)
    sys.exit(0 if ok else 1)


def world_sizes(text: str) -> list[int]:
    """The world sizes of `verify --world`: LO..HI or a comma list, each from 2 to 8."""
    if m := re.fullmatch(r"\s*(\d+)\s*\.\.\s*(\d+)\s*", text):
        sizes = list(range(int(m[1]), int(m[2]) + 1))
    elif re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", text):
        sizes = sorted({int(w) for w in text.split(",")})
    else:
        raise click.BadParameter(f"{text!r}: give LO..HI or a comma list (2..8, 2,3,4)", param_hint="--world")
    if not sizes or min(sizes) < 2 or max(sizes) > 8:
        raise click.BadParameter("world sizes run from 2 to 8", param_hint="--world")
    return sizes


@main.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--world", "worlds", default=None,
              help="world sizes, LO..HI or a list (2..8, 2,3,4), each one every spec is compiled for "
                   "[default: each spec's own world_sizes]")
@click.option("--schedules", type=click.IntRange(min=1), default=None, help="random interleavings per world size (default 100, 24 above 4 ranks)")
@click.option("--seed", type=int, default=0, show_default=True,
              help="seed of the random interleavings (the same seed replays the same schedules)")
@_jobs_option("processes verifying at once")
@_reports_errors
def verify(paths, worlds, schedules, seed, jobs):
    """Execute collective plans on the CPU under many interleavings of ranks and blocks.

    Proves for each world size a spec is compiled for: outputs equal the reference
    contributions, every output element is written exactly once per call, no read or write
    crosses a call boundary, every wait is matched by signals, and no schedule deadlocks.
    Exit 1 on any problem; 2 when the specs hold no plan, or --world names a size a spec is
    not compiled for. Plans and their schedules are verified --jobs at a time; the output is
    in spec order."""
    from .plan_jobs import verify_specs

    sizes = None if worlds is None else world_sizes(worlds)
    checked = verify_specs(list(paths) or [default_specs()], sizes, schedules, seed, jobs, click.echo)
    click.echo(f"tsgen: {checked} plans verified")


def _add_bench_commands() -> None:
    """`tsgen bench` and `tsgen results` live with the bench (tsgen/bench/cli.py)."""
    from .bench.cli import bench, results

    for command in (bench, results):
        command.callback = _reports_errors(command.callback)
        main.add_command(command)


_add_bench_commands()


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc", type=int, required=True, help="ranks to start (one per GPU)")
@click.option("--port", type=int, default=None, help="MASTER_PORT (default: a free one)")
@click.option("--timeout", type=float, default=None, help="end every rank after this many seconds")
@click.option("--grace", type=float, default=30.0, show_default=True,
              help="after a rank fails, seconds the others get to end on their own (a kernel waiting "
                   "for the failed rank times out and says what it waited for) before they are stopped")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, required=True)
def launch(nproc, port, timeout, grace, cmd):
    """Start CMD as NPROC ranks (torchrun's environment); prefix their output with
    the rank; when one fails, end the others (after --grace) and exit with its code.

    tsgen's own launcher, for worlds without torch; torchrun works as well (the ranks then
    meet in its store; docs/design/runtime.md says what each does)."""
    from .launch import launch as run_launch

    try:
        code = run_launch(list(cmd), nproc, port=port, timeout=timeout, grace=grace)
    except ValueError as e:
        click.echo(f"tsgen launch: {e}", err=True)
        code = 2
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
