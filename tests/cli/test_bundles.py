"""Bundles are checked when they are loaded (epcc.plan.bundle): format versions, the sha256 of every
file, plan.json's fields and the invariants the compiler proved, the CUDA manifest's fields.

The named cases test the exact text.  The fuzz test edits the compiled bundle of every shipped
schedule at random (type swaps, deletions, duplications, huge numbers, NaN, deep nesting, string
<-> number, values of other fields) and loads it: each edit must give a BundleError, or a bundle
whose plan `epcc run` runs correctly or refuses with one message (exit 1) -- never another
exception, an internal error or unbounded memory.  EPCC_BUNDLE_FUZZ=N runs N edits (default 200).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from epcc import pipeline
from epcc.backends.cuda.codegen import generate as generate_cuda
from epcc.cli import main
from epcc.diagnostics import SourceMap
from epcc.passes import PassOptions
from epcc.plan.bundle import BundleError, cuda_manifest, load, write_bundle

from bundle_tools import edit_json, rehash
from test_cli import REPO, SMALL, _at_repo_root, no_crash  # noqa: F401 (the fixture applies here too)

NOT_A_PLAN = "not a plan written by 'epcc compile'"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small") / "b"
    assert main(["compile", str(REPO / SMALL), "-o", str(out)]) == 0
    return out


@pytest.fixture()
def bundle(small, tmp_path) -> Path:
    b = tmp_path / "b"
    shutil.copytree(small, b)
    return b


def refused(b: Path, message: str) -> None:
    with pytest.raises(BundleError) as e:
        load(b)
    assert str(e.value) == message


def _step(d: dict, verb: str, into: str | None = None) -> tuple[int, dict]:
    return next((i, s) for i, s in enumerate(d["steps"])
                if s["verb"] == verb and (into is None or s["dst_buffer"] == into))


# --------------------------------------------------------------------------- named cases


def test_a_compiled_bundle_loads_and_says_what_it_is(bundle):
    m = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    assert (m["format"], m["version"]) == ("epcc-bundle", 1)
    assert sorted(m["sha256"]) == ["plan.json", "t.mlir"]
    p = json.loads((bundle / "plan.json").read_text(encoding="utf-8"))
    assert (p["format"], p["version"]) == ("epcc-plan", 1)
    assert load(bundle).plan.num_ranks == 4


def test_a_changed_or_missing_file_names_the_bundle_and_the_file(bundle):
    plan = bundle / "plan.json"
    plan.write_text(plan.read_text(encoding="utf-8").replace('"tokens": 64', '"tokens": 63'), encoding="utf-8")
    refused(bundle, f"{bundle}: plan.json is not the file 'epcc compile' wrote (its sha256 differs from the one "
                    f"manifest.json records): the bundle was changed after it was compiled; recompile it")
    rehash(bundle)
    assert load(bundle).plan.workload.tokens == 63
    (bundle / "t.mlir").unlink()
    refused(bundle, f"{bundle}: t.mlir is missing (manifest.json lists it); recompile the bundle")


def test_manifests_of_another_version_or_shape_are_refused(bundle):
    mf = bundle / "manifest.json"
    original = mf.read_text(encoding="utf-8")
    for edit, message in (
            (lambda m: {**m, "version": 2}, f"{mf}: compiled by a newer epcc (manifest.json version 2, this epcc "
                                            f"reads version 1): recompile it with this epcc"),
            (lambda m: {k: v for k, v in m.items() if k not in ("format", "version")},
             f"{mf}: not a manifest written by epcc (format: missing (a manifest.json of an older epcc has none: "
             f"recompile)); recompile the bundle"),
            (lambda m: {**m, "num_ranks": "2"}, f"{mf}: not a manifest written by epcc (num_ranks: expected a whole "
                                                f"number, got the string '2'); recompile the bundle"),
            (lambda m: {**m, "num_ranks": 2}, f"{bundle}: plan.json says num_ranks 4, manifest.json 2: files of "
                                              f"different compilations; recompile the bundle"),
            (lambda m: {**m, "sha256": {**m["sha256"], "../x": "0" * 64}},
             f"{mf}: not a manifest written by epcc (sha256 key: expected a relative path inside the bundle, got "
             f"the string '../x'); recompile the bundle"),
            (lambda m: {**m, "sha256": {"t.mlir": m["sha256"]["t.mlir"]}},
             f"{mf}: not a manifest written by epcc (sha256: no entry for plan.json); recompile the bundle")):
        mf.write_text(original, encoding="utf-8")
        edit_json(mf, edit)
        refused(bundle, message)


def test_a_plan_of_another_version_is_refused(bundle):
    plan = bundle / "plan.json"
    for version, which in ((2, "a newer"), (0, "an older")):
        edit_json(plan, lambda d: {**d, "version": version}, bundle=bundle)
        refused(bundle, f"{plan}: compiled by {which} epcc (plan.json version {version}, this epcc reads version 1): "
                        f"recompile it with this epcc")


def _empty_select(d: dict) -> str:
    i, s = _step(d, "send", "output")
    s["flows"][0]["select"] = []
    return f"steps[{i}].flows[0].select: an empty selection moves no token, but the flow carries " \
           f"{s['flows'][0]['bytes']:g} bytes"


def _duplicate_flow(d: dict) -> str:
    i, s = _step(d, "send", "output")
    f = s["flows"][0]
    s["flows"].append(dict(f))
    return f"steps[{i}].flows[{len(s['flows']) - 1}]: a second flow of rank {f['rank']} from {f['src']} to {f['dst']}"


def _source_twice(d: dict) -> str:
    i, s = _step(d, "send", "output")
    s["src_buffers"] = ["input", "input"]
    return f"steps[{i}].src_buffers[1]: 'input' listed twice (its tokens would move twice)"


def _ranks_string(d: dict) -> str:
    d["num_ranks"] = "4"
    return "num_ranks: expected a whole number, got the string '4'"


def _wrong_rank(d: dict) -> str:
    i, s = _step(d, "send", "output")
    s["flows"][0]["rank"] = s["flows"][0]["dst"]
    f = s["flows"][0]
    return f"steps[{i}].flows[0]: a send runs on its source rank, to another; this flow runs on rank {f['rank']} " \
           f"from {f['src']} to {f['dst']}"


def _combine_unmirrored(d: dict) -> str:
    i, s = next((i, s) for i, s in enumerate(d["steps"]) if s["program"] == "combine" and s["verb"] == "pull")
    f = s["flows"][0]
    f["src"], f["dst"] = f["dst"], f["src"]
    return f"steps[{i}].flows[0]: a pull runs on its destination rank, from another; this flow runs on rank " \
           f"{f['rank']} from {f['src']} to {f['dst']}"


def _deps_cycle(d: dict) -> str:
    i, s = _step(d, "send", "output")
    k, keep = _step(d, "permute")
    s["deps"] = [*s["deps"], keep["name"]]
    keep["deps"] = [*keep["deps"], s["name"]]
    return "steps: the dispatch steps' deps form a cycle through"


@pytest.mark.parametrize("edit", [_empty_select, _duplicate_flow, _source_twice, _ranks_string, _wrong_rank,
                                  _combine_unmirrored, _deps_cycle], ids=lambda f: f.__name__.strip("_"))
def test_a_tampered_plan_names_the_field(edit, bundle):
    d = json.loads((bundle / "plan.json").read_text(encoding="utf-8"))
    why = edit(d)
    (bundle / "plan.json").write_text(json.dumps(d), encoding="utf-8")
    rehash(bundle)
    with pytest.raises(BundleError) as e:
        load(bundle)
    assert str(e.value).startswith(f"{bundle / 'plan.json'}: {NOT_A_PLAN}: {why}"), str(e.value)


def test_a_second_delivery_into_output_is_refused(bundle):
    d = json.loads((bundle / "plan.json").read_text(encoding="utf-8"))
    i, s = _step(d, "send", "output")
    again = {**copy.deepcopy(s), "name": "again"}
    d["steps"].insert(i + 1, again)
    (bundle / "plan.json").write_text(json.dumps(d), encoding="utf-8")
    rehash(bundle)
    # push brings 3 streams to each rank; `again` the 4th (with keep's, to come: one per home) and the 5th
    j = next(j for j, f in enumerate(again["flows"]) if sum(g["dst"] == f["dst"] for g in again["flows"][:j + 1]) == 2)
    with pytest.raises(BundleError) as e:
        load(bundle)
    assert str(e.value) == (f"{bundle / 'plan.json'}: {NOT_A_PLAN}: steps[{i + 1}].flows[{j}]: the writes into output "
                            f"deliver 5 token streams to rank {again['flows'][j]['dst']}, more than one per home rank "
                            f"(4): a token would reach its expert twice")


def test_a_staging_buffer_fed_more_than_its_declared_worst_case_is_refused(tmp_path):
    b = tmp_path / "b"
    assert main(["compile", "schedules/h200x4_2vnode.sched", "-o", str(b), "--tokens", "16"]) == 0
    d = json.loads((b / "plan.json").read_text(encoding="utf-8"))
    i, s = _step(d, "send", "rdma_recv")
    f = s["flows"][0]
    z = next(r for r in range(4) if r not in (f["src"], f["dst"]))  # a second sender into f's destination
    s["flows"].append({**f, "rank": z, "src": z})
    back = next(c for c in d["steps"] if c["reverse_of"] == s["name"])  # and its reverse, so the plan is whole
    back["flows"].append({**back["flows"][0], "rank": z, "src": f["dst"], "dst": z})
    (b / "plan.json").write_text(json.dumps(d), encoding="utf-8")
    rehash(b)
    k = next(k for k, x in enumerate(d["buffers"]) if x["name"] == "rdma_recv")
    bpt = d["bytes_per_token"]
    with pytest.raises(BundleError) as e:
        load(b)
    assert str(e.value) == (f"{b / 'plan.json'}: {NOT_A_PLAN}: buffers[{k}].worst_case_bytes: 'rdma_recv' is declared "
                            f"for {16 * bpt} bytes, but the steps writing it bring 2 token streams of 16 tokens x "
                            f"{bpt} bytes to rank {f['dst']}")


@pytest.mark.parametrize("schedule", ["h200x4_2vnode", "h200x4_ubb2x2", "ubbv2_ep16"])
def test_a_staging_hop_whose_selection_drops_a_receiver_is_refused(schedule, tmp_path):
    """A hop before output that no longer selects one receiver r (r swapped for another rank, so
    the flow still carries bytes and every stream count is unchanged) would lose every token of
    its home routed to r alone: the load names the pair, whatever hop of whatever plan it is."""
    b = tmp_path / "b"
    # the plan alone: a Biren topology's default target (supa) is not what this checks
    assert main(["compile", f"schedules/{schedule}.sched", "-o", str(b), "--tokens", "16", "--target", "none"]) == 0
    d = json.loads((b / "plan.json").read_text(encoding="utf-8"))
    R = d["num_ranks"]
    own = {"input"}  # the buffers that hold only their rank's own tokens: a hop from them moves one home's
    for s in d["steps"]:
        if s["program"] == "dispatch" and s["verb"] == "copy" and set(s["src_buffers"]) <= own:
            own.add(s["dst_buffer"])
    s = next(s for s in d["steps"] if s["program"] == "dispatch" and s["verb"] != "exchange"
             and set(s["src_buffers"]) <= own and s["dst_buffer"] != "output"
             and any(f["select"] and len(f["select"]) < R for f in s["flows"]))
    f = next(f for f in s["flows"] if f["select"] and len(f["select"]) < R)
    r = f["select"][-1]
    f["select"] = sorted({*f["select"][:-1], next(x for x in range(R) if x not in f["select"])})
    (b / "plan.json").write_text(json.dumps(d), encoding="utf-8")
    rehash(b)
    with pytest.raises(BundleError) as e:
        load(b)
    assert str(e.value) == (f"{b / 'plan.json'}: {NOT_A_PLAN}: steps: no chain of dispatch flows carries rank "
                            f"{f['src']}'s tokens routed to rank {r} into its output (every selection along it "
                            f"must include {r}): they would be lost")


def test_a_plan_of_100k_flows_is_refused_in_bounded_memory(small, tmp_path):
    """19 MB of plan: 100,000 flows in steps of a 4-rank plan, refused when loaded, before a Flow
    exists, in the memory of parsing the file (the child process reports its peak)."""
    d = json.loads((small / "plan.json").read_text(encoding="utf-8"))
    i, s = _step(d, "send", "output")
    f = s["flows"][0]
    s["flows"] = [{**f, "dst": (f["src"] + 1 + n % 3) % 4, "bytes": float(n)} for n in range(100_000)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(d), encoding="utf-8")
    assert plan.stat().st_size > 15e6
    # the peak of this process's own memory (VmHWM, kB): ru_maxrss would carry over, through the
    # fork and exec, the test runner's own peak (over 1.5 GB late in a full run)
    code = ("import sys\nfrom epcc.cli import main\n"
            f"rc = main(['run', {str(plan)!r}, '--backend', 'reference'])\n"
            "print(next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')))\n"
            "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr == (f"epcc: error: {plan}: {NOT_A_PLAN}: steps[{i}].flows: 100000 flows, "
                                              f"more than the 16 (rank, source, destination) triples of 4 ranks\n")
    assert int(r.stdout) < 1_500_000, f"peak {int(r.stdout) / 1024:.0f} MB"  # KiB


# --------------------------------------------------------------------------- fuzz


SCHEDULES = sorted((REPO / "schedules").glob("*.sched"))
DEEP = 40


def _paths(v, path=()):
    yield path
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, path + (i,))


def _get(d, path):
    for k in path:
        d = d[k]
    return d


def _mutate(text: str, doc, paths: list, leaves: list, rng: random.Random) -> tuple[object, str]:
    """A copy of `doc` (whose JSON is `text`) with one random edit, and what the edit was."""
    d = json.loads(text)
    path = rng.choice(paths[1:])
    *head, last = path
    parent = _get(d, head)
    v = parent[last]
    kind = rng.choice(["delete", "duplicate", "type", "huge", "nan", "deep", "numstr", "nudge", "other", "other"])
    if kind == "delete":
        del parent[last]
    elif kind == "duplicate":
        if isinstance(parent, list):
            parent.insert(last, copy.deepcopy(v))
        elif isinstance(v, list) and v:
            v.append(copy.deepcopy(rng.choice(v)))
        else:
            parent[last] = [v, v]
    elif kind == "type":
        parent[last] = rng.choice([None, True, [], {}, {"a": 1}, "x", 0, [v]])
    elif kind == "huge":
        parent[last] = rng.choice([2 ** 63, 2 ** 53 + 1, 10 ** 30, 1e300, -1, -2 ** 63, 1e-300])
    elif kind == "nan":
        parent[last] = rng.choice([math.nan, math.inf, -math.inf])
    elif kind == "deep":
        for _ in range(DEEP):
            v = [v]
        parent[last] = v
    elif kind == "numstr":
        parent[last] = str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else \
            (int(v) if isinstance(v, str) and v.isdigit() else 3)
    elif kind == "nudge":
        parent[last] = (v + rng.choice([-1, 1])) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0
    else:  # a value another field holds: the edits that keep the shape
        parent[last] = copy.deepcopy(_get(doc, rng.choice(leaves)))
    return d, f"{kind} {'.'.join(map(str, path))}"


def _run(plan: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["run", str(plan), "--backend", "reference"])
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> dict[str, Path]:
    """Every shipped schedule's bundle, as `epcc compile --target cuda` writes it, for 16 tokens of
    hidden 128 (what `epcc run --tokens 16 --hidden 128` compiles): quick to run."""
    root = tmp_path_factory.mktemp("shipped")
    last = pipeline.STAGES[-1].name
    out = {}
    for s in SCHEDULES:
        c = pipeline.run(str(s), last, SourceMap(), PassOptions(tokens=16, hidden=128))
        plan = c.passes.get("plan")
        out[s.stem] = b = root / s.stem
        write_bundle(b, plan, ir_name=f"{plan.schedule}.mlir", ir_text=pipeline.show(c, last), source=str(s),
                     source_bytes=s.read_bytes(), stages=[st.name for st in pipeline.STAGES],
                     backends={"cuda": generate_cuda(plan, source=str(s)).write})
    return out


def test_random_edits_of_every_shipped_bundle(shipped, tmp_path, capsys):
    n = int(os.environ.get("EPCC_BUNDLE_FUZZ", "200"))
    rng = random.Random(20261126)
    work = {}
    for name, b in shipped.items():
        w = tmp_path / name
        shutil.copytree(b, w)
        files = ("plan.json", "manifest.json", "cuda/manifest.json")
        texts = {f: (w / f).read_text(encoding="utf-8") for f in files}
        docs = {f: json.loads(t) for f, t in texts.items()}
        work[name] = (w, texts, docs, {f: list(_paths(doc)) for f, doc in docs.items()},
                      {f: [p for p in _paths(doc) if not isinstance(_get(doc, p), (dict, list))]
                       for f, doc in docs.items()})
    counts: Counter = Counter()
    for _ in range(n):
        name = rng.choice(sorted(work))
        w, texts, docs, paths, leaves = work[name]
        f = rng.choices(["plan.json", "cuda/manifest.json", "manifest.json"], [6, 3, 1])[0]
        tampered, what = _mutate(texts[f], docs[f], paths[f], leaves[f], rng)
        text = json.dumps(tampered)  # NaN and infinities as the words JSON does not allow
        (w / f).write_text(text, encoding="utf-8")
        if f != "manifest.json":  # as if the tamperer had rehashed: the contents must be checked
            m = json.loads(texts["manifest.json"])
            m["sha256"][f] = hashlib.sha256(text.encode("utf-8")).hexdigest()
            (w / "manifest.json").write_text(json.dumps(m), encoding="utf-8")
        where = f"{name}: {f}: {what}"
        try:
            load(w) if f != "cuda/manifest.json" else cuda_manifest(w)
            outcome = "loaded"
        except BundleError as e:
            assert str(e).startswith(str(w)), (where, str(e))
            outcome = "refused (BundleError)"
        except Exception as e:  # pragma: no cover - the failure this test looks for
            pytest.fail(f"{where}: {type(e).__name__}: {e}")
        if f == "plan.json":  # epcc run reads the plan file alone
            rc, err = _run(w / "plan.json")
            assert rc in (0, 1) and no_crash(err), (where, rc, err)
            if rc == 0:
                outcome += ", epcc run correct"
            else:
                assert err.startswith("epcc: error: ") and err.count("\n") <= 2, (where, err)
                # a plan the loader accepted runs right: an edit that would lose or duplicate a token is
                # the loader's to refuse (plan/invariants.py), not the oracle's to catch
                assert "differs from the oracle" not in err, (where, err)
                kind = "refused"
                outcome += f", epcc run exit 1 ({kind})"
                if os.environ.get("EPCC_BUNDLE_FUZZ_SHOW"):
                    print(f"{where}: {err.strip()}")
        counts[f"{f}: {outcome}"] += 1
        for g in ("manifest.json", f):
            (w / g).write_text(texts[g], encoding="utf-8")
    with capsys.disabled():
        print(f"\nbundle fuzz: {n} edits of {len(work)} shipped bundles")
        for k, v in sorted(counts.items()):
            print(f"  {v:5d}  {k}")
    assert sum(counts.values()) == n
    assert sum(v for k, v in counts.items() if "refused (BundleError)" in k) > n // 3
