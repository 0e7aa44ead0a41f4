/*
 * epcc_sync.c - bounded-wait flag primitives (see epcc_sync.h).
 */
#define _POSIX_C_SOURCE 200809L

#include "epcc_sync.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

/* Spin phase: this many polls with a CPU pause (backoff doubling up to
 * EPCC_MAX_PAUSES pauses per poll), then one sched_yield per poll. */
#define EPCC_SPIN_POLLS 2048u
#define EPCC_MAX_PAUSES 64u
/* Read the clock once every this many polls. */
#define EPCC_CLOCK_EVERY 64u

static inline void epcc_cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

uint64_t epcc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void epcc_signal_add_u64(_Atomic uint64_t *flag, uint64_t delta) {
    atomic_fetch_add_explicit(flag, delta, memory_order_release);
}

void epcc_signal_set_u64(_Atomic uint64_t *flag, uint64_t value) {
    atomic_store_explicit(flag, value, memory_order_release);
}

static const char *or_unknown(const char *s) { return s ? s : "?"; }

static void format_timeout(char *errbuf, size_t errlen, uint64_t timeout_ns,
                           const epcc_wait_site *site, uint64_t value, uint64_t expected) {
    if (errbuf == NULL || errlen == 0) {
        return;
    }
    const char *rank = site ? or_unknown(site->rank_desc) : "?";
    const char *step = site ? or_unknown(site->step) : "?";
    const char *flag = site ? or_unknown(site->flag) : "?";
    /* Integer formatting of the timeout: seconds with millisecond precision. */
    uint64_t secs = timeout_ns / 1000000000u;
    uint64_t msecs = (timeout_ns % 1000000000u) / 1000000u;
    snprintf(errbuf, errlen,
             "epcc: wait timed out after %" PRIu64 ".%03" PRIu64
             " s: rank %s step '%s' flag '%s' (value %" PRIu64 ", waiting for >= %" PRIu64 ")",
             secs, msecs, rank, step, flag, value, expected);
}

int epcc_wait_ge_u64(const _Atomic uint64_t *flag, uint64_t expected, uint64_t timeout_ns,
                     const epcc_wait_site *site, char *errbuf, size_t errlen) {
    /* C11 atomic_load takes a pointer to non-const in some libcs; the load
     * does not write. */
    _Atomic uint64_t *f = (_Atomic uint64_t *)flag;
    uint64_t value = atomic_load_explicit(f, memory_order_acquire);
    if (value >= expected) {
        return 0;
    }

    uint64_t deadline = UINT64_MAX;
    if (timeout_ns != EPCC_WAIT_FOREVER) {
        uint64_t start = epcc_now_ns();
        deadline = (timeout_ns > UINT64_MAX - start) ? UINT64_MAX : start + timeout_ns;
    }

    uint32_t polls = 0;
    uint32_t pauses = 1;
    for (;;) {
        if (polls < EPCC_SPIN_POLLS) {
            for (uint32_t i = 0; i < pauses; i++) {
                epcc_cpu_pause();
            }
            if (pauses < EPCC_MAX_PAUSES) {
                pauses <<= 1;
            }
        } else {
            sched_yield();
        }
        polls++;

        value = atomic_load_explicit(f, memory_order_acquire);
        if (value >= expected) {
            return 0;
        }

        if (timeout_ns == 0 || (deadline != UINT64_MAX && polls % EPCC_CLOCK_EVERY == 0 &&
                                epcc_now_ns() >= deadline)) {
            /* One last look: we may have been descheduled past the deadline
             * while the flag was being set. */
            value = atomic_load_explicit(f, memory_order_acquire);
            if (value >= expected) {
                return 0;
            }
            format_timeout(errbuf, errlen, timeout_ns, site, value, expected);
            return -1;
        }
    }
}
