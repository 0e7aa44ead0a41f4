"""Every rank fails together, promptly: bounded rounds among the ranks of a group, over its store.

An engine's calls are collectives: every rank makes the same calls in the same order.  When one
rank fails (refuses an argument, a wait of its gives up, it raises, it stalls or its process
dies), its peers must not wait in a torch collective for torch's group timeout (30 minutes by
default; NCCL's cannot even be interrupted).  So no engine waits for its peers in a torch
collective: every host-side exchange of an engine is a *round* of an `Agreement`, over the
group's store (torch.distributed's Store: a TCPStore under torchrun, a FileStore for a file://
rendezvous), bounded by the Buffer's timeout; and a rank that fails posts its failure where its
peers wait for it.

Round n: every rank sets the key `n/<rank>` (its payload, or its failure), waits until every
rank's key of round n is set or its deadline passes (a TCPStore's server answers the wait; other
stores are polled), and reads them all.  So every rank that
takes part reads the same values, and either all of them go on or all raise the same
`GroupError` (base.py), whose message names the rank that failed and why:

* an exception inside `with agree.call("dispatch"):` is posted as the rank's key of the round its
  peers are in (or are about to enter), and the rank waits a short grace (`GRACE_S`) for their
  keys before it raises: a refused argument reaches every rank at once;
* a rank whose key is missing at the deadline is named as stalled or dead; the ranks that gave up
  on it overwrite their key with what they saw, so that it raises the same error if it comes
  late;
* `watch` lets a long local wait (the CPU drivers) give up as soon as a peer posts a failure: a
  failing rank raises an alarm (`alarm/n`) before it waits for the others.

The root cause, and so the message, is chosen the same way on every rank: a rank's own error
first (an argument, an exception), then a rank that never answered, then a wait that timed out
(usually a consequence of one of these), lowest rank first.  When every rank answered and every
failure was an argument refused at the start of a call (before any data moved), the Buffer stays
usable (`GroupError.rebuild` False); otherwise it is failed for good: its next call raises "this
Buffer failed in dispatch #3 on rank 1: ...; make a new Buffer".

What a round costs: a set, a check, a wait and one multi-get against the store (0.18 ms with 2
ranks on a TCPStore over loopback, measured on a 2-core CPU machine, 2026-11-26); engines take rounds where a
collective is needed anyway (the CPU engine) or where the host syncs anyway (the CUDA engine's
normal mode), never in a launch path meant for CUDA graphs.  A rank's key of round n is deleted
when round n+1 completes.  The store's own host (rank 0 of the world, under torchrun) is the one
rank whose death the others see as an unreachable store rather than a missing key.

No torch at import: `for_group` loads torch.distributed when a Buffer makes its agreement, and the
one-process-per-rank runner (cpu_procs.py) passes a FileStore of its own.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, NoReturn

from .base import GroupError, GroupTimeout, GroupTypeError, GroupValueError, KernelTimeout

#: How long a rank that failed waits for its peers' keys before it raises with what it has.
GRACE_S = 2.0
#: The longest sleep between two polls of a round's keys, and the period of `watch`.
POLL_MAX_S = 0.01
WATCH_S = 0.02

#: Root causes first: a rank's own error, then a rank that never answered, then a wait that timed
#: out, then a wait that gave up because another rank's failure raised the alarm.
PRIORITY = {"type": 0, "value": 0, "error": 0, "lost": 1, "timeout": 2, "aborted": 3}
_CLASSES = {"type": GroupTypeError, "value": GroupValueError, "lost": GroupTimeout, "timeout": GroupTimeout,
            "aborted": GroupTimeout}
_ARGUMENT_KINDS = frozenset({"type", "value"})

_OK, _FAILED = b"K", b"F"


class GaveUp(KernelTimeout):
    """This rank's wait gave up because a peer failed first (its alarm): never the root cause."""


