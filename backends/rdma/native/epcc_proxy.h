/*
 * epcc_proxy.h - the data structures and primitives of epcc's RDMA proxy loop (docs/rdma.md).
 *
 * The loop itself is emitted per plan (backends/rdma/templates/epcc_proxy.c.j2); this header
 * holds what it is made of:
 *
 *   trigger FIFO   producers (GPU kernels on the CUDA path, producer threads on the CPU path)
 *                  push one entry per chunk ready in the send slots; the proxy pops in order.
 *                  head/tail counters, a valid word per entry (lap-tagged: (index << 1) | 1, so a
 *                  stale entry from the previous lap never reads as valid), credits: a producer
 *                  may fill entry `tail` only when `tail - retired < depth` (its send slot's
 *                  previous write completed locally).
 *   remote credits the receiver returns how many chunks of a channel it has consumed (an RDMA
 *                  write of one u64 into the sender's credit word); the proxy posts chunk n of a
 *                  channel only when n < credit + depth (its landing slot is free).
 *   in-order apply chunks of a channel may land in any order within the window; the receiver
 *                  applies them in sequence order (the per-chunk flags are monotone counters:
 *                  value v means chunks < v are in place) and never twice.
 *
 * All fields are 64-bit (u64 or pointers), so the host fills descriptor tables as uint64 arrays.
 */
#ifndef EPCC_PROXY_H
#define EPCC_PROXY_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define EPCC_RDMA_OK 0
#define EPCC_RDMA_TIMEOUT 1
#define EPCC_RDMA_ABORTED 2
#define EPCC_RDMA_FAILED 3 /* a transport error */

#define EPCC_RDMA_ENTRY_DATA 1
#define EPCC_RDMA_ENTRY_FLUSH 2

/* One FIFO entry: written by a producer, then published by `word`. */
typedef struct {
    _Atomic uint64_t word; /* (index << 1) | 1 once entry `index` is valid */
    uint64_t kind;         /* EPCC_RDMA_ENTRY_DATA | EPCC_RDMA_ENTRY_FLUSH */
    uint64_t chan;         /* sender channel */
    uint64_t chan_seq;     /* the chunk's sequence number on its channel */
    uint64_t bytes;        /* payload in send slot `index % depth` */
    uint64_t value;        /* GPU path: the signal value written beside the payload (launch << 32 | seq + 1) */
} epcc_rdma_entry;

typedef struct {
    _Atomic uint64_t tail;    /* producer: entries pushed */
    _Atomic uint64_t head;    /* proxy: entries taken */
    _Atomic uint64_t retired; /* proxy: entries whose write completed, in order (producer credits) */
    _Atomic uint64_t flushed; /* proxy: the index of the last flush entry served, plus 1 */
    uint64_t depth;
    epcc_rdma_entry *entries; /* [depth] */
    uint8_t *done;            /* [depth]: completed out of order, not yet retired */
    uint64_t external;        /* 1: entries belong to the caller (GPU path: host-pinned, the kernels push) */
} epcc_rdma_fifo;

/* In-order tracker of one receive channel: chunk `seq` landed in slot seq % depth. */
typedef struct {
    uint64_t next;   /* chunks applied (the next one to apply) */
    uint64_t depth;
    uint64_t total;  /* chunks the channel carries */
    uint8_t *landed; /* [depth] */
} epcc_rdma_tracker;

/* Return codes of epcc_rdma_tracker_land. */
#define EPCC_RDMA_LAND_OK 0
#define EPCC_RDMA_LAND_DUPLICATE -1 /* the chunk already landed or was applied */
#define EPCC_RDMA_LAND_OUTSIDE -2   /* outside the window [next, next + depth) or past the end */

int epcc_rdma_fifo_init(epcc_rdma_fifo *f, uint64_t depth);
/* GPU path: `f` and its `entries` (f->entries, f->depth set, zeroed) live in host-pinned memory
 * the kernels write; only the proxy's bookkeeping is allocated here.  The counters are kept. */
