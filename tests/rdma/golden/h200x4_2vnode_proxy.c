/*
 * h200x4_2vnode_proxy.c - the RDMA proxy loop of schedule 'h200x4_2vnode' (4 ranks).
 * Emitted by epcc (backends/rdma, template epcc_proxy.c.j2); do not edit: re-run the compiler.
 *
 * RDMA steps of this plan (kernel role of kind 'proxy'; chunk size and queue depth from the
 * plan's chunk-pipeline pass, overridable at run time through the role descriptors):
 *   [0] dispatch.rdma  DSL line 95: RDMA once per target vnode to the same-index GPU
 *       link 'rdma' (rdma), 50 GB/s, latency 5 us;
 *       921600 bytes per post, queue depth 8; receiver: copy each landed row to its destination row (memcpy)
 *   [1] combine.rdma  DSL line 95: RDMA once per target vnode to the same-index GPU
 *       link 'rdma' (rdma), 50 GB/s, latency 5 us;
 *       1835008 bytes per post, queue depth 8; receiver: accumulate each landed partial into its destination (atomic float add); the fp32 partial travels as bf16 (rounded to nearest even by the sender), half the bytes, as on the GPU path
 *
 * Threads (docs/rdma.md): one producer per sending role (packs a chunk's rows into a send slot
 * once the chunk's producers are done, pushes a trigger into the role's FIFO), one proxy per
 * process (pops triggers, posts one write-with-immediate per chunk, polls completions, returns
 * FIFO credits, serves flush requests) and one receiver per process (applies landed chunks in
 * order, bumps the per-chunk flags, returns credits to the sender).  Every wait is bounded.
 */
#include "epcc_proxy.h"
#include "epcc_transport.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>

#define EPCC_RDMA_NUM_STEPS 2
#define EPCC_RDMA_CTX_DATA (1ull << 63)
#define EPCC_RDMA_POLL_BATCH 64

/* struct epcc_rdma_send_copy: one Copy of an RDMA step this rank sends (it holds the source rows) */
typedef struct {
    uint64_t n_chunks;
    uint64_t chunk_starts; /* int64 [n_chunks + 1]: the chunk's rows */
    uint64_t src_rows; /* u64 [rows]: the address of every source row */
    uint64_t wait_starts; /* int64 [n_chunks + 1]: chunk c waits for [wait_starts[c], wait_starts[c + 1]) */
    uint64_t wait_flags; /* u64 [waits]: flag addresses */
    uint64_t wait_values; /* int64 [waits] */
    uint64_t wait_names; /* const char * [waits]: flag names for the messages */
    uint64_t chan; /* index into the engine's send channels */
    uint64_t chunk_seq; /* int64 [n_chunks]: each chunk's sequence number on its channel */
} epcc_rdma_send_copy;

/* struct epcc_rdma_send_role: one RDMA role this rank runs as sender: a FIFO and its send slots */
typedef struct {
    uint64_t step; /* index into epcc_rdma_steps */
    uint64_t n_copies;
    uint64_t copies; /* epcc_rdma_send_copy [n_copies] */
    uint64_t max_chunks;
    uint64_t depth; /* FIFO entries = send slots */
    uint64_t slot_bytes;
    uint64_t src_row_bytes;
    uint64_t send_buf; /* depth x slot_bytes, registered */
    uint64_t mr; /* epcc_tp_mr of send_buf */
} epcc_rdma_send_role;

/* struct epcc_rdma_send_chan: a (step, this rank -> peer) channel: the peer's landing ring */
typedef struct {
    uint64_t peer;
    uint64_t remote_addr; /* landing ring base, as the peer's registration gave it */
    uint64_t remote_key;
    uint64_t slot_bytes; /* landing slot size */
    uint64_t depth; /* landing slots */
    uint64_t n_chunks;
    uint64_t imm_chan; /* the channel's index at the receiver, carried in the immediate */
    uint64_t credit; /* u64 the receiver writes: chunks it consumed (registered, remote-writable) */
    uint64_t credit_name; /* const char *, for the messages */
    uint64_t signal_addr; /* GPU path: the receiver's landing signal words (one per slot), as registered */
    uint64_t signal_key;
    uint64_t link; /* the transport link its chunks are posted on (the link class of its step; 0: one link) */
} epcc_rdma_send_chan;

