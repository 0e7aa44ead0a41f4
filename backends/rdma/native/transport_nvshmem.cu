/*
 * transport_nvshmem.cu - epcc_transport.h over NVSHMEM: a write is nvshmemx_putmem_signal_on_stream
 * (put with signal: the payload, then an atomic set of a signal word of the target, ordered
 * after it), so the target learns of each chunk without a receive queue.
 *
 * Built only where nvshmem.h is found (compile with -DEPCC_TP_HAVE_NVSHMEM and NVSHMEM's include
 * path, link libnvshmem_host; runtime/engines/gpu_proxy/build.py finds the pip wheel nvidia-nvshmem-cu13);
 * elsewhere this file compiles to nothing.  Only NVSHMEM's host API is used (puts and signals on
 * CUDA streams, issued by the proxy thread), so neither -rdc nor the device library is needed.
 *
 * Bootstrap (below, epcc_nvshmem_*): rank 0 makes a unique id, the caller all-gathers it through
 * torch.distributed, every rank initialises NVSHMEM with it (NVSHMEMX_INIT_WITH_UNIQUEID) before
 * epcc_tp_open.  Registered memory must lie in the symmetric heap (epcc_nvshmem_malloc, a
 * collective call), so a region's remote address is its symmetric address, valid on every PE.
 *
 * spec: "" or "signal" (the caller uses write + signal only, so the immediate words are never
 * read).  Immediates: every PE has a symmetric array of signal words, one per (sender, slot of
 * EPCC_NVSHMEM_SLOTS): the k-th write with an immediate to a peer is one put with signal whose
 * signal sets word [sender][k % SLOTS] to (k + 1) << 32 | imm, after the payload landed; the
 * target's poll copies its words to the host on a stream of its own and reports each slot whose
 * sequence is the next one expected.
 * Queues: bulk writes go on one stream; 8-byte writes from host memory (the proxy's credits) are
 * signal operations (the value is read at post time, no source registration) on a second stream,
 * so a credit never waits behind queued chunks, as on a NIC that interleaves queue pairs.
 * Links: one (epcc_tp_links), whatever NVSHMEM reaches; not paced, so a plan's RDMA steps over
 * links of different speeds all post on link 0 (runtime/engines/gpu_proxy).
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

/* ---------------------------------------------------------------- bootstrap (torch.distributed) */

extern "C" {

/* This rank's unique id (call on rank 0; the caller broadcasts the `*len` bytes). */
int epcc_nvshmem_uid(void *out, size_t *len, char *err, size_t errlen) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (*len < sizeof id)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: a unique id needs %zu bytes, the buffer has %zu",
                                sizeof id, *len);
    int rc = nvshmemx_get_uniqueid(&id);
    if (rc != 0) return epcc_tp_fail_buf(err, errlen, -EIO, "nvshmem: nvshmemx_get_uniqueid failed (%d)", rc);
    memcpy(out, &id, sizeof id);
    *len = sizeof id;
    return 0;
}

/* Initialise NVSHMEM on `device` as PE `rank` of `nranks` from rank 0's unique id; a second call
 * in the same process checks that it names the same PE and returns. */
int epcc_nvshmem_init(const void *uid, size_t len, int rank, int nranks, int device, char *err, size_t errlen) {
    if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
        if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks)
            return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: already initialised as PE %d of %d, not %d of %d",
                                    nvshmem_my_pe(), nvshmem_n_pes(), rank, nranks);
        return 0;
    }
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (len != sizeof id)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: a unique id of %zu bytes, expected %zu", len, sizeof id);
    memcpy(&id, uid, sizeof id);
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess)
        return epcc_tp_fail_buf(err, errlen, -EIO, "nvshmem: cudaSetDevice(%d): %s", device, cudaGetErrorString(ce));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    int rc = nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr);
    if (rc != 0) return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: nvshmemx_set_attr_uniqueid_args failed (%d)", rc);
    /* The host library's own initialisation (this file uses the host API only; nvshmemx_init_attr
     * would need the device library, and exits the process on failure). */
    rc = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
    if (rc != 0)
        return epcc_tp_fail_buf(err, errlen, -EIO, "nvshmem: initialisation with the unique id failed (%d; "
                                "NVSHMEM_DEBUG=INFO says why)", rc);
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: initialised as PE %d of %d, not %d of %d",
                                nvshmem_my_pe(), nvshmem_n_pes(), rank, nranks);
    return 0;
}

