"""FlashAttention-4 as an attention baseline, on CPU: the note where flash_attn.cute does not
import, the row's versions, the layout it is called in (a stand-in flash_attn_func computing
attention in FA4's [batch, seq, heads, head_dim], so a wrong transpose shows), the .pth step for a
--target install, and tools/fa4_wheels.sh (split, stash, install) on small fake wheels."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from tsgen.bench import attention_baselines as AB
from tsgen.bench import baselines as B

from conftest import ROOT

SCRIPT = ROOT / "tools" / "fa4_wheels.sh"


# ---------------------------------------------------------------------------
# the baseline: notes, versions
# ---------------------------------------------------------------------------


def _spec(**params):
    p = dict(batch=1, heads=4, kv_heads=2, head_dim=64, causal=True)
    p.update(params)
    return types.SimpleNamespace(params=types.SimpleNamespace(**p), dtype="bfloat16")


def _step(spec, size=4096):
    world = types.SimpleNamespace(ranks=[0], devices=[0], streams=[None])
    return types.SimpleNamespace(world=world, spec=spec, case=types.SimpleNamespace(size=size))


def test_a_missing_flash_attn_cute_is_a_note_naming_why(monkeypatch):
    monkeypatch.setattr(AB, "cuda_torch", lambda: (object(), None))  # a torch with a GPU, as far as it asks
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: its import fails
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    [(impl, call, why)] = AB.flash_attn_4(None, 0, _spec(), 4096)
    assert impl == "flash-attn-4" and call is None
    assert why.startswith("flash-attn-4 does not import (flash_attn.cute): ModuleNotFoundError") \
        and "tools/fa4_wheels.sh" in why
    m, why2 = AB.import_fa4()
    assert m is None and why2 == why


def test_no_gpu_is_a_note_and_the_bench_gets_a_skipped_row():
    """Through tsgen/bench/baselines.py as the bench calls it: never an error, a skipped row."""
    [m] = B.flash_attn_4(_step(_spec()))
    assert m.timing is None and m.sampler is None and m.impl == "flash-attn-4"
    assert "flash-attn-4 runs on torch tensors" in m.skipped and ("no CUDA GPU" in m.skipped or "not installed" in m.skipped)


def test_a_module_without_flash_attn_func_is_a_note(monkeypatch):
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    m, why = AB.import_fa4()
    assert m is None and why == "flash-attn-4: flash_attn.cute has no flash_attn_func"


def test_the_row_names_flash_attn_4_and_the_cute_dsl_versions():
    versions = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}
    assert AB.fa4_versions(versions.__getitem__) == \
        "flash-attn-4 4.0.0b36 (CuTe DSL nvidia-cutlass-dsl 4.8.1) flash_attn_func"

    def missing(dist):
        raise LookupError(dist)

    assert AB.fa4_versions(missing).count("(version unknown)") == 2


def test_the_baseline_is_registered_for_the_attention_suites():
    from tsgen.bench.suites import load_suite
    from tsgen.ops.attention import AttentionBench

    assert [b.name for b in AttentionBench.baselines][-1] == "flash_attn_4"
    B.runner(AttentionBench.baselines[-1])  # tsgen/bench/baselines.py has its function
    assert load_suite(ROOT / "suites" / "attention-variants.yaml").model.baselines == ["cudnn_frontend", "flash_attn_4"]
    for name in ("attention", "attention-gqa64"):  # every baseline of the op: none listed
        assert load_suite(ROOT / "suites" / f"{name}.yaml").model.baselines is None


# ---------------------------------------------------------------------------
# the layout FA4 is called in, with a stand-in flash_attn_func
# ---------------------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed: the layout test runs on CPU torch")


class FakeFA4:
    """flash_attn.cute as far as the baseline uses it: flash_attn_func on [batch, seq, heads, d]
    tensors (K / V with fewer heads: query head h reads KV head h // group), float64 softmax,
    causal as key j <= query i; it checks the shapes and contiguity FA4 asserts."""

    def __init__(self, torch):
        self.torch, self.calls = torch, []

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False, **kw):
        torch = self.torch
        b, s, h, d = q.shape
        assert k.shape[:2] == (b, s) and v.shape == k.shape and h % k.shape[2] == 0, "not [b, s, h, d]"
        assert all(t.is_contiguous() for t in (q, k, v))
        self.calls.append({"softmax_scale": softmax_scale, "causal": causal, **kw})
        g = h // k.shape[2]
        kk, vv = k.repeat_interleave(g, 2).double(), v.repeat_interleave(g, 2).double()
        scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * softmax_scale
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv).to(q.dtype)
        return out, None


@pytest.mark.parametrize("heads,kv_heads,causal", [(4, 2, True), (3, 3, False)])
def test_fa4_is_called_in_its_layout_and_its_output_matches_sdpa(heads, kv_heads, causal):
    torch = _torch()
    g = torch.Generator().manual_seed(0)
    b, s, d, scale = 2, 7, 16, 0.3  # s differs from every head count: a transposed view has another shape
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = (torch.randn(b, kv_heads, s, d, generator=g) for _ in range(2))
    fa4 = FakeFA4(torch)
    call, output = AB.fa4_call(fa4, q, k, v, causal, scale)
    assert fa4.calls == []  # the layout copies are made, nothing is run yet
    call()
    assert fa4.calls == [{"softmax_scale": scale, "causal": causal}]
    assert output().shape == q.shape
    assert AB.rel_err_vs_sdpa(torch, output(), q, k, v, causal, scale) < 1e-5


def test_a_wrong_layout_conversion_fails_the_check(monkeypatch):
    torch = _torch()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 8, 16, generator=g)
    k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(2))
    # a reshape where the transpose belongs: the shapes FA4 asserts still hold, the values are scrambled
    monkeypatch.setattr(AB, "to_fa4_layout", lambda x: x.reshape(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).contiguous())
    call, output = AB.fa4_call(FakeFA4(torch), q, k, v, True, 0.25)
    call()
    assert AB.rel_err_vs_sdpa(torch, output(), q, k, v, True, 0.25) > AB.BASELINE_MAX_REL_ERR


def test_fa4_runs_on_the_stream_of_torch_and_of_tvm_ffi(monkeypatch):
    """FA4's kernels launch on apache-tvm-ffi's environment stream: the call's context sets it with
    torch's (tvm_ffi.use_torch_stream around torch.cuda.stream), torch's alone without tvm_ffi."""
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(stream=lambda s: ("torch stream", s)))
    tvm = types.ModuleType("tvm_ffi")
    tvm.use_torch_stream = lambda ctx: ("tvm-ffi and", ctx)
    monkeypatch.setitem(sys.modules, "tvm_ffi", tvm)
    assert AB.fa4_stream(torch, "S") == ("tvm-ffi and", ("torch stream", "S"))
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)
    assert AB.fa4_stream(torch, "S") == ("torch stream", "S")


def test_the_dsl_packages_folder_goes_on_the_path_as_its_pth_would(tmp_path, monkeypatch):
    """pip --target installs nvidia-cutlass-dsl's .pth where Python does not read it (a PYTHONPATH
    folder): `cutlass` lives in nvidia_cutlass_dsl/dsl_packages."""
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass").mkdir(parents=True)
    (tmp_path / "nvidia_cutlass_dsl" / "__init__.py").write_text("")
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "__init__.py").write_text("FAKE = True\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path])
    for name in ("cutlass", "nvidia_cutlass_dsl"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    if importlib.util.find_spec("cutlass") is not None:
        pytest.skip("a real cutlass is importable here")
    AB._dsl_packages_on_path()
    assert sys.path[0] == str(tmp_path / "nvidia_cutlass_dsl" / "dsl_packages")
    assert importlib.import_module("cutlass").FAKE
    monkeypatch.delitem(sys.modules, "cutlass")
    AB._dsl_packages_on_path()  # once only
    assert sys.path.count(str(tmp_path / "nvidia_cutlass_dsl" / "dsl_packages")) == 1


# ---------------------------------------------------------------------------
# tools/fa4_wheels.sh on fake wheels
# ---------------------------------------------------------------------------

needs_tools = pytest.mark.skipif(not all(shutil.which(t) for t in ("bash", "split", "sha256sum")),
                                 reason="bash and coreutils are needed")


def _wheel(folder: Path, dist: str, version: str, payload: int) -> Path:
    """A minimal installable wheel: a package with `payload` random bytes (stored: not compressible)."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{dist}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{dist}/blob.bin", os.urandom(payload))
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _run(cwd: Path, *args: str, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHON": sys.executable, "FA4_PARTS": str(cwd / "parts"), "FA4_SITE": str(cwd / "site"),
         "FA4_FALLBACK": "pip", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=120)