/* struct epcc_rdma_recv_chan: a (step, peer -> this rank) channel: the landing ring and what each chunk does */
typedef struct {
    uint64_t peer;
    uint64_t step; /* index into epcc_rdma_steps */
    uint64_t n_chunks;
    uint64_t landing; /* depth x slot_bytes, registered remote-writable */
    uint64_t slot_bytes;
    uint64_t depth;
    uint64_t row_len; /* bytes (copy) or elements (accumulate) of a destination row */
    uint64_t src_row_bytes; /* bytes of a landed row */
    uint64_t chunk_rows; /* int64 [n_chunks + 1]: rows of chunk q (in sequence order) */
    uint64_t dst_rows; /* u64 [rows]: destination row addresses */
    uint64_t weights; /* float [rows] (weighted combine) or null */
    uint64_t chunk_flags; /* u64 [n_chunks]: the flag each chunk bumps */
    uint64_t credit_raddr; /* the sender's credit word */
    uint64_t credit_rkey;
    uint64_t credit_src; /* u64 this rank writes the credit from (registered) */
    uint64_t credit_mr;
    uint64_t name; /* const char *, for the messages */
    uint64_t consumed; /* GPU path: u64 the receiving kernel writes (launch << 32 | chunks consumed), host-mapped */
    uint64_t link; /* the transport link its credits go back on (the link class of its step; 0: one link) */
} epcc_rdma_recv_chan;

/* struct epcc_rdma_engine: one process's proxy engine */
typedef struct {
    uint64_t tp; /* epcc_tp * */
    uint64_t rank_desc; /* const char *, e.g. "rank 2 (vnode 1, gpu 0)" */
    uint64_t timeout_ns;
    uint64_t abort; /* u64 shared with the kernels' roles: set on a timeout */
    uint64_t stop; /* u64 the host sets once every rank is done */
    uint64_t n_roles;
    uint64_t roles;
    uint64_t n_send_chans;
    uint64_t send_chans;
    uint64_t n_recv_chans;
    uint64_t recv_chans;
    uint64_t err; /* char [errlen]: the first failure */
    uint64_t errlen;
    uint64_t status;
    uint64_t state; /* epcc_rdma_state *, set by epcc_rdma_engine_init */
    uint64_t gpu_fifos; /* GPU path: epcc_rdma_fifo [n_roles] in host-pinned memory, pushed by kernels; 0: CPU path */
} epcc_rdma_engine;

typedef void (*epcc_rdma_apply_fn)(const epcc_rdma_recv_chan *c, uint64_t row_lo, uint64_t row_hi, const uint8_t *slot);

typedef struct {
    const char *program, *step;
    int line;
    uint64_t chunk_bytes, depth; /* the plan's */
    epcc_rdma_apply_fn apply;
    uint32_t wire_shift; /* a row on the wire is src_row_bytes >> wire_shift bytes (1: fp32 packed as bf16) */
} epcc_rdma_step_info;

/* dispatch.rdma (DSL line 95): copy each landed row to its destination row (memcpy). */
static void epcc_rdma_apply_dispatch__rdma(const epcc_rdma_recv_chan *c, uint64_t row_lo, uint64_t row_hi, const uint8_t *slot) {
    const uint64_t *dst_rows = (const uint64_t *)(uintptr_t)c->dst_rows;
    for (uint64_t k = row_lo; k < row_hi; k++) {
        const uint8_t *src = slot + (k - row_lo) * c->src_row_bytes;
        memcpy((void *)(uintptr_t)dst_rows[k], src, c->row_len);
    }
}

/* combine.rdma (DSL line 95): accumulate each landed partial into its destination (atomic float add); the fp32 partial travels as bf16 (rounded to nearest even by the sender), half the bytes, as on the GPU path. */
static void epcc_rdma_apply_combine__rdma(const epcc_rdma_recv_chan *c, uint64_t row_lo, uint64_t row_hi, const uint8_t *slot) {
    const uint64_t *dst_rows = (const uint64_t *)(uintptr_t)c->dst_rows;
    for (uint64_t k = row_lo; k < row_hi; k++) {
        const uint8_t *src = slot + (k - row_lo) * c->src_row_bytes;
        epcc_rdma_acc_bf16((float *)(uintptr_t)dst_rows[k], (const uint16_t *)(const void *)src, 1.0f, c->row_len);
    }
}

static const epcc_rdma_step_info epcc_rdma_steps[EPCC_RDMA_NUM_STEPS] = {
    {"dispatch", "rdma", 95, 921600u, 8u, epcc_rdma_apply_dispatch__rdma, 0u},
    {"combine", "rdma", 95, 1835008u, 8u, epcc_rdma_apply_combine__rdma, 1u},
};

