/*
 * transport_ibverbs.c - epcc_transport.h over libibverbs: one RC queue pair per peer,
 * IBV_WR_RDMA_WRITE_WITH_IMM for chunks (the immediate in network order), IBV_WR_RDMA_WRITE for
 * credits, one shared completion queue; every write-with-immediate consumes a receive posted on
 * the target's QP (zero-length receives, reposted as they complete).
 *
 * spec: "DEVICE[:PORT[:GID_INDEX]]", e.g. "mlx5_0:1:3"; empty: the first device, port 1, GID 0.
 * Address blob: lid (u16), gid (16 bytes), nranks QP numbers (u32); connect() moves QP r to
 * RTR/RTS against rank r's QP for this rank.  Fails with a clear message where no device exists.
 * Links: one (one port, one QP per peer); every post is on link 0.
 */
#define _POSIX_C_SOURCE 200809L
#include "epcc_transport_impl.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <pthread.h>

#define IBV_RECVS 256
#define IBV_QP_DEPTH 1024

typedef struct {
    epcc_tp base;
    pthread_mutex_t lock;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp **qps; /* [nranks] */
    uint8_t port;
    int gid_index;
    struct ibv_port_attr port_attr;
    union ibv_gid gid;
    uint64_t outstanding;
    epcc_tp_evq q;
} ib_tp;

struct epcc_tp_mr {
    epcc_tp *tp; /* first: see epcc_tp_mr_remote */
    struct ibv_mr *mr;
};

static int post_recvs(ib_tp *t, struct ibv_qp *qp, int n) {
    for (int i = 0; i < n; i++) {
        struct ibv_recv_wr wr, *bad = NULL;
        memset(&wr, 0, sizeof wr);
        wr.wr_id = 0;
        wr.num_sge = 0;
        int rc = ibv_post_recv(qp, &wr, &bad);
        if (rc) return epcc_tp_fail(&t->base, -rc, "ibverbs: ibv_post_recv failed: %s", strerror(rc));
    }
    return 0;
}

static int ib_open(const char *spec, int rank, int nranks, epcc_tp **out, char *err, size_t errlen) {
    (void)rank;
    char dev[64] = "";
    int port = 1, gidx = 0;
    sscanf(spec, "%63[^:]:%d:%d", dev, &port, &gidx);
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list || n == 0) {
        if (list) ibv_free_device_list(list);
        return epcc_tp_fail_buf(err, errlen, -ENODEV,
                                "ibverbs: no RDMA device found (ibv_get_device_list returned %d devices%s%s); this "
                                "transport needs an InfiniBand/RoCE NIC and its rdma-core provider",
                                n, errno ? ": " : "", errno ? strerror(errno) : "");
    }
    struct ibv_device *d = NULL;
    for (int i = 0; i < n; i++)
        if (!dev[0] || strcmp(ibv_get_device_name(list[i]), dev) == 0) {
            d = list[i];
            break;
        }
    if (!d) {
        ibv_free_device_list(list);
        return epcc_tp_fail_buf(err, errlen, -ENODEV, "ibverbs: no device named '%s' (%d devices present)", dev, n);
    }
    ib_tp *t = (ib_tp *)calloc(1, sizeof *t);
    t->qps = (struct ibv_qp **)calloc((size_t)nranks, sizeof *t->qps);
    pthread_mutex_init(&t->lock, NULL);
    t->port = (uint8_t)port;
    t->gid_index = gidx;
    t->ctx = ibv_open_device(d);
    ibv_free_device_list(list);
    *out = &t->base;
    if (!t->ctx) return epcc_tp_fail_buf(err, errlen, -EIO, "ibverbs: ibv_open_device failed: %s", strerror(errno));
    if (ibv_query_port(t->ctx, t->port, &t->port_attr))
        return epcc_tp_fail_buf(err, errlen, -EIO, "ibverbs: ibv_query_port(%d) failed", port);
    if (ibv_query_gid(t->ctx, t->port, gidx, &t->gid))
        return epcc_tp_fail_buf(err, errlen, -EIO, "ibverbs: ibv_query_gid(port %d, index %d) failed", port, gidx);
    if (!(t->pd = ibv_alloc_pd(t->ctx))) return epcc_tp_fail_buf(err, errlen, -EIO, "ibverbs: ibv_alloc_pd failed");
    if (!(t->cq = ibv_create_cq(t->ctx, 4 * IBV_QP_DEPTH, NULL, NULL, 0)))
        return epcc_tp_fail_buf(err, errlen, -EIO, "ibverbs: ibv_create_cq failed");
    for (int r = 0; r < nranks; r++) {
        struct ibv_qp_init_attr a;
        memset(&a, 0, sizeof a);
        a.send_cq = a.recv_cq = t->cq;
        a.qp_type = IBV_QPT_RC;
        a.cap.max_send_wr = IBV_QP_DEPTH;
        a.cap.max_recv_wr = IBV_RECVS;
        a.cap.max_send_sge = a.cap.max_recv_sge = 1;
        if (!(t->qps[r] = ibv_create_qp(t->pd, &a)))
            return epcc_tp_fail_buf(err, errlen, -EIO, "ibverbs: ibv_create_qp for rank %d failed", r);
        struct ibv_qp_attr m;
        memset(&m, 0, sizeof m);
        m.qp_state = IBV_QPS_INIT;
        m.port_num = t->port;
        m.pkey_index = 0;
        m.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
        if (ibv_modify_qp(t->qps[r], &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
            return epcc_tp_fail_buf(err, errlen, -EIO, "ibverbs: QP of rank %d to INIT failed", r);
        if (post_recvs(t, t->qps[r], IBV_RECVS)) return epcc_tp_fail_buf(err, errlen, -EIO, "%s", t->base.err);
    }
    snprintf(t->base.desc, sizeof t->base.desc, "ibverbs %s port %d (RC, lid %u, gid index %d)",
             ibv_get_device_name(d), port, t->port_attr.lid, gidx);
    return 0;
}

static int ib_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **out) {
    ib_tp *t = (ib_tp *)tp;
    epcc_tp_mr *m = (epcc_tp_mr *)calloc(1, sizeof *m);
    if (!m) return epcc_tp_fail(tp, -ENOMEM, "ibverbs: out of memory");
    m->tp = tp;
    int acc = IBV_ACCESS_LOCAL_WRITE | ((access & EPCC_TP_REMOTE_WRITE) ? IBV_ACCESS_REMOTE_WRITE : 0);
    m->mr = ibv_reg_mr(t->pd, buf, len ? len : 1, acc);
    if (!m->mr) {
        free(m);
        return epcc_tp_fail(tp, -errno, "ibverbs: ibv_reg_mr of %zu bytes failed: %s", len, strerror(errno));
    }
    *out = m;
    return 0;
}

