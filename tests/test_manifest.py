"""The lowered spec and its typed, versioned Manifest: what the runtime loads, written and read
back exactly; an old or foreign manifest refused with a message that says to rebuild; every
spec lowered once (its comm plans built once per world size)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import ROOT, SPECS
from tsgen.build import render_all
from tsgen.lowering import lower
from tsgen.manifest import MANIFEST_VERSION, Manifest, ManifestError
from tsgen.ops import families
from tsgen.runtime.world import module_files
from tsgen.spec import load_spec, spec_variant


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_manifests_read_back_to_their_bytes(path):
    file = ROOT / "generated" / f"{path.stem}.json"
    manifest = Manifest.load(file)
    assert manifest.to_json().encode() == file.read_bytes()
    assert manifest == lower(load_spec(path), ROOT).manifest
    assert manifest.version == MANIFEST_VERSION and manifest.source == f"{path.stem}.cu"
    mode, libs = manifest.compile_mode
    assert (mode == "shared") == manifest.host_launch and libs == (() if manifest.host_launch else manifest.device_libs)
    for w in manifest.world_sizes:
        assert manifest.kernel(w).world_size == w


def _file(tmp_path, data) -> str:
    p = tmp_path / "old.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def test_old_and_foreign_manifests_are_refused_naming_the_file(tmp_path):
    data = json.loads((ROOT / "generated" / "allgather.json").read_text())
    del data["manifest_version"]
    with pytest.raises(ManifestError, match=r"old\.json: has no manifest_version \(written by tsgen [^)]+\); this "
                       r"tsgen reads version \d+: rebuild it from its spec with `tsgen build`"):
        Manifest.load(_file(tmp_path, data))
    data["manifest_version"] = MANIFEST_VERSION + 1
    with pytest.raises(ManifestError, match=rf"old\.json: is manifest version {MANIFEST_VERSION + 1} .*rebuild"):
        Manifest.load(_file(tmp_path, data))
    data["manifest_version"] = MANIFEST_VERSION
    del data["buffers"]
    with pytest.raises(ManifestError, match=r"old\.json: buffers: missing; rebuild it from its spec with `tsgen build`"):
        Manifest.load(_file(tmp_path, data))
    for text in ("not json", "[1, 2]"):
        with pytest.raises(ManifestError, match=r"old\.json: not a tsgen manifest"):
            Manifest.load(_file(tmp_path, text))
    with pytest.raises(ManifestError, match=r"cannot read the manifest .*missing\.json"):
        Manifest.load(tmp_path / "missing.json")


def test_kernel_of_a_world_size_not_built_names_the_spec():
    manifest = Manifest.load(ROOT / "generated" / "allgather.json")
    with pytest.raises(ManifestError.__mro__[1], match=r"allgather: compiled for world sizes \[2, 3, 4, 8\], not 5; "
                                                       r"add 5 to world_sizes in specs/allgather\.yaml"):
        manifest.kernel(5)


def test_world_load_takes_a_manifest_in_memory_or_a_path(tmp_path):
    manifest = Manifest.load(ROOT / "generated" / "reduce_scatter.json")
    source = tmp_path / "reduce_scatter.cu"
    assert module_files(manifest, source) == (manifest, source)
    assert module_files(ROOT / "generated" / "reduce_scatter.json") == (manifest, ROOT / "generated" / "reduce_scatter.cu")
    with pytest.raises(TypeError, match="source="):
        module_files(manifest)


def test_each_spec_is_lowered_once(monkeypatch):
    """Every comm plan of a build is built once per spec and world size (at validation); checks,
    the ABI, the template and the manifest all read those."""
    calls = Counter()
    for family in families():
        if hasattr(family, "comm_plan"):
            real = family.comm_plan

            def counted(spec, w, _real=real):
                calls[(spec.name, w)] += 1
                return _real(spec, w)

            monkeypatch.setattr(family, "comm_plan", counted)
    rendered = render_all([ROOT / "specs"], ROOT / "generated")
    assert calls and set(calls.values()) == {1}
    planned = {(r.name, w) for r in rendered for w in r.lowered.plans}
    assert planned == set(calls)
    # a variant is validated, and so planned, once too
    loaded = load_spec(ROOT / "specs" / "reduce_scatter.yaml")
    calls.clear()
    variant = spec_variant(loaded, {"launch": {"blocks": 32}})
    lower(variant)
    assert calls == {("reduce_scatter", w): 1 for w in variant.model.world_sizes}