/* `bytes` of zeroed symmetric memory: collective, every PE calls it with the same size in the same
 * order.  NULL when the heap is exhausted (NVSHMEM_SYMMETRIC_SIZE). */
void *epcc_nvshmem_malloc(size_t bytes) { return nvshmem_calloc(1, bytes ? bytes : 8); }

void epcc_nvshmem_free(void *p) { nvshmem_free(p); }

}  /* extern "C" */

/* ---------------------------------------------------------------- the transport */

typedef struct {
    epcc_tp base;
    pthread_mutex_t lock;
    int device;               /* the PE's GPU: set in whichever thread posts or polls */
    cudaStream_t stream;      /* bulk writes */
    cudaStream_t ctrl;        /* signal writes of 8 bytes from host memory (credits) */
    cudaStream_t poll_stream; /* the poll's copies of the immediate words */
    int imms_read;            /* 0 with spec "signal": nobody writes immediates */
    uint64_t *signals; /* symmetric: [npes][SLOTS], (sequence << 32 | immediate) */
    uint64_t *signals_host;
    uint64_t *seen, *sent; /* [npes] */
    uint64_t posted, completed;
    cudaEvent_t last, last_ctrl;
    epcc_tp_evq q, q_ctrl; /* local completions, released when the stream passes `last` / `last_ctrl` */
} nv_tp;

struct epcc_tp_mr {
    epcc_tp *tp;
    void *base;
};

static int nv_open(const char *spec, int rank, int nranks, epcc_tp **out, char *err, size_t errlen) {
    if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: not initialised (epcc_nvshmem_init with rank 0's "
                                "unique id first)");
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: PE %d of %d, but epcc rank %d of %d (initialise "
                                "NVSHMEM with the same ranks first)", nvshmem_my_pe(), nvshmem_n_pes(), rank, nranks);
    if (spec && *spec && strcmp(spec, "signal") != 0)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "nvshmem: spec '%s' is not '' or 'signal'", spec);
    nv_tp *t = (nv_tp *)calloc(1, sizeof *t);
    if (!t) return epcc_tp_fail_buf(err, errlen, -ENOMEM, "nvshmem: out of memory");
    *out = &t->base;
    pthread_mutex_init(&t->lock, NULL);
    t->imms_read = !(spec && strcmp(spec, "signal") == 0);
    cudaGetDevice(&t->device); /* NVSHMEM was initialised on it (epcc_nvshmem_init) */
    size_t n = (size_t)nranks * EPCC_NVSHMEM_SLOTS * 8;
    t->signals = (uint64_t *)nvshmem_calloc(1, n); /* collective: every PE opens the transport */
    t->signals_host = (uint64_t *)calloc(1, n);
    t->seen = (uint64_t *)calloc((size_t)nranks, 8);
    t->sent = (uint64_t *)calloc((size_t)nranks, 8);
    if (!t->signals_host || !t->seen || !t->sent) return epcc_tp_fail_buf(err, errlen, -ENOMEM, "nvshmem: out of memory");
    if (!t->signals || cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&t->ctrl, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&t->poll_stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&t->last, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&t->last_ctrl, cudaEventDisableTiming) != cudaSuccess)
        return epcc_tp_fail_buf(err, errlen, -ENOMEM, "nvshmem: allocating the signal words or streams failed");
    /* Every kind of operation this transport issues, once to every PE, now: NVSHMEM's stream
     * operations are kernels of its library, and CUDA loads a module lazily at its first launch,
     * which waits on the device; done while the epcc kernels run, that would stall the proxy
     * thread behind kernels that wait for the proxy.  What is written is the initial zero of this
     * rank's first signal word on each PE (sequences count from 1). */
    for (int pe = 0; pe < nranks; pe++) {
        uint64_t *word = &t->signals[(size_t)rank * EPCC_NVSHMEM_SLOTS];
        nvshmemx_putmem_signal_on_stream(word, &t->signals[(size_t)rank * EPCC_NVSHMEM_SLOTS + 1], 8, word, 0,
                                         NVSHMEM_SIGNAL_SET, pe, t->stream);
        nvshmemx_putmem_on_stream(word, &t->signals[(size_t)rank * EPCC_NVSHMEM_SLOTS + 1], 8, pe, t->stream);
        nvshmemx_signal_op_on_stream(word, 0, NVSHMEM_SIGNAL_SET, pe, t->ctrl);
    }
    nvshmemx_quiet_on_stream(t->stream);
    cudaError_t ce = cudaStreamSynchronize(t->stream);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(t->ctrl);
    if (ce != cudaSuccess)
        return epcc_tp_fail_buf(err, errlen, -EIO, "nvshmem: the warm-up writes failed: %s", cudaGetErrorString(ce));
    nvshmem_barrier_all(); /* no PE's real writes before every PE's warm-up zeros landed */
    snprintf(t->base.desc, sizeof t->base.desc, "nvshmem (put with signal, PE %d of %d, NVSHMEM %d.%d.%d)", rank,
             nranks, NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION);
    return 0;
}

