/*
 * epcc_transport.h - the one small interface every RDMA transport of epcc implements.
 *
 * A transport moves bytes from registered local memory into registered memory of a peer rank
 * with one-sided writes, optionally carrying a 32-bit immediate that the peer sees as a
 * completion (write-with-immediate on verbs, fi_writedata with FI_REMOTE_CQ_DATA on
 * libfabric, put-with-signal on NVSHMEM, a paced copy plus a flag on the emulated one).
 *
 * Life cycle (every call returns 0 on success or a negative value, with a one-line message
 * in the transport's error buffer, epcc_tp_error()):
 *
 *   epcc_tp_open(kind, spec, rank, nranks, &tp)   kind: "libfabric", "ibverbs", ...
 *   epcc_tp_reg(tp, buf, len, access, &mr)         register memory; epcc_tp_mr_remote() gives
 *                                                  the (addr, key) a peer writes to
 *   epcc_tp_address(tp, buf, &len)                 this rank's address blob
 *   epcc_tp_connect(tp, blobs, blob_len)           every rank's blob (all-gathered by the
 *                                                  caller: torch.distributed or a file)
 *   epcc_tp_post_write(tp, peer, link, src, len, mr, raddr, rkey, imm_valid, imm, ctx)
 *   epcc_tp_poll(tp, events, max)                  local completions (ctx) and remote
 *                                                  immediates, non-blocking
 *   epcc_tp_flush(tp, timeout_ns)                  every posted write completed locally
 *   epcc_tp_close(tp)
 *
 * Links: a transport has epcc_tp_links(tp) links to every peer (at least 1), each with send
 * queues of its own, like the ports of a NIC (one queue pair per port); every post names the link
 * it goes out on.  The emulated transport paces each link at its own bandwidth and latency (its
 * spec lists them); libfabric, ibverbs and nvshmem have one link (one endpoint), and a post on a
 * link the transport does not have fails with a message naming both.
 *
 * Thread safety: post, poll and flush may be called from several threads at once (each
 * transport serialises what its engine needs).  Events go to whoever polls: callers route them
 * by `ctx` (local) and by the immediate (remote).
 */
#ifndef EPCC_TRANSPORT_H
#define EPCC_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epcc_tp epcc_tp;
typedef struct epcc_tp_mr epcc_tp_mr;

#define EPCC_TP_ERRLEN 512
#define EPCC_TP_MAX_ADDR 4096 /* bytes of one rank's address blob, at most */

/* Registration access. */
#define EPCC_TP_LOCAL 1u        /* source of writes */
#define EPCC_TP_REMOTE_WRITE 2u /* target of peers' writes */

/* Event kinds returned by epcc_tp_poll. */
#define EPCC_TP_EV_LOCAL 1  /* a write this rank posted completed locally: `ctx` */
#define EPCC_TP_EV_REMOTE 2 /* a peer's write with an immediate landed here: `imm` */
#define EPCC_TP_EV_ERROR 3  /* a failed operation: `ctx`, message in epcc_tp_error() */

typedef struct {
    int32_t kind;
    uint32_t imm;
    uint64_t ctx;
} epcc_tp_event;

/* Statistics, for reports and tests. */
typedef struct {
    uint64_t writes_posted;
    uint64_t bytes_posted;
    uint64_t imm_received;
    uint64_t local_completions;
    uint64_t eagain; /* posts retried because the provider's queue was full */
    uint64_t post_ns; /* host time inside epcc_tp_post_write(_signal): what a write costs the proxy */
    /* Paced transports (emulated); 0 elsewhere.  Wire time a link sat idle between two writes less
     * than EPCC_TP_BURST_GAP_NS apart (one launch's stream: nothing was posted while the link could
     * send), and in how many gaps; host time between writes' paced landings and the issue of their
     * signals or immediates (how late the proxy's polling delivered them), over how many. */
    uint64_t link_idle_ns;
    uint64_t link_gaps;
    uint64_t signal_lag_ns;
    uint64_t signals;
} epcc_tp_stats;

#define EPCC_TP_BURST_GAP_NS 1000000ull /* 1 ms: launches of one program's stream are further apart */

int epcc_tp_open(const char *kind, const char *spec, int rank, int nranks, epcc_tp **out,
                 char *err, size_t errlen);
const char *epcc_tp_error(const epcc_tp *tp);
/* The provider / device actually used, e.g. "libfabric tcp;ofi_rxm (FI_EP_RDM) on lo". */
const char *epcc_tp_describe(const epcc_tp *tp);
/* How many links (independent send queues to every peer) the transport has: posts name one below. */
int epcc_tp_links(const epcc_tp *tp);

int epcc_tp_reg(epcc_tp *tp, void *buf, size_t len, unsigned access, epcc_tp_mr **mr);
/* What a peer needs to write into `mr`: the address to pass as raddr for byte 0 of the region
 * and the remote key. */
void epcc_tp_mr_remote(const epcc_tp_mr *mr, uint64_t *addr, uint64_t *key);
int epcc_tp_dereg(epcc_tp *tp, epcc_tp_mr *mr);

int epcc_tp_address(epcc_tp *tp, void *buf, size_t *len);
int epcc_tp_connect(epcc_tp *tp, const void *blobs, size_t blob_len);

/* Post one write of `len` bytes from `src` (inside local registration `mr`) to `raddr` (as
 * epcc_tp_mr_remote gave it, plus an offset) with key `rkey` on rank `peer`, over `link` (below
 * epcc_tp_links: writes on one link are sent in order, links are independent).  With imm_valid,
 * the peer gets an EPCC_TP_EV_REMOTE event carrying `imm` once the data has landed.  `ctx` comes
 * back in the EPCC_TP_EV_LOCAL event of this write.  Retries internally (progressing the
 * engine) while the provider's queue is full, up to timeout_ns; then returns -EAGAIN. */
int epcc_tp_post_write(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                       uint64_t raddr, uint64_t rkey, int imm_valid, uint32_t imm, uint64_t ctx,
                       uint64_t timeout_ns);

/* Write + remote signal: `len` bytes from `src` to (raddr, rkey) on `peer` over `link`, then, ordered after
 * them, the 8-byte value `sig_value` to (sig_raddr, sig_rkey) on the same peer; one local
 * completion (`ctx`) once both are done.  The GPU path's kernels wait on such signal words (one
 * per landing slot) instead of a host thread reading immediates.  Transports without it
 * (libfabric, ibverbs in this version) fail with a message naming themselves. */
int epcc_tp_post_write_signal(epcc_tp *tp, int peer, unsigned link, const void *src, size_t len, epcc_tp_mr *mr,
                              uint64_t raddr, uint64_t rkey, uint64_t sig_raddr, uint64_t sig_rkey,
                              uint64_t sig_value, uint64_t ctx, uint64_t timeout_ns);

/* Up to `max` events, non-blocking; returns how many (0: none), < 0 on a transport failure. */
int epcc_tp_poll(epcc_tp *tp, epcc_tp_event *events, int max);

/* Progress until every write posted so far has completed locally (events it reaps are kept
 * and returned by later polls).  0, or -ETIMEDOUT after timeout_ns. */
int epcc_tp_flush(epcc_tp *tp, uint64_t timeout_ns);

void epcc_tp_stats_get(const epcc_tp *tp, epcc_tp_stats *out);
void epcc_tp_close(epcc_tp *tp);

/* Which transports this build holds, comma-separated ("libfabric", "ibverbs", ...). */
const char *epcc_tp_available(void);

#ifdef __cplusplus
}
#endif
#endif /* EPCC_TRANSPORT_H */
