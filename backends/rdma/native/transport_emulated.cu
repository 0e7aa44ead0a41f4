/*
 * transport_emulated.cu - epcc_transport.h on one multi-GPU host: an RDMA-class write is a copy
 * engine transfer (cudaMemcpyAsync between peer GPU buffers mapped through CUDA IPC), paced to
 * the link class's bandwidth and latency, so RDMA-bound schedules run and are timed on GPUs
 * without a NIC (h200x4_2vnode.sched).
 *
 * spec: "BANDWIDTH_GBPS[/BANDWIDTH_GBPS...],LATENCY_US[/LATENCY_US...][,DEVICE[,signal]]", e.g.
 * "50,5", "13,5,2,signal" or "50/25,5,0,signal".  Each '/'-separated bandwidth is one link (link
 * 0 first, at most EMU_MAX_LINKS), with the latency at the same place, or the one latency given for
 * all; DEVICE: the GPU (empty: the current one); signal: the caller uses write + signal only, so
 * the immediate inbox is never read.  A bad spec fails epcc_tp_open with a message naming the
 * spec and the field ("emulated: spec '50/x,5': bandwidth 'x' of link 1 is not a number > 0").
 * Registration: GPU memory (cudaMalloc'd); every region registered before epcc_tp_address() is
 * exported by IPC handle in the address blob, keyed by its registration index; a peer maps it in
 * connect().  Immediates: each rank has an inbox in GPU memory (nranks x EMU_INBOX u64 slots);
 * after the payload copy, the same stream copies (imm | valid) into slot [sender][seq] of the
 * target's inbox, so it lands after the data.  The target's poll reads its inbox.
 * Pacing: a write starts no earlier than its link (this rank's egress port of that link) is free:
 * its copy is issued then (start); its signal or immediate is issued at start + bytes / bandwidth
 * + latency of that link (ready), ordered after the copy by an event, so the target learns of the
 * chunk when a link of that class would have delivered it, not when the copy engine (NVLink, much
 * faster) did.  The local completion comes at `ready` too, and not before the copies are done.
 * Every link has its own send queues (its own streams), like the ports of a NIC with a queue pair
 * each: a post names its link (epcc_tp_post_write's `link`), and the links are paced
 * independently, so one program's RDMA steps over links of different speeds each run at their
 * own link's rate.  Within a link, writes of at most EMU_CONTROL_BYTES (the proxy's credits) are
 * paced on a control queue of their own, as on a NIC that interleaves queue pairs per packet;
 * bulk chunks keep their order.  Writes are issued by whoever calls post or poll (the proxy thread
 * spins on poll), so pacing is as fine as polling.
 */
#include "epcc_transport_impl.h"

#include <cuda_runtime.h>
#include <pthread.h>

#define EMU_MAX_REGIONS 32 /* the address blob (IPC handles) must fit EPCC_TP_MAX_ADDR */
#define EMU_INBOX 4096
#define EMU_MAX_INFLIGHT 4096
#define EMU_CONTROL_BYTES 64 /* writes this small (credits) go on the control queue */
#define EMU_MAX_LINKS 8
#define EMU_SPEC_FORM "BANDWIDTH_GBPS[/BANDWIDTH_GBPS...],LATENCY_US[/LATENCY_US...][,DEVICE[,signal]], e.g. '50,5' " \
                      "or '50/25,5,0,signal'"

typedef struct {
    cudaIpcMemHandle_t handle;
    uint64_t size;
} emu_region_addr;

typedef struct {
    cudaIpcMemHandle_t inbox;
    uint32_t n_regions;
    emu_region_addr regions[EMU_MAX_REGIONS];
} emu_addr;

static_assert(sizeof(emu_addr) <= EPCC_TP_MAX_ADDR, "the emulated transport's address must fit EPCC_TP_MAX_ADDR");

typedef struct {
    cudaEvent_t copied; /* the payload copy is done (the signal waits for it) */
    cudaEvent_t done;   /* the signal too */
    uint64_t start_ns;  /* the link is free: issue the copy */
    uint64_t ready_ns;  /* paced delivery: issue the signal, complete locally */
    uint64_t ctx;
    void *dst;
    const void *src;
    size_t len;
    uint64_t *sig_dst;  /* NULL: no signal */
    int state;          /* 0 nothing issued, 1 copy issued, 2 signal issued */
} emu_op;