@pytest.fixture
def parts(tmp_path):
    """Three fake wheels split at 1 MiB: the 2.5 MiB one in three chunks (the last shares part 3 with
    the small wheels); a fake `pip` stands for a fallback wheel the machine already has."""
    src = tmp_path / "src"
    src.mkdir()
    wheels = [_wheel(src, "fa4big", "1.0", 2_500_000), _wheel(src, "fa4small", "2.0", 300_000),
              _wheel(src, "pip", "0.0.1", 10)]
    r = _run(tmp_path, "split", str(src), ".whl-fa4", "1")
    assert r.returncode == 0, r.stderr
    return tmp_path, wheels


@needs_tools
def test_split_parts_are_small_and_reassemble_to_the_same_bytes(parts):
    root, wheels = parts
    dirs = sorted((root / ".whl-fa4").glob("part*"))
    assert [d.name for d in dirs] == ["part1", "part2", "part3"]
    manifests = {(d / "FILES").read_text() + (d / "SHA256SUMS").read_text() for d in dirs}
    assert len(manifests) == 1  # every part carries the whole manifest
    for d in dirs:
        assert sum(f.stat().st_size for f in d.iterdir() if f.name not in ("FILES", "SHA256SUMS")) <= 1 << 20
    for w in wheels:
        pieces = sorted(p for d in dirs for p in d.iterdir() if p.name == w.name or p.name.startswith(w.name + ".chunk-"))
        assert b"".join(p.read_bytes() for p in pieces) == w.read_bytes()
    sums = (dirs[0] / "SHA256SUMS").read_text().splitlines()
    assert sorted(sums) == sorted(f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}" for w in wheels)
    assert _run(root, "split", str(root / "src"), ".whl-fa4", "1").returncode != 0  # never over old parts


