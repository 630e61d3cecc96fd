/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_parse.h - the packet parse both data planes share: Ethernet, one optional
 * 802.1Q tag, IPv4 (IHL, options, total length, fragments) or IPv6 (payload
 * length, a bounded walk of the extension-header chain, fragments), and the
 * TCP/UDP ports, into one family-aware struct lb_parsed and a verdict.
 *
 * Header-only and compiled twice: by clang -target bpf into lb.bpf.c, where
 * the verifier must prove every packet access, and natively (gcc) into the
 * DPDK forwarder and tests/unit/parse_selftest.c. The input is the same in
 * both: a pointer to the first byte of the frame and a pointer one past its
 * last byte. Nothing is read before a bound check has shown it lies in
 * [data, data_end), and every such check is written the way the verifier
 * learns a packet range from: "pointer + constant-or-bounded-scalar >
 * data_end" (LB_PAST_END). Loops have a compile-time trip count and are
 * unrolled for BPF. Only <linux/types.h> is used; the wire headers are defined
 * here, so the file depends on neither the kernel's nor DPDK's header set.
 *
 * What the planes do with a verdict is theirs (lb.bpf.c, fwd_packet.c);
 * control/hpclb/contract/model.py is the reference for that, and the order of the
 * checks below is the model's order, so that a frame that is wrong in two ways
 * gets the same verdict everywhere.
 */
#ifndef HPCLB_LB_PARSE_H
#define HPCLB_LB_PARSE_H

#include <linux/types.h>

#include "lb_tables.h" /* union lb_addr, enum lb_family */

/* ---- portability shim ---------------------------------------------------- */

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif
/* Every helper here is inlined into its caller: BPF needs it (no pointer to
 * packet data may cross a BPF-to-BPF call boundary unchecked, and the verifier
 * tracks ranges per register), and the DPDK fast path wants it anyway. */
#define LB_INLINE static __always_inline

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define lb_ntohs(x) ((__u16)(x))
#define lb_htons(x) ((__u16)(x))
#else
/* A builtin, not bpf_ntohs or ntohs: the same spelling in both compilers, and
 * constant-folded, so LB_HTONS(0x0800) costs nothing in a comparison. */
#define lb_ntohs(x) ((__u16)__builtin_bswap16((__u16)(x)))
#define lb_htons(x) ((__u16)__builtin_bswap16((__u16)(x)))
#endif

/* "Fewer than n bytes lie between p and end": the one bound check.
 * BPF: written as a pointer comparison against data_end, the only form from
 * which the verifier learns that [p, p + n) may be read.
 * Native: written as a length comparison, because forming p + n past the end
 * of the buffer is undefined behaviour in C (and caught by UBSan's
 * pointer-overflow check); p <= end always holds where it is used (p only
 * advances after a check). */
#ifdef __BPF__
#define LB_PAST_END(p, n, end) ((const __u8 *)(p) + (n) > (const __u8 *)(end))
#else
#define LB_PAST_END(p, n, end) \
	((__u64)((const __u8 *)(end) - (const __u8 *)(p)) < (__u64)(n))
#endif

/* Wire headers. In BPF they keep their natural alignment, as the kernel's
 * struct iphdr does: an XDP frame puts the IPv4 header at offset 14, and the
 * verifier accepts a 4-byte load from a 2-byte-aligned packet address, where
 * packed structs would make clang split every word into halves. Natively they
 * are packed to 2-byte alignment, which is what a frame guarantees (the
 * Ethernet header starts aligned, every later header at an even offset), so
 * that no access claims an alignment the buffer does not have (UBSan checks). */
#ifdef __BPF__
#define LB_WIRE
#else
#define LB_WIRE __attribute__((packed, aligned(2)))
#endif

#define LB_ETH_ALEN 6
#define LB_ETH_P_IP 0x0800
#define LB_ETH_P_ARP 0x0806
#define LB_ETH_P_8021Q 0x8100
#define LB_ETH_P_IPV6 0x86DD

#define LB_IPPROTO_HOPOPTS 0
#define LB_IPPROTO_TCP 6
#define LB_IPPROTO_UDP 17
#define LB_IPPROTO_ROUTING 43
#define LB_IPPROTO_FRAGMENT 44
#define LB_IPPROTO_AH 51
#define LB_IPPROTO_DSTOPTS 60