/* ---- engine state (allocated by epcc_rdma_engine_init) ---------------------------------- */
typedef struct {
    epcc_rdma_fifo *fifos;      /* [n_roles] */
    epcc_rdma_tracker *trackers; /* [n_recv_chans] */
    _Atomic uint64_t *credit_inflight; /* [n_recv_chans] */
    uint64_t *credit_sent;      /* [n_recv_chans] */
    uint32_t *arrivals;         /* SPSC ring: proxy -> receiver */
    uint64_t arrivals_cap;
    _Atomic uint64_t arr_head, arr_tail;
    _Atomic uint64_t failed;    /* first failure recorded */
    _Atomic uint64_t posted, applied;
    /* The proxy's backlog: chunk entries taken, over the passes that found at least one.  More than
     * one per pass means the producers pushed chunks faster than this thread posted them. */
    _Atomic uint64_t drained, passes;
} epcc_rdma_state;

static epcc_rdma_state *state_of(epcc_rdma_engine *e) { return (epcc_rdma_state *)(uintptr_t)e->state; }

/* Record the first failure (its message wins) and tell every other role of the run to stop. */
static int fail(epcc_rdma_engine *e, int status, const char *msg) {
    epcc_rdma_state *s = state_of(e);
    uint64_t zero = 0;
    if (atomic_compare_exchange_strong(&s->failed, &zero, 1)) {
        snprintf((char *)(uintptr_t)e->err, e->errlen, "%s", msg);
        e->status = (uint64_t)status;
    }
    if (status == EPCC_RDMA_TIMEOUT || status == EPCC_RDMA_FAILED)
        atomic_store_explicit((_Atomic uint64_t *)(uintptr_t)e->abort, 1, memory_order_release);
    return status;
}

static int fail_wait(epcc_rdma_engine *e, int st, const char *step, const char *flag, uint64_t value,
                     uint64_t expected) {
    char msg[512];
    if (st == EPCC_RDMA_ABORTED) {
        snprintf(msg, sizeof msg, "epcc: %s step '%s' gave up on '%s' (value %llu, waiting for >= %llu): another role "
                 "of the run failed", (const char *)(uintptr_t)e->rank_desc, step, flag, (unsigned long long)value,
                 (unsigned long long)expected);
    } else {
        epcc_rdma_format_timeout(msg, sizeof msg, e->timeout_ns, (const char *)(uintptr_t)e->rank_desc, step, flag,
                                 value, expected);
    }
    return fail(e, st, msg);
}

static int fail_tp(epcc_rdma_engine *e, const char *step, const char *what) {
    char msg[768];
    snprintf(msg, sizeof msg, "epcc: %s step '%s': %s: %s", (const char *)(uintptr_t)e->rank_desc, step, what,
             epcc_tp_error((epcc_tp *)(uintptr_t)e->tp));
    return fail(e, EPCC_RDMA_FAILED, msg);
}

static int aborted(const epcc_rdma_engine *e) {
    return atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)e->abort, memory_order_relaxed) != 0;
}

int epcc_rdma_engine_init(epcc_rdma_engine *e) {
    epcc_rdma_state *s = (epcc_rdma_state *)calloc(1, sizeof *s);
    if (!s) return -1;
    e->state = (uint64_t)(uintptr_t)s;
    s->fifos = (epcc_rdma_fifo *)calloc(e->n_roles ? e->n_roles : 1, sizeof *s->fifos);
    s->trackers = (epcc_rdma_tracker *)calloc(e->n_recv_chans ? e->n_recv_chans : 1, sizeof *s->trackers);
    s->credit_inflight = (_Atomic uint64_t *)calloc(e->n_recv_chans ? e->n_recv_chans : 1, sizeof(uint64_t));
    s->credit_sent = (uint64_t *)calloc(e->n_recv_chans ? e->n_recv_chans : 1, sizeof(uint64_t));
    uint64_t need = 1;
    const epcc_rdma_send_role *roles = (const epcc_rdma_send_role *)(uintptr_t)e->roles;
    const epcc_rdma_recv_chan *rc = (const epcc_rdma_recv_chan *)(uintptr_t)e->recv_chans;
    for (uint64_t i = 0; i < e->n_recv_chans; i++) need += rc[i].depth;
    s->arrivals_cap = 1;
    while (s->arrivals_cap < need) s->arrivals_cap <<= 1;
    s->arrivals = (uint32_t *)calloc(s->arrivals_cap, sizeof *s->arrivals);
    if (!s->fifos || !s->trackers || !s->credit_inflight || !s->credit_sent || !s->arrivals) return -1;
    if (e->gpu_fifos) { /* GPU path: the FIFOs live in host-pinned memory the kernels push into */
        free(s->fifos);
        s->fifos = (epcc_rdma_fifo *)(uintptr_t)e->gpu_fifos;
        for (uint64_t i = 0; i < e->n_roles; i++)
            if (s->fifos[i].depth != roles[i].depth || epcc_rdma_fifo_attach(&s->fifos[i])) return -1;
    } else {
        for (uint64_t i = 0; i < e->n_roles; i++)
            if (epcc_rdma_fifo_init(&s->fifos[i], roles[i].depth)) return -1;
    }
    for (uint64_t i = 0; i < e->n_recv_chans; i++)
        if (epcc_rdma_tracker_init(&s->trackers[i], rc[i].depth, rc[i].n_chunks)) return -1;
    return 0;
}

