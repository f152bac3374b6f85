"""Checks on a kernel's SASS that several test files share."""


def vector_to_uniform_copies(names: list[str]) -> int:
    """R2UR (a vector register copied into a uniform one) between the first and the last wgmma (HGMMA) of
    `names`, the opcodes of a kernel in order. A wgmma takes its shared-memory descriptors in uniform registers;
    built from a value the compiler cannot prove warp-uniform (threadIdx.x / 128), each is made in vector
    registers and copied before every wgmma: 44 of the hd 128 backward's copies sat there
    (docs/design/attention.md, "FA4's sm_90 backward beside tsgen's"). tsgen::ptx::warpgroup_id() makes the
    index uniform, and then none do."""
    at = [i for i, name in enumerate(names) if name.startswith("HGMMA")]
    return names[at[0]:at[-1] + 1].count("R2UR") if at else 0
