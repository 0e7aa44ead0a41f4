/*
 * transport_nvshmem.cu - epcc_transport.h over NVSHMEM: a write is nvshmemx_putmem_signal_on_stream
 * (put with signal: the payload, then an atomic add on a signal word of the target, ordered
 * after it), so the target learns of each chunk without a receive queue.
 *
 * Built only where nvshmem.h is found (compile with -DEPCC_TP_HAVE_NVSHMEM and NVSHMEM's include
 * and lib paths); elsewhere this file compiles to nothing.  NVSHMEM must be initialised by the
 * caller (nvshmemx_init_attr with the UID bootstrap through torch.distributed) before
 * epcc_tp_open; registered memory must lie in the symmetric heap (nvshmem_malloc), so a
 * region's remote address is its symmetric address, valid on every PE.
 *
 * spec: ignored.  Immediates: every PE has a symmetric array of signal words, one per
 * (sender, slot of EPCC_NVSHMEM_SLOTS) and a symmetric array of immediate words: a put writes
 * the immediate into imm[sender][k % SLOTS] with nvshmemx_putmem_signal_on_stream, the signal
 * word of that slot set to the lap-tagged sequence (NVSHMEM_SIGNAL_SET); the target's poll reads
 * its signal words (local loads) and reports each new slot's immediate.
 */
#if defined(__has_include)
#if __has_include(<nvshmem.h>) && defined(EPCC_TP_HAVE_NVSHMEM)
#define EPCC_NVSHMEM_BUILD 1
#endif
#endif

#ifdef EPCC_NVSHMEM_BUILD
#include "epcc_transport_impl.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>
#include <pthread.h>

#define EPCC_NVSHMEM_SLOTS 1024

typedef struct {
    epcc_tp base;
    pthread_mutex_t lock;
    cudaStream_t stream;
    uint64_t *signals; /* symmetric: [npes][SLOTS] */
    uint64_t *imms;    /* symmetric: [npes][SLOTS] */
    uint64_t *signals_host, *imms_host;
    uint64_t *seen, *sent; /* [npes] */
    uint64_t posted, completed;
    cudaEvent_t last;
    epcc_tp_evq q;
} nv_tp;

struct epcc_tp_mr {
    epcc_tp *tp;
    void *base;
};

static int nv_open(const char *spec, int rank, int nranks, epcc_tp **out, char *err, size_t errlen) {
    (void)spec;
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: PE %d of %d, but epcc rank %d of %d (initialise "
                                "NVSHMEM with the same ranks first)", nvshmem_my_pe(), nvshmem_n_pes(), rank, nranks);
    nv_tp *t = (nv_tp *)calloc(1, sizeof *t);
    *out = &t->base;
    pthread_mutex_init(&t->lock, NULL);
    size_t n = (size_t)nranks * EPCC_NVSHMEM_SLOTS * 8;
    t->signals = (uint64_t *)nvshmem_calloc(1, n);
    t->imms = (uint64_t *)nvshmem_calloc(1, n);
    t->signals_host = (uint64_t *)calloc(1, n);
    t->imms_host = (uint64_t *)calloc(1, n);
    t->seen = (uint64_t *)calloc((size_t)nranks, 8);
    t->sent = (uint64_t *)calloc((size_t)nranks, 8);
    if (!t->signals || !t->imms || cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&t->last, cudaEventDisableTiming) != cudaSuccess)
        return epcc_tp_fail_buf(err, errlen, -ENOMEM, "nvshmem: allocating the signal words failed");
    snprintf(t->base.desc, sizeof t->base.desc, "nvshmem (put with signal, PE %d of %d)", rank, nranks);
    return 0;
}

static int nv_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **out) {
    (void)access;
    if (!nvshmem_ptr(buf, nvshmem_my_pe()))
        return epcc_tp_fail(tp, -EINVAL, "nvshmem: %zu bytes at %p are not in the symmetric heap (nvshmem_malloc)", len,
                            buf);
    epcc_tp_mr *m = (epcc_tp_mr *)calloc(1, sizeof *m);
    m->tp = tp;
    m->base = buf;
    *out = m;
    return 0;
}

static void nv_mr_remote(const epcc_tp_mr *m, uint64_t *addr, uint64_t *key) {
    *addr = (uint64_t)(uintptr_t)m->base; /* symmetric: the same address names it on every PE */
    *key = 0;
}

static int nv_dereg(epcc_tp *tp, epcc_tp_mr *m) {
    (void)tp;
    free(m);
    return 0;
}

static int nv_address(epcc_tp *tp, void *buf, size_t *len) {
    int32_t pe = tp->rank;
    memcpy(buf, &pe, 4);
    *len = 4;
    return 0;
}

static int nv_connect(epcc_tp *tp, const void *blobs, size_t blob_len) {
    (void)tp;
    (void)blobs;
    (void)blob_len;
    return 0; /* NVSHMEM's bootstrap already connected every PE */
}

/* After a write's puts are on the stream (lock held): its local completion is queued, released by
 * poll once the stream passes this point; then the counters, and the lock is released. */
