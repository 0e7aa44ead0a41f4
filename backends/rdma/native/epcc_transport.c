/*
 * epcc_transport.c - epcc_transport.h's entry points: pick the transport by name and forward.
 * Build with -DEPCC_TP_HAVE_<NAME> for every transport source linked in.
 */
#include "epcc_transport_impl.h"

static const epcc_tp_ops *const transports[] = {
#ifdef EPCC_TP_HAVE_LIBFABRIC
    &epcc_tp_ops_libfabric,
#endif
#ifdef EPCC_TP_HAVE_IBVERBS
    &epcc_tp_ops_ibverbs,
#endif
#ifdef EPCC_TP_HAVE_EMULATED
    &epcc_tp_ops_emulated,
#endif
#ifdef EPCC_TP_HAVE_NVSHMEM
    &epcc_tp_ops_nvshmem,
#endif
    NULL,
};

const char *epcc_tp_available(void) {
    static char names[128];
    if (!names[0]) {
        size_t n = 0;
        for (int i = 0; transports[i]; i++) {
            n += (size_t)snprintf(names + n, sizeof names - n, "%s%s", i ? "," : "", transports[i]->name);
            if (n >= sizeof names) break;
        }
    }
    return names;
}

int epcc_tp_open(const char *kind, const char *spec, int rank, int nranks, epcc_tp **out, char *err,
                 size_t errlen) {
    *out = NULL;
    if (!kind) return epcc_tp_fail_buf(err, errlen, -EINVAL, "epcc transport: no transport named");
    if (nranks <= 0 || rank < 0 || rank >= nranks)
        return epcc_tp_fail_buf(err, errlen, -EINVAL, "epcc transport: rank %d of %d ranks is out of range",
                                rank, nranks);
    for (int i = 0; transports[i]; i++) {
        if (strcmp(transports[i]->name, kind) == 0) {
            int rc = transports[i]->open(spec ? spec : "", rank, nranks, out, err, errlen);
            if (rc == 0) {
                (*out)->ops = transports[i];
                (*out)->rank = rank;
                (*out)->nranks = nranks;
                if ((*out)->n_links < 1) (*out)->n_links = 1;
            }
            return rc;
        }
    }
    return epcc_tp_fail_buf(err, errlen, -ENOENT, "epcc transport: '%s' is not in this build (it has: %s)", kind,
                            epcc_tp_available()[0] ? epcc_tp_available() : "none");
}

const char *epcc_tp_error(const epcc_tp *tp) { return tp ? tp->err : ""; }
const char *epcc_tp_describe(const epcc_tp *tp) { return tp ? tp->desc : ""; }
int epcc_tp_links(const epcc_tp *tp) { return tp && tp->n_links > 0 ? tp->n_links : 1; }

/* A post's peer and link, checked for every transport alike. */
static int check_post(epcc_tp *tp, int peer, unsigned link) {
    if (peer < 0 || peer >= tp->nranks)
        return epcc_tp_fail(tp, -EINVAL, "epcc transport: write to rank %d, but there are %d ranks", peer,
                            tp->nranks);
    if (link >= (unsigned)epcc_tp_links(tp))
        return epcc_tp_fail(tp, -EINVAL, "epcc transport: write on link %u, but '%s' has %d link%s", link,
                            tp->ops->name, epcc_tp_links(tp), epcc_tp_links(tp) == 1 ? "" : "s");
    return 0;
}

int epcc_tp_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **mr) {
    return tp->ops->reg(tp, buf, len, access, mr);
}
void epcc_tp_mr_remote(const epcc_tp_mr *mr, uint64_t *addr, uint64_t *key) {
    /* every transport's mr starts with a pointer to its transport */
    const epcc_tp *tp = *(epcc_tp *const *)mr;
    tp->ops->mr_remote(mr, addr, key);
}
int epcc_tp_dereg(epcc_tp *tp, epcc_tp_mr *mr) { return tp->ops->dereg(tp, mr); }
int epcc_tp_address(epcc_tp *tp, void *buf, size_t *len) { return tp->ops->address(tp, buf, len); }
int epcc_tp_connect(epcc_tp *tp, const void *blobs, size_t blob_len) {
    return tp->ops->connect(tp, blobs, blob_len);
}
int epcc_tp_post_write(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                       uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx, uint64_t timeout_ns) {
    int rc = check_post(tp, peer, link);
    if (rc) return rc;
    uint64_t t0 = epcc_tp_now_ns();
    rc = tp->ops->post_write(tp, peer, link, src, len, mr, raddr, rkey, imm_valid, imm, ctx, timeout_ns);
    tp->stats.post_ns += epcc_tp_now_ns() - t0;
    return rc;
}
int epcc_tp_post_write_signal(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                              uint64_t raddr, uint64_t rkey, uint64_t sig_raddr, uint64_t sig_rkey,
                              uint64_t sig_value, uint64_t ctx, uint64_t timeout_ns) {
    int rc = check_post(tp, peer, link);
    if (rc) return rc;
    if (!tp->ops->post_write_signal)
        return epcc_tp_fail(tp, -ENOTSUP, "epcc transport: '%s' has no write + remote signal (the GPU proxy path "
                            "needs it: use 'emulated' or 'nvshmem')", tp->ops->name);
    uint64_t t0 = epcc_tp_now_ns();
    rc = tp->ops->post_write_signal(tp, peer, link, src, len, mr, raddr, rkey, sig_raddr, sig_rkey, sig_value, ctx,
                                    timeout_ns);
    tp->stats.post_ns += epcc_tp_now_ns() - t0;
    return rc;
}
int epcc_tp_poll(epcc_tp *tp, epcc_tp_event *events, int max) { return tp->ops->poll(tp, events, max); }
int epcc_tp_flush(epcc_tp *tp, uint64_t timeout_ns) { return tp->ops->flush(tp, timeout_ns); }
void epcc_tp_stats_get(const epcc_tp *tp, epcc_tp_stats *out) { *out = tp->stats; }
void epcc_tp_close(epcc_tp *tp) {
    if (tp) tp->ops->close(tp);
}