#define LB_IP_MF 0x2000     /* IPv4 more fragments, host order */
#define LB_IP_OFFSET 0x1fff /* IPv4 fragment offset, host order */
#define LB_IP6_MF 0x0001    /* IPv6 fragment header: more fragments, host order */
#define LB_IP6_OFFSET 0xfff8 /* IPv6 fragment header: offset (8-byte units << 3) */

#define LB_TCP_HLEN 20 /* without options: all the parse needs */
#define LB_UDP_HLEN 8

/* Extension headers walked before giving up with LB_PARSE_EXT_TOO_LONG. Real
 * traffic carries zero to two; eight leaves room for hop-by-hop, destination
 * options, routing, fragment, AH and destination options again while bounding
 * the unrolled code the verifier must walk. */
#define LB_IPV6_MAX_EXT_HDRS 8

struct lb_eth_hdr {
	__u8 dst[LB_ETH_ALEN];
	__u8 src[LB_ETH_ALEN];
	__be16 proto;
} LB_WIRE;

struct lb_vlan_hdr {
	__be16 tci;
	__be16 proto; /* the EtherType of what follows the tag */
} LB_WIRE;

struct lb_ipv4_hdr {
	__u8 ver_ihl;
	__u8 tos;
	__be16 tot_len;
	__be16 id;
	__be16 frag_off;
	__u8 ttl;
	__u8 proto;
	__u16 check;
	__be32 saddr;
	__be32 daddr;
} LB_WIRE;

struct lb_ipv6_hdr {
	__be32 ver_tc_flow;
	__be16 payload_len;
	__u8 nexthdr;
	__u8 hop_limit;
	__u8 saddr[16];
	__u8 daddr[16];
} LB_WIRE;

/* The first 8 bytes every walked extension header has (8 is each one's
 * minimum length): next header, then its length in its own unit. */
struct lb_ipv6_ext_hdr {
	__u8 nexthdr;
	__u8 hdrlen;
	__u8 rest[6];
} LB_WIRE;

struct lb_ipv6_frag_hdr {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off; /* offset << 3 | res | M */
	__be32 id;
} LB_WIRE;

/* TCP and UDP both begin with the two ports. */
struct lb_l4_ports {
	__be16 sport;
	__be16 dport;
} LB_WIRE;

/* The whole UDP header: NAT rewrites its checksum (lb_nat.h), tunnel mode
 * writes one (GUE, lb_encap.h). */
struct lb_udp_hdr {
	__be16 sport;
	__be16 dport;
	__be16 len;
	__u16 check;
} LB_WIRE;

_Static_assert(sizeof(struct lb_eth_hdr) == 14, "Ethernet header is 14 bytes");
_Static_assert(sizeof(struct lb_vlan_hdr) == 4, "802.1Q tag is 4 bytes");
_Static_assert(sizeof(struct lb_ipv4_hdr) == 20, "IPv4 header is 20 bytes");
_Static_assert(sizeof(struct lb_ipv6_hdr) == 40, "IPv6 header is 40 bytes");
_Static_assert(sizeof(struct lb_ipv6_ext_hdr) == 8, "extension header minimum is 8");
_Static_assert(sizeof(struct lb_ipv6_frag_hdr) == 8, "fragment header is 8 bytes");
_Static_assert(sizeof(struct lb_udp_hdr) == 8, "UDP header is 8 bytes");

/* ---- the result ---------------------------------------------------------- */

enum lb_parse_verdict {
	LB_PARSE_OK = 0,          /* TCP or UDP, whole headers, not a fragment: ports set */
	LB_PARSE_NOT_IP,          /* EtherType neither IPv4 nor IPv6 (ARP, a second tag...) */
	LB_PARSE_MALFORMED,       /* a header truncated or contradicting its lengths */
	LB_PARSE_UNSUPPORTED_L4,  /* IP, but its protocol is neither TCP nor UDP */
	LB_PARSE_FRAGMENT,        /* a TCP/UDP fragment (first or later) */
	LB_PARSE_EXT_TOO_LONG,    /* IPv6: more than LB_IPV6_MAX_EXT_HDRS extension headers */
};

/* The parse's names for the table contract's families (lb_tables.h). */
#define LB_FAMILY_IPV4 LB_FAMILY_V4
#define LB_FAMILY_IPV6 LB_FAMILY_V6

