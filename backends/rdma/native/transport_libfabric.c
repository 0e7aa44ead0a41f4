/*
 * transport_libfabric.c - epcc_transport.h over libfabric: reliable-datagram endpoints
 * (FI_EP_RDM), one-sided fi_writedata with FI_REMOTE_CQ_DATA (the immediate), fi_write without.
 *
 * spec: "PROVIDER[@DOMAIN]", e.g. "tcp" (the tcp;ofi_rxm stack: runs on loopback between
 * processes), "verbs", "efa", "cxi"; an empty spec takes the first provider offering RMA.
 *
 * One endpoint per process, one completion queue (FI_CQ_FORMAT_DATA) for transmit and receive,
 * an address vector (FI_AV_TABLE) holding every rank.  Modes handled: FI_CONTEXT (every
 * operation carries a struct fi_context of ours) and FI_RX_CQ_DATA (a write with remote CQ data
 * consumes a posted receive at the target: we keep EPCC_LF_RECVS zero-byte receives posted and
 * repost each as it completes).  Memory registration honours the provider's mr_mode
 * (FI_MR_LOCAL descriptors, FI_MR_VIRT_ADDR or offsets, FI_MR_PROV_KEY or our keys,
 * FI_MR_ENDPOINT binding).  Progress is driven by polling (the proxy and receiver threads poll
 * the CQ all the time, which covers FI_PROGRESS_MANUAL providers such as tcp); one mutex
 * serialises every call into the provider (the domain is opened FI_THREAD_DOMAIN).
 * Links: one (the endpoint); every post is on link 0.
 */
#define _POSIX_C_SOURCE 200809L
#include "epcc_transport_impl.h"

#include <pthread.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define EPCC_LF_RECVS 256
#define EPCC_LF_CQ_BATCH 64

enum { OP_WRITE = 1, OP_RECV = 2 };

typedef struct lf_op {
    struct fi_context fictx; /* first: the provider hands it back as op_context */
    struct lf_op *next;      /* free list */
    int kind;
    uint64_t user_ctx;
} lf_op;

typedef struct {
    epcc_tp base;
    pthread_mutex_t lock;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    fi_addr_t *peers;
    int connected;
    int rx_cq_data; /* FI_RX_CQ_DATA: remote CQ data consumes posted receives */
    uint64_t mr_mode;
    uint64_t next_key;
    lf_op *free_ops;
    lf_op *recv_ops;
    uint64_t outstanding; /* writes posted, not yet completed locally */
    epcc_tp_evq q;
} lf_tp;

struct epcc_tp_mr {
    epcc_tp *tp; /* first: see epcc_tp_mr_remote */
    struct fid_mr *mr;
    void *desc;
    uint64_t addr, key;
};

static int lf_err(lf_tp *t, int rc, const char *what) {
    return epcc_tp_fail(&t->base, rc < 0 ? rc : -EIO, "libfabric %s: %s failed: %s (%d)",
                        t->info && t->info->fabric_attr ? t->info->fabric_attr->prov_name : "?", what,
                        fi_strerror(rc < 0 ? -rc : rc), rc);
}

static lf_op *op_get(lf_tp *t) {
    lf_op *o = t->free_ops;
    if (o) {
        t->free_ops = o->next;
    } else {
        o = (lf_op *)calloc(1, sizeof *o);
        if (!o) return NULL;
    }
    memset(&o->fictx, 0, sizeof o->fictx);
    o->next = NULL;
    return o;
}

static void op_put(lf_tp *t, lf_op *o) {
    o->next = t->free_ops;
    t->free_ops = o;
}

static int post_recv(lf_tp *t, lf_op *o) {
    o->kind = OP_RECV;
    memset(&o->fictx, 0, sizeof o->fictx);
    ssize_t rc;
    do {
        rc = fi_recv(t->ep, NULL, 0, NULL, FI_ADDR_UNSPEC, &o->fictx);
        if (rc == -FI_EAGAIN) {
            struct fi_cq_data_entry e;
            (void)fi_cq_read(t->cq, &e, 0); /* progress only */
        }
    } while (rc == -FI_EAGAIN);
    return rc ? lf_err(t, (int)rc, "fi_recv (a receive for remote CQ data)") : 0;
}