static int nv_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **out) {
    (void)access;
    if (!nvshmem_ptr(buf, nvshmem_my_pe()))
        return epcc_tp_fail(tp, -EINVAL, "nvshmem: %zu bytes at %p are not in the symmetric heap (nvshmem_malloc)", len,
                            buf);
    epcc_tp_mr *m = (epcc_tp_mr *)calloc(1, sizeof *m);
    if (!m) return epcc_tp_fail(tp, -ENOMEM, "nvshmem: out of memory");
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

/* Every call that touches CUDA: the lock, and the PE's device current in the calling thread (the
 * proxy is a thread of its own; a stream of another device would fail every operation). */
static void nv_enter(nv_tp *t) {
    pthread_mutex_lock(&t->lock);
    cudaSetDevice(t->device);
}

/* After a write's operations are on `stream` (lock held): its local completion is queued, released
 * by poll once the stream passes this point; then the counters, and the lock is released. */
static int nv_posted(nv_tp *t, cudaStream_t stream, size_t len, uint64_t ctx) {
    int ctrl = stream == t->ctrl;
    cudaEventRecord(ctrl ? t->last_ctrl : t->last, stream);
    cudaError_t e = cudaGetLastError(); /* NVSHMEM's stream operations return nothing: their launch errors land here */
    if (e != cudaSuccess) {
        pthread_mutex_unlock(&t->lock);
        return epcc_tp_fail(&t->base, -EIO, "nvshmem: posting a %s of %zu B failed: %s", ctrl ? "signal" : "put", len,
                            cudaGetErrorString(e));
    }
    epcc_tp_event ev = {EPCC_TP_EV_LOCAL, 0, ctx};
    epcc_tp_evq_push(ctrl ? &t->q_ctrl : &t->q, ev);
    t->posted++;
    t->base.stats.writes_posted++;
    t->base.stats.bytes_posted += len;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

static int host_memory(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* older runtimes: unregistered host memory is an error */
        return 1;
    }
    return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
}

static int nv_post_write(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *m,
                         uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx,
                         uint64_t timeout_ns) {
    nv_tp *t = (nv_tp *)tp;
    (void)link; /* one link: whatever NVSHMEM reaches, not paced */
    (void)m;
    (void)rkey;
    (void)timeout_ns;
    nv_enter(t);
    if (!imm_valid && len == 8 && host_memory(src)) { /* a credit word: a signal op, the value read now */
        uint64_t value;
        memcpy(&value, src, 8);
        nvshmemx_signal_op_on_stream((uint64_t *)(uintptr_t)raddr, value, NVSHMEM_SIGNAL_SET, peer, t->ctrl);
        return nv_posted(t, t->ctrl, len, ctx);
    }
    if (imm_valid) { /* the immediate travels in the signal, set after the payload landed */
        uint64_t k = t->sent[peer]++;
        size_t slot = (size_t)tp->rank * EPCC_NVSHMEM_SLOTS + k % EPCC_NVSHMEM_SLOTS;
        nvshmemx_putmem_signal_on_stream((void *)(uintptr_t)raddr, src, len, &t->signals[slot],
                                         ((k + 1) & 0xffffffffull) << 32 | imm, NVSHMEM_SIGNAL_SET, peer, t->stream);
    } else {
        nvshmemx_putmem_on_stream((void *)(uintptr_t)raddr, src, len, peer, t->stream);
    }
    return nv_posted(t, t->stream, len, ctx);
}

/* Write + signal: one put with signal (NVSHMEM orders the signal after the payload), the signal
 * word set to `sig_value`; both regions in the symmetric heap, addresses symmetric. */
static int nv_post_write_signal(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *m,
                                uint64_t raddr, uint64_t rkey, uint64_t sig_raddr, uint64_t sig_rkey,
                                uint64_t sig_value, uint64_t ctx, uint64_t timeout_ns) {
    nv_tp *t = (nv_tp *)tp;
    (void)link;
    (void)m;
    (void)rkey;
    (void)sig_rkey;
    (void)timeout_ns;
    nv_enter(t);
    nvshmemx_putmem_signal_on_stream((void *)(uintptr_t)raddr, src, len, (uint64_t *)(uintptr_t)sig_raddr, sig_value,
                                     NVSHMEM_SIGNAL_SET, peer, t->stream);
    return nv_posted(t, t->stream, len, ctx);
}

static int nv_poll(epcc_tp *tp, epcc_tp_event *events, int max) {
    nv_tp *t = (nv_tp *)tp;
    nv_enter(t);
    int n = 0;
    if (cudaEventQuery(t->last_ctrl) == cudaSuccess) /* every queued signal op has completed locally */
        n += epcc_tp_evq_pop(&t->q_ctrl, events, max);
    if (n < max && cudaEventQuery(t->last) == cudaSuccess) /* every queued put has */
        n += epcc_tp_evq_pop(&t->q, events + n, max - n);
    t->completed += (uint64_t)n;
    if (t->imms_read && n < max) {
        /* On a non-blocking stream: a copy on the legacy default stream would wait for running kernels. */
        size_t bytes = (size_t)tp->nranks * EPCC_NVSHMEM_SLOTS * 8;
        cudaMemcpyAsync(t->signals_host, t->signals, bytes, cudaMemcpyDeviceToHost, t->poll_stream);
        cudaError_t ce = cudaStreamSynchronize(t->poll_stream);
        if (ce != cudaSuccess) {
            pthread_mutex_unlock(&t->lock);
            return epcc_tp_fail(tp, -EIO, "nvshmem: reading the signal words failed: %s", cudaGetErrorString(ce));
        }
        for (int s = 0; s < tp->nranks && n < max; s++) {
            while (n < max) {
                size_t slot = (size_t)s * EPCC_NVSHMEM_SLOTS + t->seen[s] % EPCC_NVSHMEM_SLOTS;
                uint64_t word = t->signals_host[slot];
                if (word >> 32 != ((t->seen[s] + 1) & 0xffffffffull)) break;
                events[n].kind = EPCC_TP_EV_REMOTE;
                events[n].imm = (uint32_t)word;
                events[n].ctx = 0;
                n++;
                t->seen[s]++;
                t->base.stats.imm_received++;
            }
        }
    }
    pthread_mutex_unlock(&t->lock);
    return n;
}

static int nv_flush(epcc_tp *tp, uint64_t timeout_ns) {
    nv_tp *t = (nv_tp *)tp;
    (void)timeout_ns;
    nv_enter(t);
    nvshmemx_quiet_on_stream(t->stream);
    cudaError_t e = cudaStreamSynchronize(t->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(t->ctrl);
    pthread_mutex_unlock(&t->lock);
    return e == cudaSuccess ? 0 : epcc_tp_fail(tp, -EIO, "nvshmem: flush failed: %s", cudaGetErrorString(e));
}

static void nv_close(epcc_tp *tp) {
    nv_tp *t = (nv_tp *)tp;
    cudaSetDevice(t->device);
    cudaStreamSynchronize(t->stream);
    cudaStreamSynchronize(t->ctrl);
    nvshmem_free(t->signals); /* collective */
    cudaEventDestroy(t->last);
    cudaEventDestroy(t->last_ctrl);
    cudaStreamDestroy(t->stream);
    cudaStreamDestroy(t->ctrl);
    cudaStreamDestroy(t->poll_stream);
    free(t->signals_host);
    free(t->seen);
    free(t->sent);
    free(t->q.ev);
    free(t->q_ctrl.ev);
    free(t);
}

/* Called first by the GPU proxy thread (runtime/engines/gpu_proxy/engine.py): its CUDA calls (copies,
 * event queries) belong to no stream capture and must go on while the application captures a CUDA
 * graph on another thread (a low-latency dispatch under torch.cuda.graph, whose default global
 * mode would refuse them): relaxed capture mode, for this thread only. */
extern "C" int epcc_tp_proxy_thread(void) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    return cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess ? 0 : -1;
}

const epcc_tp_ops epcc_tp_ops_nvshmem = {
    "nvshmem", nv_open, nv_reg, nv_mr_remote, nv_dereg, nv_address, nv_connect, nv_post_write, nv_poll, nv_flush, nv_close,
    nv_post_write_signal,
};
#endif /* EPCC_NVSHMEM_BUILD */
