/*
 * loopback_transport.c - a test-only transport over this process's memory, so that the GPU proxy
 * loop (epcc_rdma_proxy_gpu) runs on a machine without GPUs: a write is a memcpy to the remote
 * address (host memory of the same process), a signal an 8-byte release store.  Local
 * completions are handed out one per poll, newest first, so the FIFOs see them out of order and
 * retire in order over their `done` bitmaps.  It has `n_links` links (epcc_tp_links) and counts
 * the writes and bytes posted on each (epcc_test_loopback_link_stats), so a test sees which link
 * the loop posted every chunk and credit on.  Opened directly (epcc_test_loopback_open), not
 * through epcc_tp_open.  Built by tests/rdma/test_rdma.py with the emitted loop.
 */
#include "epcc_transport_impl.h"

#include <stdatomic.h>

#define LB_MAX_LINKS 8

typedef struct {
    epcc_tp base;
    epcc_tp_event *pending;
    size_t n, cap;
    uint64_t link_writes[LB_MAX_LINKS], link_bytes[LB_MAX_LINKS];
} lb_tp;

static void lb_count(epcc_tp *tp, unsigned link, size_t len) {
    lb_tp *t = (lb_tp *)tp;
    t->link_writes[link]++; /* below n_links <= LB_MAX_LINKS: epcc_transport.c checked it */
    t->link_bytes[link] += len;
    tp->stats.writes_posted++;
    tp->stats.bytes_posted += len;
}

typedef struct {
    epcc_tp *tp; /* first: epcc_tp_mr_remote finds the transport through it */
    void *buf;
} lb_mr;

static int lb_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **mr) {
    (void)len;
    (void)access;
    lb_mr *m = (lb_mr *)calloc(1, sizeof *m);
    if (!m) return epcc_tp_fail(tp, -ENOMEM, "loopback: out of memory");
    m->tp = tp;
    m->buf = buf;
    *mr = (epcc_tp_mr *)m;
    return 0;
}

static void lb_mr_remote(const epcc_tp_mr *mr, uint64_t *addr, uint64_t *key) {
    *addr = (uint64_t)(uintptr_t)((const lb_mr *)mr)->buf;
    *key = 0;
}

static int lb_dereg(epcc_tp *tp, epcc_tp_mr *mr) {
    (void)tp;
    free(mr);
    return 0;
}

static int lb_complete(epcc_tp *tp, uint64_t ctx) {
    lb_tp *t = (lb_tp *)tp;
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 64;
        epcc_tp_event *p = (epcc_tp_event *)realloc(t->pending, cap * sizeof *p);
        if (!p) return epcc_tp_fail(tp, -ENOMEM, "loopback: out of memory");
        t->pending = p;
        t->cap = cap;
    }
    t->pending[t->n++] = (epcc_tp_event){EPCC_TP_EV_LOCAL, 0, ctx};
    tp->stats.local_completions++;
    return 0;
}

static int lb_post_write(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                         uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx,
                         uint64_t timeout_ns) {
    (void)peer;
    (void)mr;
    (void)rkey;
    (void)imm;
    (void)timeout_ns;
    if (imm_valid) return epcc_tp_fail(tp, -ENOTSUP, "loopback: no immediates");
    memcpy((void *)(uintptr_t)raddr, src, len);
    lb_count(tp, link, len);
    return lb_complete(tp, ctx);
}

static int lb_post_write_signal(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                                uint64_t raddr, uint64_t rkey, uint64_t sig_raddr, uint64_t sig_rkey,
                                uint64_t sig_value, uint64_t ctx, uint64_t timeout_ns) {
    (void)peer;
    (void)mr;
    (void)rkey;
    (void)sig_rkey;
    (void)timeout_ns;
    memcpy((void *)(uintptr_t)raddr, src, len);
    lb_count(tp, link, len);
    atomic_store_explicit((_Atomic uint64_t *)(uintptr_t)sig_raddr, sig_value, memory_order_release);
    return lb_complete(tp, ctx);
}

static int lb_poll(epcc_tp *tp, epcc_tp_event *events, int max) {
    lb_tp *t = (lb_tp *)tp;
    if (max < 1 || t->n == 0) return 0;
    events[0] = t->pending[--t->n]; /* newest first: completions out of order */
    return 1;
}

static int lb_flush(epcc_tp *tp, uint64_t timeout_ns) {
    (void)tp;
    (void)timeout_ns;
    return 0;
}

static void lb_close(epcc_tp *tp) {
    free(((lb_tp *)tp)->pending);
    free(tp);
}

static const epcc_tp_ops lb_ops = {
    "loopback", NULL, lb_reg, lb_mr_remote, lb_dereg, NULL, NULL, lb_post_write, lb_poll, lb_flush, lb_close,
    lb_post_write_signal,
};

epcc_tp *epcc_test_loopback_open(int rank, int nranks, int n_links) {
    if (n_links < 1 || n_links > LB_MAX_LINKS) return NULL;
    lb_tp *t = (lb_tp *)calloc(1, sizeof *t);
    if (!t) return NULL;
    t->base.ops = &lb_ops;
    t->base.rank = rank;
    t->base.nranks = nranks;
    t->base.n_links = n_links;
    snprintf(t->base.desc, sizeof t->base.desc, "loopback (test, %d link%s)", n_links, n_links == 1 ? "" : "s");
    return &t->base;
}

/* Writes (what = 0) or bytes (what = 1) posted on `link` so far. */
uint64_t epcc_test_loopback_link_stats(const epcc_tp *tp, int link, int what) {
    const lb_tp *t = (const lb_tp *)tp;
    if (link < 0 || link >= LB_MAX_LINKS) return 0;
    return what ? t->link_bytes[link] : t->link_writes[link];
}