/* One send queue of a link, like a NIC's queue pair: its writes are paced one after the other
 * (link order) and complete in order.  Two per link: bulk writes, and control writes of at most
 * EMU_CONTROL_BYTES (credits), which a NIC interleaves with the bulk traffic of other queue pairs
 * at packet granularity, so they do not wait behind megabytes of queued chunks. */
typedef struct {
    char name[24];
    emu_op ops[EMU_MAX_INFLIGHT];
    uint64_t head, tail;
    uint64_t link_free_ns;
    cudaStream_t stream;     /* payload copies */
    cudaStream_t sig_stream; /* signals and immediates */
    uint64_t *sig_host;      /* pinned: [EMU_MAX_INFLIGHT] signal values, by op slot */
} emu_queue;

/* One link of the spec: its rate and its two send queues. */
typedef struct {
    double bytes_per_ns, latency_ns;
    emu_queue qs[2]; /* bulk, control */
} emu_link;

typedef struct {
    epcc_tp base;
    pthread_mutex_t lock;
    int device;
    emu_link *links;          /* [base.n_links] */
    cudaStream_t poll_stream; /* reading the inbox */
    int signal_only;          /* spec ",signal": no immediates, the inbox is never read */
    uint64_t *inbox;       /* device: [nranks][EMU_INBOX] */
    uint64_t *inbox_host;  /* host copy for polling */
    uint64_t *seen;        /* [nranks]: immediates consumed per sender */
    uint64_t *sent;        /* [nranks]: immediates sent per target */
    void *regions[EMU_MAX_REGIONS];
    uint64_t region_size[EMU_MAX_REGIONS];
    unsigned region_access[EMU_MAX_REGIONS];
    uint32_t n_regions;
    void ***peer_regions; /* [nranks][EMU_MAX_REGIONS] */
    uint64_t **peer_inbox;
    epcc_tp_evq q;
} emu_tp;

struct epcc_tp_mr {
    epcc_tp *tp; /* first: see epcc_tp_mr_remote */
    uint32_t index;
    void *base;
};

#define CU(call, what)                                                                               \
    do {                                                                                             \
        cudaError_t e_ = (call);                                                                     \
        if (e_ != cudaSuccess)                                                                       \
            return epcc_tp_fail(&t->base, -EIO, "emulated: %s failed: %s", what, cudaGetErrorString(e_)); \
    } while (0)

/* The stuck-write report's probe kernel (loaded at open: loading it later, lazily, would wait
 * for the device, which is what a stuck write may be waiting for). */
__global__ void emu_probe_kernel(unsigned long long *p) { *p = 1; }

/* One '/'-separated list of numbers (a spec field): each finite and > 0 (`positive`) or >= 0.
 * Returns how many, or -EINVAL with the message in err. */
static int parse_list(const char *spec, const char *field, size_t len, const char *what, int positive,
                      double *out, int max, char *err, size_t errlen) {
    int n = 0;
    for (size_t at = 0;;) {
        size_t end = at;
        while (end < len && field[end] != '/') end++;
        char item[64];
        int fits = end - at < sizeof item;
        snprintf(item, sizeof item, "%.*s", (int)(end - at), field + at);
        char *stop = NULL;
        double v = fits && item[0] ? strtod(item, &stop) : 0.0;
        if (!fits || !item[0] || *stop || !(v == v) || v > 1e300 || (positive ? v <= 0 : v < 0))
            return epcc_tp_fail_buf(err, errlen, -EINVAL, "emulated: spec '%s': %s '%.*s' of link %d is not a number %s",
                                    spec, what, (int)(end - at), field + at, n, positive ? "> 0" : ">= 0");
        if (n == max)
            return epcc_tp_fail_buf(err, errlen, -EINVAL, "emulated: spec '%s': more than %d links", spec, max);
        out[n++] = v;
        if (end == len) return n;
        at = end + 1;
    }
}

