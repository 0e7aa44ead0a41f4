/*
 * epcc_sync.h - bounded-wait flag primitives for the epcc CPU backend and runtime.
 *
 * A flag is a monotonically increasing 64-bit counter in memory shared by the
 * ranks (threads or processes). A producer writes its payload with ordinary
 * stores and then publishes it with epcc_signal_add_u64/epcc_signal_set_u64
 * (release); a consumer calls epcc_wait_ge_u64 (acquire) and may then read the
 * payload. A wait never hangs forever by accident: it gives up after a timeout
 * and describes which rank, step and flag it was stuck on.
 *
 * C11 only (uses _Atomic; not for C++); needs lock-free 64-bit atomics
 * (x86-64, AArch64).
 */
#ifndef EPCC_SYNC_H
#define EPCC_SYNC_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Where a wait happens, for the timeout message. Any field may be NULL. */
typedef struct {
    const char *rank_desc; /* e.g. "3" -> "rank 3" */
    const char *step;      /* schedule step name, e.g. "fwd_mate" */
    const char *flag;      /* flag name, e.g. "tail[2]" */
} epcc_wait_site;

/* Pass as timeout_ns to wait without a time limit. */
#define EPCC_WAIT_FOREVER UINT64_MAX

/* Recommended size of the errbuf given to epcc_wait_ge_u64. */
#define EPCC_ERRBUF_SIZE 256

/*
 * Waits until *flag >= expected, reading it with acquire loads: spins with a
 * CPU pause and exponential backoff, then yields the CPU (sched_yield) between
 * polls.
 *
 * Returns 0 once the condition holds (at once if it already does, whatever
 * the timeout). Returns -1 if it still does not hold after timeout_ns
 * nanoseconds (timeout_ns == 0: check once; EPCC_WAIT_FOREVER: never time
 * out); then, if errbuf != NULL and errlen > 0, writes a NUL-terminated
 * message (truncated to errlen) such as
 *   epcc: wait timed out after 1.000 s: rank 3 step 'fwd_mate' flag 'tail[2]' (value 5, waiting for >= 7)
 * where the time is the timeout given and value is the flag's last value seen.
 */
int epcc_wait_ge_u64(const _Atomic uint64_t *flag, uint64_t expected, uint64_t timeout_ns,
                     const epcc_wait_site *site, char *errbuf, size_t errlen);

/* *flag += delta, with release ordering (publishes the writes before it). */
void epcc_signal_add_u64(_Atomic uint64_t *flag, uint64_t delta);

/* *flag = value, with release ordering (publishes the writes before it). */
void epcc_signal_set_u64(_Atomic uint64_t *flag, uint64_t value);

/* CLOCK_MONOTONIC, in nanoseconds. */
uint64_t epcc_now_ns(void);

#endif /* EPCC_SYNC_H */
