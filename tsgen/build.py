"""`tsgen build`: render every spec, then write (or check) the outputs.

All specs are loaded and rendered before anything is written, so one bad
spec leaves the output folder untouched. The outputs that changed are then
staged as temporary files beside their targets and renamed into place only
once every one of them is written: a folder that cannot take one output (a
folder in the way, no permission) takes none. Outputs are compared byte for
byte. An orphan, which `--prune` removes, is only what tsgen provably wrote for
a spec folder of this build: a manifest of that name whose spec lies in one of
those folders, and the source whose first line is the banner that manifest gives.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckFailed, SpecError, TsgenError
from .files import stage, sweep_temps
from .lowering import BANNER_LINE
from .render import Rendered, banner_first_line, comment_line, render
from .spec import LoadedSpec, load_spec, spec_files


@dataclass
class BuildResult:
    rendered: list[Rendered]
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    orphans: list[Path] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)  # look like tsgen's, not provably orphans: why


def render_all(paths: list[str | Path], out_dir: Path, amalgamated: bool = False) -> list[Rendered]:
    """Every spec under `paths` rendered for `out_dir` (render.render; `amalgamated`: the one-file
    form); SpecError listing every spec's problems, nothing rendered, if any has one."""
    files = spec_files(paths)
    if not files:
        raise SpecError([f"{p}:1:1: <file>: no spec files (*.yaml) found" for p in paths])
    problems: list[str] = []
    loaded: list[LoadedSpec] = []
    for f in files:
        try:
            loaded.append(load_spec(f))
        except SpecError as e:
            problems += e.problems
    seen: dict[str, Path] = {}
    for spec in loaded:
        if spec.name in seen:
            problems.append(
                f"{spec.path}:1:1: name: {spec.name!r} is also the name of {seen[spec.name]}; "
                "names are output file names and must be unique"
            )
        seen[spec.name] = spec.path
    if problems:
        raise SpecError(problems)
    base = out_dir.resolve().parent
    return [render(spec, base, amalgamated=amalgamated) for spec in loaded]


# ---------------------------------------------------------------------------
# Orphans
# ---------------------------------------------------------------------------


def _manifest(path: Path) -> dict | None:
    """The tsgen manifest at `path` (NAME.json naming NAME.cu), or None. Read as plain JSON,
    not with Manifest.from_json: an output of any manifest version is tsgen's to prune."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    ours = (isinstance(data, dict) and isinstance(data.get("tsgen_version"), str)
            and isinstance(data.get("spec"), str) and data.get("name") == path.stem
            and data.get("source") == f"{path.stem}.cu")
    return data if ours else None


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError:
        return b""


def _first_line(path: Path) -> bytes:
    return _head(path).split(b"\n", 1)[0]


def _not_an_orphan(path: Path, base: Path, folders: set[Path]) -> str | None:
    """Why `path` is not provably an output tsgen wrote for a spec in `folders`, or None."""
    manifest = _manifest(path.with_suffix(".json"))
    if manifest is None:
        return f"no tsgen manifest {path.stem}.json for it"
    if (base / manifest["spec"]).resolve().parent not in folders:
        return f"its spec {manifest['spec']} is not in a spec folder of this build"
    banner = "// " + banner_first_line(manifest["tsgen_version"], manifest["spec"])
    if path.suffix == ".cu" and _first_line(path) != banner.encode():
        return "its first line is not the banner of its manifest"
    return None


def find_orphans(out_dir: Path, rendered: list[Rendered],
                 folders: list[Path]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(outputs tsgen wrote for a spec in `folders` that no spec of this build produces,
    [(file that looks like tsgen's but is not provably one of those, why)])."""
    expected = {name for r in rendered for name in r.files()}
    if not os.path.isdir(out_dir):  # False for any OSError; Path.is_dir raises some
        return [], []
    base, homes = out_dir.resolve().parent, {f.resolve() for f in folders}
    orphans, kept = [], []
    for p in sorted(out_dir.iterdir()):
        if p.suffix not in (".cu", ".json") or p.name in expected or not p.is_file():
            continue
        why = _not_an_orphan(p, base, homes)
        if why is None:
            orphans.append(p)
        elif (_manifest(p.with_suffix(".json")) or b"Generated by tsgen" in _first_line(p)
              or b'"tsgen_version"' in _head(p)[:400]):
            kept.append((p, why))
    return orphans, kept


# ---------------------------------------------------------------------------
# Outputs of another spec
# ---------------------------------------------------------------------------

def _spec_named_by(path: Path) -> str | None:
    """The spec an existing output says it was rendered from (a source's banner, a manifest's
    "spec"), as a banner gives it; None when it names none (absent, not tsgen's)."""
    if path.suffix == ".json":
        manifest = _manifest(path)
        return comment_line(manifest["spec"]) if manifest else None
    banner = BANNER_LINE.fullmatch(_first_line(path).rstrip())  # a CRLF file is stale, not another spec's
    return banner[1].decode("ascii", "replace") if banner else None