#define LB_PF_VLAN 0x0001           /* one 802.1Q tag was present (vlan_tci set) */
#define LB_PF_FRAGMENT 0x0002       /* IPv4 MF or offset; IPv6 fragment header, not atomic */
#define LB_PF_LATER_FRAGMENT 0x0004 /* ... and not the first: no L4 header in it */
#define LB_PF_IP_OPTIONS 0x0008     /* IPv4 IHL > 5, or IPv6 extension headers walked */

struct lb_parsed {
	__u8 family;      /* LB_FAMILY_*, set as soon as the EtherType names one (even when
			   * the IP header then turns out malformed); 0 otherwise */
	__u8 proto;       /* IPv4 protocol, or the IPv6 next header that ended the walk */
	__u16 flags;      /* LB_PF_* */
	__be16 eth_proto; /* EtherType after the tag, if any (network order) */
	__u16 vlan_tci;   /* host order, with LB_PF_VLAN */
	__u16 l3_off;     /* what follows Ethernet and the tag (the IP header): 0 until
			   * they fit in the frame */
	__u16 l4_off;     /* L4 header offset (an IPv6 fragment: its fragmentable part);
			   * 0 until the IP header (options, chain) is walked */
	__u16 l3_len;     /* IP packet length from its header; bytes past l3_off + l3_len
			   * are Ethernet padding, no part of the packet */
	__be16 sport;     /* network order, set only with LB_PARSE_OK */
	__be16 dport;
	__u16 pad;        /* always 0 */
	union lb_addr src; /* network order; v4 in .v4, v6 in .v6 (set once the IP header fits) */
	union lb_addr dst;
};

/* ---- the parse ----------------------------------------------------------- */

/* TCP or UDP header at l4, l4_rel bytes into the l3_len-byte packet that
 * lb_parse_ipv4/6 already found to lie inside the frame. */
LB_INLINE enum lb_parse_verdict lb_parse_ports(struct lb_parsed *p, const __u8 *l4, __u32 l4_rel,
					       const __u8 *end)
{
	__u32 need = p->proto == LB_IPPROTO_TCP ? LB_TCP_HLEN : LB_UDP_HLEN;
	const struct lb_l4_ports *ports = (const struct lb_l4_ports *)l4;

	/* The whole header within the packet (its length field), not just
	 * within the frame: what follows the packet is Ethernet padding, and
	 * ports read from it would be noise. As the packet lies in the frame,
	 * this also puts the header in the frame. */
	if (l4_rel + need > p->l3_len)
		return LB_PARSE_MALFORMED;
	/* Implied by the above, but the verifier cannot follow that arithmetic:
	 * it needs a constant-size check on this very pointer before the read.
	 * One constant (the two ports) rather than 20-or-8, which clang may
	 * fold into a select the verifier learns no range from. */
	if (LB_PAST_END(ports, sizeof(*ports), end))
		return LB_PARSE_MALFORMED;
	p->sport = ports->sport;
	p->dport = ports->dport;
	return LB_PARSE_OK;
}

LB_INLINE int lb_l4_supported(__u8 proto)
{
	return proto == LB_IPPROTO_TCP || proto == LB_IPPROTO_UDP;
}

