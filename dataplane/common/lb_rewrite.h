/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_rewrite.h - the frame rewrites both data planes share, header-only and
 * compiled the same two ways as lb_parse.h (clang -target bpf, native gcc).
 *
 *   lb_rewrite_macs       DSR: destination MAC to the backend's, source MAC to
 *                         the egress port's (used by lb.bpf.c and fwd_packet.c)
 *   lb_csum_replace2/4/16 RFC 1624 incremental update of an Internet checksum
 *                         when 2, 4 or 16 bytes it covers change: for the NAT
 *                         mode to come (addresses and ports in the IPv4 header
 *                         and in the TCP/UDP pseudo-header); unit-tested by
 *                         tests/unit/parse_selftest.c, not used by a plane yet.
 */
#ifndef HPCLB_LB_REWRITE_H
#define HPCLB_LB_REWRITE_H

#include "lb_parse.h"

/* Set the frame's destination and source MACs. Returns 0, or -1 (nothing
 * written) when the frame is shorter than an Ethernet header: it cannot be
 * after a parse that got past Ethernet, but the check is here so that the
 * helper is safe on its own and the verifier sees the bound on the very
 * pointer that is written through. */
LB_INLINE int lb_rewrite_macs(void *data, const void *data_end, const __u8 *dst, const __u8 *src)
{
	struct lb_eth_hdr *eth = (struct lb_eth_hdr *)data;

	if (LB_PAST_END(data, sizeof(*eth), data_end))
		return -1;
	__builtin_memcpy(eth->dst, dst, LB_ETH_ALEN);
	__builtin_memcpy(eth->src, src, LB_ETH_ALEN);
	return 0;
}

/* ---- RFC 1624 incremental checksum update ---------------------------------
 *
 * HC' = ~(~HC + ~m + m')   (RFC 1624, eqn. 3), in one's-complement arithmetic,
 * for every 16-bit word m of the covered data that becomes m'. Eqn. 3 rather
 * than RFC 1141's HC' = HC + m + ~m': that one can give 0x0000 where a full
 * recomputation gives 0xFFFF (RFC 1624, section 3); eqn. 3 equals a full
 * recomputation whenever the old checksum was right, except for data that
 * becomes all zeroes (no real header does).
 *
 * All values are taken as they lie in the packet: the checksum field and the
 * old and new bytes read with plain loads, no byte swap. A one's-complement
 * sum commutes with swapping the bytes of every word, so it is right on a
 * little-endian host as long as everything is in the same (memory) order;
 * a 4-byte value read whole splits into the same two 16-bit words as two
 * 2-byte reads of its halves would give.
 *
 * The sums stay in 32 bits: 17 words of at most 0xFFFF (replace16) is below
 * 2^21, and two folds bring any 32-bit sum to 16 bits.
 *
 * UDP over IPv4: a checksum field of 0 means "none" and must stay 0; a
 * computed 0 is sent as 0xFFFF (RFC 768). The caller applies both. */

LB_INLINE __u16 lb_csum_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

/* The checksum `check` after a 16-bit word of what it covers goes from `from`
 * to `to`. */
LB_INLINE __u16 lb_csum_replace2(__u16 check, __u16 from, __u16 to)
{
	__u32 sum = (__u16)~check;

	sum += (__u16)~from;
	sum += to;
	return (__u16)~lb_csum_fold(sum);
}

/* ... after 4 bytes (an IPv4 address) go from `from` to `to`. */
LB_INLINE __u16 lb_csum_replace4(__u16 check, __u32 from, __u32 to)
{
	__u32 sum = (__u16)~check;

	sum += (__u16)~(from >> 16);
	sum += (__u16)~from;
	sum += to >> 16;
	sum += to & 0xffff;
	return (__u16)~lb_csum_fold(sum);
}

/* ... after 16 bytes (an IPv6 address, as 4 words read from memory: union
 * lb_addr's v6w) go from `from` to `to`. */
LB_INLINE __u16 lb_csum_replace16(__u16 check, const __u32 from[4], const __u32 to[4])
{
	__u32 sum = (__u16)~check;
	int i;

#ifdef __clang__
#pragma unroll
#endif
	for (i = 0; i < 4; i++) {
		sum += (__u16)~(from[i] >> 16);
		sum += (__u16)~from[i];
		sum += to[i] >> 16;
		sum += to[i] & 0xffff;
	}
	return (__u16)~lb_csum_fold(sum);
}

#endif /* HPCLB_LB_REWRITE_H */