def _carry(root: Path, *numbers: int) -> None:
    """What a device call sees: .whl-fa4 holding only the parts it carried."""
    shutil.rmtree(root / "carried", ignore_errors=True)
    for n in numbers:
        shutil.copytree(root / ".whl-fa4" / f"part{n}", root / "carried" / f"part{n}")


@needs_tools
def test_stash_then_install_over_calls_and_a_missing_part_is_named(parts):
    root, _ = parts
    env = {"FA4_SRC": "carried"}
    _carry(root, 1)
    r = _run(root, "stash", **env)
    assert r.returncode == 0 and "part 1: stashed" in r.stdout and "missing: 2 3" in r.stdout
    _carry(root, 3)
    r = _run(root, "install", **env)  # part 2 never came (the machine went cold, or a call was skipped)
    assert r.returncode == 3 and "part(s) 2 missing" in r.stderr and "carry .whl-fa4/part2" in r.stderr
    assert not (root / "site").exists()
    _carry(root, 2)
    r = _run(root, "install", **env)
    assert r.returncode == 0, r.stderr
    assert "part 2: stashed" in r.stdout and "stashed parts: 1 2 3 of 3" in r.stdout
    assert "reassembled and checked 3 wheels" in r.stdout and "kept the machine's pip" in r.stdout
    site = root / "site"
    assert (site / "fa4big" / "blob.bin").stat().st_size == 2_500_000 and (site / "fa4small").is_dir()
    assert not (site / "pip").exists()  # a fallback the machine has is not shadowed
    assert "export PYTHONPATH=" in r.stdout and f"{site}/nvidia_cutlass_dsl/dsl_packages" in r.stdout
    _carry(root)
    r = _run(root, "install", **env)  # idempotent: a later call finds it done
    assert r.returncode == 0 and "already installed" in r.stdout


