/*
 * epcc_transport_impl.h - what the transports of epcc_transport.h share: the dispatch table,
 * the common header of every transport object, error formatting, an event queue.
 * Internal to backends/rdma/native.
 */
#ifndef EPCC_TRANSPORT_IMPL_H
#define EPCC_TRANSPORT_IMPL_H

#if !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif

#include "epcc_transport.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct epcc_tp_ops {
    const char *name;
    int (*open)(const char *spec, int rank, int nranks, epcc_tp **out, char *err, size_t errlen);
    int (*reg)(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **mr);
    void (*mr_remote)(const epcc_tp_mr *mr, uint64_t *addr, uint64_t *key);
    int (*dereg)(epcc_tp *tp, epcc_tp_mr *mr);
    int (*address)(epcc_tp *tp, void *buf, size_t *len);
    int (*connect)(epcc_tp *tp, const void *blobs, size_t blob_len);
    /* `link` is below the transport's n_links (epcc_transport.c checks it) */
    int (*post_write)(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                      uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx, uint64_t timeout_ns);
    int (*poll)(epcc_tp *tp, epcc_tp_event *events, int max);
    int (*flush)(epcc_tp *tp, uint64_t timeout_ns);
    void (*close)(epcc_tp *tp);
    /* Optional (NULL: the transport cannot): a write of `len` bytes followed, once it has landed,
     * by an 8-byte write of `sig_value` at (sig_raddr, sig_rkey) on the same peer (the GPU path's
     * per-slot landing flags: write + remote signal instead of an immediate). */
    int (*post_write_signal)(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                             uint64_t raddr, uint64_t rkey, uint64_t sig_raddr, uint64_t sig_rkey, uint64_t sig_value,
                             uint64_t ctx, uint64_t timeout_ns);
} epcc_tp_ops;

/* The first member of every transport object. */
struct epcc_tp {
    const epcc_tp_ops *ops;
    int rank, nranks;
    int n_links; /* links (send queues of their own) to every peer; epcc_tp_open makes 0 a 1 */
    char err[EPCC_TP_ERRLEN];
    char desc[256];
    epcc_tp_stats stats;
};

static inline int epcc_tp_fail(epcc_tp *tp, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tp->err, sizeof tp->err, fmt, ap);
    va_end(ap);
    return code < 0 ? code : -EIO;
}

static inline int epcc_tp_fail_buf(char *err, size_t errlen, int code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code < 0 ? code : -EIO;
}

static inline uint64_t epcc_tp_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t epcc_tp_deadline(uint64_t timeout_ns) {
    uint64_t now = epcc_tp_now_ns();
    return timeout_ns > UINT64_MAX - now ? UINT64_MAX : now + timeout_ns;
}

/* A growable FIFO of events reaped while a caller was waiting for something else (a flush, a
 * full send queue): handed out by later polls, in order.  Callers hold the transport's lock. */
typedef struct {
    epcc_tp_event *ev;
    size_t cap, head, count;
} epcc_tp_evq;

static inline int epcc_tp_evq_push(epcc_tp_evq *q, epcc_tp_event e) {
    if (q->count == q->cap) {
        size_t ncap = q->cap ? 2 * q->cap : 256;
        epcc_tp_event *n = (epcc_tp_event *)malloc(ncap * sizeof *n);
        if (!n) return -ENOMEM;
        for (size_t i = 0; i < q->count; i++) n[i] = q->ev[(q->head + i) % q->cap];
        free(q->ev);
        q->ev = n;
        q->cap = ncap;
        q->head = 0;
    }
    q->ev[(q->head + q->count) % q->cap] = e;
    q->count++;
    return 0;
}

static inline int epcc_tp_evq_pop(epcc_tp_evq *q, epcc_tp_event *out, int max) {
    int n = 0;
    while (n < max && q->count) {
        out[n++] = q->ev[q->head];
        q->head = (q->head + 1) % q->cap;
        q->count--;
    }
    return n;
}

#ifdef __cplusplus
extern "C" {
#endif
#ifdef EPCC_TP_HAVE_LIBFABRIC
extern const epcc_tp_ops epcc_tp_ops_libfabric;
#endif
#ifdef EPCC_TP_HAVE_IBVERBS
extern const epcc_tp_ops epcc_tp_ops_ibverbs;
#endif
#ifdef EPCC_TP_HAVE_EMULATED
extern const epcc_tp_ops epcc_tp_ops_emulated;
#endif
#ifdef EPCC_TP_HAVE_NVSHMEM
extern const epcc_tp_ops epcc_tp_ops_nvshmem;
#endif

#ifdef __cplusplus
}
#endif

#endif /* EPCC_TRANSPORT_IMPL_H */
