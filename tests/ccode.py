"""What a C/C++ compiler sees of a source once comments are gone, for the injection tests:
translation phases 1-3 as GCC and nvcc run them (trigraphs optionally, line splices, then
comments replaced by a space; string and character literals and pp-numbers such as 1'000
kept whole), as its non-blank lines (a comment line more or less is no change to the code)."""

from __future__ import annotations

import re

TRIGRAPHS = {"=": "#", "/": "\\", "'": "^", "(": "[", ")": "]", "!": "|", "<": "{", ">": "}", "-": "~"}
_TOKEN = re.compile(r"""//[^\n]*|/\*.*?(?:\*/|\Z)|\.?\d(?:[eEpP][+-]|'?[\w.])*"""
                    r"""|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?""", re.S)


def code_without_comments(source: str, trigraphs: bool) -> list[str]:
    text = source.replace("\r\n", "\n").replace("\r", "\n")  # GCC ends a line at a lone CR too
    if trigraphs:
        text = re.sub(r"\?\?([=/'()!<>-])", lambda m: TRIGRAPHS[m[1]], text)
    text = re.sub(r"\\[ \t\f\v]*\n", "", text)  # GCC splices a backslash followed by blanks too
    code = _TOKEN.sub(lambda m: " " if m[0].startswith(("//", "/*")) else m[0], text)
    return [line.strip() for line in code.splitlines() if line.strip()]