/* The spec (see the header): links, device (-1: the current one), signal-only. */
static int parse_spec(const char *spec, double *gbps, double *lat_us, int *n_links, int *dev, int *signal_only,
                      char *err, size_t errlen) {
    const char *f[5];
    size_t len[5];
    int nf = 0;
    for (const char *at = spec;; nf++) {
        const char *comma = strchr(at, ',');
        if (nf == 4)
            return epcc_tp_fail_buf(err, errlen, -EINVAL, "emulated: spec '%s' has more than 4 fields: it must be "
                                    EMU_SPEC_FORM, spec);
        f[nf] = at;
        len[nf] = comma ? (size_t)(comma - at) : strlen(at);
        if (!comma) {
            nf++;
            break;
        }
        at = comma + 1;
    }
    if (nf < 2)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "emulated: spec '%s' must be " EMU_SPEC_FORM, spec);
    double lat[EMU_MAX_LINKS];
    int nb = parse_list(spec, f[0], len[0], "bandwidth", 1, gbps, EMU_MAX_LINKS, err, errlen);
    if (nb < 0) return nb;
    int nl = parse_list(spec, f[1], len[1], "latency", 0, lat, EMU_MAX_LINKS, err, errlen);
    if (nl < 0) return nl;
    if (nl != nb && nl != 1)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "emulated: spec '%s': %d bandwidths but %d latencies: give one "
                                "latency per link, or one for all", spec, nb, nl);
    for (int i = 0; i < nb; i++) lat_us[i] = lat[nl == 1 ? 0 : i];
    *n_links = nb;
    *dev = -1;
    *signal_only = 0;
    int next = 2;
    if (nf > 2 && !(nf == 3 && len[2] == 6 && strncmp(f[2], "signal", 6) == 0)) { /* "BW,LAT,signal": no device */
        char text[16], *stop = NULL;
        snprintf(text, sizeof text, "%.*s", (int)len[2], f[2]);
        long d = len[2] && len[2] < sizeof text ? strtol(text, &stop, 10) : -1;
        if (len[2] && (len[2] >= sizeof text || *stop || d < 0 || d > 1 << 20))
            return epcc_tp_fail_buf(err, errlen, -EINVAL, "emulated: spec '%s': device '%.*s' is not a GPU index (a "
                                    "whole number >= 0, or empty for the current GPU)", spec, (int)len[2], f[2]);
        *dev = len[2] ? (int)d : -1;
        next = 3;
    }
    if (next < nf) {
        if (len[next] != 6 || strncmp(f[next], "signal", 6) != 0)
            return epcc_tp_fail_buf(err, errlen, -EINVAL, "emulated: spec '%s': '%.*s' after the device is not "
                                    "'signal'", spec, (int)len[next], f[next]);
        *signal_only = 1;
    }
    return 0;
}

