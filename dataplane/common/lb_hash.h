/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_hash.h - the keyed flow hash: SipHash-2-4 over the 16-byte struct
 * lb_flow_key, keyed with the 16-byte hash key from the configuration.
 *
 * Keyed so that every appliance of a fleet given the same key computes the same
 * ring slot for a flow, and an outsider who does not know the key cannot aim
 * many flows at one backend. The message is always exactly 16 bytes, so the
 * compression loop has a fixed trip count (two words) and the BPF verifier sees
 * straight-line code.
 *
 * Bytes are read little-endian, as SipHash specifies; the structs hold
 * addresses and ports in network order, so the hash is a function of the
 * packet's bytes, identical on every little-endian host and in
 * control/hpclb/flowhash.py.
 */
#ifndef HPCLB_LB_HASH_H
#define HPCLB_LB_HASH_H

#include "lb_tables.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "lb_hash.h assumes a little-endian host (x86-64, arm64, BPF on them)"
#endif

#define LB_ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))

#define LB_SIPROUND(v0, v1, v2, v3)                                         \
	do {                                                                  \
		v0 += v1; v1 = LB_ROTL64(v1, 13); v1 ^= v0; v0 = LB_ROTL64(v0, 32); \
		v2 += v3; v3 = LB_ROTL64(v3, 16); v3 ^= v2;                       \
		v0 += v3; v3 = LB_ROTL64(v3, 21); v3 ^= v0;                       \
		v2 += v1; v1 = LB_ROTL64(v1, 17); v1 ^= v2; v2 = LB_ROTL64(v2, 32); \
	} while (0)

static inline __u64 lb_load_le64(const __u8 *p)
{
	return (__u64)p[0] | (__u64)p[1] << 8 | (__u64)p[2] << 16 |
	       (__u64)p[3] << 24 | (__u64)p[4] << 32 | (__u64)p[5] << 40 |
	       (__u64)p[6] << 48 | (__u64)p[7] << 56;
}

/* SipHash-2-4 of one 16-byte flow key. */
static inline __u64 lb_flow_hash(const __u8 key[LB_HASH_KEY_LEN],
				 const struct lb_flow_key *flow)
{
	const __u8 *msg = (const __u8 *)flow;
	__u64 k0 = lb_load_le64(key);
	__u64 k1 = lb_load_le64(key + 8);
	__u64 v0 = k0 ^ 0x736f6d6570736575ULL;
	__u64 v1 = k1 ^ 0x646f72616e646f6dULL;
	__u64 v2 = k0 ^ 0x6c7967656e657261ULL;
	__u64 v3 = k1 ^ 0x7465646279746573ULL;
	__u64 m0 = lb_load_le64(msg);
	__u64 m1 = lb_load_le64(msg + 8);
	__u64 last = (__u64)sizeof(struct lb_flow_key) << 56;

	v3 ^= m0;
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	v0 ^= m0;
	v3 ^= m1;
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	v0 ^= m1;
	v3 ^= last;
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	v0 ^= last;
	v2 ^= 0xff;
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	LB_SIPROUND(v0, v1, v2, v3);
	return v0 ^ v1 ^ v2 ^ v3;
}

/* Ring slot of a flow. */
static inline __u32 lb_flow_slot(const __u8 key[LB_HASH_KEY_LEN],
				 const struct lb_flow_key *flow, __u32 ring_size)
{
	return (__u32)(lb_flow_hash(key, flow) % ring_size);
}

/* Slot tried on the n-th probe when the slot's backend is not up: a second,
 * independent step derived from the high half of the same hash, so that
 * consecutive probes of two flows do not follow each other (Maglev's
 * permutation idea). step is in 1..ring_size-1 and ring_size is prime, so the
 * sequence never revisits a slot within ring_size probes. */
static inline __u32 lb_probe_slot(__u64 hash, __u32 ring_size, __u32 n)
{
	__u64 step = (hash >> 32) % (ring_size - 1) + 1;
	return (__u32)((hash % ring_size + step * n) % ring_size);
}

#endif /* HPCLB_LB_HASH_H */