def describe(error: BaseException) -> tuple[str, str]:
    """(kind, reason) of one rank's own exception: an argument it refused (TypeError, ValueError),
    a wait that timed out or gave up (KernelTimeout), or any other error (its type named unless it
    is one of those or a RuntimeError, whose messages say what they are)."""
    if isinstance(error, GaveUp):
        return "aborted", str(error)
    if isinstance(error, KernelTimeout):
        stuck = getattr(error, "stuck", None)  # the CPU drivers' waits: "timed out" or "gave up"
        gave_up = bool(stuck) and not any(": timed out on " in line for line in stuck)
        return ("aborted" if gave_up else "timeout"), str(error)
    kind = "type" if isinstance(error, TypeError) else "value" if isinstance(error, ValueError) else "error"
    text = str(error)
    if not text or not isinstance(error, (TypeError, ValueError, RuntimeError)):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return kind, text


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def compose(failures: dict[int, tuple[str, str, str]], *, rebuild: bool) -> GroupError:
    """The error every rank raises for `failures` ({rank: (kind, reason, call)}, not empty): its
    class and message come from the root cause alone (the call it failed in included), so ranks
    that heard of different secondary failures, or met it in a later call, raise the same error."""
    root = min(failures, key=lambda r: (PRIORITY.get(failures[r][0], 0), r))
    kind, reason, call = failures[root]
    ranks = tuple(sorted(r for r, f in failures.items() if tuple(f) == (kind, reason, call)))
    cls = _CLASSES.get(kind, GroupError)
    return cls(f"{call} failed on {ranks_text(ranks)}: {reason}", call=call, rank=ranks[0], ranks=ranks,
               reason=reason, failures={r: f[1] for r, f in sorted(failures.items())}, rebuild=rebuild)


class _StoreGone(Exception):
    """A store operation failed: the store's host is gone or unreachable."""


