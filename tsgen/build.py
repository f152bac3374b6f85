"""`tsgen build`: render every spec, then write (or check) the outputs.

All specs are loaded and rendered before anything is written, so one bad
spec leaves the output folder untouched.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckFailed, SpecError
from .render import Rendered, is_generated, render, write_if_different
from .spec import LoadedSpec, load_spec, spec_files


@dataclass
class BuildResult:
    rendered: list[Rendered]
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    orphans: list[Path] = field(default_factory=list)


def render_all(paths: list[str | Path], out_dir: Path) -> list[Rendered]:
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
    return [render(spec, base) for spec in loaded]


def find_orphans(out_dir: Path, rendered: list[Rendered]) -> list[Path]:
    """Generated files in out_dir that no spec of this build produces."""
    expected = {name for r in rendered for name in r.files()}
    if not out_dir.is_dir():
        return []
    return sorted(
        p
        for p in out_dir.iterdir()
        if p.suffix in (".cu", ".json") and p.name not in expected and is_generated(p)
    )


def build(
    paths: list[str | Path], out_dir: Path, check: bool = False, prune: bool = False
) -> BuildResult:
    rendered = render_all(paths, out_dir)
    # Orphans only make sense when whole folders of specs are built.
    whole_folders = any(Path(p).is_dir() for p in paths)
    result = BuildResult(rendered, orphans=find_orphans(out_dir, rendered) if whole_folders else [])
    if check:
        problems: list[str] = []
        for r in rendered:
            for name, text in r.files().items():
                path = out_dir / name
                if not path.exists():
                    problems.append(f"missing: {path} (from {r.plan.spec.name})")
                    continue
                old = path.read_text(encoding="utf-8")
                if old != text:
                    diff = difflib.unified_diff(
                        old.splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        fromfile=f"{path} (on disk)",
                        tofile=f"{path} (rendered now)",
                        n=2,
                    )
                    problems.append(f"stale: {path}\n" + "".join(list(diff)[:60]).rstrip())
        problems += [f"orphan: {p} (no spec produces it; `tsgen build --prune` removes it)" for p in result.orphans]
        if problems:
            raise CheckFailed("\n".join(problems))
        return result
    for r in rendered:
        for name, text in r.files().items():
            path = out_dir / name
            (result.written if write_if_different(path, text) else result.unchanged).append(path)
    if prune:
        for p in result.orphans:
            p.unlink()
    return result
