/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_encap.h - tunnel mode's encapsulation, written once for both data planes
 * (header-only, compiled like lb_parse.h: clang -target bpf and native gcc).
 * control/hpclb/contract/model.py ports it byte for byte; the conformance
 * suite compares the two on every tunnel case.
 *
 * Tunnel mode is DSR through a tunnel: the flow is picked and pinned exactly
 * as in DSR mode (same ring, same flow table), and instead of only rewriting
 * the MACs the plane puts outer headers in front of the IP packet, whose
 * bytes stay as they came (TTL, checksums, options, Ethernet padding after
 * it). The backend decapsulates and answers the client directly.
 *
 * The frame, before and after (the 14-byte Ethernet header is rewritten in
 * place, the outer headers are what the plane makes room for):
 *
 *   [eth 14][inner IP packet ...]
 *   [eth 14][outer IP 20|40][UDP 8, GUE only][inner IP packet ...]
 *
 * Which outer family: the backend's (struct lb_backend's family). The pairs:
 *   inner IPv4 -> outer IPv4 (IPIP, proto 4) or outer IPv6 (4in6, next header 4)
 *   inner IPv6 -> outer IPv6 (next header 41)
 *   inner IPv6 -> outer IPv4: refused (drop_encap), as Katran and GLB refuse it:
 *                the IPv4 path MTU cannot carry IPv6's minimum 1280 plus 20.
 * The VIP's tunnel source must be of the outer family too (else drop_encap):
 * the control plane keeps a tunnel pool's backends of one family.
 * GUE (LB_ENCAP_GUE) adds a UDP header after the outer IP header and no GUE
 * header: GUE variant 1, "direct IP encapsulation", whose first payload
 * nibble (4 or 6) is the inner IP version (Linux fou in gue mode and Katran
 * read it so).
 *
 * Outer fields, every one of them (nothing is left from the old bytes):
 *   Ethernet  dst = backend MAC (the next hop's, for a distant backend),
 *             src = the egress port's MAC, type 0x0800 or 0x86DD
 *   IPv4      0x45, tos = the inner tos/traffic class (DSCP and ECN copied,
 *             RFC 6040 normal mode), total length = 20 [+ 8] + inner length,
 *             id 0, flags DF (0x4000), offset 0, TTL 64, proto 4 / 41 / 17,
 *             header checksum computed over the 20 bytes,
 *             src = lb_tunnel_src (below), dst = the backend's address
 *   IPv6      version 6, traffic class = the inner's, flow label = the 16
 *             flow bits (upper 4 bits 0; RFC 6438: routers may hash it),
 *             payload length = [8 +] inner length, next header 4 / 41 / 17,
 *             hop limit 64, src = lb_tunnel_src, dst = the backend's address
 *   UDP (GUE) src port = 49152 + (flow bits & 0x3fff) (RFC 6335's dynamic
 *             range, so that NICs and ECMP routers hashing on ports spread
 *             the flows), dst port = the VIP's gue_port, length = 8 + inner
 *             length, checksum 0 (allowed over IPv4; over IPv6, RFC 6935: the
 *             backend's tunnel endpoint must accept zero checksums)
 * where "inner length" is the IP packet's own length (IPv4 total length,
 * IPv6 40 + payload length): Ethernet padding after it stays padding.
 *
 * The flow bits (lb_tunnel_flow_bits): a 16-bit value that is the same for
 * every packet of a flow and differs between a client's flows, computed
 * without a hash so that a pinned flow costs no SipHash: the XOR of every
 * 16-bit word of the inner source address (2 for IPv4, 8 for IPv6) and of
 * the inner source port, each read as a big-endian number. It sets
 *   - the low tunnel_src_bits bits of the outer source address (Katran's
 *     and GLB's reason: a backend NIC's RSS hashes the outer addresses of an
 *     IPIP packet, and one outer source would put every flow on one queue);
 *     the address's last 16 bits are (tunnel_src & ~mask) | (bits & mask),
 *     mask = (1 << tunnel_src_bits) - 1, the rest of tunnel_src unchanged;
 *   - the IPv6 flow label and the GUE source port, as above.
 *
 * MTU: the plane never fragments and never sends "too big": IPv4 outer
 * headers carry DF and IPv6 is never fragmented on the way, so a frame
 * whose encapsulated size exceeds an MTU on the path is dropped there (an
 * XDP_TX or a DPDK transmit larger than the egress MTU is dropped by the
 * egress). The operator gives the tunnel path an MTU 20 (IPIP over IPv4),
 * 28 (GUE over IPv4), 40 (IPIP over IPv6) or 48 (GUE over IPv6) bytes above
 * the client path's, or clamps the TCP MSS by as much; docs/ARCHITECTURE.md
 * "Tunnel mode" says how.
 *
 * How a plane uses it: lb_encap_prepare (is this pair encapsulated, how many
 * bytes go in front) before making room, then lb_encap_write on the frame's
 * new first byte. XDP: bpf_xdp_adjust_head(ctx, -len) between the two;
 * DPDK: rte_pktmbuf_prepend.
 */
#ifndef HPCLB_LB_ENCAP_H
#define HPCLB_LB_ENCAP_H

#include "lb_parse.h"
#include "lb_rewrite.h"

#define LB_IPPROTO_IPIP 4
#define LB_IPPROTO_IPV6 41
#define LB_TUNNEL_TTL 64
#define LB_IP_DF 0x4000
#define LB_GUE_SPORT_BASE 49152
#define LB_GUE_SPORT_MASK 0x3fff

#define LB_ENCAP_V4_LEN 20  /* outer IPv4 header */
#define LB_ENCAP_V6_LEN 40  /* outer IPv6 header */
#define LB_ENCAP_UDP_LEN 8  /* GUE's UDP header */
#define LB_ENCAP_MAX_LEN (LB_ENCAP_V6_LEN + LB_ENCAP_UDP_LEN)

/* Everything lb_encap_write needs, gathered before the frame moves (XDP's
 * adjust_head invalidates every packet pointer). */
struct lb_encap_plan {
	union lb_addr src;   /* outer source: lb_tunnel_src */
	union lb_addr dst;   /* outer destination: the backend's address */
	__u8 outer_family;   /* enum lb_family: the backend's */
	__u8 encap;          /* enum lb_encap */
	__u8 inner_proto;    /* LB_IPPROTO_IPIP (inner IPv4) or LB_IPPROTO_IPV6 */
	__u8 tos;            /* inner tos / traffic class */
	__u16 inner_len;     /* the inner IP packet's length (its header's) */
	__u16 flow_bits;     /* lb_tunnel_flow_bits */
	__be16 gue_port;     /* network order */
	__u16 len;           /* bytes put in front of the inner packet: 20, 28, 40 or 48 */
	__u8 dst_mac[LB_ETH_ALEN];
	__u8 src_mac[LB_ETH_ALEN];
};

/* The flow bits of a parsed TCP/UDP packet (see the top of this file). */
LB_INLINE __u16 lb_tunnel_flow_bits(const struct lb_parsed *p)
{
	__u32 x;

	if (p->family == LB_FAMILY_V4) {
		x = p->src.v4;
	} else {
		x = p->src.v6w[0] ^ p->src.v6w[1] ^ p->src.v6w[2] ^ p->src.v6w[3];
	}
	/* XOR of the two 16-bit halves in memory order is the byte-swapped
	 * XOR of the big-endian words; swap once at the end. */
	x = (x ^ (x >> 16)) & 0xffff;
	return (__u16)(lb_ntohs((__u16)x) ^ lb_ntohs(p->sport));
}

/* The outer source address: tunnel_src with its last 16 bits' low `bits`
 * bits taken from the flow bits (bits 0..LB_TUNNEL_SRC_BITS_MAX). */
LB_INLINE void lb_tunnel_src(union lb_addr *out, const union lb_addr *tunnel_src, __u8 family,
			     __u8 bits, __u16 flow_bits)
{
	__u16 mask = bits >= 16 ? 0xffff : (__u16)((1u << bits) - 1);
	/* The 32-bit word holding the last 16 bits: bytes 2..3 of it in memory. */
	__u32 w = family == LB_FAMILY_V4 ? tunnel_src->v4 : tunnel_src->v6w[3];
	__u16 last = lb_ntohs((__u16)(w >> 16));

	last = (__u16)((last & ~mask) | (flow_bits & mask));
	w = (w & 0xffff) | ((__u32)lb_htons(last) << 16);
	/* The word is computed from tunnel_src and stored whole, not patched
	 * in *out: a 16-bit store into it followed by lb_encap_write's 32-bit
	 * load of the address defeats the CPU's store-to-load forwarding (the
	 * load waits for the stores to reach the cache). */
	*out = *tunnel_src;
	if (family == LB_FAMILY_V4)
		out->v4 = w;
	else
		out->v6w[3] = w;
}
/* The shifts above assume a little-endian host (memory byte 2 is bits 16..23
 * of the loaded word): both planes run on x86-64 and BPF is host-endian. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "lb_tunnel_src assumes a little-endian host"
#endif

/* The inner tos / traffic class of the packet the parse found at l3_off. */
LB_INLINE __u8 lb_inner_tos(const void *data, const void *data_end, const struct lb_parsed *p)
{
	const __u8 *l3 = (const __u8 *)data + sizeof(struct lb_eth_hdr);

	/* Untagged frames only (the planes' rule): the IP header is at 14. */
	if (LB_PAST_END(l3, 2, data_end))
		return 0;
	if (p->family == LB_FAMILY_V4)
		return l3[1];
	return (__u8)(((l3[0] & 0x0f) << 4) | (l3[1] >> 4));
}

/* Fill *e for a parsed packet going to backend b of the tunnel VIP v; the
 * MACs are the caller's. 0, or -1 when the pair is not encapsulated
 * (drop_encap): IPv6 inside IPv4, or a tunnel source of another family than
 * the backend's. */
LB_INLINE int lb_encap_prepare(struct lb_encap_plan *e, const struct lb_parsed *p,
			    const struct lb_vip_entry *v, const struct lb_backend *b, __u8 tos)
{
	__u8 bits = v->tunnel_src_bits;

	if (b->family != v->tunnel_family)
		return -1;
	if (b->family == LB_FAMILY_V4) {
		if (p->family != LB_FAMILY_V4)
			return -1;
		e->len = LB_ENCAP_V4_LEN;
	} else if (b->family == LB_FAMILY_V6) {
		e->len = LB_ENCAP_V6_LEN;
	} else {
		return -1;
	}
	if (v->tunnel_encap == LB_ENCAP_GUE)
		e->len += LB_ENCAP_UDP_LEN;
	else if (v->tunnel_encap != LB_ENCAP_IPIP)
		return -1;
	if (bits > LB_TUNNEL_SRC_BITS_MAX)
		bits = LB_TUNNEL_SRC_BITS_MAX;
	e->outer_family = b->family;
	e->encap = v->tunnel_encap;
	e->inner_proto = p->family == LB_FAMILY_V4 ? LB_IPPROTO_IPIP : LB_IPPROTO_IPV6;
	e->tos = tos;
	e->inner_len = p->l3_len;
	e->flow_bits = lb_tunnel_flow_bits(p);
	e->gue_port = v->gue_port;
	e->dst = b->addr;
	lb_tunnel_src(&e->src, &v->tunnel_src, b->family, bits, e->flow_bits);
	return 0;
}

/* RFC 791 header checksum of the outer IPv4 header lb_encap_write writes
 * (0x45, tos, tot_len, id 0, DF, TTL 64, proto, checksum 0, saddr, daddr),
 * summed from the values rather than read back from the frame: the same
 * ten 16-bit words in memory order (as lb_rewrite.h's updates, on this
 * little-endian host: a word's first byte is its low byte), so the same
 * checksum, without ten loads from packet memory after the stores, and with
 * the constant words folded at compile time. tot_len is in network order,
 * as stored. */
LB_INLINE __u16 lb_encap_ipv4_csum(__u8 tos, __be16 tot_len, __u8 proto, __be32 saddr,
				   __be32 daddr)
{
	__u32 sum = (__u32)(0x45 | (tos << 8))             /* ver_ihl, tos */
		    + tot_len                                /* id 0 adds nothing */
		    + lb_htons(LB_IP_DF)                     /* frag_off */
		    + (__u32)(LB_TUNNEL_TTL | (proto << 8))  /* ttl, proto */
		    + (saddr & 0xffff) + (saddr >> 16)
		    + (daddr & 0xffff) + (daddr >> 16);

	return (__u16)~lb_csum_fold(sum);
}

/* Write the Ethernet and outer headers at data, the frame's first byte after
 * the plane made e->len bytes of room in front of the inner packet (so the
 * inner packet starts at data + 14 + e->len). 0, or -1 (nothing written)
 * when the frame is too short to hold them, which cannot be after a parse
 * and a successful adjust; the checks are on the pointer written through and
 * come before any store, for the verifier. The Ethernet addresses are
 * dst_mac and src_mac (lb_encap_write: the plan's; XDP passes its map values
 * straight, which outlive the adjust, rather than copying them into the plan
 * byte by byte and reading them back 16 bits at a time, a pattern the CPU's
 * store-to-load forwarding cannot serve). */
LB_INLINE int lb_encap_write_macs(void *data, const void *data_end,
				  const struct lb_encap_plan *e, const __u8 *dst_mac,
				  const __u8 *src_mac)
{
	struct lb_eth_hdr *eth = (struct lb_eth_hdr *)data;
	__u8 *l3 = (__u8 *)data + sizeof(*eth);
	__u16 udp_len = (__u16)(LB_ENCAP_UDP_LEN + e->inner_len);
	__u8 gue = e->encap == LB_ENCAP_GUE;
	struct lb_udp_hdr *udp;

	/* Ethernet + IPv4 + UDP, the least any encapsulation writes (an IPIP
	 * frame is longer anyway: its inner IP header follows), checked before
	 * the first store; the IPv6 branch checks its own, longer span. */
	if (LB_PAST_END(data, sizeof(*eth) + LB_ENCAP_V4_LEN + LB_ENCAP_UDP_LEN, data_end))
		return -1;
	if (e->outer_family == LB_FAMILY_V4) {
		struct lb_ipv4_hdr *ip = (struct lb_ipv4_hdr *)l3;

		__be16 tot_len = lb_htons((__u16)(e->len + e->inner_len));
		__u8 proto = gue ? LB_IPPROTO_UDP : e->inner_proto;

		__builtin_memcpy(eth->dst, dst_mac, LB_ETH_ALEN);
		__builtin_memcpy(eth->src, src_mac, LB_ETH_ALEN);
		eth->proto = lb_htons(LB_ETH_P_IP);
		ip->ver_ihl = 0x45;
		ip->tos = e->tos;
		ip->tot_len = tot_len;
		ip->id = 0;
		ip->frag_off = lb_htons(LB_IP_DF);
		ip->ttl = LB_TUNNEL_TTL;
		ip->proto = proto;
		ip->saddr = e->src.v4;
		ip->daddr = e->dst.v4;
		ip->check = lb_encap_ipv4_csum(e->tos, tot_len, proto, e->src.v4, e->dst.v4);
		udp = (struct lb_udp_hdr *)(l3 + LB_ENCAP_V4_LEN);
	} else {
		struct lb_ipv6_hdr *ip6 = (struct lb_ipv6_hdr *)l3;
		__u32 vtf = (6u << 28) | ((__u32)e->tos << 20) | e->flow_bits;

		if (LB_PAST_END(data, sizeof(*eth) + LB_ENCAP_V6_LEN + LB_ENCAP_UDP_LEN, data_end))
			return -1;
		__builtin_memcpy(eth->dst, dst_mac, LB_ETH_ALEN);
		__builtin_memcpy(eth->src, src_mac, LB_ETH_ALEN);
		eth->proto = lb_htons(LB_ETH_P_IPV6);
		ip6->ver_tc_flow = __builtin_bswap32(vtf);
		ip6->payload_len = lb_htons((__u16)(e->len - LB_ENCAP_V6_LEN + e->inner_len));
		ip6->nexthdr = gue ? LB_IPPROTO_UDP : e->inner_proto;
		ip6->hop_limit = LB_TUNNEL_TTL;
		__builtin_memcpy(ip6->saddr, e->src.v6, 16);
		__builtin_memcpy(ip6->daddr, e->dst.v6, 16);
		udp = (struct lb_udp_hdr *)(l3 + LB_ENCAP_V6_LEN);
	}
	if (gue) {
		udp->sport = lb_htons((__u16)(LB_GUE_SPORT_BASE + (e->flow_bits & LB_GUE_SPORT_MASK)));
		udp->dport = e->gue_port;
		udp->len = lb_htons(udp_len);
		udp->check = 0;
	}
	return 0;
}

/* lb_encap_write with the MACs of the plan (the DPDK plane's call). */
LB_INLINE int lb_encap_write(void *data, const void *data_end, const struct lb_encap_plan *e)
{
	return lb_encap_write_macs(data, data_end, e, e->dst_mac, e->src_mac);
}

#endif /* HPCLB_LB_ENCAP_H */