def _of_other_specs(out_dir: Path, rendered: list[Rendered]) -> list[str]:
    """A line for each existing output that names another spec than the one about to
    overwrite it (a copy of a spec, its name unchanged, built into the same folder)."""
    clashes = []
    for r in rendered:
        for name in r.files():
            named = _spec_named_by(out_dir / name)
            if named is not None and named != comment_line(r.lowered.manifest.spec):
                clashes.append(f"{out_dir / name} was rendered from {named}, not from {r.lowered.loaded.path}")
    return clashes


# ---------------------------------------------------------------------------
# Checking and writing
# ---------------------------------------------------------------------------


def _on_disk(path: Path) -> bytes | None:
    """What `path` holds, None if it does not exist; OSError if it cannot be read (a folder)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _stale(path: Path, old: bytes, new: bytes) -> str:
    if old.replace(b"\r\n", b"\n") == new:
        return f"stale: {path}: line endings differ (CRLF on disk); `tsgen build` rewrites it"
    diff = difflib.unified_diff(
        old.decode("utf-8", "replace").splitlines(keepends=True),
        new.decode().splitlines(keepends=True),
        fromfile=f"{path} (on disk)",
        tofile=f"{path} (rendered now)",
        n=2,
    )
    return f"stale: {path}\n" + "".join(list(diff)[:60]).rstrip()


def _check(outputs: dict[Path, bytes], orphans: list[Path], spec_of: dict[Path, str]) -> None:
    problems: list[str] = []
    for path, data in outputs.items():
        try:
            old = _on_disk(path)
        except OSError as e:
            problems.append(f"unreadable: {path}: {e.strerror}")
            continue
        if old is None:
            problems.append(f"missing: {path} (from {spec_of[path]})")
        elif old != data:
            problems.append(_stale(path, old, data))
    problems += [f"orphan: {p} (no spec produces it; `tsgen build --prune` removes it)" for p in orphans]
    if problems:
        raise CheckFailed("\n".join(problems))


def _write(outputs: dict[Path, bytes], out_dir: Path, result: BuildResult) -> None:
    """Stage every changed output, then rename them all into place; TsgenError (and nothing
    written, no folder made) if any output cannot be read or staged."""
    made = [p for p in (out_dir, *out_dir.parents) if not os.path.lexists(p)]  # deepest first
    changed: dict[Path, bytes] = {}
    staged: dict[Path, Path] = {}
    target = out_dir
    try:
        for target, data in outputs.items():
            if _on_disk(target) == data:
                result.unchanged.append(target)
            else:
                changed[target] = data
        if changed:
            target = out_dir
            out_dir.mkdir(parents=True, exist_ok=True)
            sweep_temps(out_dir)
            for target, data in changed.items():
                staged[target] = stage(target, data)
    except OSError as e:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
        raise TsgenError(f"cannot write {target}: {e.strerror or e}; nothing was written") from None
    for target, tmp in staged.items():
        try:
            os.replace(tmp, target)
        except OSError as e:
            for t in staged.values():
                t.unlink(missing_ok=True)
            raise TsgenError(f"cannot write {target}: {e.strerror or e}; "
                             f"{len(result.written)} of {len(staged)} changed outputs were written") from None
        result.written.append(target)


def build(
    paths: list[str | Path], out_dir: Path, check: bool = False, prune: bool = False, force: bool = False,
    amalgamated: bool = False,
) -> BuildResult:
    """Render the specs under `paths` into `out_dir` (check: compare, write nothing; prune:
    remove orphans; amalgamated: the one-file form a user vendors, the library inlined). An
    existing output whose banner or manifest names another spec file is overwritten only with
    `force` (else TsgenError, nothing written)."""
    # Orphans only make sense when whole folders of specs are built.
    folders = [Path(p) for p in paths if os.path.isdir(p)]
    if prune and not folders:
        raise TsgenError("--prune removes the outputs of specs no longer in a spec folder: "
                         "give it folders, not spec files")
    rendered = render_all(paths, out_dir, amalgamated)
    outputs = {out_dir / name: text.encode() for r in rendered for name, text in r.files().items()}
    spec_of = {out_dir / name: r.abi.spec.name for r in rendered for name in r.files()}
    orphans, kept = find_orphans(out_dir, rendered, folders) if folders else ([], [])
    result = BuildResult(rendered, orphans=orphans, kept=kept)
    if check:
        _check(outputs, orphans, spec_of)
        return result
    if not force and (clashes := _of_other_specs(out_dir, rendered)):
        raise TsgenError("\n".join(clashes) + "\nnothing was written; a spec's name is its output's name: rename "
                         "the spec, build into another folder (-o), or give --force to overwrite")
    _write(outputs, out_dir, result)
    if prune:
        for p in orphans:
            try:
                p.unlink()
            except OSError as e:
                raise TsgenError(f"cannot remove the orphan {p}: {e.strerror or e}") from None
    return result