static int emu_open(const char *spec, int rank, int nranks, epcc_tp **out, char *err, size_t errlen) {
    (void)rank;
    double gbps[EMU_MAX_LINKS], lat_us[EMU_MAX_LINKS];
    int n_links = 0, dev = -1, signal_only = 0;
    int rc = parse_spec(spec, gbps, lat_us, &n_links, &dev, &signal_only, err, errlen);
    if (rc) return rc;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0)
        return epcc_tp_fail_buf(err, errlen, -ENODEV, "emulated: no CUDA device");
    emu_tp *t = (emu_tp *)calloc(1, sizeof *t);
    if (!t) return epcc_tp_fail_buf(err, errlen, -ENOMEM, "emulated: out of memory");
    *out = &t->base;
    pthread_mutex_init(&t->lock, NULL);
    t->base.n_links = n_links;
    t->links = (emu_link *)calloc((size_t)n_links, sizeof *t->links);
    if (!t->links) return epcc_tp_fail_buf(err, errlen, -ENOMEM, "emulated: out of memory");
    for (int l = 0; l < n_links; l++) {
        t->links[l].bytes_per_ns = gbps[l]; /* GB/s == bytes/ns */
        t->links[l].latency_ns = lat_us[l] * 1e3;
    }
    t->device = dev >= 0 ? dev : 0;
    t->signal_only = signal_only;
    if (dev < 0) cudaGetDevice(&t->device);
    cudaFuncAttributes probe_attr;
    t->seen = (uint64_t *)calloc((size_t)nranks, 8);
    t->sent = (uint64_t *)calloc((size_t)nranks, 8);
    t->inbox_host = (uint64_t *)calloc((size_t)nranks * EMU_INBOX, 8);
    t->peer_regions = (void ***)calloc((size_t)nranks, sizeof(void **));
    t->peer_inbox = (uint64_t **)calloc((size_t)nranks, sizeof(uint64_t *));
    if (!t->seen || !t->sent || !t->inbox_host || !t->peer_regions || !t->peer_inbox)
        return epcc_tp_fail_buf(err, errlen, -ENOMEM, "emulated: out of memory");
    if (cudaSetDevice(t->device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&t->poll_stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaMalloc((void **)&t->inbox, (size_t)nranks * EMU_INBOX * 8) != cudaSuccess ||
        cudaMemset(t->inbox, 0, (size_t)nranks * EMU_INBOX * 8) != cudaSuccess ||
        cudaFuncGetAttributes(&probe_attr, emu_probe_kernel) != cudaSuccess)
        return epcc_tp_fail_buf(err, errlen, -EIO, "emulated: CUDA setup on device %d failed", t->device);
    for (int q = 0; q < 2 * n_links; q++) {
        emu_queue *qu = &t->links[q / 2].qs[q % 2];
        if (n_links == 1)
            snprintf(qu->name, sizeof qu->name, "%s", q % 2 ? "control" : "bulk");
        else
            snprintf(qu->name, sizeof qu->name, "link %d %s", q / 2, q % 2 ? "control" : "bulk");
        if (cudaStreamCreateWithFlags(&qu->stream, cudaStreamNonBlocking) != cudaSuccess ||
            cudaStreamCreateWithFlags(&qu->sig_stream, cudaStreamNonBlocking) != cudaSuccess ||
            cudaHostAlloc((void **)&qu->sig_host, EMU_MAX_INFLIGHT * 8, cudaHostAllocPortable) != cudaSuccess)
            return epcc_tp_fail_buf(err, errlen, -EIO, "emulated: CUDA setup on device %d failed", t->device);
        for (int i = 0; i < EMU_MAX_INFLIGHT; i++) {
            cudaEventCreateWithFlags(&qu->ops[i].done, cudaEventDisableTiming);
            cudaEventCreateWithFlags(&qu->ops[i].copied, cudaEventDisableTiming);
        }
    }
    if (n_links == 1) {
        snprintf(t->base.desc, sizeof t->base.desc, "emulated (copy engine on GPU %d, paced to %g GB/s, %g us)",
                 t->device, gbps[0], lat_us[0]);
    } else {
        size_t n = (size_t)snprintf(t->base.desc, sizeof t->base.desc, "emulated (copy engine on GPU %d, %d links "
                                    "paced to", t->device, n_links);
        for (int l = 0; l < n_links && n < sizeof t->base.desc; l++)
            n += (size_t)snprintf(t->base.desc + n, sizeof t->base.desc - n, "%s %g GB/s %g us", l ? "," : "",
                                  gbps[l], lat_us[l]);
        if (n < sizeof t->base.desc) snprintf(t->base.desc + n, sizeof t->base.desc - n, ")");
    }
    return 0;
}

static int emu_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **out) {
    emu_tp *t = (emu_tp *)tp;
    if (t->n_regions >= EMU_MAX_REGIONS) return epcc_tp_fail(tp, -ENOSPC, "emulated: more than %d regions", EMU_MAX_REGIONS);
    epcc_tp_mr *m = (epcc_tp_mr *)calloc(1, sizeof *m);
    if (!m) return epcc_tp_fail(tp, -ENOMEM, "emulated: out of memory");
    m->tp = tp;
    m->index = t->n_regions++;
    m->base = buf;
    t->regions[m->index] = buf;
    t->region_size[m->index] = len;
    t->region_access[m->index] = access;
    *out = m;
    return 0;
}

static void emu_mr_remote(const epcc_tp_mr *m, uint64_t *addr, uint64_t *key) {
    *addr = 0; /* offsets into the region */
    *key = m->index;
}

static int emu_dereg(epcc_tp *tp, epcc_tp_mr *m) {
    (void)tp;
    free(m);
    return 0;
}

static int emu_address(epcc_tp *tp, void *buf, size_t *len) {
    emu_tp *t = (emu_tp *)tp;
    if (*len < sizeof(emu_addr)) return epcc_tp_fail(tp, -ENOSPC, "emulated: the address needs %zu bytes", sizeof(emu_addr));
    emu_addr a;
    memset(&a, 0, sizeof a);
    CU(cudaIpcGetMemHandle(&a.inbox, t->inbox), "cudaIpcGetMemHandle (inbox)");
    a.n_regions = t->n_regions;
    for (uint32_t i = 0; i < t->n_regions; i++) { /* only targets of peers' writes (cudaMalloc'd) are exported */
        if (!(t->region_access[i] & EPCC_TP_REMOTE_WRITE)) continue;
        CU(cudaIpcGetMemHandle(&a.regions[i].handle, t->regions[i]), "cudaIpcGetMemHandle (a registered region)");
        a.regions[i].size = t->region_size[i];
    }
    memcpy(buf, &a, sizeof a);
    *len = sizeof a;
    return 0;
}