void epcc_rdma_engine_fini(epcc_rdma_engine *e) {
    epcc_rdma_state *s = state_of(e);
    if (!s) return;
    for (uint64_t i = 0; s->fifos && i < e->n_roles; i++) epcc_rdma_fifo_free(&s->fifos[i]);
    for (uint64_t i = 0; s->trackers && i < e->n_recv_chans; i++) epcc_rdma_tracker_free(&s->trackers[i]);
    if (!e->gpu_fifos) free(s->fifos);
    free(s->trackers);
    free((void *)s->credit_inflight);
    free(s->credit_sent);
    free(s->arrivals);
    free(s);
    e->state = 0;
}

uint64_t epcc_rdma_engine_posted(epcc_rdma_engine *e) { return atomic_load(&state_of(e)->posted); }
uint64_t epcc_rdma_engine_applied(epcc_rdma_engine *e) { return atomic_load(&state_of(e)->applied); }
uint64_t epcc_rdma_engine_drained(epcc_rdma_engine *e) { return atomic_load(&state_of(e)->drained); }
uint64_t epcc_rdma_engine_passes(epcc_rdma_engine *e) { return atomic_load(&state_of(e)->passes); }

/* One pass over a FIFO took `n` chunk entries. */
static void count_pass(epcc_rdma_state *s, uint64_t n) {
    if (!n) return;
    atomic_fetch_add_explicit(&s->drained, n, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->passes, 1, memory_order_relaxed);
}

/* ---- producer: one per sending role ------------------------------------------------------ */
int epcc_rdma_produce(epcc_rdma_engine *e, uint64_t role_index) {
    epcc_rdma_state *s = state_of(e);
    const epcc_rdma_send_role *role = &((const epcc_rdma_send_role *)(uintptr_t)e->roles)[role_index];
    const epcc_rdma_step_info *si = &epcc_rdma_steps[role->step];
    const epcc_rdma_send_copy *copies = (const epcc_rdma_send_copy *)(uintptr_t)role->copies;
    const epcc_rdma_send_chan *chans = (const epcc_rdma_send_chan *)(uintptr_t)e->send_chans;
    epcc_rdma_fifo *f = &s->fifos[role_index];
    const _Atomic uint64_t *ab = (const _Atomic uint64_t *)(uintptr_t)e->abort;
    uint8_t *send_buf = (uint8_t *)(uintptr_t)role->send_buf;
    char name[256];
    uint64_t seen;
    /* Chunk-major over the role's copies, as the kernels' roles run them. */
    for (uint64_t r = 0; r < role->max_chunks; r++) {
        for (uint64_t i = 0; i < role->n_copies; i++) {
            const epcc_rdma_send_copy *c = &copies[i];
            if (r >= c->n_chunks) continue;
            const int64_t *ws = (const int64_t *)(uintptr_t)c->wait_starts;
            for (int64_t w = ws[r]; w < ws[r + 1]; w++) {
                const _Atomic uint64_t *flag = (const _Atomic uint64_t *)(uintptr_t)((const uint64_t *)(uintptr_t)c->wait_flags)[w];
                uint64_t want = (uint64_t)((const int64_t *)(uintptr_t)c->wait_values)[w];
                int st = epcc_rdma_wait_ge(flag, want, e->timeout_ns, ab, &seen);
                if (st) {
                    const char *const *names = (const char *const *)(uintptr_t)c->wait_names;
                    return fail_wait(e, st, si->step, names[w], seen, want);
                }
            }
            /* A free send slot (FIFO credit): the write of the entry `depth` back completed. */
            uint64_t tail = atomic_load(&f->tail);
            if (!epcc_rdma_fifo_can_push(f)) {
                int st = epcc_rdma_wait_ge(&f->retired, tail - f->depth + 1, e->timeout_ns, ab, &seen);
                if (st) {
                    snprintf(name, sizeof name, "%s.%s.fifo.retired", si->program, si->step);
                    return fail_wait(e, st, si->step, name, seen, tail - f->depth + 1);
                }
            }
            const int64_t *cs = (const int64_t *)(uintptr_t)c->chunk_starts;
            const uint64_t *rows = (const uint64_t *)(uintptr_t)c->src_rows;
            uint8_t *slot = send_buf + (tail % f->depth) * role->slot_bytes;
            const uint64_t wire_row = role->src_row_bytes >> si->wire_shift;
            uint64_t bytes = (uint64_t)(cs[r + 1] - cs[r]) * wire_row;
            if (bytes > role->slot_bytes || bytes > chans[c->chan].slot_bytes) {
                char msg[256];
                snprintf(msg, sizeof msg, "epcc: %s step '%s': chunk %llu holds %llu bytes, more than a send or landing "
                         "slot (%llu)", (const char *)(uintptr_t)e->rank_desc, si->step, (unsigned long long)r,
                         (unsigned long long)bytes, (unsigned long long)role->slot_bytes);
                return fail(e, EPCC_RDMA_FAILED, msg);
            }
            for (int64_t k = cs[r]; k < cs[r + 1]; k++) {
                uint8_t *to = slot + (uint64_t)(k - cs[r]) * wire_row;
                if (si->wire_shift)
                    epcc_rdma_pack_f32_bf16((uint16_t *)(void *)to, (const float *)(uintptr_t)rows[k],
                                            role->src_row_bytes / 4);
                else
                    memcpy(to, (const void *)(uintptr_t)rows[k], role->src_row_bytes);
            }
            epcc_rdma_fifo_push(f, EPCC_RDMA_ENTRY_DATA, c->chan, (uint64_t)((const int64_t *)(uintptr_t)c->chunk_seq)[r],
                                bytes);
        }
    }
    /* Flush: every write of this role has completed locally. */
    uint64_t tail = atomic_load(&f->tail);
    if (!epcc_rdma_fifo_can_push(f)) {
        int st = epcc_rdma_wait_ge(&f->retired, tail - f->depth + 1, e->timeout_ns, ab, &seen);
        if (st) {
            snprintf(name, sizeof name, "%s.%s.fifo.retired", si->program, si->step);
            return fail_wait(e, st, si->step, name, seen, tail - f->depth + 1);
        }
    }
    uint64_t idx = epcc_rdma_fifo_push(f, EPCC_RDMA_ENTRY_FLUSH, 0, 0, 0);
    int st = epcc_rdma_wait_ge(&f->flushed, idx + 1, e->timeout_ns, ab, &seen);
    if (st) {
        snprintf(name, sizeof name, "%s.%s.fifo.flushed", si->program, si->step);
        return fail_wait(e, st, si->step, name, seen, idx + 1);
    }
    return EPCC_RDMA_OK;
}

