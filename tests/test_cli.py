"""The command line: exit codes (0 ok, 1 check failed, 2 bad input) and what
it prints, on a machine without GPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, gpu_count, run_cli
from tsgen import __version__
from tsgen.ops import family_names, get_family



def tsgen(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m tsgen ARGS` in a fresh interpreter, in the repo root."""
    return subprocess.run([sys.executable, "-m", "tsgen", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


@pytest.fixture
def no_cupy_env(tmp_path):
    """Environment in which `import cupy` fails, whatever is installed."""
    shadow = tmp_path / "shadow"
    (shadow / "cupy").mkdir(parents=True)
    (shadow / "cupy" / "__init__.py").write_text('raise ImportError("No module named \'cupy\' (hidden by the test)")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shadow)] + [p for p in [env.get("PYTHONPATH")] if p])
    probe = subprocess.run([sys.executable, "-c", "import cupy"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0 and "hidden by the test" in probe.stderr
    return env


def test_version():
    p = tsgen("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"tsgen, version {__version__}\n"


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.code == 0
    for cmd in ("build", "list", "schema", "test"):
        assert any(line.split()[:1] == [cmd] for line in r.stdout.splitlines()), (cmd, r.stdout)



def test_every_option_says_what_it_does_in_help():
    """`tsgen CMD --help` explains every option it lists (a flag shown with no words is one a user
    has to read the source for)."""
    import click

    from tsgen.cli import main

    def commands(group, path):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from commands(cmd, path + [name])
            else:
                yield path + [name], cmd

    bare = [f"{' '.join(path)} {'/'.join(p.opts)}" for path, cmd in commands(main, ["tsgen"])
            for p in cmd.params if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert not bare, bare

def test_list():
    r = run_cli("list")
    assert r.code == 0, r
    lines = r.stdout.splitlines()
    assert len(lines) == len(family_names())
    assert sorted(line.split()[0] for line in lines) == family_names()
    for line in lines:
        kind, summary = line.split(None, 1)
        assert summary == get_family(kind).summary


def test_unknown_command_and_option():
    assert run_cli("frobnicate").code == 2
    r = run_cli("build", "--no-such-option")
    assert r.code == 2 and "No such option" in r.stderr


def test_build_writes_and_reports(tmp_path):
    r = run_cli("build", "specs/put_block.yaml", "specs/barrier_all.yaml", "-o", tmp_path / "out")
    assert r.code == 0, r
    assert r.stdout == f"tsgen: 2 spec(s): 4 file(s) written, 0 unchanged in {tmp_path / 'out'}\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "barrier_all.cu", "barrier_all.json", "put_block.cu", "put_block.json"]


def test_test_without_cupy(no_cupy_env):
    p = tsgen("test", "specs/put_block.yaml", "--gpus", "2", env=no_cupy_env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("tsgen: running kernels needs CuPy for your driver's CUDA version: "
                               '`pip install ".[cuda13]"` in the tsgen checkout'), p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU: `tsgen test` would run")
def test_test_without_gpu():
    """With whatever is installed here (CuPy or not), no usable GPU -> exit 2, one clear line."""
    p = tsgen("test", "specs/put_block.yaml", "--gpus", "2")
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "needs CuPy" in err or "no usable CUDA device" in err or "no CUDA device" in err, err


def test_test_world_size_not_compiled(no_cupy_env):
    """Checked before CuPy is touched: the message is about world sizes, not CuPy."""
    p = tsgen("test", "specs/put_block.yaml", "--gpus", "5", env=no_cupy_env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr == "tsgen: specs/put_block.yaml: compiled for world sizes [2, 3, 4]; --gpus 5 is not one\n"


def test_probe_timeout_on_op_that_never_waits(no_cupy_env):
    p = tsgen("test", "specs/put_block.yaml", "--gpus", "2", "--probe-timeout", env=no_cupy_env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr == ("tsgen: specs/put_block.yaml: op put_block never waits; "
                        "probe a signal or barrier spec\n")


def test_test_bad_spec(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nop: put_block\nworld_sizes: [2]\nlaunch:\n  blocks: 0\n")
    r = run_cli("test", bad, "--gpus", "2")
    assert r.code == 2, r
    assert r.stderr.splitlines()[0] == f"{bad}:5:3: launch.blocks: Input should be greater than or equal to 1"
    r = run_cli("test", tmp_path / "missing.yaml", "--gpus", "2")
    assert r.code == 2, r
    assert r.stderr.splitlines()[0] == f"{tmp_path / 'missing.yaml'}:1:1: <file>: no such file"


def test_test_needs_gpus_option():
    r = run_cli("test", "specs/put_block.yaml")
    assert r.code == 2 and "--gpus" in r.stderr


@pytest.mark.parametrize("args,folder,why", [
    (("build",), "specs", "with no spec given, tsgen reads the shipped specs of a checkout"),
    (("verify",), "specs", "with no spec given, tsgen reads the shipped specs of a checkout"),
    (("bench", "--list-suites"), "suites", "the benchmark suites are suites/*.yaml of a tsgen checkout"),
], ids=["build", "verify", "list-suites"])
def test_outside_a_checkout_says_where_it_looked(tmp_path, monkeypatch, args, folder, why):
    """Run where there is no specs/ or suites/ folder: exit 2, the folder it looked for and where
    (was: `specs:1:1: <file>: no such file`, and for --list-suites nothing at all, exit 0)."""
    monkeypatch.chdir(tmp_path)
    r = run_cli(*args)
    assert r.code == 2 and r.stdout == "", r
    assert r.stderr.startswith(f"tsgen: no {folder}/ folder in {tmp_path}: {why}"), r


def test_list_suites():
    r = run_cli("bench", "--list-suites")
    assert r.code == 0, r
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert names == [p.stem for p in sorted((ROOT / "suites").glob("*.yaml"))] and names


def test_check_exit_code_1(tmp_path, monkeypatch):
    """A failed check is 1, not 2: stale output is not bad input."""
    out = tmp_path / "out"
    assert run_cli("build", "specs/put_warp.yaml", "-o", out).code == 0
    (out / "put_warp.cu").write_text((out / "put_warp.cu").read_text() + "// edited by hand\n")
    r = run_cli("build", "specs/put_warp.yaml", "-o", out, "--check")
    assert r.code == 1, r
    assert r.stderr.startswith(f"tsgen: stale: {out / 'put_warp.cu'}\n")
    assert "-// edited by hand" in r.stderr.splitlines()


# ---------------------------------------------------------------------------
# --backend ipc (one process per GPU): option checks before any GPU is touched
# ---------------------------------------------------------------------------

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                 "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


def _env(base, **launcher):
    env = {k: v for k, v in (base or os.environ).items() if k not in LAUNCHER_VARS}
    env.update(launcher)
    return env


@pytest.mark.parametrize("backend", ["ipc", "nvshmem"])
def test_per_process_backend_without_a_launcher(no_cupy_env, backend):
    p = tsgen("test", "specs/put_block.yaml", "--backend", backend, env=_env(no_cupy_env))
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("tsgen: the ipc and nvshmem backends run one process per GPU, but no launcher set "
                               "this process's rank: none of RANK/WORLD_SIZE (torchrun),"), p.stderr
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.parametrize("args,launcher,message", [
    ((), {"RANK": "0", "WORLD_SIZE": "5"},
     "tsgen: specs/put_block.yaml: compiled for world sizes [2, 3, 4]; the launcher's 5 ranks is not one\n"),
    (("--gpus", "3"), {"RANK": "0", "WORLD_SIZE": "2"},
     "tsgen: world size 3 asked for (--gpus), but the launcher started 2 ranks (WORLD_SIZE=2)\n"),
    ((), {"SLURM_PROCID": "2", "SLURM_NTASKS": "2"},
     "tsgen: SLURM_PROCID=2 but SLURM_NTASKS=2: ranks run from 0 to 1\n"),
], ids=["world-not-compiled", "gpus-disagree", "bad-rank"])
def test_ipc_world_size_checked_before_cupy(no_cupy_env, args, launcher, message):
    p = tsgen("test", "specs/put_block.yaml", "--backend", "ipc", *args, env=_env(no_cupy_env, **launcher))
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr == message


@pytest.mark.parametrize("args,message", [
    (("test", "specs/put_block.yaml"), "--gpus N is required with --backend single"),
    (("bench", "specs/allgather.yaml"), "a world size is needed (--gpus, or gpus: in the suite)"),
    (("test", "specs/barrier_all.yaml", "--backend", "ipc", "--probe-timeout"), "--probe-timeout runs with --backend single"),
    (("test", "specs/put_block.yaml", "--backend", "shmem"), "Invalid value for '--backend'"),
    (("bench", "specs/put_block.yaml", "--suite", "gemm"), "give a SPEC or --suite NAME (not both)"),
    (("bench",), "give a SPEC or --suite NAME (not both)"),
])
def test_backend_option_errors(args, message):
    r = run_cli(*args)
    assert r.code == 2, r
    assert message in r.stderr, r
