"""Dump or compare the machine code of every generated source: for each NAME.cu in a
folder (default generated/), compile it as the runtime loads it (tsgen.toolchain.
compile_module: a cubin, or the shared library with host launchers), take the device
ELF (the cubin, or the cubins cuobjdump extracts from the library) and record the sha256
of each `.text.*` section, by kernel name (for -rdc builds, the source-hash part of the
names of static functions is left out).

    python tools/compare_text.py dump [FOLDER] > before.json
    python tools/compare_text.py compare before.json after.json

`compare` lists the kernels whose .text differs, appeared or disappeared; exit 1 if any
differs in more than the slot numbers of the global-address table (see sass_digests). A
section that disappeared and one that appeared in the same module with the same code (bytes,
or SASS up to slot numbers) count as renamed, not different: a helper that is not inlined
(the timeout trap) takes its C++ name, namespace included, into its section's name.
Used to show that a change to templates or headers leaves the kernels unchanged."""
from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from tsgen.toolchain import compile_module, find_cuobjdump


def elf_text_sections(data: bytes) -> dict[str, str]:
    """`.text.*` section name -> sha256 of its bytes, from an ELF64 little-endian image."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 image")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    out = {}
    for h in headers:
        name = names[h[0]:names.index(b"\0", h[0])].decode()
        if name.startswith(".text."):
            # -rdc builds name static functions _INTERNAL_<hash of the source>_: keep the name only
            out[re.sub(r"_INTERNAL_[0-9a-f]+_", "_INTERNAL_", name)] = hashlib.sha256(data[h[4]:h[4] + h[5]]).hexdigest()
    return out


def device_elves(binary: Path) -> list[bytes]:
    if binary.suffix == ".cubin":
        return [binary.read_bytes()]
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([str(find_cuobjdump()), "-xelf", "all", str(binary.resolve())], cwd=d, check=True,
                       capture_output=True)
        return [p.read_bytes() for p in sorted(Path(d).iterdir())]


_SLOT = re.compile(r"c\[0x4\]\[(0x[0-9a-f]+|RZ)\]")  # RZ: slot 0x0


def sass_digests(binary: Path) -> dict[str, str]:
    """`.text.<function>` -> sha256 of its SASS with the encodings left out and the slots of
    the global-address table (c[0x4][...]) renumbered in order of first use: two kernels that
    differ only in where the linker put the addresses of the globals they read compare equal
    (a global added or dropped elsewhere in the module renumbers them). Trailing blanks are
    dropped: cuobjdump pads each instruction to a column, so a shorter slot number pads more."""
    text = subprocess.run([str(find_cuobjdump()), "-sass", str(binary)], check=True, capture_output=True,
                          text=True).stdout
    out = {}
    for part in text.split("Function : ")[1:]:
        name, body = part.split("\n", 1)
        slots: dict[str, str] = {}
        lines = [_SLOT.sub(lambda m: "c[0x4][slot%d]" % slots.setdefault(m.group(1), len(slots)), line.split("/* 0x")[0].rstrip())
                 for line in body.splitlines() if line.strip() and not line.strip().startswith("/* 0x")]
        key = re.sub(r"_INTERNAL_[0-9a-f]+_", "_INTERNAL_", ".text." + name.strip())
        out[key] = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return out


def dump(folder: Path) -> dict[str, dict[str, dict[str, str]]]:
    """module -> .text section -> {"bytes": sha256 of the section, "sass": see sass_digests}."""
    result = {}
    for src in sorted(folder.glob("*.cu")):
        binary = compile_module(src).output
        sections: dict[str, str] = {}
        for elf in device_elves(binary):
            sections.update(elf_text_sections(elf))
        sass = sass_digests(binary)
        result[src.stem] = {name: {"bytes": digest, "sass": sass.get(name, "")} for name, digest in sections.items()}
        print(f"{src.stem}: {len(sections)} .text sections", file=sys.stderr)
    return result


def compare(before: dict, after: dict) -> int:
    """Print each section that is not byte-identical; exit status 1 if any differs in more
    than the numbering of its global-address slots (see sass_digests)."""
    bad = slots = renamed = n = 0
    for mod in sorted(set(before) | set(after)):
        b, a = before.get(mod, {}), after.get(mod, {})
        gone = sorted(set(b) - set(a))
        new = sorted(set(a) - set(b))
        for old in list(gone):  # the same code under a new name
            same = [s for s in new if a[s]["bytes"] == b[old]["bytes"] or (a[s]["sass"] and a[s]["sass"] == b[old]["sass"])]
            if same:
                gone.remove(old)
                new.remove(same[0])
                n += 1
                renamed += 1
                kind = "same bytes" if a[same[0]]["bytes"] == b[old]["bytes"] else "same SASS but for c[0x4] slot numbers"
                print(f"{mod}: {old} renamed {same[0]} ({kind})")
        for sec in gone + new:
            n += 1
            bad += 1
            print(f"{mod}: {sec} {'added' if sec in new else 'removed'}")
        for sec in sorted(set(b) & set(a)):
            n += 1
            if b[sec]["bytes"] != a[sec]["bytes"]:
                if b[sec]["sass"] and b[sec]["sass"] == a[sec]["sass"]:
                    slots += 1
                    print(f"{mod}: {sec} differs only in its c[0x4] global-address slot numbers")
                else:
                    bad += 1
                    print(f"{mod}: {sec} differs")
    print(f"{n} .text sections in {len(set(before) | set(after))} modules compared: "
          f"{n - bad - slots - renamed} byte-identical, {slots} identical but for c[0x4] slot numbers, "
          f"{renamed} renamed with the same code, {bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"]:
        json.dump(dump(Path(sys.argv[2] if len(sys.argv) > 2 else "generated")), sys.stdout, indent=1,
                  sort_keys=True)
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(*(json.loads(Path(p).read_text()) for p in sys.argv[2:4])))
    else:
        sys.exit(__doc__)
