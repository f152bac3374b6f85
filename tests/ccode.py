"""What a C/C++ compiler sees of a source once comments are gone, for the injection tests:
translation phases 1-3 as GCC and nvcc run them (trigraphs optionally, line splices, then
comments replaced by a space, string and character literals kept whole)."""

from __future__ import annotations

import re

TRIGRAPHS = {"=": "#", "/": "\\", "'": "^", "(": "[", ")": "]", "!": "|", "<": "{", ">": "}", "-": "~"}


def code_without_comments(source: str, trigraphs: bool) -> str:
    text = source.replace("\r\n", "\n").replace("\r", "\n")  # GCC ends a line at a lone CR too
    if trigraphs:
        text = re.sub(r"\?\?([=/'()!<>-])", lambda m: TRIGRAPHS[m[1]], text)
    text = re.sub(r"\\[ \t\f\v]*\n", "", text)  # GCC splices a backslash followed by blanks too
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            out.append(" ")
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        elif text[i] in "\"'" and not (text[i] == "'" and i and text[i - 1].isalnum()):  # 1'000
            j = i + 1
            while j < n and text[j] not in (text[i], "\n"):
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