/* ---- proxy: one per process -------------------------------------------------------------- */
static int route(epcc_rdma_engine *e, const epcc_tp_event *ev) {
    epcc_rdma_state *s = state_of(e);
    if (ev->kind == EPCC_TP_EV_LOCAL) {
        if (ev->ctx & EPCC_RDMA_CTX_DATA) {
            uint64_t role = (ev->ctx >> 32) & 0x7fffffffu, index = ev->ctx & 0xffffffffu;
            if (role >= e->n_roles || epcc_rdma_fifo_complete(&s->fifos[role], index))
                return fail(e, EPCC_RDMA_FAILED, "epcc rdma proxy: a completion for no outstanding write");
        } else if (ev->ctx < e->n_recv_chans) {
            atomic_store_explicit(&s->credit_inflight[ev->ctx], 0, memory_order_release);
        }
        return 0;
    }
    if (ev->kind == EPCC_TP_EV_REMOTE) {
        uint64_t t = atomic_load_explicit(&s->arr_tail, memory_order_relaxed);
        if (t - atomic_load_explicit(&s->arr_head, memory_order_acquire) >= s->arrivals_cap)
            return fail(e, EPCC_RDMA_FAILED, "epcc rdma proxy: more chunks landed than the landing slots hold");
        s->arrivals[t & (s->arrivals_cap - 1)] = ev->imm;
        atomic_store_explicit(&s->arr_tail, t + 1, memory_order_release);
        return 0;
    }
    return fail_tp(e, "?", "a transport operation failed");
}

