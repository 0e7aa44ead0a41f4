/*
 * test_sync.c - tests of the epcc_rt flag primitives (runtime/native/epcc_sync.h).
 *
 * 1. handoff: a producer and a consumer thread pass ITERS payloads through a
 *    ring of DEPTH slots. The payload is written with ordinary stores before
 *    the release signal; the consumer checks every word of it after its
 *    acquire wait, and the producer reuses a slot only after the consumer's
 *    acknowledgement (signal_set) says it is free.
 * 2. timeout: a wait on a flag that never gets there returns -1 after at least
 *    the timeout, with the exact message.
 * 3. small cases: already satisfied, timeout 0, NULL site / tiny errbuf, and a
 *    wait that succeeds when another thread sets the flag late.
 */
#define _POSIX_C_SOURCE 200809L

#include "epcc_sync.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ITERS 100000u
#define DEPTH 8u
#define WORDS 8u
#define HANDOFF_TIMEOUT_NS (30ull * 1000000000ull)

static int failures = 0;

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                   \
            fprintf(stderr, "\n");                                          \
            failures++;                                                     \
        }                                                                   \
    } while (0)

/* ---- 1. producer/consumer handoff ---------------------------------------- */

static uint64_t payload[DEPTH][WORDS];  /* plain memory, published by release */
static _Atomic uint64_t produced;       /* number of slots written */
static _Atomic uint64_t consumed;       /* number of slots read */
static uint64_t consumer_errors;
static char producer_err[EPCC_ERRBUF_SIZE];
static char consumer_err[EPCC_ERRBUF_SIZE];

static uint64_t word_value(uint64_t i, uint64_t w) {
    return (i + 1) * 0x9E3779B97F4A7C15ull ^ (w << 56);
}

static void *producer(void *arg) {
    (void)arg;
    const epcc_wait_site site = {"0", "producer", "consumed"};
    for (uint64_t i = 0; i < ITERS; i++) {
        /* Slot i % DEPTH is free once the consumer has read item i - DEPTH. */
        if (i >= DEPTH &&
            epcc_wait_ge_u64(&consumed, i - DEPTH + 1, HANDOFF_TIMEOUT_NS, &site, producer_err,
                             sizeof producer_err) != 0) {
            return (void *)1;
        }
        for (uint64_t w = 0; w < WORDS; w++) {
            payload[i % DEPTH][w] = word_value(i, w);
        }
        epcc_signal_add_u64(&produced, 1);
    }
    return NULL;
}

static void *consumer(void *arg) {
    (void)arg;
    const epcc_wait_site site = {"1", "consumer", "produced"};
    for (uint64_t i = 0; i < ITERS; i++) {
        if (epcc_wait_ge_u64(&produced, i + 1, HANDOFF_TIMEOUT_NS, &site, consumer_err,
                             sizeof consumer_err) != 0) {
            return (void *)1;
        }
        for (uint64_t w = 0; w < WORDS; w++) {
            if (payload[i % DEPTH][w] != word_value(i, w)) {
                consumer_errors++;
            }
        }
        epcc_signal_set_u64(&consumed, i + 1);
    }
    return NULL;
}

static void test_handoff(void) {
    pthread_t p, c;
    void *pr = NULL, *cr = NULL;
    uint64_t t0 = epcc_now_ns();
    CHECK(pthread_create(&c, NULL, consumer, NULL) == 0, "pthread_create consumer");
    CHECK(pthread_create(&p, NULL, producer, NULL) == 0, "pthread_create producer");
    pthread_join(p, &pr);
    pthread_join(c, &cr);
    uint64_t t1 = epcc_now_ns();
    CHECK(pr == NULL, "producer timed out: %s", producer_err);
    CHECK(cr == NULL, "consumer timed out: %s", consumer_err);
    CHECK(consumer_errors == 0, "%" PRIu64 " payload words read before they were published",
          consumer_errors);
    CHECK(atomic_load(&produced) == ITERS, "produced = %" PRIu64, atomic_load(&produced));
    CHECK(atomic_load(&consumed) == ITERS, "consumed = %" PRIu64, atomic_load(&consumed));
    printf("handoff: %u items through %u slots in %.3f s\n", ITERS, DEPTH, (t1 - t0) / 1e9);
}

/* ---- 2. timeout ---------------------------------------------------------- */

