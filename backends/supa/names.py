"""The check that emitted SUPA code reaches the device and the runtime only through epcc's headers.

* Generated sources (`.su`, `.suh`) and the static headers they share with CUDA (meta.cuh): no
  CUDA name (cuda*, __nv*, threadIdx..., __ldg, __shfl*, __nanosleep, int4 ...), no inline asm and
  no `<<<` launch; no raw SUPA runtime name (su*/supa*: the runtime is reached through the
  epcc_rt_* wrappers); every epcc_rt_* / EPCC_RT_* name is one epcc_supa_api.h declares; every
  EPCC_* macro is one the sources, the prelude or the API header define (or an option they test).
* The SUPA headers (the prelude and the API header): no CUDA name, and every su* / supa* name
  they use is one docs/supa.md lists in its table of the names epcc uses (each with its source).

Comments and string literals are blanked first (line and column kept), so a comment may name
CUDA.  Problems come back as "FILE:LINE:COL: message".
"""

from __future__ import annotations

import re

_CUDA_DEVICE = (r"threadIdx|blockIdx|blockDim|gridDim|warpSize|__ldg|__ldcg|__ldcs|__nanosleep|__shfl\w*|__ballot\w*|"
                r"__reduce\w*|__grid_constant__|__trap|__popc|__ffs|__syncwarp_\w*|__cvta\w*|int4|int2|uint4|float4|"
                r"make_\w+")
_CUDA_RUNTIME = r"cuda\w*|cu[A-Z]\w*|CU_\w+|CUDA\w*|__nv\w*|__CUDA\w*|nccl\w*|NCCL\w*|nvshmem\w*"
_SOURCE_DENY = re.compile(rf"\b(?:{_CUDA_RUNTIME}|{_CUDA_DEVICE}|asm|__asm__)\b")
# in the headers the torch_supa-era built-ins (CUDA-style spelling [T, S]) and __trap [T] are SUPA's own
_HEADER_DENY = re.compile(rf"\b(?:{_CUDA_RUNTIME}|__ldg|__ldcg|__ldcs|__nanosleep|__shfl\w*|__ballot\w*|"
                          rf"__grid_constant__|int4|int2|uint4|float4)\b")
_RAW_SUPA = re.compile(r"\b(?:su[A-Z]\w*|supa[A-Z]\w*|sudrv\w*|supa::\w+)")
_RT = re.compile(r"\b(?:epcc_rt_\w+|EPCC_RT_\w+)\b")
_MACRO = re.compile(r"\bEPCC_[A-Z0-9_]+\b")
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.M)
_TESTED = re.compile(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b(.*)$", re.M)


def blank(text: str) -> str:
    """`text` with comments and string and character literals replaced by spaces (newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text[i] in "\"'" and not (text[i] == "'" and i and (text[i - 1].isalnum())):
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _where(name: str, text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"{name}:{line}:{col}"


def _macros(texts: list[str]) -> set[str]:
    """Macros these texts define or test (an option such as EPCC_SUPA_API_V1 is tested, not defined)."""
    out: set[str] = set()
    for t in texts:
        b = blank(t)
        out.update(_DEFINE.findall(b))
        for cond in _TESTED.findall(b):
            out.update(_MACRO.findall(cond))
    return out


def check_sources(files: dict[str, str], api_header: str, prelude: str) -> list[str]:
    """Problems of the emitted SUPA sources `files` (name -> text), given the API header's and the
    prelude's text."""
    declared = set(_RT.findall(blank(api_header)))
    macros = _macros([api_header, prelude, *files.values()])
    problems = []
    for name, text in files.items():
        b = blank(text)
        for m in _SOURCE_DENY.finditer(b):
            problems.append(f"{_where(name, b, m.start())}: CUDA name or construct '{m.group()}' in SUPA output")
        for m in re.finditer(r"<<<", b):
            problems.append(f"{_where(name, b, m.start())}: a <<<...>>> launch (launch through epcc_rt_launch)")
        for m in _RAW_SUPA.finditer(b):
            problems.append(f"{_where(name, b, m.start())}: SUPA runtime name '{m.group()}' used directly (reach the "
                            f"runtime through epcc_supa_api.h's epcc_rt_* wrappers)")
        for m in _RT.finditer(b):
            if m.group() not in declared:
                problems.append(f"{_where(name, b, m.start())}: '{m.group()}' is not declared by epcc_supa_api.h")
        for m in _MACRO.finditer(b):
            if m.group() not in macros:
                problems.append(f"{_where(name, b, m.start())}: macro '{m.group()}' is defined by no SUPA header")
    return problems


def check_headers(headers: dict[str, str], surveyed: set[str]) -> list[str]:
    """Problems of the SUPA headers (name -> text): a CUDA name, or a SUPA name not in `surveyed`
    (the names docs/supa.md lists with their sources)."""
    problems = []
    for name, text in headers.items():
        b = blank(text)
        for m in _HEADER_DENY.finditer(b):
            problems.append(f"{_where(name, b, m.start())}: CUDA name '{m.group()}' in a SUPA header")
        for m in _RAW_SUPA.finditer(b):
            if m.group() not in surveyed:
                problems.append(f"{_where(name, b, m.start())}: SUPA name '{m.group()}' is not in docs/supa.md's "
                                f"table of the names epcc uses")
    return problems


def surveyed_names(doc: str, heading: str = "## Names epcc's SUPA headers use") -> set[str]:
    """The SUPA names of docs/supa.md's table under `heading` (first column, in backquotes)."""
    if heading not in doc:
        raise ValueError(f"docs/supa.md has no section {heading!r}")
    section = doc.split(heading, 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Za-z_][\w:]*)`", line.split("|")[1]))
    return names


__all__ = ["blank", "check_headers", "check_sources", "surveyed_names"]
