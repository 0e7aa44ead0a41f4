"""The paced SM roles' emulated link (device.cu.j2 PacedLink: an RDMA step with rdma="emulate"),
run on the host: the generated device header's paced_until_ready / paced_watch / paced_landing,
compiled by nvcc as host code against a clock of the test's own (Env), in the order a block's
thread 0 calls them in run_role: wait for the item's producers, copy it (`copy` ns, watching),
replay the link up to it, hold until its landing.  Each block keeps its own replay, as on the GPU.

What must hold: every chunk lands no sooner than one serial link of the plan's rate and latency,
fed the chunks in item order as they became ready, would land it (the emulation never beats its
link), and no later than that plus a poll where the chunks are ready ahead of the link (it loses
nothing a NIC would not).  The per-block pacing it replaces (each of the role's blocks keeping to
its share of the rate from its own last publication) landed chunks in bursts of one per block
and fell ~7 % behind the link on 2 x H200 (2026-11-27): these checks fail on it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from epcc import pipeline
from epcc.backends.cuda import codegen
from epcc.passes import PassOptions
from epcc.runtime import build_cache

REPO = Path(__file__).resolve().parents[2]
NVCC = build_cache.find_nvcc()

HARNESS = r"""
#include <cstdio>
#include <vector>
#include "epcc_cuda_device.cuh"
using namespace epcc;

struct Clock {  // the Env of PacedLink: one block's thread 0, on a clock of its own
  uint64_t t = 0, poll = 0, timeout_ns = 1000000000ull;
  const std::vector<uint64_t>* ready = nullptr;  // by ItemDesc.chunk: when the item's producers are done
  uint64_t now() const { return t; }
  bool done(const ItemDesc& x) const { return (*ready)[x.chunk] <= t; }
  void wait(const ItemDesc& x) { if ((*ready)[x.chunk] > t) t = (*ready)[x.chunk]; }
  void pause() { t += poll; }
};

int main() {
  unsigned blocks = 0, n = 0, pitch = 0;
  double rate = 0;
  unsigned long long latency = 0, copy = 0, poll = 0;
  if (scanf("%u %u %lf %llu %u %llu %llu", &blocks, &n, &rate, &latency, &pitch, &copy, &poll) != 7) return 2;
  std::vector<ItemDesc> items(n);
  std::vector<uint64_t> ready(n);
  for (unsigned i = 0; i < n; ++i) {
    unsigned rows = 0, waits = 0;
    unsigned long long r = 0;
    if (scanf("%u %u %llu", &rows, &waits, &r) != 3) return 2;
    items[i] = ItemDesc{};
    items[i].chunk = i;
    items[i].row_end = rows;
    items[i].wait_count = waits;
    ready[i] = waits ? r : 0;
  }
  for (unsigned b = 0; b < blocks; ++b) {
    PacedLink l;
    l.bytes_per_ns = static_cast<float>(rate);
    l.latency_ns = latency;
    uint64_t seen[PacedLink::kLookahead];
    Clock c;
    c.poll = poll;
    c.ready = &ready;
    for (unsigned k = b; k < n; k += blocks) {
      paced_until_ready(l, seen, items.data(), n, k, c);
      c.wait(items[k]);  // the item's own waits (run_role's wait_ge)
      const uint64_t at = k < l.observed ? seen[k % PacedLink::kLookahead] : c.now();
      const uint64_t copied = c.t + copy;
      paced_watch(l, seen, items.data(), n, c, [&] { return c.t >= copied; });
      const uint64_t landing = paced_landing(l, seen, items.data(), k, at, pitch, c);
      paced_watch(l, seen, items.data(), n, c, [&] { return c.t >= landing; });
      printf("%u %llu\n", k, static_cast<unsigned long long>(landing));
    }
  }
  return 0;
}
"""

RATE = 50.0  # bytes per ns: a 50 GB/s link
LATENCY = 5000
PITCH = 14336  # one bf16 row of 7168
COPY = 30000  # one block copies a 64-token chunk in ~30 us (8 warps)
POLL = 1000


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, $NVCC, /usr/local/cuda*/bin): the paced link is not compiled")
    d = tmp_path_factory.mktemp("paced")
    plan = pipeline.run(str(REPO / "schedules" / "h200x2_2vnode.sched"), options=PassOptions()).passes.get("plan")
    codegen.generate(plan, "schedules/h200x2_2vnode.sched", codegen.CudaOptions(rdma="emulate")).write(d)
    (d / "harness.cu").write_text(HARNESS, encoding="utf-8")
    res = subprocess.run([NVCC, "-std=c++17", "-O1", "-I", str(d), "-o", str(d / "harness"), str(d / "harness.cu")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return d / "harness"


def run(exe: Path, blocks: int, items: list[tuple[int, int]]) -> list[int]:
    """Each item's landing, items given as (rows, ready ns or -1: no producers)."""
    text = f"{blocks} {len(items)} {RATE} {LATENCY} {PITCH} {COPY} {POLL}\n"
    text += "".join(f"{rows} {int(r >= 0)} {max(r, 0)}\n" for rows, r in items)
    res = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    landing = {}
    for line in res.stdout.split("\n"):
        if line:
            k, t = line.split()
            landing[int(k)] = int(t)
    return [landing[k] for k in range(len(items))]


