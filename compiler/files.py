"""The files a user names: read only if regular and bounded, never written over.

Every file epcc reads on a user's behalf -- a .sched file, a routing .npy, a plan.json, a
bundle's manifests -- goes through :func:`read_bytes` (or :func:`read_json`, :func:`read_npy`):

* the path must name a regular file: a directory, named pipe, device or socket is refused by
  its type, from ``os.stat``, before anything is opened (a FIFO never blocks the command, a
  link to /dev/zero is never read);
* the file is opened with O_NONBLOCK and checked again on the open descriptor (in case it was
  replaced in between), then read up to a size cap, past which it is refused by its size;
* a .npy header is checked against the bytes that follow it before any array is allocated,
  and JSON is refused when it nests too deeply or holds NaN or infinities.

Every refusal is a :class:`FileError` whose message starts with the path.  Commands that write
call :func:`refuse_overwrite` first, so that no command writes over one of its own inputs.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterable

import numpy as np

MiB = 1 << 20
SCHED_MAX_BYTES = 4 * MiB  # a .sched file (the shipped ones are under 12 KB)
JSON_MAX_BYTES = 256 * MiB  # a plan.json or manifest.json (the 32-rank schedules' plans are under 1 MB)
NPY_MAX_BYTES = 1 << 30  # a routing .npy: 16 M tokens x top-8 int64 indices
JSON_MAX_DEPTH = 32  # what epcc writes nests 6 deep

_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class FileError(ValueError):
    """A file the user named cannot be read, or must not be written; the message names it."""


class ContentError(FileError):
    """The file was read but its contents are not what was expected: `reason` says why, without
    the path (for a caller that words the message itself)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def size_text(n: int) -> str:
    """A byte count for messages: '4 MiB', '1 GiB', '1536 bytes'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _not_regular(name: str, mode: int, what: str) -> FileError | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((k for test, k in _TYPES if test(mode)), "not a regular file")
    return FileError(f"{name}: is {kind}, not {what}")


def _too_large(name: str, size: int, what: str, limit: int) -> FileError:
    return FileError(f"{name}: {size} bytes is too large for {what} (at most {size_text(limit)})")


def read_bytes(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The contents of the regular file `path` (`what` it should be, for messages: 'a .sched
    file'), at most `limit` bytes; FileError otherwise."""
    name = os.fspath(path)
    if name == "":
        raise FileError(f"empty file name: expected {what}")
    try:
        st = os.stat(name)
    except (FileNotFoundError, NotADirectoryError):
        raise FileError(f"{name}: no such file") from None
    except OSError as e:
        raise FileError(f"{name}: cannot read it: {e.strerror or e}") from None
    err = _not_regular(name, st.st_mode, what)
    if err is not None:
        raise err
    if st.st_size > limit:
        raise _too_large(name, st.st_size, what, limit)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FileError(f"{name}: cannot read it: {e.strerror or e}") from None
    try:
        err = _not_regular(name, os.fstat(fd).st_mode, what)  # replaced since the stat above
        if err is not None:
            raise err
        chunks: list[bytes] = []
        n = 0
        while True:
            b = os.read(fd, min(MiB, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:  # it grew since the stat
                raise _too_large(name, n, what, limit)
        return b"".join(chunks)
    except OSError as e:
        raise FileError(f"{name}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _no_constant(text: str):
    raise ValueError(f"{text} is not a number JSON allows")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text} is out of range of a double")
    return v


def _depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (iteratively: no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def read_json(path: str | os.PathLike, what: str, limit: int = JSON_MAX_BYTES,
              max_depth: int = JSON_MAX_DEPTH) -> Any:
    """The JSON value in `path` (read as by :func:`read_bytes`): UTF-8, no NaN or infinity, no
    number beyond a double, nested at most `max_depth` deep; FileError otherwise."""
    name = os.fspath(path)
    data = read_bytes(path, what, limit)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ContentError(name, f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    too_deep = ContentError(name, f"JSON nested more than {max_depth} levels deep")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        raise ContentError(name, f"not valid JSON: {e}") from None
    if _depth(value) > max_depth:
        raise too_deep
    return value


def read_npy(path: str | os.PathLike, what: str, limit: int = NPY_MAX_BYTES) -> np.ndarray:
    """The array in the .npy file `path` (read as by :func:`read_bytes`): a header that NumPy
    writes, no Python objects, and exactly the bytes its shape and dtype need -- checked before
    the array exists, so that a header claiming a huge shape costs nothing; FileError otherwise."""
    name = os.fspath(path)
    data = read_bytes(path, what, limit)
    if not data:
        raise ContentError(name, "an empty file, not a NumPy .npy array")
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"format version {version[0]}.{version[1]} (epcc reads 1.0 and 2.0)")
        shape, fortran, dtype = read_header(f, max_header_size=1 << 16)
    except (ValueError, OSError, SyntaxError, EOFError) as e:
        raise ContentError(name, f"not a NumPy .npy array ({e})") from None
    if any(n < 0 for n in shape):
        raise ContentError(name, f"not a NumPy .npy array (the header gives shape {list(shape)})")
    if dtype.hasobject:
        raise ContentError(name, f"the array holds Python objects ({dtype}); expected numbers")
    count = math.prod(shape)
    need, have = count * dtype.itemsize, len(data) - f.tell()
    if need != have:
        raise ContentError(name, f"the header gives shape {list(shape)} of {dtype} ({need} bytes), but {have} bytes "
                                 f"of data follow it")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=f.tell())
    return arr.reshape(shape, order="F" if fortran else "C").copy()


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): compare where they lead
        return os.path.realpath(a) == os.path.realpath(b)


def _inside(p: Path, directory: Path) -> bool:
    d = os.path.realpath(directory)
    return os.path.realpath(p).startswith(d.rstrip(os.sep) + os.sep)


def refuse_overwrite(flag: str, given: str, outputs: Iterable[str | os.PathLike], inputs: Iterable[str],
                     dirs: Iterable[str | os.PathLike] = ()) -> None:
    """FileError when a file the command is about to write (`outputs`) is one of its `inputs`
    (`FLAG GIVEN: would overwrite the input X`), or when the output directory it fills (`dirs`) is
    or holds one, at any depth (`FLAG GIVEN: the output directory holds the input X`) -- compared
    by the files they resolve to, links, hard links and `..` included."""
    ins = [Path(i) for i in inputs if i]
    for i in ins:
        if any(_same(Path(o), i) for o in outputs):
            raise FileError(f"{flag} {given}: would overwrite the input {i}")
        for d in dirs:
            if _same(Path(d), i) or _inside(i, Path(d)):
                raise FileError(f"{flag} {given}: the output directory holds the input {i}")


__all__ = ["ContentError", "FileError", "JSON_MAX_BYTES", "JSON_MAX_DEPTH", "NPY_MAX_BYTES", "SCHED_MAX_BYTES", "read_bytes",
           "read_json", "read_npy", "refuse_overwrite", "size_text"]