static int emu_connect(epcc_tp *tp, const void *blobs, size_t blob_len) {
    emu_tp *t = (emu_tp *)tp;
    for (int r = 0; r < tp->nranks; r++) {
        emu_addr a;
        memcpy(&a, (const char *)blobs + (size_t)r * blob_len, sizeof a);
        t->peer_regions[r] = (void **)calloc(EMU_MAX_REGIONS, sizeof(void *));
        if (!t->peer_regions[r]) return epcc_tp_fail(tp, -ENOMEM, "emulated: out of memory");
        if (r == tp->rank) {
            t->peer_inbox[r] = t->inbox;
            for (uint32_t i = 0; i < t->n_regions; i++) t->peer_regions[r][i] = t->regions[i];
            continue;
        }
        CU(cudaIpcOpenMemHandle((void **)&t->peer_inbox[r], a.inbox, cudaIpcMemLazyEnablePeerAccess),
           "cudaIpcOpenMemHandle (a peer's inbox)");
        for (uint32_t i = 0; i < a.n_regions; i++)
            if (a.regions[i].size)
                CU(cudaIpcOpenMemHandle(&t->peer_regions[r][i], a.regions[i].handle, cudaIpcMemLazyEnablePeerAccess),
                   "cudaIpcOpenMemHandle (a peer's region)");
    }
    return 0;
}

/* The calling thread (the proxy's, not the one that opened the transport) must have the
 * transport's device current: a copy issued from another device's context is staged and blocks. */
static int on_device(emu_tp *t) {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == t->device) return 0;
    cudaError_t e = cudaSetDevice(t->device);
    return e == cudaSuccess ? 0 : epcc_tp_fail(&t->base, -EIO, "emulated: cudaSetDevice(%d) failed: %s", t->device,
                                               cudaGetErrorString(e));
}

/* Issue what is due on one queue: an op's copy once the link is free (start), its signal once a
 * link of the class would have delivered it (ready).  A queue's ops are in link order, so start
 * and ready increase. */
static int progress_queue(emu_tp *t, emu_queue *qu, uint64_t now) {
    for (uint64_t i = qu->head; i < qu->tail; i++) {
        emu_op *o = &qu->ops[i % EMU_MAX_INFLIGHT];
        if (o->state == 0) {
            if (now < o->start_ns) break;
            cudaError_t e = cudaMemcpyAsync(o->dst, o->src, o->len, cudaMemcpyDefault, qu->stream);
            if (e == cudaSuccess) e = cudaEventRecord(o->copied, qu->stream);
            if (e != cudaSuccess)
                return epcc_tp_fail(&t->base, -EIO, "emulated: issuing a copy failed: %s", cudaGetErrorString(e));
            o->state = 1;
        }
        if (o->state == 1) {
            if (now < o->ready_ns) continue; /* later ops' copies may start meanwhile */
            cudaError_t e = cudaStreamWaitEvent(qu->sig_stream, o->copied, 0);
            if (e == cudaSuccess && o->sig_dst)
                e = cudaMemcpyAsync(o->sig_dst, &qu->sig_host[i % EMU_MAX_INFLIGHT], 8, cudaMemcpyDefault,
                                    qu->sig_stream);
            if (e == cudaSuccess) e = cudaEventRecord(o->done, qu->sig_stream);
            if (e != cudaSuccess)
                return epcc_tp_fail(&t->base, -EIO, "emulated: issuing a signal failed: %s", cudaGetErrorString(e));
            o->state = 2;
            if (o->sig_dst) { /* how late the polling issued it: the landing a NIC would signal at `ready` */
                t->base.stats.signal_lag_ns += now - o->ready_ns;
                t->base.stats.signals++;
            }
        }
    }
    return 0;
}

static int progress(emu_tp *t) {
    uint64_t now = epcc_tp_now_ns();
    for (int l = 0; l < t->base.n_links; l++)
        for (int k = 0; k < 2; k++)
            if (progress_queue(t, &t->links[l].qs[k], now)) return -EIO;
    return 0;
}

/* For the stuck-write report: which of these go through on a fresh stream, each waited on for at
 * most 100 ms: the same copy, a local copy from the same source, a copy to the same peer
 * address from the inbox, a one-thread kernel.  Says whether the copy engine, the peer mapping
 * or the whole device stopped accepting work.  Only on the way to failing the transport: the
 * probes overwrite the stuck write's landing slot and the first inbox word. */