static void ib_mr_remote(const epcc_tp_mr *m, uint64_t *addr, uint64_t *key) {
    *addr = (uint64_t)(uintptr_t)m->mr->addr;
    *key = m->mr->rkey;
}

static int ib_dereg(epcc_tp *tp, epcc_tp_mr *m) {
    (void)tp;
    int rc = m ? ibv_dereg_mr(m->mr) : 0;
    free(m);
    return rc ? -rc : 0;
}

static int ib_address(epcc_tp *tp, void *buf, size_t *len) {
    ib_tp *t = (ib_tp *)tp;
    size_t need = 2 + 16 + 4 * (size_t)tp->nranks;
    if (*len < need) return epcc_tp_fail(tp, -ENOSPC, "ibverbs: the address needs %zu bytes", need);
    uint8_t *p = (uint8_t *)buf;
    memcpy(p, &t->port_attr.lid, 2);
    memcpy(p + 2, t->gid.raw, 16);
    for (int r = 0; r < tp->nranks; r++) memcpy(p + 18 + 4 * r, &t->qps[r]->qp_num, 4);
    *len = need;
    return 0;
}

static int ib_connect(epcc_tp *tp, const void *blobs, size_t blob_len) {
    ib_tp *t = (ib_tp *)tp;
    for (int r = 0; r < tp->nranks; r++) {
        const uint8_t *p = (const uint8_t *)blobs + (size_t)r * blob_len;
        uint16_t lid;
        uint32_t qpn;
        memcpy(&lid, p, 2);
        memcpy(&qpn, p + 18 + 4 * tp->rank, 4);
        struct ibv_qp_attr m;
        memset(&m, 0, sizeof m);
        m.qp_state = IBV_QPS_RTR;
        m.path_mtu = t->port_attr.active_mtu;
        m.dest_qp_num = qpn;
        m.rq_psn = 0;
        m.max_dest_rd_atomic = 1;
        m.min_rnr_timer = 12;
        m.ah_attr.port_num = t->port;
        m.ah_attr.dlid = lid;
        if (t->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET || lid == 0) {
            m.ah_attr.is_global = 1;
            memcpy(m.ah_attr.grh.dgid.raw, p + 2, 16);
            m.ah_attr.grh.sgid_index = (uint8_t)t->gid_index;
            m.ah_attr.grh.hop_limit = 1;
        }
        if (ibv_modify_qp(t->qps[r], &m, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
            return epcc_tp_fail(tp, -EIO, "ibverbs: QP to rank %d: RTR failed: %s", r, strerror(errno));
        memset(&m, 0, sizeof m);
        m.qp_state = IBV_QPS_RTS;
        m.timeout = 14;
        m.retry_cnt = 7;
        m.rnr_retry = 7;
        m.sq_psn = 0;
        m.max_rd_atomic = 1;
        if (ibv_modify_qp(t->qps[r], &m, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                             IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
            return epcc_tp_fail(tp, -EIO, "ibverbs: QP to rank %d: RTS failed: %s", r, strerror(errno));
    }
    return 0;
}

static int reap(ib_tp *t) {
    struct ibv_wc wc[32];
    int n = ibv_poll_cq(t->cq, 32, wc);
    if (n < 0) return epcc_tp_fail(&t->base, -EIO, "ibverbs: ibv_poll_cq failed");
    for (int i = 0; i < n; i++) {
        epcc_tp_event ev = {0, 0, wc[i].wr_id};
        if (wc[i].status != IBV_WC_SUCCESS) {
            epcc_tp_fail(&t->base, -EIO, "ibverbs: a work request failed: %s (vendor error %u)",
                         ibv_wc_status_str(wc[i].status), wc[i].vendor_err);
            ev.kind = EPCC_TP_EV_ERROR;
            if (wc[i].opcode == IBV_WC_RDMA_WRITE) t->outstanding--;
        } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
            ev.kind = EPCC_TP_EV_REMOTE;
            ev.imm = ntohl(wc[i].imm_data);
            t->base.stats.imm_received++;
            for (int r = 0; r < t->base.nranks; r++)
                if (t->qps[r]->qp_num == wc[i].qp_num && post_recvs(t, t->qps[r], 1)) return -EIO;
        } else {
            ev.kind = EPCC_TP_EV_LOCAL;
            t->outstanding--;
            t->base.stats.local_completions++;
        }
        epcc_tp_evq_push(&t->q, ev);
    }
    return n;
}

static int ib_post_write(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *m,
                         uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx,
                         uint64_t timeout_ns) {
    ib_tp *t = (ib_tp *)tp;
    (void)link; /* one QP per peer: one link */
    struct ibv_sge sge = {(uint64_t)(uintptr_t)src, (uint32_t)len, m ? m->mr->lkey : 0};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = ctx;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = imm_valid ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = (uint32_t)rkey;
    uint64_t deadline = epcc_tp_deadline(timeout_ns);
    pthread_mutex_lock(&t->lock);
    int rc;
    while ((rc = ibv_post_send(t->qps[peer], &wr, &bad)) == ENOMEM) { /* send queue full */
        t->base.stats.eagain++;
        if (reap(t) < 0 || epcc_tp_now_ns() >= deadline) break;
    }
    if (!rc) {
        t->outstanding++;
        t->base.stats.writes_posted++;
        t->base.stats.bytes_posted += len;
    }
    pthread_mutex_unlock(&t->lock);
    return rc ? epcc_tp_fail(tp, -rc, "ibverbs: ibv_post_send to rank %d failed: %s", peer, strerror(rc)) : 0;
}

static int ib_poll(epcc_tp *tp, epcc_tp_event *events, int max) {
    ib_tp *t = (ib_tp *)tp;
    pthread_mutex_lock(&t->lock);
    int n = epcc_tp_evq_pop(&t->q, events, max), r = 0;
    if (n < max && (r = reap(t)) >= 0) n += epcc_tp_evq_pop(&t->q, events + n, max - n);
    pthread_mutex_unlock(&t->lock);
    return r < 0 ? r : n;
}

static int ib_flush(epcc_tp *tp, uint64_t timeout_ns) {
    ib_tp *t = (ib_tp *)tp;
    uint64_t deadline = epcc_tp_deadline(timeout_ns);
    for (;;) {
        pthread_mutex_lock(&t->lock);
        int r = reap(t);
        uint64_t left = t->outstanding;
        pthread_mutex_unlock(&t->lock);
        if (r < 0) return r;
        if (!left) return 0;
        if (epcc_tp_now_ns() >= deadline)
            return epcc_tp_fail(tp, -ETIMEDOUT, "ibverbs: flush timed out with %llu writes outstanding",
                                (unsigned long long)left);
    }
}

static void ib_close(epcc_tp *tp) {
    ib_tp *t = (ib_tp *)tp;
    for (int r = 0; t->qps && r < tp->nranks; r++)
        if (t->qps[r]) ibv_destroy_qp(t->qps[r]);
    if (t->cq) ibv_destroy_cq(t->cq);
    if (t->pd) ibv_dealloc_pd(t->pd);
    if (t->ctx) ibv_close_device(t->ctx);
    free(t->qps);
    free(t->q.ev);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

const epcc_tp_ops epcc_tp_ops_ibverbs = {
    "ibverbs", ib_open, ib_reg, ib_mr_remote, ib_dereg, ib_address, ib_connect, ib_post_write, ib_poll, ib_flush, ib_close,
    NULL, /* no write + signal in this version */
};