static void test_timeout(void) {
    _Atomic uint64_t flag = 5;
    const epcc_wait_site site = {"3", "fwd_mate", "tail[2]"};
    char err[EPCC_ERRBUF_SIZE];
    memset(err, 'x', sizeof err);
    const uint64_t timeout_ns = 200ull * 1000000ull; /* 0.2 s */

    uint64_t t0 = epcc_now_ns();
    int rc = epcc_wait_ge_u64(&flag, 7, timeout_ns, &site, err, sizeof err);
    uint64_t elapsed = epcc_now_ns() - t0;

    CHECK(rc == -1, "rc = %d", rc);
    CHECK(elapsed >= timeout_ns, "returned after %" PRIu64 " ns, before the timeout", elapsed);
    CHECK(elapsed < timeout_ns + 2000000000ull, "returned %" PRIu64 " ns late", elapsed);
    const char *prefix = "epcc: wait timed out after ";
    CHECK(strncmp(err, prefix, strlen(prefix)) == 0, "message prefix: '%s'", err);
    const char *want =
        "epcc: wait timed out after 0.200 s: rank 3 step 'fwd_mate' flag 'tail[2]' "
        "(value 5, waiting for >= 7)";
    CHECK(strcmp(err, want) == 0, "message:\n  got  '%s'\n  want '%s'", err, want);
    printf("timeout: returned -1 after %.3f s: %s\n", elapsed / 1e9, err);

    /* The example of the header: 1.000 s would take a second; check the
     * formatting of whole seconds with timeout 0 (which checks once). */
    rc = epcc_wait_ge_u64(&flag, 6, 0, &site, err, sizeof err);
    CHECK(rc == -1, "timeout 0: rc = %d", rc);
    CHECK(strcmp(err, "epcc: wait timed out after 0.000 s: rank 3 step 'fwd_mate' flag 'tail[2]' "
                      "(value 5, waiting for >= 6)") == 0,
          "timeout 0 message: '%s'", err);
}

/* ---- 3. small cases ------------------------------------------------------ */

static _Atomic uint64_t late_flag;

static void *set_late(void *arg) {
    (void)arg;
    struct timespec ts = {0, 50 * 1000000L}; /* 50 ms */
    nanosleep(&ts, NULL);
    epcc_signal_set_u64(&late_flag, 42);
    return NULL;
}

static void test_small_cases(void) {
    _Atomic uint64_t flag = 10;
    char err[EPCC_ERRBUF_SIZE] = "untouched";

    /* Already satisfied: succeeds at once even with timeout 0; errbuf untouched. */
    CHECK(epcc_wait_ge_u64(&flag, 10, 0, NULL, err, sizeof err) == 0, "equal");
    CHECK(epcc_wait_ge_u64(&flag, 3, 0, NULL, err, sizeof err) == 0, "greater");
    CHECK(strcmp(err, "untouched") == 0, "errbuf written on success: '%s'", err);

    /* signal_add / signal_set. */
    epcc_signal_add_u64(&flag, 5);
    CHECK(atomic_load(&flag) == 15, "after add: %" PRIu64, atomic_load(&flag));
    epcc_signal_set_u64(&flag, 2);
    CHECK(atomic_load(&flag) == 2, "after set: %" PRIu64, atomic_load(&flag));

    /* NULL site and NULL site fields print '?'. */
    CHECK(epcc_wait_ge_u64(&flag, 3, 1000000, NULL, err, sizeof err) == -1, "NULL site rc");
    CHECK(strcmp(err, "epcc: wait timed out after 0.001 s: rank ? step '?' flag '?' "
                      "(value 2, waiting for >= 3)") == 0,
          "NULL site message: '%s'", err);
    const epcc_wait_site partial = {NULL, "s", NULL};
    CHECK(epcc_wait_ge_u64(&flag, 3, 0, &partial, err, sizeof err) == -1, "partial site rc");
    CHECK(strstr(err, "rank ? step 's' flag '?'") != NULL, "partial site message: '%s'", err);

    /* A small errbuf is truncated and NUL-terminated; NULL errbuf is allowed. */
    char small[8];
    memset(small, 'x', sizeof small);
    CHECK(epcc_wait_ge_u64(&flag, 3, 0, NULL, small, sizeof small) == -1, "small rc");
    CHECK(strcmp(small, "epcc: w") == 0, "small errbuf: '%.8s'", small);
    CHECK(epcc_wait_ge_u64(&flag, 3, 0, NULL, NULL, 0) == -1, "NULL errbuf rc");

    /* A wait that is satisfied by another thread after 50 ms. */
    pthread_t t;
    atomic_store(&late_flag, 0);
    CHECK(pthread_create(&t, NULL, set_late, NULL) == 0, "pthread_create");
    uint64_t t0 = epcc_now_ns();
    int rc = epcc_wait_ge_u64(&late_flag, 42, 10ull * 1000000000ull, NULL, err, sizeof err);
    uint64_t elapsed = epcc_now_ns() - t0;
    pthread_join(t, NULL);
    CHECK(rc == 0, "late set: rc = %d (%s)", rc, err);
    CHECK(elapsed >= 40ull * 1000000ull, "late set returned after only %" PRIu64 " ns", elapsed);

    /* EPCC_WAIT_FOREVER does not overflow the deadline. */
    atomic_store(&late_flag, 0);
    CHECK(pthread_create(&t, NULL, set_late, NULL) == 0, "pthread_create");
    rc = epcc_wait_ge_u64(&late_flag, 1, EPCC_WAIT_FOREVER, NULL, err, sizeof err);
    pthread_join(t, NULL);
    CHECK(rc == 0, "forever: rc = %d", rc);

    /* now_ns is monotonic. */
    uint64_t a = epcc_now_ns(), b = epcc_now_ns();
    CHECK(b >= a, "clock went back: %" PRIu64 " -> %" PRIu64, a, b);
}

int main(void) {
    test_small_cases();
    test_timeout();
    test_handoff();
    if (failures) {
        fprintf(stderr, "test_sync: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_sync: all checks passed\n");
    return 0;
}
