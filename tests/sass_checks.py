"""Reading a kernel's SASS (cuobjdump --dump-sass), and checks on it, that several test files share."""

import re

# One instruction: its address, an optional predicate, the opcode (group 1) and its operands (group 2, with the
# whitespace before them). Addresses of 4 to 6 hex digits: a kernel past 64 KiB keeps its later instructions.
SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def sass_function(sass: str, name: str) -> str:
    """The part of a cuobjdump listing that is function `name` (up to the next function)."""
    text = sass[sass.index(f"Function : {name}"):]
    return text[:text.index("Function :", 10)] if "Function :" in text[10:] else text


def sass_ops(sass: str) -> list[tuple[str, str]]:
    """(opcode, operands) of every instruction, in address order."""
    return SASS_INSTRUCTION.findall(sass)


def sass_names(sass: str) -> list[str]:
    """The opcode of every instruction, in address order."""
    return [op for op, _ in sass_ops(sass)]


def vector_to_uniform_copies(names: list[str]) -> int:
    """R2UR (a vector register copied into a uniform one) between the first and the last wgmma (HGMMA) of
    `names`, the opcodes of a kernel in order. A wgmma takes its shared-memory descriptors in uniform registers;
    built from a value the compiler cannot prove warp-uniform (threadIdx.x / 128), each is made in vector
    registers and copied before every wgmma: 44 of the hd 128 backward's copies sat there
    (docs/design/attention.md, "FA4's sm_90 backward beside tsgen's"). tsgen::ptx::warpgroup_id() makes the
    index uniform, and then none do. (The span leaves out the step loop's head, before its first wgmma: 1 R2UR
    stays there in the hd 128 backward.)"""
    at = [i for i, name in enumerate(names) if name.startswith("HGMMA")]
    return sum(name.startswith("R2UR") for name in names[at[0]:at[-1] + 1]) if at else 0  # R2UR, R2UR.OR