static const char *probe_wait(cudaStream_t s, cudaError_t e) {
    cudaEvent_t ev;
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    if ((e = cudaEventRecord(ev, s)) != cudaSuccess) return cudaGetErrorString(e);
    uint64_t until = epcc_tp_now_ns() + 100000000ull;
    while ((e = cudaEventQuery(ev)) == cudaErrorNotReady && epcc_tp_now_ns() < until) {
    }
    cudaEventDestroy(ev); /* released once recorded work completes */
    return e == cudaSuccess ? "done" : e == cudaErrorNotReady ? "pending" : cudaGetErrorString(e);
}

static void probe_copy(emu_tp *t, const emu_queue *qu, const emu_op *o, char *out, size_t n) {
    cudaStream_t s[4];
    for (int i = 0; i < 4; i++)
        if (cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking) != cudaSuccess) {
            snprintf(out, n, "no probe stream");
            return;
        }
    size_t len = o->len < 4096 ? o->len : 4096;
    const char *same = probe_wait(s[0], cudaMemcpyAsync(o->dst, o->src, len, cudaMemcpyDefault, s[0]));
    const char *local = probe_wait(s[1], cudaMemcpyAsync(t->inbox, o->src, 8, cudaMemcpyDefault, s[1]));
    const char *peer = probe_wait(s[2], cudaMemcpyAsync(o->dst, t->inbox, 8, cudaMemcpyDefault, s[2]));
    emu_probe_kernel<<<1, 1, 0, s[3]>>>((unsigned long long *)t->inbox);
    const char *kernel = probe_wait(s[3], cudaGetLastError());
    for (int i = 0; i < 4; i++) cudaStreamDestroy(s[i]);
    cudaError_t sq = cudaStreamQuery(qu->stream);
    snprintf(out, n, "probes on fresh streams: the same copy %s, a local copy %s, 8 B to the same peer address %s, "
             "a kernel %s; the transport's stream %s", same, local, peer, kernel,
             sq == cudaSuccess ? "idle" : sq == cudaErrorNotReady ? "busy" : cudaGetErrorString(sq));
}

/* Completed ops (copy and signal done, paced time reached), in order; the inbox's new immediates. */
static int reap_queue(emu_tp *t, emu_queue *qu) {
    uint64_t now = epcc_tp_now_ns();
    while (qu->head < qu->tail) {
        emu_op *o = &qu->ops[qu->head % EMU_MAX_INFLIGHT];
        if (o->state != 2 || now < o->ready_ns) break;
        cudaError_t q = cudaEventQuery(o->done);
        if (q == cudaErrorNotReady) {
            if (now > o->ready_ns + 2000000000ull) { /* a copy engine transfer stuck for 2 s: say which */
                cudaError_t c = cudaEventQuery(o->copied);
                char probe[320];
                probe_copy(t, qu, o, probe, sizeof probe);
                return epcc_tp_fail(&t->base, -ETIMEDOUT, "emulated: %s write %llu (%zu bytes) not complete 2 s after "
                                    "its paced time: payload copy %s, signal %s; %s", qu->name,
                                    (unsigned long long)qu->head, o->len,
                                    c == cudaSuccess ? "done" : c == cudaErrorNotReady ? "pending" : cudaGetErrorString(c),
                                    o->sig_dst ? "pending" : "none", probe);
            }
            break;
        }
        if (q != cudaSuccess) return epcc_tp_fail(&t->base, -EIO, "emulated: a copy failed: %s", cudaGetErrorString(q));
        epcc_tp_event ev = {EPCC_TP_EV_LOCAL, 0, o->ctx};
        epcc_tp_evq_push(&t->q, ev);
        t->base.stats.local_completions++;
        qu->head++;
    }
    return 0;
}

