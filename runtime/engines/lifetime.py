"""How long what a Buffer holds lives: released by the call that fails, and before the interpreter's teardown.

An engine holds native resources (the launcher's context and the buffers it allocated, host-mapped
error records, CUDA IPC mappings of its peers' memory, the GPU proxy path's transport, rings and
proxy threads running C loops, NVSHMEM's symmetric memory, shared-memory segments on the CPU) and
references to the torch.distributed group and its store.  None of it is left to the garbage
collector or to `__del__` (no engine has one):

* A call that fails to make an engine or a Buffer releases what it acquired before the error
  leaves it, in reverse order, without meeting the peers (`Held`, `released_on_failure`).
* An error leaving a Buffer's call has the locals of the frames it passed through cleared
  (`forget_frames`).  Otherwise one reference cycle through them (an exception kept in a local of
  the frame that raised it, or by an object of the call) keeps the half-made Buffer, its engine
  and the process group alive after the caller dropped the error and called
  `destroy_process_group()`, until the collector frees them during the interpreter's teardown,
  where the group's and NCCL's destructors run against a runtime that is shutting down.
* An engine made is held here until it is closed (`track`, `untrack`): one whose Buffer was
  dropped without `close()` keeps its resources (nothing frees them behind the caller's back),
  and its proxy threads keep running, until the interpreter exits.
* At interpreter exit one atexit hook (`release_live`), registered when the first Buffer or engine
  is being made (after torch's own hooks, so it runs before them: atexit calls the last registered
  first), releases every engine still open, the last made first (`release_at_exit`): its proxy
  threads stopped first (a daemon thread still in a C loop while the interpreter and CUDA tear
  down is a crash), then, where its Buffer is still usable, what it allocated; a failed Buffer's
  memory stays, since a peer's kernel may still write into it until the process ends.  Nothing
  there meets the peers: they may be gone.  Then it runs the garbage collector once, so that
  whatever a reference cycle elsewhere still holds (a group, a store) is destroyed while torch and
  CUDA are whole, not during the interpreter's teardown.

No torch here.
"""

from __future__ import annotations

import atexit
import gc
import sys
import traceback
from typing import Any, Callable


class Held:
    """What an object acquired, each with how to release it, released last acquired first.  A
    release callable must not refer to the owner (a bound method of the owner would make a
    reference cycle): pass the library's function and the handle."""

    def __init__(self) -> None:
        self._items: list[tuple[str, Callable[..., Any], tuple]] = []

    def push(self, what: str, release: Callable[..., Any], *args: Any) -> None:
        self._items.append((what, release, args))

    def __len__(self) -> int:
        return len(self._items)

    def release(self) -> list[str]:
        """Release everything, last acquired first; a release that fails is reported ("what:
        error") and the others still run."""
        failures = []
        while self._items:
            what, release, args = self._items.pop()
            try:
                release(*args)
            except Exception as e:  # noqa: BLE001 - every other resource must still be released
                failures.append(f"{what}: {e}")
        return failures


def forget_frames(error: BaseException, outer: BaseException | None = None) -> None:
    """Clear the locals of the finished frames `error` passed through, and of those of the errors
    it was raised from or during (its causes and contexts), up to `outer`: the error that was
    being handled when the call began, which is the caller's.  Frames still running are left."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or e is outer or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def note(error: BaseException, text: str) -> None:
    """Add `text` to `error`'s report (a note where Python has them, else a line on stderr)."""
    add = getattr(error, "add_note", None)
    if add is not None:
        add(text)
    else:
        print(f"epcc: {text}", file=sys.stderr)


class released_on_failure:  # noqa: N801 (used as a context manager, as the function it replaced)
    """Around a call of the runtime's API: an error leaving it first runs `release` (what the call
    acquired, in reverse order; its failures are noted on the error), then has its frames forgotten
    (`forget_frames`).  A class, not a generator: it is entered on every dispatch and combine."""

    __slots__ = ("release", "outer")

    def __init__(self, release: Callable[[], list[str]] | None = None):
        self.release = release

    def __enter__(self) -> None:
        self.outer = sys.exc_info()[1]

    def __exit__(self, kind, e, tb) -> bool:
        if e is not None:
            if self.release is not None:
                for failure in self.release():
                    note(e, f"releasing what was acquired before the failure: {failure}")
            forget_frames(e, self.outer)
        return False


_live: dict[int, Any] = {}  # id -> engine still open, in the order made (a dict keeps it)
_hooked = False


def exit_hook() -> None:
    """Register the atexit hook (`release_live`) once, before the first Buffer or engine acquires
    anything: after torch registered its own, so that it runs before them."""
    global _hooked
    if not _hooked:
        atexit.register(release_live)
        _hooked = True


def track(engine: Any) -> None:
    """`engine` (with a `release_at_exit()`) is open: held, and released at exit unless `untrack`ed
    (closed) first."""
    exit_hook()
    _live[id(engine)] = engine


def untrack(engine: Any) -> None:
    _live.pop(id(engine), None)


def live() -> list[Any]:
    """The engines still open, the first made first."""
    return list(_live.values())


def release_live() -> None:
    """The atexit hook: `release_at_exit()` of every engine still open, the last made first (one
    that fails is one line on stderr, and the others are still released), then one collection of
    the garbage that reference cycles hold."""
    for key in reversed(list(_live)):
        engine = _live.pop(key, None)
        if engine is None:
            continue
        try:
            engine.release_at_exit()
        except Exception as e:  # noqa: BLE001 - at exit: say it, release the others
            print(f"epcc: at exit, releasing a Buffer's {type(engine).__name__}: {e}", file=sys.stderr)
        del engine
    gc.collect()


__all__ = ["Held", "exit_hook", "forget_frames", "live", "note", "release_live", "released_on_failure", "track",
           "untrack"]
