/*
 * epcc_proxy_prim.c - the primitives of epcc_proxy.h: trigger FIFO, in-order tracker, atomic
 * accumulates, bounded waits.  Compiled into every emitted proxy library (and alone, for the
 * property tests of tests/rdma).
 */
#define _POSIX_C_SOURCE 200809L
#include "epcc_proxy.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int epcc_rdma_fifo_init(epcc_rdma_fifo *f, uint64_t depth) {
    memset(f, 0, sizeof *f);
    if (depth == 0) return -1;
    f->depth = depth;
    f->entries = (epcc_rdma_entry *)calloc(depth, sizeof *f->entries);
    f->done = (uint8_t *)calloc(depth, 1);
    if (!f->entries || !f->done) {
        epcc_rdma_fifo_free(f);
        return -1;
    }
    for (uint64_t i = 0; i < depth; i++) atomic_init(&f->entries[i].word, 0); /* index 0 << 1 | 0: invalid */
    return 0;
}

int epcc_rdma_fifo_attach(epcc_rdma_fifo *f) {
    if (f->depth == 0 || !f->entries) return -1;
    f->external = 1;
    f->done = (uint8_t *)calloc(f->depth, 1);
    return f->done ? 0 : -1;
}

void epcc_rdma_fifo_free(epcc_rdma_fifo *f) {
    if (!f->external) free(f->entries);
    free(f->done);
    f->entries = NULL;
    f->done = NULL;
}

int epcc_rdma_fifo_can_push(epcc_rdma_fifo *f) {
    uint64_t tail = atomic_load_explicit(&f->tail, memory_order_relaxed);
    return tail - atomic_load_explicit(&f->retired, memory_order_acquire) < f->depth;
}

uint64_t epcc_rdma_fifo_push(epcc_rdma_fifo *f, uint64_t kind, uint64_t chan, uint64_t chan_seq, uint64_t bytes) {
    uint64_t i = atomic_load_explicit(&f->tail, memory_order_relaxed);
    epcc_rdma_entry *e = &f->entries[i % f->depth];
    e->kind = kind;
    e->chan = chan;
    e->chan_seq = chan_seq;
    e->bytes = bytes;
    /* The payload in the send slot and the fields above, then the valid word (release). */
    atomic_store_explicit(&e->word, (i << 1) | 1u, memory_order_release);
    atomic_store_explicit(&f->tail, i + 1, memory_order_release);
    return i;
}

epcc_rdma_entry *epcc_rdma_fifo_peek(epcc_rdma_fifo *f) {
    uint64_t h = atomic_load_explicit(&f->head, memory_order_relaxed);
    epcc_rdma_entry *e = &f->entries[h % f->depth];
    return atomic_load_explicit(&e->word, memory_order_acquire) == ((h << 1) | 1u) ? e : NULL;
}

uint64_t epcc_rdma_fifo_take(epcc_rdma_fifo *f) {
    uint64_t h = atomic_load_explicit(&f->head, memory_order_relaxed);
    atomic_store_explicit(&f->head, h + 1, memory_order_release);
    return h;
}

int epcc_rdma_fifo_complete(epcc_rdma_fifo *f, uint64_t index) {
    uint64_t r = atomic_load_explicit(&f->retired, memory_order_relaxed);
    uint64_t h = atomic_load_explicit(&f->head, memory_order_relaxed);
    if (index < r || index >= h || f->done[index % f->depth]) return -1;
    f->done[index % f->depth] = 1;
    while (r < h && f->done[r % f->depth]) {
        f->done[r % f->depth] = 0;
        r++;
    }
    atomic_store_explicit(&f->retired, r, memory_order_release);
    return 0;
}

int epcc_rdma_tracker_init(epcc_rdma_tracker *t, uint64_t depth, uint64_t total) {
    memset(t, 0, sizeof *t);
    if (depth == 0) return -1;
    t->depth = depth;
    t->total = total;
    t->landed = (uint8_t *)calloc(depth, 1);
    return t->landed ? 0 : -1;
}

void epcc_rdma_tracker_free(epcc_rdma_tracker *t) {
    free(t->landed);
    t->landed = NULL;
}

int epcc_rdma_tracker_land(epcc_rdma_tracker *t, uint64_t seq) {
    if (seq < t->next) return EPCC_RDMA_LAND_DUPLICATE;
    if (seq >= t->total || seq >= t->next + t->depth) return EPCC_RDMA_LAND_OUTSIDE;
    if (t->landed[seq % t->depth]) return EPCC_RDMA_LAND_DUPLICATE;
    t->landed[seq % t->depth] = 1;
    return EPCC_RDMA_LAND_OK;
}