static int reap(emu_tp *t) {
    if (progress(t)) return -EIO;
    for (int l = 0; l < t->base.n_links; l++)
        for (int k = 0; k < 2; k++)
            if (reap_queue(t, &t->links[l].qs[k])) return -EIO;
    if (t->signal_only) return 0;
    int n = t->base.nranks;
    /* Its own non-blocking stream: never ordered behind a kernel on the legacy default stream. */
    if (cudaMemcpyAsync(t->inbox_host, t->inbox, (size_t)n * EMU_INBOX * 8, cudaMemcpyDeviceToHost, t->poll_stream) !=
            cudaSuccess || cudaStreamSynchronize(t->poll_stream) != cudaSuccess)
        return epcc_tp_fail(&t->base, -EIO, "emulated: reading the inbox failed");
    for (int s = 0; s < n; s++) {
        for (;;) {
            uint64_t v = t->inbox_host[(size_t)s * EMU_INBOX + t->seen[s] % EMU_INBOX];
            if ((v >> 32) != (t->seen[s] / EMU_INBOX) * 2 + 1) break; /* lap-tagged valid word */
            epcc_tp_event ev = {EPCC_TP_EV_REMOTE, (uint32_t)v, 0};
            epcc_tp_evq_push(&t->q, ev);
            t->base.stats.imm_received++;
            t->seen[s]++;
        }
    }
    return 0;
}

/* Queue one paced op on `link`: the copy, then (optional) 8 bytes of `sig_value` at `sig_dst`. */
static int enqueue(emu_tp *t, int peer, unsigned link, const void *src, size_t len, uint64_t raddr, uint64_t rkey,
                   uint64_t *sig_dst, uint64_t sig_value, uint64_t ctx, uint64_t timeout_ns) {
    uint64_t deadline = epcc_tp_deadline(timeout_ns);
    emu_link *ln = &t->links[link]; /* below n_links: epcc_transport.c checked it */
    emu_queue *qu = &ln->qs[len <= EMU_CONTROL_BYTES ? 1 : 0];
    while (qu->tail - qu->head >= EMU_MAX_INFLIGHT) {
        t->base.stats.eagain++;
        if (reap(t) || epcc_tp_now_ns() >= deadline)
            return epcc_tp_fail(&t->base, -EAGAIN, "emulated: %d %s writes in flight for too long", EMU_MAX_INFLIGHT,
                                qu->name);
    }
    if (rkey >= EMU_MAX_REGIONS || !t->peer_regions[peer] || !t->peer_regions[peer][rkey])
        return epcc_tp_fail(&t->base, -EINVAL, "emulated: rank %d has no region %llu", peer, (unsigned long long)rkey);
    uint64_t now = epcc_tp_now_ns();
    uint64_t start = now > qu->link_free_ns ? now : qu->link_free_ns;
    if (qu == &ln->qs[0] && qu->link_free_ns && now > qu->link_free_ns &&
        now - qu->link_free_ns < EPCC_TP_BURST_GAP_NS) { /* the link idled inside a stream: nothing posted */
        t->base.stats.link_idle_ns += now - qu->link_free_ns;
        t->base.stats.link_gaps++;
    }
    uint64_t busy = (uint64_t)((double)len / ln->bytes_per_ns);
    qu->link_free_ns = start + busy;
    uint64_t i = qu->tail;
    emu_op *o = &qu->ops[i % EMU_MAX_INFLIGHT];
    o->start_ns = start;
    o->ready_ns = start + busy + (uint64_t)ln->latency_ns;
    o->ctx = ctx;
    o->dst = (char *)t->peer_regions[peer][rkey] + raddr;
    o->src = src;
    o->len = len;
    o->sig_dst = sig_dst;
    o->state = 0;
    qu->sig_host[i % EMU_MAX_INFLIGHT] = sig_value;
    qu->tail++;
    t->base.stats.writes_posted++;
    t->base.stats.bytes_posted += len;
    return progress(t);
}

static int emu_post_write(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *m,
                          uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx,
                          uint64_t timeout_ns) {
    emu_tp *t = (emu_tp *)tp;
    (void)m;
    pthread_mutex_lock(&t->lock);
    if (on_device(t)) {
        pthread_mutex_unlock(&t->lock);
        return -EIO;
    }
    int rc;
    if (imm_valid && t->signal_only) {
        rc = epcc_tp_fail(tp, -EINVAL, "emulated: a write with an immediate on a transport opened with ',signal'");
    } else if (imm_valid) {
        uint64_t k = t->sent[peer]++;
        uint64_t word = (((k / EMU_INBOX) * 2 + 1) << 32) | imm;
        rc = enqueue(t, peer, link, src, len, raddr, rkey,
                     t->peer_inbox[peer] + (size_t)tp->rank * EMU_INBOX + k % EMU_INBOX, word, ctx, timeout_ns);
    } else {
        rc = enqueue(t, peer, link, src, len, raddr, rkey, NULL, 0, ctx, timeout_ns);
    }
    pthread_mutex_unlock(&t->lock);
    return rc;
}