static int lf_open(const char *spec, int rank, int nranks, epcc_tp **out, char *err, size_t errlen) {
    (void)rank;
    char prov[128] = "", dom[128] = "";
    const char *at = strchr(spec, '@');
    if (at) {
        snprintf(prov, sizeof prov, "%.*s", (int)(at - spec), spec);
        snprintf(dom, sizeof dom, "%s", at + 1);
    } else {
        snprintf(prov, sizeof prov, "%s", spec);
    }
    lf_tp *t = (lf_tp *)calloc(1, sizeof *t);
    if (!t) return epcc_tp_fail_buf(err, errlen, -ENOMEM, "libfabric: out of memory");
    pthread_mutex_init(&t->lock, NULL);
    t->peers = (fi_addr_t *)calloc((size_t)nranks, sizeof *t->peers);
    struct fi_info *hints = fi_allocinfo();
    if (!hints || !t->peers) {
        free(t->peers);
        free(t);
        return epcc_tp_fail_buf(err, errlen, -ENOMEM, "libfabric: out of memory");
    }
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->mode = FI_CONTEXT | FI_RX_CQ_DATA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    if (prov[0]) hints->fabric_attr->prov_name = strdup(prov);
    if (dom[0]) hints->domain_attr->name = strdup(dom);
    struct fi_info *info = NULL;
    int rc = fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    if (rc || !info) {
        free(t->peers);
        free(t);
        return epcc_tp_fail_buf(err, errlen, -ENODEV,
                                "libfabric: no provider '%s'%s%s offers reliable-datagram endpoints with RMA writes "
                                "(fi_getinfo: %s); `fi_info -p %s -t FI_EP_RDM -c FI_RMA` lists what there is",
                                prov[0] ? prov : "(any)", dom[0] ? " on domain " : "", dom, fi_strerror(-rc),
                                prov[0] ? prov : "PROVIDER");
    }
    /* The first match, preferring one that carries remote CQ data of at least 4 bytes. */
    struct fi_info *pick = NULL;
    for (struct fi_info *i = info; i; i = i->next)
        if (i->domain_attr->cq_data_size >= 4) {
            pick = i;
            break;
        }
    if (!pick) {
        fi_freeinfo(info);
        free(t->peers);
        free(t);
        return epcc_tp_fail_buf(err, errlen, -ENOTSUP,
                                "libfabric: provider '%s' carries no remote CQ data (cq_data_size 0); epcc needs a "
                                "32-bit immediate per write",
                                prov);
    }
    t->info = fi_dupinfo(pick);
    fi_freeinfo(info);
    t->mr_mode = (uint64_t)t->info->domain_attr->mr_mode;
    t->rx_cq_data = (t->info->mode & FI_RX_CQ_DATA) != 0;
    t->next_key = 1;
    *out = &t->base;

    if ((rc = fi_fabric(t->info->fabric_attr, &t->fabric, NULL))) goto fail_fabric;
    if ((rc = fi_domain(t->fabric, t->info, &t->domain, NULL))) goto fail_domain;
    struct fi_cq_attr cqa;
    memset(&cqa, 0, sizeof cqa);
    cqa.format = FI_CQ_FORMAT_DATA;
    cqa.size = 4096;
    cqa.wait_obj = FI_WAIT_NONE;
    if ((rc = fi_cq_open(t->domain, &cqa, &t->cq, NULL))) goto fail_cq;
    struct fi_av_attr ava;
    memset(&ava, 0, sizeof ava);
    ava.type = FI_AV_TABLE;
    ava.count = (size_t)nranks;
    if ((rc = fi_av_open(t->domain, &ava, &t->av, NULL))) goto fail_av;
    if ((rc = fi_endpoint(t->domain, t->info, &t->ep, NULL))) goto fail_ep;
    if ((rc = fi_ep_bind(t->ep, &t->av->fid, 0))) goto fail_bind;
    if ((rc = fi_ep_bind(t->ep, &t->cq->fid, FI_TRANSMIT | FI_RECV))) goto fail_bind;
    if ((rc = fi_enable(t->ep))) goto fail_enable;
    if (t->rx_cq_data) {
        for (int i = 0; i < EPCC_LF_RECVS; i++) {
            lf_op *o = op_get(t);
            if (!o) return epcc_tp_fail_buf(err, errlen, -ENOMEM, "libfabric: out of memory");
            o->next = t->recv_ops;
            t->recv_ops = o; /* the list of every receive op, for close() */
            if ((rc = post_recv(t, o))) {
                snprintf(err, errlen, "%s", t->base.err);
                return rc;
            }
        }
    }
    snprintf(t->base.desc, sizeof t->base.desc, "libfabric %s (FI_EP_RDM, fabric %s, domain %s%s)",
             t->info->fabric_attr->prov_name, t->info->fabric_attr->name, t->info->domain_attr->name,
             t->rx_cq_data ? ", FI_RX_CQ_DATA" : "");
    return 0;

#define LF_FAIL(what)                                                                                  \
    lf_err(t, rc, what);                                                                               \
    snprintf(err, errlen, "%s", t->base.err);                                                          \
    return rc < 0 ? rc : -EIO;
fail_fabric:
    LF_FAIL("fi_fabric")
fail_domain:
    LF_FAIL("fi_domain")
fail_cq:
    LF_FAIL("fi_cq_open")
fail_av:
    LF_FAIL("fi_av_open")
fail_ep:
    LF_FAIL("fi_endpoint")
fail_bind:
    LF_FAIL("fi_ep_bind")
fail_enable:
    LF_FAIL("fi_enable")
#undef LF_FAIL
}