int epcc_rdma_proxy(epcc_rdma_engine *e) {
    epcc_rdma_state *s = state_of(e);
    epcc_tp *tp = (epcc_tp *)(uintptr_t)e->tp;
    const epcc_rdma_send_role *roles = (const epcc_rdma_send_role *)(uintptr_t)e->roles;
    const epcc_rdma_send_chan *chans = (const epcc_rdma_send_chan *)(uintptr_t)e->send_chans;
    const _Atomic uint64_t *stop = (const _Atomic uint64_t *)(uintptr_t)e->stop;
    epcc_tp_event evs[EPCC_RDMA_POLL_BATCH];
    uint64_t blocked_since = 0;
    uint32_t idle = 0;
    while (!atomic_load_explicit((_Atomic uint64_t *)stop, memory_order_acquire)) {
        int busy = 0, blocked = 0;
        for (uint64_t i = 0; i < e->n_roles; i++) {
            epcc_rdma_fifo *f = &s->fifos[i];
            const epcc_rdma_step_info *si = &epcc_rdma_steps[roles[i].step];
            epcc_rdma_entry *en;
            uint64_t taken = 0;
            while ((en = epcc_rdma_fifo_peek(f)) != NULL) {
                uint64_t head = atomic_load(&f->head);
                if (en->kind == EPCC_RDMA_ENTRY_FLUSH) {
                    if (atomic_load(&f->retired) != head) break; /* earlier writes still in flight */
                    epcc_rdma_fifo_take(f);
                    epcc_rdma_fifo_complete(f, head);
                    atomic_store_explicit(&f->flushed, head + 1, memory_order_release);
                    busy = 1;
                    continue;
                }
                const epcc_rdma_send_chan *c = &chans[en->chan];
                uint64_t credit = atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)c->credit, memory_order_acquire);
                if (!epcc_rdma_credit_ok(en->chan_seq, credit, c->depth)) {
                    blocked = 1;
                    uint64_t now = epcc_rdma_now_ns();
                    if (!blocked_since) blocked_since = now;
                    if (now - blocked_since > e->timeout_ns)
                        return fail_wait(e, EPCC_RDMA_TIMEOUT, si->step, (const char *)(uintptr_t)c->credit_name,
                                         credit, en->chan_seq - c->depth + 1);
                    break;
                }
                const uint8_t *src = (const uint8_t *)(uintptr_t)roles[i].send_buf + (head % f->depth) * roles[i].slot_bytes;
                uint64_t raddr = c->remote_addr + (en->chan_seq % c->depth) * c->slot_bytes;
                uint64_t ctx = EPCC_RDMA_CTX_DATA | (i << 32) | (head & 0xffffffffu);
                if (epcc_tp_post_write(tp, (int)c->peer, (unsigned)c->link, src, en->bytes,
                                       (epcc_tp_mr *)(uintptr_t)roles[i].mr, raddr,
                                       c->remote_key, 1, epcc_rdma_imm(c->imm_chan, en->chan_seq), ctx, e->timeout_ns))
                    return fail_tp(e, si->step, "posting a chunk");
                epcc_rdma_fifo_take(f);
                atomic_fetch_add(&s->posted, 1);
                taken++;
                busy = 1;
            }
            count_pass(s, taken);
        }
        if (!blocked) blocked_since = 0;
        int n = epcc_tp_poll(tp, evs, EPCC_RDMA_POLL_BATCH);
        if (n < 0) return fail_tp(e, "?", "polling completions");
        for (int k = 0; k < n; k++)
            if (route(e, &evs[k])) return (int)e->status;
        if (n || busy) {
            idle = 0;
        } else {
            if (aborted(e)) return EPCC_RDMA_ABORTED;
            epcc_rdma_backoff(&idle); /* spin, then yield, then sleep longer and longer while idle */
        }
    }
    return EPCC_RDMA_OK;
}