static int emu_post_write_signal(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *m,
                                 uint64_t raddr, uint64_t rkey, uint64_t sig_raddr, uint64_t sig_rkey,
                                 uint64_t sig_value, uint64_t ctx, uint64_t timeout_ns) {
    emu_tp *t = (emu_tp *)tp;
    (void)m;
    pthread_mutex_lock(&t->lock);
    int rc;
    if (on_device(t))
        rc = -EIO;
    else if (sig_rkey >= EMU_MAX_REGIONS || !t->peer_regions[peer] || !t->peer_regions[peer][sig_rkey] || (sig_raddr & 7))
        rc = epcc_tp_fail(tp, -EINVAL, "emulated: rank %d has no signal word at region %llu offset %llu", peer,
                          (unsigned long long)sig_rkey, (unsigned long long)sig_raddr);
    else
        rc = enqueue(t, peer, link, src, len, raddr, rkey,
                     (uint64_t *)((char *)t->peer_regions[peer][sig_rkey] + sig_raddr), sig_value, ctx, timeout_ns);
    pthread_mutex_unlock(&t->lock);
    return rc;
}

static int emu_poll(epcc_tp *tp, epcc_tp_event *events, int max) {
    emu_tp *t = (emu_tp *)tp;
    pthread_mutex_lock(&t->lock);
    int n = epcc_tp_evq_pop(&t->q, events, max), r = on_device(t);
    if (r == 0 && n < max && (r = reap(t)) == 0) n += epcc_tp_evq_pop(&t->q, events + n, max - n);
    pthread_mutex_unlock(&t->lock);
    return r < 0 ? r : n;
}

static int emu_flush(epcc_tp *tp, uint64_t timeout_ns) {
    emu_tp *t = (emu_tp *)tp;
    uint64_t deadline = epcc_tp_deadline(timeout_ns);
    for (;;) {
        pthread_mutex_lock(&t->lock);
        int r = on_device(t) ? -EIO : reap(t);
        uint64_t left = 0;
        for (int q = 0; q < 2 * tp->n_links; q++) left += t->links[q / 2].qs[q % 2].tail - t->links[q / 2].qs[q % 2].head;
        pthread_mutex_unlock(&t->lock);
        if (r) return r;
        if (!left) return 0;
        if (epcc_tp_now_ns() >= deadline) return epcc_tp_fail(tp, -ETIMEDOUT, "emulated: flush timed out");
    }
}

static void emu_close(epcc_tp *tp) {
    emu_tp *t = (emu_tp *)tp;
    for (int r = 0; r < tp->nranks; r++) {
        if (r != tp->rank && t->peer_regions && t->peer_regions[r])
            for (int i = 0; i < EMU_MAX_REGIONS; i++)
                if (t->peer_regions[r][i]) cudaIpcCloseMemHandle(t->peer_regions[r][i]);
        if (r != tp->rank && t->peer_inbox && t->peer_inbox[r]) cudaIpcCloseMemHandle(t->peer_inbox[r]);
        if (t->peer_regions) free(t->peer_regions[r]);
    }
    for (int q = 0; t->links && q < 2 * tp->n_links; q++) {
        emu_queue *qu = &t->links[q / 2].qs[q % 2];
        for (int i = 0; i < EMU_MAX_INFLIGHT; i++) {
            if (qu->ops[i].done) cudaEventDestroy(qu->ops[i].done);
            if (qu->ops[i].copied) cudaEventDestroy(qu->ops[i].copied);
        }
        if (qu->sig_host) cudaFreeHost(qu->sig_host);
        if (qu->stream) cudaStreamDestroy(qu->stream);
        if (qu->sig_stream) cudaStreamDestroy(qu->sig_stream);
    }
    free(t->links);
    cudaFree(t->inbox);
    cudaStreamDestroy(t->poll_stream);
    free(t->peer_regions);
    free(t->peer_inbox);
    free(t->inbox_host);
    free(t->seen);
    free(t->sent);
    free(t->q.ev);
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

const epcc_tp_ops epcc_tp_ops_emulated = {
    "emulated", emu_open, emu_reg, emu_mr_remote, emu_dereg, emu_address, emu_connect,
    emu_post_write, emu_poll, emu_flush, emu_close, emu_post_write_signal,
};