static int lf_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **out) {
    lf_tp *t = (lf_tp *)tp;
    epcc_tp_mr *m = (epcc_tp_mr *)calloc(1, sizeof *m);
    if (!m) return epcc_tp_fail(tp, -ENOMEM, "libfabric: out of memory");
    m->tp = tp;
    uint64_t acc = 0;
    if (access & EPCC_TP_LOCAL) acc |= FI_WRITE;
    if (access & EPCC_TP_REMOTE_WRITE) acc |= FI_REMOTE_WRITE;
    pthread_mutex_lock(&t->lock);
    uint64_t want_key = t->next_key++;
    int rc = fi_mr_reg(t->domain, buf, len ? len : 1, acc, 0, want_key, 0, &m->mr, NULL);
    if (!rc && (t->mr_mode & FI_MR_ENDPOINT)) {
        rc = fi_mr_bind(m->mr, &t->ep->fid, 0);
        if (!rc) rc = fi_mr_enable(m->mr);
    }
    pthread_mutex_unlock(&t->lock);
    if (rc) {
        free(m);
        return lf_err(t, rc, "fi_mr_reg");
    }
    m->desc = fi_mr_desc(m->mr);
    m->key = fi_mr_key(m->mr);
    m->addr = (t->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0;
    *out = m;
    return 0;
}

static void lf_mr_remote(const epcc_tp_mr *m, uint64_t *addr, uint64_t *key) {
    *addr = m->addr;
    *key = m->key;
}

static int lf_dereg(epcc_tp *tp, epcc_tp_mr *m) {
    lf_tp *t = (lf_tp *)tp;
    if (!m) return 0;
    pthread_mutex_lock(&t->lock);
    int rc = fi_close(&m->mr->fid);
    pthread_mutex_unlock(&t->lock);
    free(m);
    return rc ? lf_err(t, rc, "fi_close (memory region)") : 0;
}

static int lf_address(epcc_tp *tp, void *buf, size_t *len) {
    lf_tp *t = (lf_tp *)tp;
    size_t n = *len;
    int rc = fi_getname(&t->ep->fid, buf, &n);
    if (rc) return lf_err(t, rc, "fi_getname");
    *len = n;
    return 0;
}

static int lf_connect(epcc_tp *tp, const void *blobs, size_t blob_len) {
    lf_tp *t = (lf_tp *)tp;
    pthread_mutex_lock(&t->lock);
    for (int r = 0; r < tp->nranks; r++) {
        int n = fi_av_insert(t->av, (const char *)blobs + (size_t)r * blob_len, 1, &t->peers[r], 0, NULL);
        if (n != 1) {
            pthread_mutex_unlock(&t->lock);
            return epcc_tp_fail(tp, -EINVAL, "libfabric: fi_av_insert of rank %d's address failed (%d: %s)", r, n,
                                fi_strerror(n < 0 ? -n : EINVAL));
        }
    }
    t->connected = 1;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

/* Reap up to EPCC_LF_CQ_BATCH completions into the event queue.  Caller holds the lock. */
static int reap(lf_tp *t) {
    struct fi_cq_data_entry e[EPCC_LF_CQ_BATCH];
    ssize_t n = fi_cq_read(t->cq, e, EPCC_LF_CQ_BATCH);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry ee;
        memset(&ee, 0, sizeof ee);
        char pbuf[256] = "";
        if (fi_cq_readerr(t->cq, &ee, 0) < 0) return lf_err(t, -EIO, "fi_cq_readerr");
        const char *why = fi_cq_strerror(t->cq, ee.prov_errno, ee.err_data, pbuf, sizeof pbuf);
        lf_op *o = (lf_op *)ee.op_context;
        epcc_tp_fail(&t->base, -EIO, "libfabric %s: %s failed: %s (provider: %s)", t->info->fabric_attr->prov_name,
                     o && o->kind == OP_RECV ? "a receive" : "a write", fi_strerror(ee.err), why ? why : "?");
        epcc_tp_event ev = {EPCC_TP_EV_ERROR, 0, o && o->kind == OP_WRITE ? o->user_ctx : 0};
        if (o && o->kind == OP_WRITE) {
            t->outstanding--;
            op_put(t, o);
        }
        epcc_tp_evq_push(&t->q, ev);
        return 1;
    }
    if (n < 0) return lf_err(t, (int)n, "fi_cq_read");
    for (ssize_t i = 0; i < n; i++) {
        lf_op *o = (lf_op *)e[i].op_context;
        if (e[i].flags & FI_REMOTE_CQ_DATA) {
            epcc_tp_event ev = {EPCC_TP_EV_REMOTE, (uint32_t)e[i].data, 0};
            t->base.stats.imm_received++;
            if (epcc_tp_evq_push(&t->q, ev)) return epcc_tp_fail(&t->base, -ENOMEM, "libfabric: out of memory");
            if (o && o->kind == OP_RECV) {
                int rc = post_recv(t, o);
                if (rc) return rc;
            }
        } else if (o && o->kind == OP_WRITE) {
            epcc_tp_event ev = {EPCC_TP_EV_LOCAL, 0, o->user_ctx};
            t->outstanding--;
            t->base.stats.local_completions++;
            op_put(t, o);
            if (epcc_tp_evq_push(&t->q, ev)) return epcc_tp_fail(&t->base, -ENOMEM, "libfabric: out of memory");
        } else if (o && o->kind == OP_RECV) {
            int rc = post_recv(t, o); /* a message we never send: keep the receive posted */
            if (rc) return rc;
        }
    }
    return (int)n;
}

static int lf_post_write(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *m,
                         uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx,
                         uint64_t timeout_ns) {
    lf_tp *t = (lf_tp *)tp;
    (void)link; /* one endpoint: one link */
    if (!t->connected) return epcc_tp_fail(tp, -ENOTCONN, "libfabric: write before epcc_tp_connect");
    pthread_mutex_lock(&t->lock);
    lf_op *o = op_get(t);
    if (!o) {
        pthread_mutex_unlock(&t->lock);
        return epcc_tp_fail(tp, -ENOMEM, "libfabric: out of memory");
    }
    o->kind = OP_WRITE;
    o->user_ctx = ctx;
    uint64_t deadline = 0;
    for (;;) {
        ssize_t rc = imm_valid ? fi_writedata(t->ep, src, len, m ? m->desc : NULL, imm, t->peers[peer], raddr, rkey,
                                              &o->fictx)
                               : fi_write(t->ep, src, len, m ? m->desc : NULL, t->peers[peer], raddr, rkey, &o->fictx);
        if (rc == 0) break;
        if (rc != -FI_EAGAIN) {
            op_put(t, o);
            pthread_mutex_unlock(&t->lock);
            return lf_err(t, (int)rc, imm_valid ? "fi_writedata" : "fi_write");
        }
        t->base.stats.eagain++;
        if (!deadline) deadline = epcc_tp_deadline(timeout_ns);
        int r = reap(t);
        if (r < 0) {
            op_put(t, o);
            pthread_mutex_unlock(&t->lock);
            return r;
        }
        if (epcc_tp_now_ns() >= deadline) {
            op_put(t, o);
            pthread_mutex_unlock(&t->lock);
            return epcc_tp_fail(tp, -EAGAIN, "libfabric: the send queue to rank %d stayed full for %.3f s", peer,
                                (double)timeout_ns / 1e9);
        }
    }
    t->outstanding++;
    t->base.stats.writes_posted++;
    t->base.stats.bytes_posted += len;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

static int lf_poll(epcc_tp *tp, epcc_tp_event *events, int max) {
    lf_tp *t = (lf_tp *)tp;
    pthread_mutex_lock(&t->lock);
    int n = epcc_tp_evq_pop(&t->q, events, max);
    if (n < max) {
        int r = reap(t);
        if (r < 0) {
            pthread_mutex_unlock(&t->lock);
            return r;
        }
        n += epcc_tp_evq_pop(&t->q, events + n, max - n);
    }
    pthread_mutex_unlock(&t->lock);
    return n;
}

static int lf_flush(epcc_tp *tp, uint64_t timeout_ns) {
    lf_tp *t = (lf_tp *)tp;
    uint64_t deadline = epcc_tp_deadline(timeout_ns);
    for (;;) {
        pthread_mutex_lock(&t->lock);
        int r = reap(t);
        uint64_t left = t->outstanding;
        pthread_mutex_unlock(&t->lock);
        if (r < 0) return r;
        if (!left) return 0;
        if (epcc_tp_now_ns() >= deadline)
            return epcc_tp_fail(tp, -ETIMEDOUT, "libfabric: flush timed out after %.3f s with %llu writes outstanding",
                                (double)timeout_ns / 1e9, (unsigned long long)left);
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

static void lf_close(epcc_tp *tp) {
    lf_tp *t = (lf_tp *)tp;
    if (t->ep) fi_close(&t->ep->fid);
    if (t->av) fi_close(&t->av->fid);
    if (t->cq) fi_close(&t->cq->fid);
    if (t->domain) fi_close(&t->domain->fid);
    if (t->fabric) fi_close(&t->fabric->fid);
    if (t->info) fi_freeinfo(t->info);
    for (lf_op *o = t->free_ops; o;) {
        lf_op *n = o->next;
        free(o);
        o = n;
    }
    for (lf_op *o = t->recv_ops; o;) {
        lf_op *n = o->next;
        free(o);
        o = n;
    }
    free(t->q.ev);
    free(t->peers);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

const epcc_tp_ops epcc_tp_ops_libfabric = {
    "libfabric", lf_open, lf_reg, lf_mr_remote, lf_dereg, lf_address, lf_connect,
    lf_post_write, lf_poll, lf_flush, lf_close, NULL, /* no write + signal in this version */
};
