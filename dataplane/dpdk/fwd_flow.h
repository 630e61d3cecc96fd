/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_flow.h - one worker's flow-affinity table: lb_flow_key -> pinned backend.
 *
 * Per lcore, so it takes no lock: RSS (or af_packet/af_xdp's per-queue
 * steering) sends every packet of a flow to the same queue, hence to the same
 * worker. An rte_hash (with its extendable bucket table, so that it fills to
 * capacity instead of failing early on a full cuckoo path) holds the keys; the
 * entries live in an array indexed by the key's position. Bounded: idle
 * entries are expired by a sweep over positions, a few per loop; when the table
 * is full, the least recently seen of a small sample is evicted (counted), as
 * an LRU would.
 *
 * The rte_hash signature is SipHash-1-3 (the variant Rust's and CPython's
 * hash tables use against hash flooding: one round per word and three to
 * finish, where the ring's SipHash-2-4 has two and four) under a per-table
 * random key, so an outsider cannot aim many flows at one bucket, and
 * re-keying the ring hash (set_config) does not lose the table. Every
 * rte_hash call therefore passes the signature (the *_with_hash variants):
 * the plain ones would hash with the table's own function and never find the
 * key. Keys are compared as five 64-bit words (fwd_flow_key_eq), not by
 * memcmp: callers write a key as whole words (fwd_flow_key_words), which the
 * compare then reads without a store-forwarding stall.
 */
#ifndef HPCLB_FWD_FLOW_H
#define HPCLB_FWD_FLOW_H

#include <stdbool.h>
#include <string.h>
#include <rte_hash.h>

#include "lb_hash.h" /* LB_SIPROUND: the one SipHash round of both planes */
#include "lb_tables.h"

struct fwd_flow_slot {
	struct lb_flow_entry e;
	__u64 last_seen; /* TSC of the last packet */
	struct lb_flow_key key;
	bool used;
};

struct fwd_flow_table {
	struct rte_hash *h;
	__u64 sip_v[4];              /* SipHash state after the key, for fwd_flow_sig */
	struct fwd_flow_slot *slots; /* indexed by rte_hash key position */
	__u32 capacity;
	__u8 sig_key[LB_HASH_KEY_LEN];
	__u64 timeout_tsc; /* idle time after which an entry may be expired */
	__u32 sweep_next;  /* next position the expiry sweep looks at */
	__u64 pin_failures; /* flows forwarded unpinned: no room even after eviction */
};

/* capacity entries on socket_id; name must be unique in the process. */
int fwd_flow_init(struct fwd_flow_table *ft, const char *name, __u32 capacity,
		  __u64 timeout_tsc, int socket_id);
void fwd_flow_free(struct fwd_flow_table *ft);

#define FWD_FLOW_KEY_WORDS (sizeof(struct lb_flow_key) / 8)

/* A key's bytes as 64-bit words (little-endian host, lb_hash.h), read and
 * written in place: struct lb_flow_key is 4-byte aligned, x86 and arm64 load
 * unaligned words, and may_alias lets the words alias the struct. */
typedef __u64 fwd_flow_word __attribute__((may_alias, aligned(4)));

/* Writes an IPv4 flow key as five whole words: the same bytes as filling
 * struct lb_flow_key field by field (addresses in the first four bytes of
 * their 16, the rest 0, pad 0), but stores a later 8-byte read can forward. */
static inline void fwd_flow_key_v4(struct lb_flow_key *k, __u32 saddr, __u32 daddr, __u16 sport,
				   __u16 dport, __u8 proto)
{
	fwd_flow_word *w = (fwd_flow_word *)k;

	w[0] = saddr;
	w[1] = 0;
	w[2] = daddr;
	w[3] = 0;
	w[4] = (__u64)sport | (__u64)dport << 16 | (__u64)proto << 32 | (__u64)LB_FAMILY_V4 << 40;
}

/* Equal keys, compared as five words (rte_hash's compare, fwd_flow.c). */
static inline bool fwd_flow_key_eq(const struct lb_flow_key *a, const struct lb_flow_key *b)
{
	const fwd_flow_word *wa = (const fwd_flow_word *)a, *wb = (const fwd_flow_word *)b;

	return !((wa[0] ^ wb[0]) | (wa[1] ^ wb[1]) | (wa[2] ^ wb[2]) | (wa[3] ^ wb[3]) |
		 (wa[4] ^ wb[4]));
}

/* The rte_hash signature of k (computed once per packet, used by both calls):
 * SipHash-1-3 over the words the flow hash reads (an IPv4 flow's 16-byte
 * tuple, an IPv6 flow's 40 bytes), under the table's key. */
static inline __attribute__((always_inline)) hash_sig_t
fwd_flow_sig(const struct fwd_flow_table *ft, const struct lb_flow_key *k)
{
	const fwd_flow_word *w = (const fwd_flow_word *)k;
	__u64 v0 = ft->sip_v[0], v1 = ft->sip_v[1], v2 = ft->sip_v[2], v3 = ft->sip_v[3];
	__u64 last;

	if (k->family == LB_FAMILY_V6) {
		for (unsigned int i = 0; i < FWD_FLOW_KEY_WORDS; i++) {
			v3 ^= w[i];
			LB_SIPROUND(v0, v1, v2, v3);
			v0 ^= w[i];
		}
		last = (__u64)(FWD_FLOW_KEY_WORDS * 8) << 56;
	} else {
		/* {saddr, daddr} and {sport, dport, proto}: lb_flow_hash_v4's words */
		__u64 m0 = (w[0] & 0xffffffffu) | w[2] << 32, m1 = w[4] & 0xffffffffffull;

		v3 ^= m0;
		LB_SIPROUND(v0, v1, v2, v3);
		v0 ^= m0;
		v3 ^= m1;
		LB_SIPROUND(v0, v1, v2, v3);
		v0 ^= m1;
		last = (__u64)16 << 56;
	}
	v3 ^= last;
	LB_SIPROUND(v0, v1, v2, v3);
	v0 ^= last;
	v2 ^= 0xff;
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	return (hash_sig_t)(v0 ^ v1 ^ v2 ^ v3);
}

/* The flow's slot, or NULL. */
static inline __attribute__((always_inline)) struct fwd_flow_slot *fwd_flow_lookup(struct fwd_flow_table *ft,
						    const struct lb_flow_key *k, hash_sig_t sig,
						    __u64 now)
{
	int32_t pos = rte_hash_lookup_with_hash(ft->h, k, sig);

	if (pos < 0 || (__u32)pos >= ft->capacity)
		return NULL;
	ft->slots[pos].last_seen = now;
	return &ft->slots[pos];
}

/* Pins k to e (insert or replace). Returns 1 when a live flow had to be
 * evicted to make room, 0 otherwise, a negative errno on failure. */
int fwd_flow_pin(struct fwd_flow_table *ft, const struct lb_flow_key *k, hash_sig_t sig,
		 const struct lb_flow_entry *e, __u64 now);

/* Looks at the next `budget` positions and removes the entries idle for
 * longer than the timeout. Returns how many it removed. */
unsigned int fwd_flow_expire(struct fwd_flow_table *ft, __u64 now, unsigned int budget);

/* Flows in the table. */
__u32 fwd_flow_count(const struct fwd_flow_table *ft);

/* Empties the table (the --bench forget-flows mode; never on an appliance). */
void fwd_flow_reset(struct fwd_flow_table *ft);

#endif /* HPCLB_FWD_FLOW_H */