@needs_tools
def test_a_corrupt_chunk_is_refused(parts):
    root, _ = parts
    _carry(root, 1)
    chunk = next((root / "carried" / "part1").glob("*.chunk-*"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    r = _run(root, "stash", FA4_SRC="carried")
    assert r.returncode == 4 and "part 1 as carried" in r.stderr


@needs_tools
def test_nothing_carried_or_stashed_is_a_clear_error(tmp_path):
    r = _run(tmp_path, "install")
    assert r.returncode == 3 and "no part carried (.whl-fa4/partN)" in r.stderr


# ---------------------------------------------------------------------------
# the backward's bench (tools/gpu_attention_bwd.py): column fa4
# ---------------------------------------------------------------------------


def test_backward_bench_fa4_is_a_note_without_flash_attn(monkeypatch):
    from conftest import load_script

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    call, why = tool.fa4_backward(None, {}, True, None)
    assert call is None and why.startswith("flash-attn-4 does not import")


def test_backward_bench_fa4_is_timed_only_when_its_gradients_match_sdpa(monkeypatch):
    """The fa4 column's gradients are checked against SDPA's of the same tensors before it is timed: a
    stand-in flash_attn_func that is SDPA passes; one with another softmax scale is refused by name."""
    import contextlib
    import types

    from conftest import load_script

    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import tsgen.bench.attention_baselines as ab

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    gen = torch.Generator().manual_seed(3)
    t = {n: torch.randn(1, 40, h, 16, generator=gen) for n, h in (("q", 4), ("k", 2), ("v", 2), ("do", 4))}
    proxy = types.SimpleNamespace(autograd=torch.autograd, cuda=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(ab, "fa4_stream", lambda torch, stream: contextlib.nullcontext())
    for scale, ok in ((None, True), (0.5, False)):
        def flash_attn_func(q, k, v, causal=False, scale=scale):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal, scale=scale, enable_gqa=True)
            return o.transpose(1, 2), None

        fake = types.SimpleNamespace(flash_attn_func=flash_attn_func)
        monkeypatch.setattr(ab, "import_fa4", lambda fake=fake: (fake, None))
        call, why = tool.fa4_backward(proxy, t, True, None)
        assert (call is not None) == ok, why
        if not ok:
            assert "differs from SDPA's" in why and "dQ" in why


def _backward_report(tsgen: dict, sdpa_cudnn: dict):
    """tools/gpu_attention_bwd.py, one bench row (hd 128 variant "v" at 4096) of these two columns, and the summary
    its report is made from."""
    from conftest import load_script

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    row = {"variant": "v", "seq": 4096, "batch": 4, "tsgen": tsgen, "sdpa_cudnn": sdpa_cudnn}
    return tool, row, {"device": "NVIDIA H200", "date": "2026-11-28", "command": "c", "checks": {},
                       "bench": {"rows": [row]}}


def _table_head(text: list[str], start: str) -> int:
    """The line of the report's table whose header starts so."""
    return next(i for i, line in enumerate(text) if line.startswith(start))


def test_backward_report_has_the_fa4_column_only_where_a_row_has_it():
    tool, row, summary = _backward_report({"tflops": 200.0}, {"tflops": 500.0, "ratio": 2.5})
    assert "FA4" not in tool.markdown(summary)
    summary["bench"]["rows"] = [dict(row, fa4={"tflops": 400.0, "ratio": 2.0}), dict(row, seq=8192)]
    text = tool.markdown(summary).splitlines()
    head = _table_head(text, "| variant | S |")
    assert text[head].endswith("SDPA flash | ratio | SDPA cuDNN | ratio | FA4 | ratio |")
    assert text[head + 1].count("---") == text[head].count("|") - 1  # one separator per column
    assert "| v | 4096 | 200 | - | - | 500 | 2.50 | 400 | 2.00 |" in text
    assert "| v | 8192 | 200 | - | - | 500 | 2.50 | - | - |" in text


def test_backward_cycle_ratio_pairs_time_and_clock_round_by_round():
    """cycle_ratio: per round, (baseline time x its clock) / (tsgen's time x its clock), the median; none where a
    round has no reading. A baseline 10 % slower in time at a 10 % lower clock takes the same cycles."""
    from conftest import load_script

    from tsgen.bench.timing import Timing

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    mine = Timing([100.0, 100.0, 100.0], 3, "eager", sm_mhz=[1800.0, 1800.0, 1800.0])
    slower_clock = Timing([110.0, 110.0, 110.0], 3, "eager", sm_mhz=[1800 / 1.1] * 3)
    assert tool.cycle_ratio(slower_clock, mine) == pytest.approx(1.0)
    same_clock = Timing([110.0, 121.0, 99.0], 3, "eager", sm_mhz=[1800.0] * 3)
    assert tool.cycle_ratio(same_clock, mine) == pytest.approx(1.1)  # the middle round's
    assert tool.cycle_ratio(Timing([110.0] * 3, 3, "eager", sm_mhz=[1800.0, None, 1800.0]), mine) is None
    assert tool.cycle_ratio(Timing([110.0] * 3, 3, "eager"), mine) is None


def test_backward_report_has_the_clock_table_only_with_clocks():
    tool, row, summary = _backward_report({"tflops": 500.0}, {"tflops": 450.0, "ratio": 0.9})
    assert "cycle ratio" not in tool.markdown(summary)
    summary["bench"]["rows"] = [dict(row, tsgen={"tflops": 500.0, "sm_mhz_median": 1650.0},
                                     sdpa_cudnn={"tflops": 450.0, "ratio": 0.9, "sm_mhz_median": 1700.0,
                                                 "cycle_ratio": 0.927})]
    text = tool.markdown(summary).splitlines()
    head = _table_head(text, "| variant | S | tsgen MHz")
    assert text[head] == "| variant | S | tsgen MHz | sdpa_flash MHz | sdpa_cudnn MHz | sdpa_flash cycles | sdpa_cudnn cycles |"
    assert text[head + 1].count("---") == text[head].count("|") - 1
    assert text[head + 2] == "| v | 4096 | 1650 | - | 1700 | - | 0.927 |"


@needs_tools
def test_split_refuses_parts_that_would_not_fit_beside_the_working_tree(tmp_path):
    """A device call carries the working tree and one part, 64 MiB in all: parts too large for that are refused at
    split, with the size that fits (a 41 MiB part beside the 23.5 MiB tree was refused by the device on 2026-11-28)."""
    src = tmp_path / "src"
    src.mkdir()
    _wheel(src, "fa4small", "2.0", 1000)
    r = _run(tmp_path, "split", str(src), ".whl-fa4", "60")
    assert r.returncode == 2 and "pass what one device call carries (64 MiB): use PART_MIB" in r.stderr, r.stderr
    assert not (tmp_path / ".whl-fa4").exists()