/* ---- receiver: one per process ----------------------------------------------------------- */
int epcc_rdma_receive(epcc_rdma_engine *e) {
    epcc_rdma_state *s = state_of(e);
    epcc_tp *tp = (epcc_tp *)(uintptr_t)e->tp;
    const epcc_rdma_recv_chan *chans = (const epcc_rdma_recv_chan *)(uintptr_t)e->recv_chans;
    uint64_t left = 0;
    for (uint64_t i = 0; i < e->n_recv_chans; i++) left += chans[i].n_chunks;
    uint64_t last_progress = epcc_rdma_now_ns();
    uint32_t polls = 0;
    while (left) {
        int progress = 0;
        uint64_t h = atomic_load_explicit(&s->arr_head, memory_order_relaxed);
        uint64_t t = atomic_load_explicit(&s->arr_tail, memory_order_acquire);
        for (; h < t; h++) {
            uint32_t imm = s->arrivals[h & (s->arrivals_cap - 1)];
            uint64_t ci = epcc_rdma_imm_chan(imm);
            if (ci >= e->n_recv_chans)
                return fail(e, EPCC_RDMA_FAILED, "epcc rdma receiver: an immediate names no receive channel");
            epcc_rdma_tracker *tr = &s->trackers[ci];
            uint64_t seq = epcc_rdma_imm_seq(imm, tr->next);
            int rc = epcc_rdma_tracker_land(tr, seq);
            if (rc) {
                char msg[512];
                snprintf(msg, sizeof msg, "epcc: %s step '%s': chunk %llu of '%s' landed %s (applied %llu of %llu, "
                         "window %llu)", (const char *)(uintptr_t)e->rank_desc, epcc_rdma_steps[chans[ci].step].step,
                         (unsigned long long)seq, (const char *)(uintptr_t)chans[ci].name,
                         rc == EPCC_RDMA_LAND_DUPLICATE ? "twice" : "outside the credit window",
                         (unsigned long long)tr->next, (unsigned long long)tr->total, (unsigned long long)tr->depth);
                return fail(e, EPCC_RDMA_FAILED, msg);
            }
        }
        atomic_store_explicit(&s->arr_head, h, memory_order_release);
        for (uint64_t i = 0; i < e->n_recv_chans; i++) {
            const epcc_rdma_recv_chan *c = &chans[i];
            epcc_rdma_tracker *tr = &s->trackers[i];
            int64_t q;
            while ((q = epcc_rdma_tracker_pop(tr)) >= 0) {
                const int64_t *cr = (const int64_t *)(uintptr_t)c->chunk_rows;
                const uint8_t *slot = (const uint8_t *)(uintptr_t)c->landing + ((uint64_t)q % c->depth) * c->slot_bytes;
                epcc_rdma_steps[c->step].apply(c, (uint64_t)cr[q], (uint64_t)cr[q + 1], slot);
                _Atomic uint64_t *flag = (_Atomic uint64_t *)(uintptr_t)((const uint64_t *)(uintptr_t)c->chunk_flags)[q];
                atomic_fetch_add_explicit(flag, 1, memory_order_release);
                atomic_fetch_add(&s->applied, 1);
                left--;
                progress = 1;
            }
            /* Return credits while the sender still needs them (it posts chunk n once n < credit + depth). */
            if (tr->next > s->credit_sent[i] && s->credit_sent[i] + c->depth < c->n_chunks &&
                !atomic_load_explicit(&s->credit_inflight[i], memory_order_acquire)) {
                *(uint64_t *)(uintptr_t)c->credit_src = tr->next;
                atomic_store_explicit(&s->credit_inflight[i], 1, memory_order_release);
                s->credit_sent[i] = tr->next;
                if (epcc_tp_post_write(tp, (int)c->peer, (unsigned)c->link, (const void *)(uintptr_t)c->credit_src, 8,
                                       (epcc_tp_mr *)(uintptr_t)c->credit_mr, c->credit_raddr, c->credit_rkey, 0, 0, i,
                                       e->timeout_ns))
                    return fail_tp(e, epcc_rdma_steps[c->step].step, "returning credits");
                progress = 1;
            }
        }
        uint64_t now = epcc_rdma_now_ns();
        if (progress) {
            last_progress = now;
            polls = 0;
            continue;
        }
        if (aborted(e)) return EPCC_RDMA_ABORTED;
        if (now - last_progress > e->timeout_ns) {
            for (uint64_t i = 0; i < e->n_recv_chans; i++) {
                if (s->trackers[i].next < chans[i].n_chunks) {
                    const epcc_rdma_recv_chan *c = &chans[i];
                    return fail_wait(e, EPCC_RDMA_TIMEOUT, epcc_rdma_steps[c->step].step, (const char *)(uintptr_t)c->name,
                                     s->trackers[i].next, s->trackers[i].next + 1);
                }
            }
        }
        epcc_rdma_backoff(&polls);
    }
    return EPCC_RDMA_OK;
}

/* ---- GPU path: one proxy thread per process and program, for the life of the engine ---------
 * The kernels' pack roles push one entry per chunk into the role's FIFO (host-pinned) after
 * packing the rows into send slot `index % depth` (device memory) and checking the receiver's
 * credit; this loop posts each as write + remote signal (the payload into landing slot
 * `seq % depth`, then `value` into that slot's signal word, which the receiver's unpack role
 * waits on), retires entries as writes complete (the pack roles wait on `retired` for a free send
 * slot), and returns credits: the unpack roles write their consumed count (launch << 32 | chunks)
 * into a host-mapped word per channel, this loop writes it into the sender's credit word.  Each
 * channel posts its chunks and credits on its own transport link (`link`: the link class of its
 * step, so the emulated transport paces every step at its own link's speed).  It
 * spins (a dedicated core, as NCCL's and DeepEP's proxies do): the emulated link is paced by
 * how often it polls. */
