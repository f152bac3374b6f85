"""Dump or compare the machine code of every generated source: for each NAME.cu in a
folder (default generated/), compile it as the runtime loads it (tsgen.toolchain.
compile_module: a cubin, or the shared library with host launchers), take the device
ELF (the cubin, or the cubins cuobjdump extracts from the library) and record the sha256
of each `.text.*` section, by kernel name (for -rdc builds, the source-hash part of the
names of static functions is left out).

    python tools/compare_text.py dump [FOLDER] > before.json
    python tools/compare_text.py compare before.json after.json

`compare` lists the kernels whose .text differs, appeared or disappeared; exit 1 if any
differs in more than the slot numbers of the global-address table and the order of its
out-of-line callees (see sass_digests). A
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
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*$")
# opcodes whose hex operands may be code addresses of the function (branch and call targets,
# the return address a caller passes in a register)
_CODE_OPS = ("BRA", "CALL", "BSSY", "JMP", "BRX", "JMX", "LEPC", "MOV", "IMAD.MOV")


def _renumber_slots(lines: list[str]) -> list[str]:
    slots: dict[str, int] = {}
    return [_SLOT.sub(lambda m: "c[0x4][slot%d]" % slots.setdefault(m.group(1), len(slots)), line) for line in lines]


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P[T0-9]\s+", "", instruction).split()[0]


def _callees_in_any_order(instructions: list[tuple[int, str]]) -> list[str]:
    """A function's SASS with its out-of-line callees (CALL.REL targets inside the function)
    as blocks in an order of their own: code addresses become block + offset (a return
    address passed in MOV: RETURN_ADDRESS), padding NOPs and the closing self-branch go, the
    blocks after the entry are sorted by their text, then slots are renumbered. ptxas places
    the callees by their (mangled) names, so renaming one can move the blocks."""
    calls = [(a, i) for a, i in instructions if _opcode(i).startswith("CALL.REL")]
    starts = sorted({0} | {int(x, 16) for _, i in calls for x in re.findall(r"0x[0-9a-f]+", i)})
    code = {a for a, _ in instructions}
    returns = {a + 0x10 for a, _ in calls}

    def block(a: int) -> int:
        return max(s for s in starts if s <= a)

    def addresses(i: str, name) -> str:
        op = _opcode(i)
        if not op.startswith(_CODE_OPS):
            return i

        def one(m):
            v = int(m.group(0), 16)
            if op.startswith(("MOV", "IMAD.MOV")):
                return "RETURN_ADDRESS" if v in returns else m.group(0)
            return name(v) if v in code or v in starts else m.group(0)
        return re.sub(r"(?<![\[\w])0x[0-9a-f]+(?![\]\w])", one, i)

    blocks: dict[int, list[str]] = {s: [] for s in starts}
    for a, i in instructions:
        if not (_opcode(i) == "NOP" or (_opcode(i) == "BRA" and i.endswith(hex(a)))):
            blocks[block(a)].append(i)
    ids = {s: hashlib.sha256("\n".join(_renumber_slots([addresses(i, lambda v: "T") for i in blocks[s]])).encode())
           .hexdigest()[:16] for s in starts}
    ids[0] = "entry"
    lines = []
    for s in [0] + sorted((s for s in starts if s), key=lambda s: ids[s]):
        lines.append("block " + ids[s])
        lines += [addresses(i, lambda v: f"{ids[block(v)]}+{v - block(v):x}") for i in blocks[s]]
    return _renumber_slots(lines)


def sass_digests(binary: Path) -> dict[str, dict[str, str]]:
    """`.text.<function>` -> {"sass": sha256 of its SASS with the encodings left out and the
    slots of the global-address table (c[0x4][...]) renumbered in order of first use, "callees":
    the same with its out-of-line callees in any order (_callees_in_any_order)}. Two kernels
    that differ only in where the linker put the addresses of the globals they read have the
    same "sass" (a global added or dropped elsewhere in the module renumbers them). Trailing
    blanks are dropped: cuobjdump pads each instruction to a column, so a shorter slot number
    pads more."""
    text = subprocess.run([str(find_cuobjdump()), "-sass", str(binary)], check=True, capture_output=True,
                          text=True).stdout
    out = {}
    for part in text.split("Function : ")[1:]:
        name, body = part.split("\n", 1)
        lines = [line.split("/* 0x")[0].rstrip() for line in body.splitlines()
                 if line.strip() and not line.strip().startswith("/* 0x")]
        instructions = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INSTRUCTION.match, lines) if m]
        key = re.sub(r"_INTERNAL_[0-9a-f]+_", "_INTERNAL_", ".text." + name.strip())
        out[key] = {"sass": hashlib.sha256("\n".join(_renumber_slots(lines)).encode()).hexdigest(),
                    "callees": hashlib.sha256("\n".join(_callees_in_any_order(instructions)).encode()).hexdigest()}
    return out


def dump(folder: Path) -> dict[str, dict[str, dict[str, str]]]:
    """module -> .text section -> {"bytes": sha256 of the section, "sass", "callees": see sass_digests}."""
    result = {}
    for src in sorted(folder.glob("*.cu")):
        binary = compile_module(src).output
        sections: dict[str, str] = {}
        for elf in device_elves(binary):
            sections.update(elf_text_sections(elf))
        sass = sass_digests(binary)
        result[src.stem] = {name: {"bytes": digest, **sass.get(name, {"sass": "", "callees": ""})}
                            for name, digest in sections.items()}
        print(f"{src.stem}: {len(sections)} .text sections", file=sys.stderr)
    return result


def compare(before: dict, after: dict) -> int:
    """Print each section that is not byte-identical; exit status 1 if any differs in more
    than the numbering of its global-address slots and the order of its out-of-line callees
    (see sass_digests)."""
    bad = slots = placed = renamed = n = 0
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
                elif b[sec].get("callees") and b[sec]["callees"] == a[sec].get("callees"):
                    placed += 1
                    print(f"{mod}: {sec} differs only in where its out-of-line callees sit (and slot numbers)")
                else:
                    bad += 1
                    print(f"{mod}: {sec} differs")
    print(f"{n} .text sections in {len(set(before) | set(after))} modules compared: "
          f"{n - bad - slots - placed - renamed} byte-identical, {slots} identical but for c[0x4] slot numbers, "
          f"{placed} identical but for the order of out-of-line callees, {renamed} renamed with the same code, "
          f"{bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"]:
        json.dump(dump(Path(sys.argv[2] if len(sys.argv) > 2 else "generated")), sys.stdout, indent=1,
                  sort_keys=True)
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(*(json.loads(Path(p).read_text()) for p in sys.argv[2:4])))
    else:
        sys.exit(__doc__)