def serial(items: list[tuple[int, int]]) -> list[int]:
    """One link of RATE fed the items in order as they are ready: each one's landing."""
    wire, out = 0, []
    for rows, r in items:
        wire = max(wire, max(r, 0)) + int(rows * PITCH / RATE) + 1
        out.append(wire + LATENCY)
    return out


def chunks(tokens: int, per: int) -> list[int]:
    return [per] * (tokens // per) + ([tokens % per] if tokens % per else [])


@pytest.mark.parametrize("blocks", [1, 4, 16])
def test_chunks_without_producers_land_as_one_serial_link(harness, blocks):
    """h200x2_2vnode's RDMA step (it reads `input`): 4078 tokens in 64-token chunks, 4 blocks at
    50 GB/s.  Every chunk lands when the serial link lands it, whichever block carries it: the
    last one bytes / rate + latency after the start (1.175 ms), not in per-block bursts."""
    items = [(rows, -1) for rows in chunks(4078, 64)]
    got = run(harness, blocks, items)
    assert got == serial(items)
    assert got[-1] == pytest.approx(4078 * PITCH / RATE + LATENCY, abs=len(items) + 1)
    gaps = {b - a for a, b in zip(got, got[1:-1])}
    assert gaps <= {int(64 * PITCH / RATE) + 1}  # one chunk's wire time apart: a stream, no bursts


def test_producers_ahead_of_the_link_lose_nothing(harness):
    """Chunks whose producers finish twice as fast as the link carries them (the ubb2x2 NIC's
    reorder): each lands within a poll of the serial link's landing, though a block only gets
    round to the chunks of the others between its own copies."""
    per = int(64 * PITCH / RATE)
    items = [(64, 2000 + j * per // 2) for j in range(48)]
    want = serial(items)
    got = run(harness, 4, items)
    assert all(g >= w for g, w in zip(got, want))  # never faster than the link
    assert max(g - w for g, w in zip(got, want)) <= POLL


def test_a_late_chunk_holds_the_link_and_what_follows(harness):
    """A chunk whose producers finish late (chunk 9, 0.5 ms) goes on the wire then, and the chunks
    after it queue behind it: the link idles while it waits and never makes that time up."""
    per = int(64 * PITCH / RATE)
    items = [(64, 1000 + j * per // 4) for j in range(24)]
    items[9] = (64, 500_000)
    want = serial(items)
    got = run(harness, 4, items)
    assert all(g >= w for g, w in zip(got, want))
    assert got[9] >= 500_000 + per + LATENCY
    assert got[10] >= got[9] + per and got[-1] >= 500_000 + 15 * (per + 1) + LATENCY
    assert max(g - w for g, w in zip(got, want)) <= COPY + POLL  # seen late at most by one copy of its block
