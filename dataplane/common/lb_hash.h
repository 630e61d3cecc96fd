/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_hash.h - the keyed flow hash: SipHash-2-4 over a struct lb_flow_key (an
 * IPv4 flow as the 16-byte tuple of protocol 1, an IPv6 flow as its 40 bytes;
 * see lb_flow_hash), keyed with the 16-byte hash key from the configuration.
 *
 * Keyed so that every appliance of a fleet given the same key computes the same
 * ring slot for a flow, and an outsider who does not know the key cannot aim
 * many flows at one backend. The message is 16 or 40 bytes, whole words only,
 * so the compression loop has a fixed bound (at most five words) and the BPF
 * verifier sees straight-line code.
 *
 * Bytes are read little-endian, as SipHash specifies; the structs hold
 * addresses and ports in network order, so the hash is a function of the
 * packet's bytes, identical on every little-endian host and in
 * control/hpclb/contract/flowhash.py.
 */
#ifndef HPCLB_LB_HASH_H
#define HPCLB_LB_HASH_H

#include "lb_tables.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "lb_hash.h assumes a little-endian host (x86-64, arm64, BPF on them)"
#endif

/* Inlined into the caller, so that the message length is a constant there
 * and the word loop unrolls into straight-line code for the verifier. */
#define LB_HASH_INLINE static inline __attribute__((always_inline))

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

/* Words of the longest hashed message: an IPv6 struct lb_flow_key. */
#define LB_FLOW_HASH_MAX_WORDS (sizeof(struct lb_flow_key) / 8)

/* SipHash-2-4 of a message of nwords little-endian 64-bit words (nwords * 8
 * bytes, so there is no partial last block), 1 <= nwords <=
 * LB_FLOW_HASH_MAX_WORDS. The loop has a constant trip count: the BPF
 * verifier sees it unrolled. */
LB_HASH_INLINE __u64 lb_siphash24_words(const __u8 key[LB_HASH_KEY_LEN], const __u64 *m,
					__u32 nwords)
{
	__u64 k0 = lb_load_le64(key);
	__u64 k1 = lb_load_le64(key + 8);
	__u64 v0 = k0 ^ 0x736f6d6570736575ULL;
	__u64 v1 = k1 ^ 0x646f72616e646f6dULL;
	__u64 v2 = k0 ^ 0x6c7967656e657261ULL;
	__u64 v3 = k1 ^ 0x7465646279746573ULL;
	__u64 last = (__u64)(nwords * 8) << 56;
	__u32 i;

#ifdef __clang__
#pragma unroll
#endif
	for (i = 0; i < LB_FLOW_HASH_MAX_WORDS; i++) {
		if (i >= nwords)
			break;
		v3 ^= m[i];
		LB_SIPROUND(v0, v1, v2, v3);
		LB_SIPROUND(v0, v1, v2, v3);
		v0 ^= m[i];
	}
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

/* The flow hash of an IPv4 flow: the 16-byte tuple of table protocol 1
 * {saddr, daddr, sport, dport, proto, 0, 0, 0}, not the 40-byte key, so that
 * every IPv4 flow keeps the ring slot it had before the tables became
 * family-aware (an upgrade moves no established flow, and the golden vectors
 * of tests/unit/test_flowhash.py still hold). The words are loaded
 * little-endian as SipHash reads bytes: on a little-endian host a __u32 or
 * __u16 field read as a number is already its bytes' little-endian value. */
LB_HASH_INLINE __u64 lb_flow_hash_v4_tuple(const __u8 key[LB_HASH_KEY_LEN], __u32 saddr,
					   __u32 daddr, __u16 sport, __u16 dport, __u8 proto)
{
	__u64 m[2];

	m[0] = (__u64)saddr | (__u64)daddr << 32;
	m[1] = (__u64)sport | (__u64)dport << 16 | (__u64)proto << 32;
	return lb_siphash24_words(key, m, 2);
}

LB_HASH_INLINE __u64 lb_flow_hash_v4(const __u8 key[LB_HASH_KEY_LEN],
				     const struct lb_flow_key *flow)
{
	return lb_flow_hash_v4_tuple(key, flow->saddr.v4, flow->daddr.v4, flow->sport,
				     flow->dport, flow->proto);
}

/* The same hash of the XDP plane's compact IPv4 key (lb_tables.h), whose 16
 * bytes are that very tuple. */
LB_HASH_INLINE __u64 lb_flow_hash_v4_key(const __u8 key[LB_HASH_KEY_LEN],
					 const struct lb_flow_key_v4 *flow)
{
	return lb_flow_hash_v4_tuple(key, flow->saddr, flow->daddr, flow->sport, flow->dport,
				     flow->proto);
}

/* The flow hash of an IPv6 flow: the whole 40-byte key (family byte 6, pad 0). */
LB_HASH_INLINE __u64 lb_flow_hash_v6(const __u8 key[LB_HASH_KEY_LEN],
				     const struct lb_flow_key *flow)
{
	const __u8 *msg = (const __u8 *)flow;
	__u64 m[LB_FLOW_HASH_MAX_WORDS];
	__u32 i;

#ifdef __clang__
#pragma unroll
#endif
	for (i = 0; i < LB_FLOW_HASH_MAX_WORDS; i++)
		m[i] = lb_load_le64(msg + i * 8);
	return lb_siphash24_words(key, m, LB_FLOW_HASH_MAX_WORDS);
}

/* The flow hash of either family. A fast path that knows the family of the
 * key it built may call lb_flow_hash_v4/_v6 directly: same result, and the
 * BPF verifier does not walk the other family's code. */
LB_HASH_INLINE __u64 lb_flow_hash(const __u8 key[LB_HASH_KEY_LEN],
				  const struct lb_flow_key *flow)
{
	if (flow->family == LB_FAMILY_V6)
		return lb_flow_hash_v6(key, flow);
	return lb_flow_hash_v4(key, flow);
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
