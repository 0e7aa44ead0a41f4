"""The static program of the metadata kernels (include/epcc/table/meta.cuh): what a
rank's GPU needs, besides the gathered routing, to write its placed table blobs (placement.py)
for any routing -- everything compute_layout would decide that does not depend on the routing.

It is encoded from the plan's segment program (epcc.plan.segments; runtime/testing/device_tables.py
is the same arithmetic in NumPy) as one int64 array, uploaded once per Buffer:

* sets: per home rank, the token predicates the kernels evaluate for each of its tokens, in an
  order where a set comes after the sets it is made of -- SEG (a segment: its parent set and the
  rank mask its last flow applied, or every token of the home for `input`), OUT (the tokens of a
  segment with an expert on one rank: an into-output part's tokens, one row per such expert) and
  LIVE (the tokens of a segment that went on from there: the union of the LIVE sets of the
  segments made from it and of the OUT sets read out of it); a set's `bit` is its place among its
  home's sets (a token's memberships: `set_words` words of 64 bits, sized by the plan's most sets
  of one home rank), an OUT set's `out` its place among its home's OUT sets (its per-row masks);
* groups: each dispatch buffer of each rank, its SEG sets in slot order (offsets are prefix sums);
* copies: every copy of both programs (its chunking) and its parts: which set gives a part's
  tokens, where their source and destination slots come from (`srcbuf`: the buffer its source
  rows are in, the role's source buffer resolved here), and what a chunk waits for;
* tables: the copies of this rank's two blobs, with their descriptors' static fields, where their
  rows go, their producers, how many work items (below) write their rows; the roles (item and
  wait room); the drain and zero lists;
* work: the (part, token block) pairs whose rows this rank writes.

Every record is a fixed number of int64 fields, named below (the header declares the same
indices as enums, generated from these lists by the code generator, so the two cannot drift).

The kernels' shared memory is sized per bundle (`Capacity`: the generated driver defines it
before it includes meta.cuh): the set words, OUT sets, experts and top-k of the plan.
`shared_bytes` is what one block of the kernels then holds (count's: the scan's fits in it); a
plan whose capacity exceeds the target's shared memory per block is refused with the numbers
(MetaProgramError).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epcc.backends.cuda.abi import NO_FLAG, PROGRAMS, step_crc
from epcc.backends.cuda.abi import dtype as abi_dtype
from epcc.plan.model import ramp_sizes
from epcc.plan.segments import SegmentProgram

from .placement import Placement, PlacementError

MAGIC = 0x4D455043  # "CPEM"
VERSION = 4
TOKEN_BLOCK = 128  # tokens per block of the kernels: 4 x 32-bit membership words
SCAN_SERIES = 4  # sums over the token blocks a scan block does (meta.cuh kSeries: kBlock / kLanes threads)
OFFSET_BLOCKS = 3  # the scan's blocks of what needs the totals only (meta.cuh kOffsetBlocks)
SET_WORD = 64  # a token's set memberships: words of 64 bits, as many as the plan's most sets per home rank
MAX_RANKS = 64  # a rank mask fits one 64-bit word
MAX_RAMP = 64  # chunk sizes of one ramp end, at most

SET_SEG, SET_OUT, SET_LIVE = 0, 1, 2
PART_D_STAGE, PART_D_OUT, PART_C_STAGE, PART_C_OUT = 0, 1, 2, 3

# The fields of each record, in order (int64 each).
HEADER = ["magic", "version", "num_ranks", "experts", "topk", "epr", "strided", "max_tokens", "token_blocks",
          "hidden", "row_bytes", "rank", "num_sets", "num_groups", "num_copies", "num_parts", "num_contrib",
          "num_tcopies", "num_roles", "num_drain", "num_zero", "num_work", "num_prods", "num_ramp",
          "off_sets", "off_groups", "off_group_sets", "off_copies", "off_parts",
          "off_contrib", "off_tcopies", "off_roles", "off_drain", "off_zero", "off_work", "off_prods", "off_ramp",
          "blob_bytes_d", "blob_bytes_c", "num_group_sets", "sets_max",
          "items_off_d", "waits_off_d", "items_off_c", "waits_off_c", "off_set_info", "set_info_words"]
SET = ["origin", "kind", "parent", "mask", "all", "dst", "group", "bit", "out"]
# Per (home rank, bit) the set as count reads it into shared memory before the routing comes
# (meta.cuh count_prepare, SetInfo), then set_info_words words of the bits of the sets a LIVE set
# unites: one record a set, each field in place, where the set records, their parents' and the
# united sets' bits were four dependent loads (kind -1, set -1: past the home's last set).
SET_INFO = ["set", "kind", "parent_bit", "all", "mask", "dst", "out"]
GROUP = ["first", "count"]  # into group_sets
COPY = ["program", "tpc", "head", "tail", "first_part", "num_parts", "dst", "ramp_front", "ramp_front_n",
        "ramp_back", "ramp_back_n", "ramp_front_sum", "ramp_back_sum"]
PART = ["copy", "origin", "kind", "tok_set", "src_set", "dst_set", "out_rank", "srcbuf", "producer", "prod_part",
        "prod_slot", "contrib_begin", "contrib_count", "index", "tcopy"]
CONTRIB = ["copy", "part", "slot"]  # combine: a part of an earlier copy that adds into the slots a part reads
TCOPY = ["program", "copy", "role", "side", "weighted", "src_rows", "dst_rows", "weights", "rows_cap", "chunks_cap",
         "prod_begin", "prod_count", "desc_off", "dst_buf", "flag_id", "flag_rank", "step_index", "flow_index",
         "src_rank", "dst_rank", "role_rec", "desc_index", "scratch_waits", "scratch_starts", "work_items"]
ROLE = ["program", "item_begin", "item_cap", "wait_begin", "wait_stride", "first_tcopy", "num_tcopies", "desc_off",
        "step_crc"]
DRAIN = ["program", "copy", "desc_off"]
ZERO = ["buf", "group_first", "group_count", "result", "desc_off"]  # rows: the mirrored dispatch buffer's groups
WORK = ["part", "block"]

SIDES = {"sm": 0, "rdma-pack": 1, "rdma-unpack": 2}


class MetaProgramError(PlacementError):
    """The plan is beyond what the metadata kernels handle (the message says what; the host lays it out)."""


@dataclass(frozen=True)
class Capacity:
    """What the metadata kernels' shared memory is sized for (meta.cuh's EPCC_META_* macros)."""
    set_words: int  # 64-bit words of a token's set memberships: the most sets of one home rank / 64
    out_sets: int  # the most OUT sets of one home rank (each holds top-k row masks)
    experts: int
    topk: int
    home: int = 0  # a home rank with the most sets (what an error names)
    sets: int = 0  # its sets

    def macros(self) -> dict[str, int]:
        return {"EPCC_META_SET_WORDS": self.set_words, "EPCC_META_OUT_SETS": self.out_sets,
                "EPCC_META_EXPERTS": self.experts, "EPCC_META_TOPK": self.topk}

    def covers(self, need: "Capacity") -> bool:
        return all(getattr(self, f) >= getattr(need, f) for f in ("set_words", "out_sets", "experts", "topk"))


def shared_bytes(cap: Capacity) -> int:
    """sizeof(meta.cuh's Shared) at `cap` (tests/backends/test_meta_kernels.py checks it against
    the host compiler's): per set its SetInfo (a rank mask, `set_words` words of LIVE bits, six
    ints) and its block mask; per token its set bits, top-k experts (short) and rank mask; per
    expert a block mask; per OUT set top-k block masks; the block's first bad token (an int, padded
    to 8 bytes)."""
    words = TOKEN_BLOCK // 32
    sets = SET_WORD * cap.set_words
    info = 8 + 8 * cap.set_words + 6 * 4
    info += -info % 8
    total = (sets * info + TOKEN_BLOCK * 8 * cap.set_words + sets * words * 4 + cap.experts * words * 4
             + cap.out_sets * cap.topk * words * 4 + TOKEN_BLOCK * cap.topk * 2)
    total += -total % 8
    return total + TOKEN_BLOCK * 8 + 8


def check_shared(cap: Capacity, limit: int, target: str) -> None:
    """MetaProgramError, with the numbers, where `cap` needs more shared memory than `limit`."""
    need = shared_bytes(cap)
    if need > limit:
        raise MetaProgramError(
            f"the metadata kernels need {need} bytes of shared memory per block for rank {cap.home}'s "
            f"{cap.sets} token sets ({cap.set_words} x 64-bit words), {cap.out_sets} output sets of one home rank, "
            f"{cap.experts} experts and top-{cap.topk}; the {target} target allows {limit}")


@dataclass
class MetaProgram:
    array: np.ndarray  # int64
    scratch_words: int  # int64 words of device scratch the kernels need
    blob_bytes: dict[str, int]

    def capacity(self) -> Capacity:
        """What this program needs of the kernels' shared memory."""
        h = {f: int(self.array[i]) for i, f in enumerate(HEADER)}
        sets = self.array[h["off_sets"]: h["off_sets"] + h["num_sets"] * len(SET)].reshape(-1, len(SET))
        origin, kind = sets[:, SET.index("origin")], sets[:, SET.index("kind")]
        per_home = np.bincount(origin, minlength=h["num_ranks"]) if len(sets) else np.zeros(1, np.int64)
        outs = np.bincount(origin[kind == SET_OUT], minlength=1) if len(sets) else np.zeros(1, np.int64)
        home = int(np.argmax(per_home))
        return Capacity(set_words=max(1, -(-int(per_home.max()) // SET_WORD)), out_sets=max(1, int(outs.max())),
                        experts=h["experts"], topk=h["topk"], home=home, sets=int(per_home[home]))

    def grids(self) -> dict[str, int]:
        """Blocks of the metadata kernels' phases (meta.cuh phase_blocks; epcc_table_meta.cu's
        grid_count, grid_rows, grid_items, grid_scan): `count`, one per (home rank, token block);
        `rows`, one per (part, token block), the rows phase having count's more for the received
        rows; `items`, one per copy of this rank; `scan`, OFFSET_BLOCKS for the offsets and one
        per SCAN_SERIES of the sums over token blocks (two per token set, one per (home rank,
        expert))."""
        h = {f: int(self.array[i]) for i, f in enumerate(HEADER)}
        series = 2 * h["num_sets"] + h["num_ranks"] * h["experts"]
        return {"count": h["num_ranks"] * h["token_blocks"], "rows": h["num_work"], "items": h["num_tcopies"],
                "scan": OFFSET_BLOCKS + -(-series // SCAN_SERIES)}

    def phase_blocks(self) -> dict[str, int]:
        """Blocks of each phase as meta.cuh phase_blocks counts them, what meta_fused's blocks loop
        over: grids()'s, the rows phase with count's blocks again (the received rows)."""
        g = self.grids()
        return {"count": g["count"], "scan": g["scan"], "rows": g["rows"] + g["count"], "items": g["items"]}

    def busy_blocks(self, grid: int) -> dict[str, tuple[int, int]]:
        """Per phase, the blocks of meta_fused's `grid` with work in it, (first, n): blocks first ..
        first + n - 1, modulo the grid (all of them where n >= grid).  Each phase starts at block 0
        but the scan, which starts after the count blocks where the grid has room beyond them
        (meta.cuh phase_first says the same)."""
        blocks = self.phase_blocks()
        shift = blocks["count"] if blocks["count"] < grid else 0
        return {phase: (shift if phase == "scan" else 0, n) for phase, n in blocks.items()}


def _put(rows: list[list[int]], fields: list[str], rec: dict) -> int:
    missing = set(fields) - set(rec)
    if missing:
        raise ValueError(f"record misses {sorted(missing)}")
    rows.append([int(rec[f]) for f in fields])
    return len(rows) - 1


def _s64(mask: int) -> int:
    """A 64-bit mask as the int64 with the same bits."""
    return mask - (1 << 64) if mask >= 1 << 63 else mask


def encode(manifest: dict, placement: str, prog: SegmentProgram, placements: dict[str, Placement], rank: int,
           max_tokens: int) -> MetaProgram:
    """The metadata program of `rank` (placements: its placed blob of each program; placement: the
    workload's expert placement, blocked or strided)."""
    R = prog.num_ranks
    wl = manifest["workload"]
    if R > MAX_RANKS:
        raise MetaProgramError(f"{R} ranks: the metadata kernels handle at most {MAX_RANKS}")
    seg_set: dict[int, int] = {}
    sets: list[list[int]] = []
    per_origin: dict[int, int] = {h: 0 for h in range(R)}
    outs_of: dict[int, int] = {h: 0 for h in range(R)}
    unites: dict[int, list[int]] = {}  # a LIVE set: the sets it unites

    def new_set(origin: int, kind: int, parent: int = -1, mask: int = 0, every: int = 0, dst: int = -1,
                group: int = -1) -> int:
        bit = per_origin[origin]
        per_origin[origin] += 1
        out = -1
        if kind == SET_OUT:
            out = outs_of[origin]
            outs_of[origin] += 1
        return _put(sets, SET, dict(origin=origin, kind=kind, parent=parent, mask=_s64(mask), all=every, dst=dst,
                                    group=group, bit=bit, out=out))

    groups: list[list[int]] = []
    group_sets: list[int] = []
    group_of: dict[tuple[str, int], int] = {}
    for key, sids in sorted(prog.buffers.items(), key=lambda kv: kv[1][0]):
        group_of[key] = len(groups)
        groups.append([0, 0])
    for s in prog.segments:
        every = 1 if not s.masks or s.parent < 0 else 0
        mask = 0 if s.parent < 0 else (s.masks[-1] if len(s.masks) > len(prog.segments[s.parent].masks) else 0)
        if s.parent >= 0 and len(s.masks) == len(prog.segments[s.parent].masks):
            every = 1  # a flow with no selection: every token of the parent
        seg_set[s.id] = new_set(s.origin, SET_SEG, seg_set[s.parent] if s.parent >= 0 else -1, mask, every,
                                group=group_of[(s.buffer, s.rank)])
    for key, sids in prog.buffers.items():
        g = group_of[key]
        groups[g] = [len(group_sets), len(sids)]
        group_sets.extend(seg_set[s] for s in sids)
    # OUT sets: one per (source segment, destination rank) an into-output part reads
    out_set: dict[tuple[int, int], int] = {}
    for c in prog.dispatch:
        if c.into_output:
            for p in c.parts:
                if (p.src, c.dst) not in out_set:
                    s = prog.segments[p.src]
                    out_set[(p.src, c.dst)] = new_set(s.origin, SET_OUT, seg_set[p.src], dst=c.dst)
    # LIVE sets, children first (segments are numbered parents first)
    readers: dict[int, list] = {}
    for c in prog.dispatch:
        for p in c.parts:
            readers.setdefault(p.src, []).append((c, p))
    live_set: dict[int, int] = {}
    for s in reversed(prog.segments):
        members = []
        for c, p in readers.get(s.id, []):
            members.append(live_set[p.dst] if p.dst >= 0 else out_set[(p.src, c.dst)])
        i = new_set(s.origin, SET_LIVE, seg_set[s.id])
        unites[i] = members
        live_set[s.id] = i
    sets_max = max(per_origin.values(), default=0)
    set_info_words = max(1, -(-sets_max // SET_WORD))
    past_last = dict(set=-1, kind=-1, parent_bit=-1, all=0, mask=0, dst=-1, out=-1)  # a home's bits past its sets
    set_info = [[past_last[f] for f in SET_INFO] + [0] * set_info_words for _ in range(R * sets_max)]
    for si, row in enumerate(sets):  # each set at (its home rank, its bit)
        st = dict(zip(SET, row))
        words = [0] * set_info_words
        for m in unites.get(si, []):  # a LIVE set's
            bit = sets[m][SET.index("bit")]
            words[bit // SET_WORD] |= 1 << (bit % SET_WORD)
        parent_bit = sets[st["parent"]][SET.index("bit")] if st["parent"] >= 0 else -1
        info = dict(st, set=si, parent_bit=parent_bit)
        set_info[st["origin"] * sets_max + st["bit"]] = [info[f] for f in SET_INFO] + [_s64(w) for w in words]

    # copies and parts
    copies: list[list[int]] = []
    parts: list[list[int]] = []
    contrib: list[list[int]] = []
    ramp: list[int] = []
    part_of: dict[tuple[int, int], int] = {}  # (copy, index within it) -> part id
    # the part of the writer that created each segment (producers of dispatch waits)
    creator: dict[int, tuple[int, int]] = {}
    for c in prog.dispatch:
        for i, p in enumerate(c.parts):
            if p.dst >= 0:
                creator[p.dst] = (c.id, i)
    seg_read: dict[int, int] = {}  # combine staging part -> the segment whose slots it reads
    adds_into: dict[int, list[int]] = {}  # segment -> combine parts whose rows add into its slots
    copy_meta = {c.id: c for c in (*prog.dispatch, *prog.combine)}
    tables = {program: placements[program] for program in placements}
    producers_of: dict[tuple[str, int], list[int]] = {}
    for program, pl in tables.items():
        for pc in pl.copies:
            if pc.side != "rdma-unpack":  # a landing chunk waits for its signal, not for producers
                producers_of[(program, pc.copy)] = pc.producers

    def ramp_lists(tpc, head, tail):
        if not tpc:
            return [], []
        return ramp_sizes(tpc, head), ramp_sizes(tpc, tail)[::-1]

    for cid in sorted(copy_meta):
        c = copy_meta[cid]
        program = "dispatch" if cid < len(prog.dispatch) else "combine"
        front, back = ramp_lists(c.tpc, c.ramp_head, c.ramp_tail)
        if len(front) > MAX_RAMP or len(back) > MAX_RAMP:
            raise MetaProgramError(f"{program} step '{c.step}': its ramped ends are {len(front)} and {len(back)} "
                                   f"chunks, the metadata kernels take at most {MAX_RAMP} at each end (give it a "
                                   f"smaller `ramp`)")
        rec = dict(program=PROGRAMS.index(program), tpc=c.tpc or 0, head=c.ramp_head, tail=c.ramp_tail,
                   first_part=len(parts), num_parts=0, dst=c.dst, ramp_front=len(ramp), ramp_front_n=len(front),
                   ramp_back=len(ramp) + len(front), ramp_back_n=len(back), ramp_front_sum=sum(front),
                   ramp_back_sum=sum(back))
        ramp.extend(front + back)
        n = 0
        if program == "dispatch":
            for i, p in enumerate(c.parts):
                s = prog.segments[p.src]
                wr = s.writer
                prods = producers_of.get(("dispatch", cid), [])
                kind = PART_D_OUT if p.dst < 0 else PART_D_STAGE
                pp = dict(copy=cid, origin=s.origin, kind=kind,
                          tok_set=out_set[(p.src, c.dst)] if p.dst < 0 else seg_set[p.dst],
                          src_set=seg_set[p.src], dst_set=seg_set[p.dst] if p.dst >= 0 else -1,
                          out_rank=c.dst, srcbuf=p.src_buffer, producer=wr,
                          prod_part=part_of_creator(creator, p.src), prod_slot=prods.index(wr) if wr in prods else -1,
                          contrib_begin=0, contrib_count=0, index=i, tcopy=-1)
                part_of[(cid, i)] = _put(parts, PART, pp)
                n += 1
        else:
            i = 0
            for did in c.pool:
                d = prog.dispatch[did]
                for p in d.parts:
                    if p.src_buffer != c.src_buffer:
                        continue
                    s = prog.segments[p.src]
                    kind = PART_C_OUT if d.into_output else PART_C_STAGE
                    pp = dict(copy=cid, origin=s.origin, kind=kind,
                              tok_set=out_set[(p.src, d.dst)] if d.into_output else live_set[p.dst],
                              src_set=-1 if d.into_output else seg_set[p.dst], dst_set=seg_set[p.src],
                              out_rank=d.dst, srcbuf=0, producer=-1, prod_part=-1, prod_slot=-1,
                              contrib_begin=0, contrib_count=0, index=i, tcopy=-1)
                    part_of[(cid, i)] = _put(parts, PART, pp)
                    seg_read[part_of[(cid, i)]] = p.dst  # the dispatch segment whose slots the part reads
                    adds_into.setdefault(p.src, []).append(part_of[(cid, i)])
                    i += 1
                    n += 1
        rec["num_parts"] = n
        _put(copies, COPY, rec)
    # combine contributors: a combine part reading segment d waits for the parts of earlier
    # combine copies whose rows add into d's slots (they reverse dispatch parts reading d)
    for pid, seg in seg_read.items():
        row = parts[pid]
        cc = copy_meta[row[PART.index("copy")]]
        if ("combine", cc.id) not in producers_of:  # not in this rank's tables, or landing here: no waits
            continue
        prods = producers_of[("combine", cc.id)]
        row[PART.index("contrib_begin")] = len(contrib)
        for q in adds_into.get(seg, []):
            c2 = copy_meta[parts[q][PART.index("copy")]]
            if c2.dst_buffer == cc.src_buffer_name and c2.dst == cc.src and c2.step_index < cc.step_index:
                if c2.id not in prods:
                    raise MetaProgramError(f"combine copy {cc.id}: contributor {c2.id} is not among its producers")
                contrib.append([c2.id, q, prods.index(c2.id)])
        row[PART.index("contrib_count")] = len(contrib) - row[PART.index("contrib_begin")]
    # this rank's tables
    tcopies: list[list[int]] = []
    roles: list[list[int]] = []
    drain: list[list[int]] = []
    zero: list[list[int]] = []
    prods: list[int] = []
    scratch = 0
    bufs = {program: {b["name"]: i for i, b in enumerate(manifest["buffers"][program])} for program in PROGRAMS}
    kernels = {k["program"]: k for k in manifest["kernels"] if k["kind"] == "main"}
    for program, pl in tables.items():
        kernel = kernels[program]
        for ri, (pr, role) in enumerate(zip(pl.roles, kernel["roles"])):
            first = len(tcopies)
            for pc in pr.copies:
                c = copy_meta[pc.copy]
                lut = [bufs[program][b] for b in (role.get("src_buffers") or [])]
                no_flag = pr.side == "rdma-pack"
                t = dict(program=PROGRAMS.index(program), copy=pc.copy, role=ri, side=SIDES[pr.side],
                         weighted=int(pc.weighted), src_rows=pc.src_rows, dst_rows=pc.dst_rows, weights=pc.weights,
                         rows_cap=pc.rows_cap, chunks_cap=pc.chunks_cap, prod_begin=len(prods),
                         prod_count=len(pc.producers),
                         desc_off=pl.offsets["copies"] + pc.index * abi_dtype("CopyDesc").itemsize,
                         dst_buf=bufs[program][c.dst_buffer], flag_id=NO_FLAG if no_flag else pc.copy,
                         flag_rank=0 if no_flag else c.dst, step_index=c.step_index, flow_index=c.flow_index,
                         src_rank=c.src, dst_rank=c.dst, role_rec=len(roles), desc_index=pc.index,
                         scratch_waits=scratch, scratch_starts=scratch + pc.chunks_cap * max(len(pc.producers), 1),
                         work_items=0)
                scratch += pc.chunks_cap * max(len(pc.producers), 1) + pc.chunks_cap + 1
                prods.extend(pc.producers)
                ti = _put(tcopies, TCOPY, t)
                for k in range(copies[pc.copy][COPY.index("num_parts")]):
                    part = parts[copies[pc.copy][COPY.index("first_part")] + k]
                    if part[PART.index("tcopy")] == -1:
                        part[PART.index("tcopy")] = ti
                        # the role's source buffer the part reads (its index there; none: buffer 0)
                        i = part[PART.index("srcbuf")]
                        part[PART.index("srcbuf")] = lut[i] if i < len(lut) else 0
            _put(roles, ROLE, dict(program=PROGRAMS.index(program), item_begin=pr.item_begin, item_cap=pr.item_cap,
                                   wait_begin=pr.wait_begin, wait_stride=pr.wait_stride, first_tcopy=first,
                                   num_tcopies=len(pr.copies),
                                   desc_off=pl.offsets["roles"] + ri * abi_dtype("RoleDesc").itemsize,
                                   step_crc=step_crc(pr.step)))
        for i, fid in enumerate(pl.drain):
            _put(drain, DRAIN, dict(program=PROGRAMS.index(program), copy=fid,
                                    desc_off=pl.offsets["drain"] + i * abi_dtype("DrainDesc").itemsize))
        for i, (b, name) in enumerate(pl.zero):
            mirror = prog.partial_of.get(name, name)
            g = group_of.get((mirror, rank))
            first, count = (groups[g] if g is not None else (0, 0))
            _put(zero, ZERO, dict(buf=b, group_first=first, group_count=count, result=int(name == "result"),
                                  desc_off=pl.offsets["zero"] + i * abi_dtype("ZeroDesc").itemsize))
    token_blocks = -(-max_tokens // TOKEN_BLOCK)
    work = [[pid, b] for pid, row in enumerate(parts) if row[PART.index("tcopy")] >= 0
            for b in range(token_blocks)]
    for pid, _ in work:  # each table copy's rows work items (meta_fused's items block waits for them)
        tcopies[parts[pid][PART.index("tcopy")]][TCOPY.index("work_items")] += 1
    sections = [("sets", sets, len(SET)),
                ("groups", groups, len(GROUP)), ("group_sets", [[x] for x in group_sets], 1),
                ("copies", copies, len(COPY)), ("parts", parts, len(PART)), ("contrib", contrib, len(CONTRIB)),
                ("tcopies", tcopies, len(TCOPY)), ("roles", roles, len(ROLE)), ("drain", drain, len(DRAIN)),
                ("zero", zero, len(ZERO)), ("work", work, len(WORK)), ("prods", [[x] for x in prods], 1),
                ("ramp", [[x] for x in ramp], 1), ("set_info", set_info, len(SET_INFO) + set_info_words)]
    head = dict(magic=MAGIC, version=VERSION,
                items_off_d=placements["dispatch"].offsets["items"] if "dispatch" in placements else 0,
                waits_off_d=placements["dispatch"].offsets["waits"] if "dispatch" in placements else 0,
                items_off_c=placements["combine"].offsets["items"] if "combine" in placements else 0,
                waits_off_c=placements["combine"].offsets["waits"] if "combine" in placements else 0,
                num_ranks=R, experts=int(wl["experts"]), topk=int(wl["topk"]),
                epr=int(wl["experts"]) // R, strided=int(placement == "strided"),
                max_tokens=max_tokens, token_blocks=token_blocks, hidden=int(wl["hidden"]),
                row_bytes=int(wl["row_bytes"]), rank=rank, num_sets=len(sets), num_groups=len(groups),
                num_copies=len(copies), num_parts=len(parts), num_contrib=len(contrib), num_tcopies=len(tcopies),
                num_roles=len(roles), num_drain=len(drain), num_zero=len(zero), num_work=len(work),
                num_prods=len(prods), num_ramp=len(ramp),
                blob_bytes_d=placements["dispatch"].total_bytes if "dispatch" in placements else 0,
                blob_bytes_c=placements["combine"].total_bytes if "combine" in placements else 0,
                num_group_sets=len(group_sets), sets_max=sets_max,
                set_info_words=set_info_words)
    off = len(HEADER)
    body: list[int] = []
    for name, rows, width in sections:
        head[f"off_{name}"] = off + len(body)
        for r in rows:
            if len(r) != width:
                raise ValueError(f"{name}: a record of {len(r)} fields, {width} expected")
            body.extend(int(x) for x in r)
    arr = np.array([head[f] for f in HEADER] + body, dtype=np.int64)
    return MetaProgram(arr, scratch, {p: pl.total_bytes for p, pl in placements.items()})


def part_of_creator(creator: dict[int, tuple[int, int]], seg: int) -> int:
    """The index, within its writer, of the part that created segment `seg` (-1: input)."""
    return creator[seg][1] if seg in creator else -1