int64_t epcc_rdma_tracker_pop(epcc_rdma_tracker *t) {
    if (t->next >= t->total || !t->landed[t->next % t->depth]) return -1;
    t->landed[t->next % t->depth] = 0;
    return (int64_t)t->next++;
}

static inline void atomic_add_f32(float *p, float v) {
    _Atomic uint32_t *w = (_Atomic uint32_t *)(void *)p;
    uint32_t old = atomic_load_explicit(w, memory_order_relaxed), nw;
    do {
        float f;
        memcpy(&f, &old, 4);
        f += v;
        memcpy(&nw, &f, 4);
    } while (!atomic_compare_exchange_weak_explicit(w, &old, nw, memory_order_relaxed, memory_order_relaxed));
}

void epcc_rdma_pack_f32_bf16(uint16_t *dst, const float *src, uint64_t n) {
    for (uint64_t j = 0; j < n; j++) {
        uint32_t bits;
        memcpy(&bits, &src[j], 4);
        if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
            dst[j] = (uint16_t)((bits >> 16) | 0x0040u); /* NaN: keep it a (quiet) NaN */
            continue;
        }
        bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
        dst[j] = (uint16_t)(bits >> 16);
    }
}

void epcc_rdma_acc_bf16(float *dst, const uint16_t *src, float w, uint64_t n) {
    for (uint64_t j = 0; j < n; j++) {
        uint32_t bits = (uint32_t)src[j] << 16;
        float x;
        memcpy(&x, &bits, 4);
        atomic_add_f32(&dst[j], w * x);
    }
}

uint64_t epcc_rdma_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spin a little, then yield, then sleep with a growing interval (the CPU path runs more threads
 * than cores; a GPU host would keep a core per proxy and spin). */
void epcc_rdma_backoff(uint32_t *polls) {
    uint32_t n = (*polls)++;
    if (n < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else if (n < 128) {
        sched_yield();
    } else {
        uint32_t k = n - 128 < 8 ? n - 128 : 8;
        struct timespec ts = {0, (long)(10000u << k)}; /* 10 us .. 2.5 ms */
        nanosleep(&ts, NULL);
    }
}

int epcc_rdma_wait_ge(const _Atomic uint64_t *flag, uint64_t value, uint64_t timeout_ns,
                      const _Atomic uint64_t *abort, uint64_t *observed) {
    _Atomic uint64_t *f = (_Atomic uint64_t *)flag;
    uint64_t v = atomic_load_explicit(f, memory_order_acquire);
    *observed = v;
    if (v >= value) return EPCC_RDMA_OK;
    uint64_t start = epcc_rdma_now_ns();
    uint64_t deadline = timeout_ns > UINT64_MAX - start ? UINT64_MAX : start + timeout_ns;
    uint32_t polls = 0;
    for (;;) {
        epcc_rdma_backoff(&polls);
        v = atomic_load_explicit(f, memory_order_acquire);
        *observed = v;
        if (v >= value) return EPCC_RDMA_OK;
        if (abort && atomic_load_explicit((_Atomic uint64_t *)abort, memory_order_relaxed)) return EPCC_RDMA_ABORTED;
        if ((polls % 16 == 0 || polls > 128) && epcc_rdma_now_ns() >= deadline) {
            v = atomic_load_explicit(f, memory_order_acquire);
            *observed = v;
            return v >= value ? EPCC_RDMA_OK : EPCC_RDMA_TIMEOUT;
        }
    }
}

void epcc_rdma_format_timeout(char *buf, size_t len, uint64_t timeout_ns, const char *rank_desc,
                              const char *step, const char *flag, uint64_t value, uint64_t expected) {
    if (!buf || !len) return;
    uint64_t secs = timeout_ns / 1000000000u, msecs = (timeout_ns % 1000000000u) / 1000000u;
    const char *rank = rank_desc ? rank_desc : "rank ?";
    snprintf(buf, len,
             "epcc: wait timed out after %" PRIu64 ".%03" PRIu64 " s: %s step '%s' flag '%s' (value %" PRIu64
             ", waiting for >= %" PRIu64 ")",
             secs, msecs, rank, step ? step : "?", flag ? flag : "?", value, expected);
}