static int nv_posted(nv_tp *t, size_t len, uint64_t ctx) {
    cudaEventRecord(t->last, t->stream);
    epcc_tp_event ev = {EPCC_TP_EV_LOCAL, 0, ctx};
    epcc_tp_evq_push(&t->q, ev);
    t->posted++;
    t->base.stats.writes_posted++;
    t->base.stats.bytes_posted += len;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

static int nv_post_write(epcc_tp *tp, int peer, const void *src, size_t len, epcc_tp_mr *m, uint64_t raddr,
                         uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx, uint64_t timeout_ns) {
    nv_tp *t = (nv_tp *)tp;
    (void)m;
    (void)rkey;
    (void)timeout_ns;
    pthread_mutex_lock(&t->lock);
    if (imm_valid) {
        uint64_t k = t->sent[peer]++;
        size_t slot = (size_t)tp->rank * EPCC_NVSHMEM_SLOTS + k % EPCC_NVSHMEM_SLOTS;
        nvshmemx_putmem_on_stream((void *)(uintptr_t)raddr, src, len, peer, t->stream);
        uint64_t word = imm;
        /* The immediate word, then its signal (lap-tagged sequence), ordered after the payload. */
        nvshmemx_putmem_signal_on_stream(&t->imms[slot], &word, 8, &t->signals[slot], k + 1, NVSHMEM_SIGNAL_SET, peer,
                                         t->stream);
    } else {
        nvshmemx_putmem_on_stream((void *)(uintptr_t)raddr, src, len, peer, t->stream);
    }
    return nv_posted(t, len, ctx);
}

/* Write + signal: one put with signal (NVSHMEM orders the signal after the payload), the signal
 * word set to `sig_value`; both regions in the symmetric heap, addresses symmetric. */
static int nv_post_write_signal(epcc_tp *tp, int peer, const void *src, size_t len, epcc_tp_mr *m, uint64_t raddr,
                                uint64_t rkey, uint64_t sig_raddr, uint64_t sig_rkey, uint64_t sig_value, uint64_t ctx,
                                uint64_t timeout_ns) {
    nv_tp *t = (nv_tp *)tp;
    (void)m;
    (void)rkey;
    (void)sig_rkey;
    (void)timeout_ns;
    pthread_mutex_lock(&t->lock);
    nvshmemx_putmem_signal_on_stream((void *)(uintptr_t)raddr, src, len, (uint64_t *)(uintptr_t)sig_raddr, sig_value,
                                     NVSHMEM_SIGNAL_SET, peer, t->stream);
    return nv_posted(t, len, ctx);
}

static int nv_poll(epcc_tp *tp, epcc_tp_event *events, int max) {
    nv_tp *t = (nv_tp *)tp;
    pthread_mutex_lock(&t->lock);
    int n = 0;
    if (cudaEventQuery(t->last) == cudaSuccess) { /* every queued put has completed locally */
        n = epcc_tp_evq_pop(&t->q, events, max);
        t->completed += (uint64_t)n;
    }
    size_t bytes = (size_t)tp->nranks * EPCC_NVSHMEM_SLOTS * 8;
    cudaMemcpy(t->signals_host, t->signals, bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(t->imms_host, t->imms, bytes, cudaMemcpyDeviceToHost);
    for (int s = 0; s < tp->nranks && n < max; s++) {
        while (n < max) {
            size_t slot = (size_t)s * EPCC_NVSHMEM_SLOTS + t->seen[s] % EPCC_NVSHMEM_SLOTS;
            if (t->signals_host[slot] != t->seen[s] + 1) break;
            events[n].kind = EPCC_TP_EV_REMOTE;
            events[n].imm = (uint32_t)t->imms_host[slot];
            events[n].ctx = 0;
            n++;
            t->seen[s]++;
            t->base.stats.imm_received++;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return n;
}

static int nv_flush(epcc_tp *tp, uint64_t timeout_ns) {
    nv_tp *t = (nv_tp *)tp;
    (void)timeout_ns;
    cudaError_t e = cudaStreamSynchronize(t->stream);
    nvshmemx_quiet_on_stream(t->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(t->stream);
    return e == cudaSuccess ? 0 : epcc_tp_fail(tp, -EIO, "nvshmem: flush failed: %s", cudaGetErrorString(e));
}

static void nv_close(epcc_tp *tp) {
    nv_tp *t = (nv_tp *)tp;
    nvshmem_free(t->signals);
    nvshmem_free(t->imms);
    cudaEventDestroy(t->last);
    cudaStreamDestroy(t->stream);
    free(t->signals_host);
    free(t->imms_host);
    free(t->seen);
    free(t->sent);
    free(t->q.ev);
    free(t);
}

const epcc_tp_ops epcc_tp_ops_nvshmem = {
    "nvshmem", nv_open, nv_reg, nv_mr_remote, nv_dereg, nv_address, nv_connect, nv_post_write, nv_poll, nv_flush, nv_close,
    nv_post_write_signal,
};
#endif /* EPCC_NVSHMEM_BUILD */