/* IPv4 at l3. Order as the model: header, lengths, protocol, fragment, L4. */
LB_INLINE enum lb_parse_verdict lb_parse_ipv4(struct lb_parsed *p, const __u8 *l3, const __u8 *end)
{
	const struct lb_ipv4_hdr *iph = (const struct lb_ipv4_hdr *)l3;
	__u32 ihl_bytes, ip_len;

	if (LB_PAST_END(l3, sizeof(*iph), end))
		return LB_PARSE_MALFORMED;
	if ((iph->ver_ihl >> 4) != 4 || (iph->ver_ihl & 0xf) < 5)
		return LB_PARSE_MALFORMED;
	p->src.v4 = iph->saddr;
	p->dst.v4 = iph->daddr;
	p->proto = iph->proto;
	/* The total length covers the header (so it is not 0 either) and fits
	 * in the frame; what follows it is Ethernet padding. Options beyond the
	 * frame fail here too: they make the header longer than the total
	 * length or the total length longer than the frame. */
	ihl_bytes = (iph->ver_ihl & 0xf) * 4u; /* 20..60: a bound the verifier sees */
	ip_len = lb_ntohs(iph->tot_len);
	if (ip_len < ihl_bytes || LB_PAST_END(l3, ip_len, end))
		return LB_PARSE_MALFORMED;
	p->l3_len = (__u16)ip_len;
	p->l4_off = (__u16)(p->l3_off + ihl_bytes);
	if (ihl_bytes > sizeof(*iph))
		p->flags |= LB_PF_IP_OPTIONS;
	if (iph->frag_off & lb_htons(LB_IP_MF | LB_IP_OFFSET)) {
		p->flags |= LB_PF_FRAGMENT;
		if (iph->frag_off & lb_htons(LB_IP_OFFSET))
			p->flags |= LB_PF_LATER_FRAGMENT;
	}
	/* Another protocol is that before it is a fragment (the model's order:
	 * a fragmented ICMP message is "not for a VIP", not "a fragment"). */
	if (!lb_l4_supported(iph->proto))
		return LB_PARSE_UNSUPPORTED_L4;
	if (p->flags & LB_PF_FRAGMENT)
		return LB_PARSE_FRAGMENT;
	/* Re-derive the offset from the header byte rather than reuse
	 * ihl_bytes: where the compiler spills that variable, the verifier would
	 * otherwise see the pointer move by an unbounded scalar. */
	return lb_parse_ports(p, l3 + (iph->ver_ihl & 0xf) * 4u, ihl_bytes, end);
}

LB_INLINE int lb_ipv6_is_ext(__u8 nexthdr)
{
	return nexthdr == LB_IPPROTO_HOPOPTS || nexthdr == LB_IPPROTO_ROUTING ||
	       nexthdr == LB_IPPROTO_FRAGMENT || nexthdr == LB_IPPROTO_AH ||
	       nexthdr == LB_IPPROTO_DSTOPTS;
}

/* IPv6 at l3: header, payload length, the extension-header chain (each header
 * inside the packet; at most LB_IPV6_MAX_EXT_HDRS), then the L4 header.
 * ESP (50) ends the walk as an unsupported protocol: what follows it is
 * encrypted. Hop-by-hop's position is not enforced (the kernel checks that
 * when it receives the packet). A payload length of 0 is taken at its word:
 * a jumbogram cannot be carried by Ethernet. */
LB_INLINE enum lb_parse_verdict lb_parse_ipv6(struct lb_parsed *p, const __u8 *l3, const __u8 *end)
{
	const struct lb_ipv6_hdr *ip6 = (const struct lb_ipv6_hdr *)l3;
	__u32 pkt_len, off = sizeof(*ip6), i;
	__u8 nexthdr;

	if (LB_PAST_END(l3, sizeof(*ip6), end))
		return LB_PARSE_MALFORMED;
	if ((*l3 >> 4) != 6)
		return LB_PARSE_MALFORMED;
	__builtin_memcpy(p->src.v6, ip6->saddr, 16);
	__builtin_memcpy(p->dst.v6, ip6->daddr, 16);
	pkt_len = sizeof(*ip6) + lb_ntohs(ip6->payload_len); /* <= 65575, bounded */
	if (LB_PAST_END(l3, pkt_len, end))
		return LB_PARSE_MALFORMED;
	p->l3_len = (__u16)pkt_len; /* fits: the frame holds it, and frames are < 64 KiB */
	nexthdr = ip6->nexthdr;

#ifdef __clang__
#pragma unroll
#endif
	for (i = 0; i < LB_IPV6_MAX_EXT_HDRS; i++) {
		/* off <= 40 + i * 2048 here: each step adds at most 2048 (the
		 * largest hdrlen), so the verifier sees a bounded offset. */
		const struct lb_ipv6_ext_hdr *ext = (const struct lb_ipv6_ext_hdr *)(l3 + off);

		if (!lb_ipv6_is_ext(nexthdr))
			break;
		p->flags |= LB_PF_IP_OPTIONS;
		if (off + sizeof(*ext) > pkt_len || LB_PAST_END(ext, sizeof(*ext), end))
			return LB_PARSE_MALFORMED;
		if (nexthdr == LB_IPPROTO_FRAGMENT) {
			const struct lb_ipv6_frag_hdr *frag = (const struct lb_ipv6_frag_hdr *)ext;
			__u16 fo = lb_ntohs(frag->frag_off);

			off += sizeof(*frag);
			nexthdr = frag->nexthdr;
			/* An atomic fragment (offset 0, no more fragments,
			 * RFC 6946) is a whole packet: walk on. */
			if (fo & (LB_IP6_OFFSET | LB_IP6_MF)) {
				p->flags |= LB_PF_FRAGMENT;
				if (fo & LB_IP6_OFFSET)
					p->flags |= LB_PF_LATER_FRAGMENT;
				p->proto = nexthdr;
				p->l4_off = (__u16)(p->l3_off + off);
				/* As for IPv4, a known other protocol wins over
				 * "fragment"; an extension header in the
				 * fragmentable part hides the protocol. */
				if (!lb_l4_supported(nexthdr) && !lb_ipv6_is_ext(nexthdr))
					return LB_PARSE_UNSUPPORTED_L4;
				return LB_PARSE_FRAGMENT;
			}
			continue;
		}
		if (nexthdr == LB_IPPROTO_AH)
			off += (ext->hdrlen + 2u) * 4u; /* RFC 4302: 4-byte units, minus 2 */
		else
			off += (ext->hdrlen + 1u) * 8u; /* RFC 8200: 8-byte units, minus 1 */
		nexthdr = ext->nexthdr;
		if (off > pkt_len) /* the next header's start; its bytes are checked above */
			return LB_PARSE_MALFORMED;
	}
	if (lb_ipv6_is_ext(nexthdr))
		return LB_PARSE_EXT_TOO_LONG;
	p->proto = nexthdr;
	p->l4_off = (__u16)(p->l3_off + off);
	if (!lb_l4_supported(nexthdr))
		return LB_PARSE_UNSUPPORTED_L4;
	return lb_parse_ports(p, l3 + off, off, end);
}