class Agreement:
    """Bounded rounds among `size` ranks over `store` (any torch.distributed Store: set, get,
    check, multi_get, delete_key, add), this process being `rank`.  Make it with `for_group`
    (a Buffer's group) or directly over a store of one's own."""

    def __init__(self, store, rank: int, size: int, timeout_s: float):
        self.store, self.rank, self.size, self.timeout_s = store, rank, size, float(timeout_s)
        self._served = _served(store)
        self.seq = 0  # the next round
        self.failure: GroupError | None = None
        self._call: str | None = None  # the call in progress, e.g. "dispatch #3"
        self._last_call = "the first call"
        self._first = 0  # the first round of the call in progress
        self._counts: dict[str, int] = {}

    @classmethod
    def for_group(cls, group, timeout_s: float) -> "Agreement":
        """The agreement of a new Buffer over `group` (None: the world), in its own key space of
        the group's store.  Not a collective: every rank of the group makes one per Buffer, in
        the same order, and they meet at the first round."""
        import torch.distributed as dist  # torch is the runtime extra: the runners (cpu_procs) pass a store instead
        from torch.distributed import distributed_c10d as c10d  # the group's store has no public accessor

        group = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        try:
            store = c10d._get_process_group_store(group)
        except KeyError:  # a group torch does not list: the default store, keyed by the group's ranks
            store = c10d._get_default_store()
        tag = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        base = f"epcc/agree/{tag}"
        index = (int(store.add(f"{base}/made", 1)) - 1) // len(ranks)  # every rank adds 1 per agreement
        return cls(dist.PrefixStore(f"{base}/{index}/", store), dist.get_rank(group), len(ranks), timeout_s)

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """"ready", or "failed": the next call raises (make a new Buffer)."""
        return "ready" if self.failure is None else "failed"

    def check(self) -> None:
        """Raise if an earlier call failed for good: "this Buffer failed in <call> on rank r: why;
        make a new Buffer" (the class of the first failure)."""
        f = self.failure
        if f is not None:
            where = f" on {ranks_text(f.ranks)}" if f.ranks else ""
            raise f.retold(f"this Buffer failed in {f.call}{where}: {f.reason}; make a new Buffer", rebuild=True)

    @contextmanager
    def call(self, name: str, *, numbered: bool = True) -> Iterator[str]:
        """One collective call ("dispatch" -> "dispatch #n"): raises at once if the Buffer failed;
        an exception inside becomes a GroupError on every rank (`fail`).  Nested calls are the
        outer call's (Buffer.dispatch around the engine's dispatch)."""
        if self._call is not None:
            yield self._call
            return
        self.check()
        n = self._counts[name] = self._counts.get(name, 0) + 1
        self._call, self._first = (f"{name} #{n}" if numbered else name), self.seq
        try:
            yield self._call
        except GroupError:
            raise
        except Exception as e:  # noqa: BLE001 - every kind of failure must reach the peers
            self.fail(e)
        finally:
            self._last_call, self._call = self._call, None

    # ------------------------------------------------------------------ rounds
    def exchange(self, phase: str, payload: bytes = b"", *, timeout_s: float | None = None) -> list[bytes]:
        """A round: every rank's `payload`, in rank order.  Raises the same GroupError on every rank
        if a rank failed (its exception, posted by `fail`) or did not post within `timeout_s`
        (default: the Buffer's timeout).  `phase` names where the ranks meet, in messages."""
        self.check()
        call = self._call or self._last_call
        seq = self._next()
        keys = self._keys(seq)
        tag = f"{call}\x1f{phase}".encode()  # where this rank is: the call, then the phase
        bound = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            self._set(keys[self.rank], _OK + len(tag).to_bytes(4, "little") + tag + payload)
            complete = self._wait(keys, time.monotonic() + bound)
            values = self._read(keys, complete)
        except _StoreGone as e:
            self._store_gone(call, e)
        lost = f"no answer within {bound:g} s at {phase} (stalled, or its process died)"
        failures = self._failures(values, (lost, call))
        met = {r: _tag(v).decode(errors="replace").split("\x1f")
               for r, v in values.items() if r not in failures and v is not None and v[:1] == _OK}
        if met:  # a rank at another call than the lowest rank here: the same verdict on every rank
            first = min(met)
            for r, t in met.items():
                if t != met[first]:
                    failures[r] = ("error", f"it was at {': '.join(t)}, rank {first} at {': '.join(met[first])} "
                                            f"(every rank must make the same calls in the same order)", met[first][0])
        if failures:
            self._settle(seq, failures)
        if seq > 0:
            self._quiet(lambda: self.store.delete_key(self._key(seq - 1, self.rank)))
        return [_payload(values[r]) for r in range(self.size)]

    def gather(self, phase: str, obj: Any, *, timeout_s: float | None = None) -> list[Any]:
        """`exchange` of picklable objects (the store is the group's own channel, as torch's
        all_gather_object)."""
        return [pickle.loads(b) for b in self.exchange(phase, pickle.dumps(obj), timeout_s=timeout_s)]

    def barrier(self, phase: str, *, timeout_s: float | None = None) -> None:
        self.exchange(phase, timeout_s=timeout_s)

    def verdicts(self, phase: str, error: BaseException | None) -> None:
        """A round in which every rank says whether it refuses its arguments after work that left
        every rank consistent (a bad routing row its kernels ignored, read back once they had
        finished): where any rank does, every rank raises the same GroupError, and the Buffer stays
        usable (nothing is left half done)."""
        said = self.exchange(phase, b"" if error is None else json.dumps(describe(error)).encode())
        call = self._call or self._last_call
        failures = {r: (*json.loads(p), call) for r, p in enumerate(said) if p}
        if failures:
            raise compose(failures, rebuild=False)

    def everyone(self, error: BaseException) -> GroupError:
        """The error of a check every rank made on the same data after a round (the token counts
        all ranks sent): the same on every rank without another round.  Raise it before any data
        moves: the Buffer stays usable."""
        kind, reason = describe(error)
        call = self._call or self._last_call
        err = compose({r: (kind, reason, call) for r in range(self.size)}, rebuild=kind not in _ARGUMENT_KINDS)
        if err.rebuild:
            self._failed(err)
        return err

    def fail(self, error: BaseException, *, wait_s: float | None = None, fatal: bool = False) -> NoReturn:
        """This rank failed (`error`): post it as its key of the round its peers are in (or will
        enter), raise the alarm, wait up to `wait_s` (default GRACE_S; 0 where the peers cannot
        be in that round yet, e.g. in their kernels) for their keys, and raise the GroupError that
        they raise too.  `fatal`: the peers started work this rank will not match (their kernels
        wait for it), so even a refused argument fails the Buffer for good.  A peer that does not
        answer is named as lost, "stalled, or its process died", or what `error.lost_why` says
        where the error knows more (the collective metadata exchange: it did not come to it)."""
        call = self._call or self._last_call
        if self.failure is not None:
            self.check()
        seq = self._next()
        keys = self._keys(seq)
        kind, reason = describe(error)
        grace = GRACE_S if wait_s is None else float(wait_s)
        try:
            self._set(keys[self.rank], _FAILED + json.dumps({str(self.rank): [kind, reason, call]}).encode())
            self._set(f"alarm/{seq}", str(self.rank).encode())
            complete = self._wait(keys, time.monotonic() + grace)
            values = self._read(keys, complete)
        except _StoreGone as e:
            self._store_gone(call, e, cause=error)
        # without a wait (wait_s=0) a missing peer is no news: it is not called lost
        why = getattr(error, "lost_why", None) or "stalled, or its process died"
        lost = (f"no answer within {grace:g} s of its peers' failure ({why})", call)
        self._settle(seq, self._failures(values, lost if grace > 0 else None), cause=error, fatal=fatal)

    def heed(self) -> None:
        """Raise at once if a peer already failed at the next round (its alarm is up): a rank that
        comes late to a call learns the verdict before it starts work its peers will not match.
        One store lookup; for host-synchronous paths."""
        try:
            alarmed = self.store.check([f"alarm/{self.seq}"])
        except Exception as e:  # noqa: BLE001
            self._store_gone(self._call or self._last_call, e)
        if alarmed:
            self.fail(GaveUp("gave up: another rank failed first"), wait_s=0)

    @contextmanager
    def watch(self, on_alarm: Callable[[], None]) -> Iterator[None]:
        """While inside, poll for the alarm of the next round (a peer that failed before it) and
        call `on_alarm` once if it is raised: a local wait can give up at once instead of at its
        own timeout."""
        seq, stop = self.seq, threading.Event()

        def poll() -> None:
            while not stop.wait(WATCH_S):
                try:
                    if self.store.check([f"alarm/{seq}"]):
                        on_alarm()
                        return
                except Exception:  # noqa: BLE001 - the store is gone: the local waits time out on their own
                    return

        t = threading.Thread(target=poll, name="epcc-watch", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    # ------------------------------------------------------------------ helpers
    def _next(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def _key(self, seq: int, rank: int) -> str:
        return f"{seq}/{rank}"

    def _keys(self, seq: int) -> list[str]:
        return [self._key(seq, r) for r in range(self.size)]

    def _set(self, key: str, value: bytes) -> None:
        try:
            self.store.set(key, value)
        except Exception as e:  # noqa: BLE001 - any store error means the store is gone
            raise _StoreGone(str(e)) from e

    def _quiet(self, op) -> None:
        try:
            op()
        except Exception:  # noqa: BLE001 - housekeeping only: a failed delete costs a key
            pass

    def _wait(self, keys: list[str], deadline: float) -> bool:
        """Until every key is set (True) or the deadline passes (False).  A TCPStore's server
        answers a wait when the keys are set; other stores (a FileStore's wait sleeps in whole
        seconds) are polled."""
        try:
            if self._served:  # no check first: a wait for keys already set returns at once (one trip, not two)
                left = deadline - time.monotonic()
                if left <= 0:  # no time to wait (a failed rank's grace of 0): what is there already
                    return bool(self.store.check(keys))
                try:
                    self.store.wait(keys, timedelta(seconds=left))
                    return True
                except Exception:  # noqa: BLE001 - a timeout, or a store gone: the check below tells
                    return bool(self.store.check(keys))
            if self.store.check(keys):
                return True
            pause = 0.0001
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return False
                time.sleep(min(pause, deadline - now))
                pause = min(2 * pause, POLL_MAX_S)
                if self.store.check(keys):
                    return True
        except Exception as e:  # noqa: BLE001
            raise _StoreGone(str(e)) from e

    def _read(self, keys: list[str], complete: bool) -> dict[int, bytes | None]:
        """Every rank's value (None: not set)."""
        try:
            present = list(range(self.size)) if complete else \
                [r for r, k in enumerate(keys) if self.store.check([k])]
            got = self.store.multi_get([keys[r] for r in present]) if present else []
        except Exception as e:  # noqa: BLE001
            raise _StoreGone(str(e)) from e
        values: dict[int, bytes | None] = {r: None for r in range(self.size)}
        values.update({r: bytes(v) for r, v in zip(present, got)})
        return values

    def _failures(self, values: dict[int, bytes | None],
                  lost: tuple[str, str] | None) -> dict[int, tuple[str, str, str]]:
        """Who failed, from every rank's key: of what it says of itself and what others saw of it
        (a rank that came late reads the verdict of those that gave up on it), the most telling
        (PRIORITY); a missing key is a lost rank (`lost`: the reason and the call to say; None: the
        rank did not wait, a missing key says nothing)."""
        claims: dict[int, list[tuple[int, str, str, str]]] = {}
        for r, v in values.items():
            if v is not None and v[:1] == _FAILED:
                for who, (kind, reason, call) in json.loads(v[1:]).items():
                    claims.setdefault(int(who), []).append((r, kind, reason, call))
        failures: dict[int, tuple[str, str, str]] = {}
        for r in range(self.size):
            said = claims.get(r, [])
            if values[r] is None and lost is not None:
                said = said + [(self.rank, "lost", *lost)]
            if said:  # the most telling claim: a rank that gave up late was lost to the others; own first
                failures[r] = min(said, key=lambda c: (PRIORITY.get(c[1], 0), c[0] != r, c[0]))[1:]
        return failures

    def _settle(self, seq: int, failures: dict[int, tuple[str, str, str]],
                cause: BaseException | None = None, fatal: bool = False) -> NoReturn:
        """Raise the round's GroupError; unless every rank refused arguments at the start of the
        call, the Buffer is failed: post what this rank saw (for ranks that come late) and the
        alarm (for peers still in a local wait)."""
        refused = seq == self._first and all(f[0] in _ARGUMENT_KINDS for f in failures.values())
        rebuild = (fatal and self.size > 1) or not refused
        err = compose(failures, rebuild=rebuild)
        if rebuild:
            self._failed(err)
            view = _FAILED + json.dumps({str(r): list(f) for r, f in failures.items()}).encode()
            self._quiet(lambda: self.store.set(self._key(seq, self.rank), view))
            self._quiet(lambda: self.store.set(f"alarm/{seq}", str(self.rank).encode()))
        raise err from cause

    def _store_gone(self, call: str, e: Exception, cause: BaseException | None = None) -> NoReturn:
        err = GroupTimeout(f"{call} failed: the group's store is unreachable ({e}); the rank that hosts it (rank 0 "
                           f"of the world under torchrun) may have died", call=call, reason=str(e), rebuild=True)
        self._failed(err)
        raise err from cause

    def _failed(self, err: GroupError) -> None:
        """The Buffer failed for good with `err`: kept as a copy that is never raised, so that the
        agreement holds no traceback (whose frames would hold the Buffer, its engine and the group:
        a reference cycle, left to the garbage collector; lifetime.py)."""
        self.failure = err.retold(str(err))


def _served(store) -> bool:
    """Whether `store` (through its prefixes) is a TCPStore, whose waits the server answers."""
    while type(store).__name__ == "PrefixStore":
        store = store.underlying_store
    return type(store).__name__ == "TCPStore"


def _tag(value: bytes) -> bytes:
    n = int.from_bytes(value[1:5], "little")
    return value[5:5 + n]


def _payload(value: bytes) -> bytes:
    return value[5 + int.from_bytes(value[1:5], "little"):]