int epcc_rdma_fifo_attach(epcc_rdma_fifo *f);
void epcc_rdma_fifo_free(epcc_rdma_fifo *f);
/* Producer: may entry `tail` be filled now (its send slot free)? */
int epcc_rdma_fifo_can_push(epcc_rdma_fifo *f);
/* Producer: fill and publish the next entry; returns its index (slot = index % depth). */
uint64_t epcc_rdma_fifo_push(epcc_rdma_fifo *f, uint64_t kind, uint64_t chan, uint64_t chan_seq, uint64_t bytes);
/* Proxy: the entry at head if it is valid, else NULL (does not take it). */
epcc_rdma_entry *epcc_rdma_fifo_peek(epcc_rdma_fifo *f);
/* Proxy: take the entry at head (after peek returned it); returns its index. */
uint64_t epcc_rdma_fifo_take(epcc_rdma_fifo *f);
/* Proxy: the write of entry `index` completed; retire every completed entry in order.
 * Returns -1 if `index` is not outstanding (a duplicate or unknown completion). */
int epcc_rdma_fifo_complete(epcc_rdma_fifo *f, uint64_t index);

int epcc_rdma_tracker_init(epcc_rdma_tracker *t, uint64_t depth, uint64_t total);
void epcc_rdma_tracker_free(epcc_rdma_tracker *t);
int epcc_rdma_tracker_land(epcc_rdma_tracker *t, uint64_t seq);
/* The next chunk to apply if it has landed (then it is marked applied), else -1. */
int64_t epcc_rdma_tracker_pop(epcc_rdma_tracker *t);

/* May a sender post chunk `seq` of a channel whose receiver consumed `credit` chunks? */
static inline int epcc_rdma_credit_ok(uint64_t seq, uint64_t credit, uint64_t depth) {
    return seq < credit + depth;
}

/* The immediate of a chunk: receiver channel index and the chunk's sequence number modulo
 * 2^EPCC_RDMA_SEQ_BITS (the receiver knows the window, so it recovers the full number). */
#define EPCC_RDMA_SEQ_BITS 20u
#define EPCC_RDMA_MAX_CHANS (1u << (32u - EPCC_RDMA_SEQ_BITS))
static inline uint32_t epcc_rdma_imm(uint64_t chan, uint64_t seq) {
    return (uint32_t)((chan << EPCC_RDMA_SEQ_BITS) | (seq & ((1u << EPCC_RDMA_SEQ_BITS) - 1u)));
}
static inline uint64_t epcc_rdma_imm_chan(uint32_t imm) { return imm >> EPCC_RDMA_SEQ_BITS; }
/* The full sequence number of an immediate, given the channel's next chunk to apply. */
static inline uint64_t epcc_rdma_imm_seq(uint32_t imm, uint64_t next) {
    uint64_t mod = 1ull << EPCC_RDMA_SEQ_BITS, low = imm & (mod - 1);
    uint64_t base = next - (next % mod) + low;
    return base < next ? base + mod : base;
}

/* dst[j] += w * float(bf16 src[j]), atomically. */
void epcc_rdma_acc_bf16(float *dst, const uint16_t *src, float w, uint64_t n);
/* dst[j] = bf16(src[j]), rounded to nearest even (NaN stays NaN): an fp32 partial on the wire. */
void epcc_rdma_pack_f32_bf16(uint16_t *dst, const float *src, uint64_t n);

/* Bounded wait until *flag >= value (acquire), giving up at the deadline (EPCC_RDMA_TIMEOUT) or
 * when *abort becomes non-zero (EPCC_RDMA_ABORTED); *observed gets the last value seen. */
int epcc_rdma_wait_ge(const _Atomic uint64_t *flag, uint64_t value, uint64_t timeout_ns,
                      const _Atomic uint64_t *abort, uint64_t *observed);
/* The message of runtime/native/epcc_sync.c's format_timeout. */
void epcc_rdma_format_timeout(char *buf, size_t len, uint64_t timeout_ns, const char *rank_desc,
                              const char *step, const char *flag, uint64_t value, uint64_t expected);
uint64_t epcc_rdma_now_ns(void);
void epcc_rdma_backoff(uint32_t *polls);

#endif /* EPCC_PROXY_H */