/* Parse the frame [data, data_end) into *p (which is cleared first). */
LB_INLINE enum lb_parse_verdict lb_parse_frame(struct lb_parsed *p, const void *data,
					       const void *data_end)
{
	const __u8 *pos = (const __u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	const struct lb_eth_hdr *eth = (const struct lb_eth_hdr *)pos;
	__u32 l3_off = sizeof(*eth);
	__be16 proto;

	__builtin_memset(p, 0, sizeof(*p));
	if (LB_PAST_END(pos, sizeof(*eth), end))
		return LB_PARSE_MALFORMED;
	proto = eth->proto;
	/* One 802.1Q tag; a second tag (QinQ) or an 802.1ad outer tag is left
	 * as "not IP": nothing in the appliance's networks stacks them. */
	if (proto == lb_htons(LB_ETH_P_8021Q)) {
		const struct lb_vlan_hdr *vlan = (const struct lb_vlan_hdr *)(pos + sizeof(*eth));

		p->flags |= LB_PF_VLAN;
		if (LB_PAST_END(pos, sizeof(*eth) + sizeof(*vlan), end))
			return LB_PARSE_MALFORMED;
		p->vlan_tci = lb_ntohs(vlan->tci);
		proto = vlan->proto;
		l3_off += sizeof(*vlan);
	}
	p->eth_proto = proto;
	p->l3_off = (__u16)l3_off;
	if (proto == lb_htons(LB_ETH_P_IP)) {
		p->family = LB_FAMILY_IPV4;
		return lb_parse_ipv4(p, pos + l3_off, end);
	}
	if (proto == lb_htons(LB_ETH_P_IPV6)) {
		p->family = LB_FAMILY_IPV6;
		return lb_parse_ipv6(p, pos + l3_off, end);
	}
	return LB_PARSE_NOT_IP;
}

/* What the data planes balance today: untagged IPv4. The tables are
 * family-aware since protocol 2 (an IPv6 VIP can be configured), but IPv6
 * forwarding is not written yet. Every other frame whose Ethernet header is
 * whole is LB_PARSE_NOT_IP to them, whatever the parse found in it (a tagged
 * or IPv6 frame, even a malformed one, even one to a configured IPv6 VIP),
 * which is exactly what they did when they read the EtherType and stopped
 * there. To be dropped when the fast paths forward IPv6. */
LB_INLINE enum lb_parse_verdict lb_untagged_ipv4_only(const struct lb_parsed *p,
						      enum lb_parse_verdict v)
{
	if (p->flags & LB_PF_VLAN)
		return LB_PARSE_NOT_IP;
	if (p->l3_off == 0) /* no whole Ethernet header: v is MALFORMED */
		return v;
	if (p->family != LB_FAMILY_IPV4)
		return LB_PARSE_NOT_IP;
	return v;
}

/* lb_untagged_ipv4_only(p, lb_parse_frame(p, data, data_end)) in one pass,
 * for a fast path that balances untagged IPv4 only (lb.bpf.c): the same
 * verdict for every frame, but a tagged or non-IPv4 frame is LB_PARSE_NOT_IP
 * from its EtherType, without walking the tag or the IPv6 header, and *p is
 * not cleared first. Every field is written once, on the path that learns it:
 * with LB_PARSE_OK, *p is byte for byte what lb_parse_frame fills (the
 * constant stores the caller never reads cost nothing once inlined); with any
 * other verdict nothing in *p is promised, and the caller reads only the
 * verdict. Clearing the struct up front, or merging the verdicts of both
 * families before the policy, made every field a merge of "0 or the value"
 * that the per-packet path paid for (perf/packet_cost.py).
 * tests/unit/parse_selftest.c checks both promises on its whole corpus, in the
 * native and the BPF build. */
LB_INLINE enum lb_parse_verdict lb_parse_untagged_ipv4(struct lb_parsed *p, const void *data,
						       const void *data_end)
{
	const __u8 *pos = (const __u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	const struct lb_eth_hdr *eth = (const struct lb_eth_hdr *)pos;

	if (LB_PAST_END(pos, sizeof(*eth), end))
		return LB_PARSE_MALFORMED;
	if (eth->proto != lb_htons(LB_ETH_P_IP))
		return LB_PARSE_NOT_IP; /* a tag, IPv6, ARP...: lb_untagged_ipv4_only's NOT_IP */
	p->family = LB_FAMILY_IPV4;
	p->flags = 0;
	p->eth_proto = eth->proto;
	p->vlan_tci = 0;
	p->l3_off = sizeof(*eth);
	p->pad = 0;
	p->src.v6w[1] = 0;
	p->src.v6w[2] = 0;
	p->src.v6w[3] = 0;
	p->dst.v6w[1] = 0;
	p->dst.v6w[2] = 0;
	p->dst.v6w[3] = 0;
	/* proto, addresses, l3_len, l4_off: lb_parse_ipv4; ports: with OK. */
	return lb_parse_ipv4(p, pos + sizeof(*eth), end);
}

/* What the data planes balance: untagged IPv4 and untagged IPv6, in one pass.
 * An IPv4 frame takes exactly lb_parse_untagged_ipv4's path (the same
 * instructions: the IPv4 per-packet cost does not move); an IPv6 frame gets
 * its fields written the same way, then lb_parse_ipv6. A tagged or non-IP
 * frame is LB_PARSE_NOT_IP from its EtherType. With LB_PARSE_OK, *p is byte
 * for byte what lb_parse_frame fills; with another verdict, only p->proto
 * (UNSUPPORTED_L4: the protocol, for ICMP's paths) and p->family are
 * promised. tests/unit/parse_selftest.c checks it on the corpus. */
LB_INLINE enum lb_parse_verdict lb_parse_untagged(struct lb_parsed *p, const void *data,
						  const void *data_end)
{
	const __u8 *pos = (const __u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	const struct lb_eth_hdr *eth = (const struct lb_eth_hdr *)pos;

	if (LB_PAST_END(pos, sizeof(*eth), end))
		return LB_PARSE_MALFORMED;
	if (eth->proto == lb_htons(LB_ETH_P_IP))
		return lb_parse_untagged_ipv4(p, data, data_end);
	if (eth->proto != lb_htons(LB_ETH_P_IPV6))
		return LB_PARSE_NOT_IP;
	p->family = LB_FAMILY_IPV6;
	p->proto = 0;
	p->flags = 0;
	p->eth_proto = eth->proto;
	p->vlan_tci = 0;
	p->l3_off = sizeof(*eth);
	p->l4_off = 0;
	p->l3_len = 0;
	p->sport = 0;
	p->dport = 0;
	p->pad = 0;
	return lb_parse_ipv6(p, pos + sizeof(*eth), end);
}

#endif /* HPCLB_LB_PARSE_H */