int epcc_rdma_proxy_gpu(epcc_rdma_engine *e) {
    epcc_rdma_state *s = state_of(e);
    epcc_tp *tp = (epcc_tp *)(uintptr_t)e->tp;
    const epcc_rdma_send_role *roles = (const epcc_rdma_send_role *)(uintptr_t)e->roles;
    const epcc_rdma_send_chan *chans = (const epcc_rdma_send_chan *)(uintptr_t)e->send_chans;
    const epcc_rdma_recv_chan *rchans = (const epcc_rdma_recv_chan *)(uintptr_t)e->recv_chans;
    const _Atomic uint64_t *stop = (const _Atomic uint64_t *)(uintptr_t)e->stop;
    epcc_tp_event evs[EPCC_RDMA_POLL_BATCH];
    uint32_t idle = 0;
    if (!e->gpu_fifos) return fail(e, EPCC_RDMA_FAILED, "epcc rdma: epcc_rdma_proxy_gpu on an engine without GPU FIFOs");
    while (!atomic_load_explicit((_Atomic uint64_t *)stop, memory_order_acquire)) {
        int busy = 0;
        for (uint64_t i = 0; i < e->n_roles; i++) {
            epcc_rdma_fifo *f = &s->fifos[i];
            const epcc_rdma_step_info *si = &epcc_rdma_steps[roles[i].step];
            epcc_rdma_entry *en;
            uint64_t taken = 0;
            while ((en = epcc_rdma_fifo_peek(f)) != NULL) {
                uint64_t head = atomic_load(&f->head);
                if (en->kind != EPCC_RDMA_ENTRY_DATA || en->chan >= e->n_send_chans) {
                    char msg[256];
                    snprintf(msg, sizeof msg, "epcc: %s step '%s': FIFO entry %llu is not a chunk (kind %llu, channel "
                             "%llu)", (const char *)(uintptr_t)e->rank_desc, si->step, (unsigned long long)head,
                             (unsigned long long)en->kind, (unsigned long long)en->chan);
                    return fail(e, EPCC_RDMA_FAILED, msg);
                }
                const epcc_rdma_send_chan *c = &chans[en->chan];
                if (en->bytes > c->slot_bytes || en->bytes > roles[i].slot_bytes) {
                    char msg[256];
                    snprintf(msg, sizeof msg, "epcc: %s step '%s': chunk %llu holds %llu bytes, more than a slot (%llu)",
                             (const char *)(uintptr_t)e->rank_desc, si->step, (unsigned long long)en->chan_seq,
                             (unsigned long long)en->bytes, (unsigned long long)c->slot_bytes);
                    return fail(e, EPCC_RDMA_FAILED, msg);
                }
                const uint8_t *src = (const uint8_t *)(uintptr_t)roles[i].send_buf + (head % f->depth) * roles[i].slot_bytes;
                uint64_t slot = en->chan_seq % c->depth;
                uint64_t ctx = EPCC_RDMA_CTX_DATA | (i << 32) | (head & 0xffffffffu);
                if (epcc_tp_post_write_signal(tp, (int)c->peer, (unsigned)c->link, src, en->bytes,
                                              (epcc_tp_mr *)(uintptr_t)roles[i].mr,
                                              c->remote_addr + slot * c->slot_bytes, c->remote_key,
                                              c->signal_addr + slot * 8, c->signal_key, en->value, ctx, e->timeout_ns))
                    return fail_tp(e, si->step, "posting a chunk");
                epcc_rdma_fifo_take(f);
                atomic_fetch_add(&s->posted, 1);
                taken++;
                busy = 1;
            }
            count_pass(s, taken);
        }
        for (uint64_t i = 0; i < e->n_recv_chans; i++) {
            const epcc_rdma_recv_chan *c = &rchans[i];
            uint64_t v = atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)c->consumed, memory_order_acquire);
            if (v == s->credit_sent[i] || atomic_load_explicit(&s->credit_inflight[i], memory_order_acquire)) continue;
            *(volatile uint64_t *)(uintptr_t)c->credit_src = v;
            atomic_store_explicit(&s->credit_inflight[i], 1, memory_order_release);
            s->credit_sent[i] = v;
            if (epcc_tp_post_write(tp, (int)c->peer, (unsigned)c->link, (const void *)(uintptr_t)c->credit_src, 8,
                                   (epcc_tp_mr *)(uintptr_t)c->credit_mr, c->credit_raddr, c->credit_rkey, 0, 0, i,
                                   e->timeout_ns))
                return fail_tp(e, epcc_rdma_steps[c->step].step, "returning credits");
            busy = 1;
        }
        int n = epcc_tp_poll(tp, evs, EPCC_RDMA_POLL_BATCH);
        if (n < 0) return fail_tp(e, "?", "polling completions");
        for (int k = 0; k < n; k++) {
            if (evs[k].kind == EPCC_TP_EV_REMOTE)
                return fail(e, EPCC_RDMA_FAILED, "epcc rdma proxy: an immediate arrived on the GPU path (signals only)");
            if (route(e, &evs[k])) return (int)e->status;
        }
        if (n || busy) {
            idle = 0;
        } else {
            if (aborted(e)) return EPCC_RDMA_ABORTED;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            if ((++idle & 1023u) == 0) sched_yield();
        }
    }
    return EPCC_RDMA_OK;
}
