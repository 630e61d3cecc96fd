/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_nat6.h - NAT mode's packet rewrites for IPv6, beside lb_nat.h's IPv4
 * ones and written the same way (header-only; clang -target bpf into the XDP
 * program, natively into the DPDK forwarder and the tests). lb_nat.h
 * includes this file, so either header gives both families.
 *
 *   lb_nat6_rewrite       IPv6 TCP/UDP: the source (SNAT) or destination (DNAT)
 *                         address and port become a given pair, the TCP/UDP
 *                         checksum updated incrementally (RFC 1624; it covers
 *                         both addresses through the pseudo-header, RFC 8200
 *                         section 8.1). IPv6 has no header checksum.
 *                         lb_nat6_xlat does both sides in one pass, for
 *                         lb_conn6_translate.
 *   lb_nat6_icmp_parse    an ICMPv6 error (RFC 4443: destination unreachable,
 *                         packet too big, time exceeded, parameter problem;
 *                         any code) quoting a TCP/UDP packet: where the quote
 *                         is and its 5-tuple, for the connection lookup.
 *   lb_nat6_icmp_rewrite  the quote back to what the endpoint sent (address,
 *                         port, its L4 checksum when quoted), the ICMPv6
 *                         checksum, and optionally the outer address: path
 *                         MTU discovery (RFC 8201, which IPv6 cannot do
 *                         without: routers never fragment) and traceroute
 *                         work through the gateway.
 *
 * Extension headers: allowed before the L4 header (the parse walks them and
 * gives p->l4_off), up to LB_NAT6_MAX_L4_OFF (lb_nat.h): the verifier adds
 * only a bounded scalar to a packet pointer, and the planes pass a packet
 * beyond the bound to the kernel (pass_ext_headers) before any lookup. The
 * functions here refuse one too (LB_NAT_NOT_APPLICABLE), for safety on
 * their own. A quoted packet must have no extension header (its next header
 * TCP or UDP): walking a quoted chain is not worth its code, and an error
 * about such a packet is passed to the kernel untranslated.
 *
 * Fragments never reach NAT (lb_parse gives LB_PARSE_FRAGMENT for a
 * non-atomic fragment header, and the planes pass those); a parse with
 * LB_PF_FRAGMENT is refused here as in lb_nat4_rewrite. An atomic fragment
 * (RFC 6946: offset 0, no more fragments) is a whole packet and is
 * translated like one.
 *
 * Safety, exactly as lb_nat.h: every offset taken from a caller's struct is
 * bounded before it moves a pointer, every byte touched is checked with
 * LB_PAST_END on the very pointer used, all checks come before the first
 * store (a refused call has written nothing), no loops. Offsets the parse
 * found by walking the extension chain cannot be re-derived from one header
 * byte as lb_nat.h does with the IHL: p->l4_off is read through
 * lb_nat6_l4_off (which keeps the verifier from verifying everything here
 * once per extension-chain shape the parse took), and every offset goes
 * through lb_nat6_off, which makes the bound one the verifier sees whatever
 * register clang loads the value into.
 *
 * Checksum arithmetic: lb_rewrite.h's RFC 1624 eqn. 3 helpers on values as
 * they lie in memory. The addresses sit at even offsets of the IPv6 header
 * (8, 24), which the pseudo-header carries in whole 16-bit words; the ports
 * and the L4 checksum at even offsets of their header; so every 16-bit word
 * read in memory order is a word of the sum. The UDP rule of lb_nat.h holds
 * unchanged: a UDP checksum field of 0 stays 0 (RFC 8200 forbids it, but the
 * gateway makes no packet more wrong or more right than it came), a computed
 * 0 is written 0xFFFF. Incremental updates keep a wrong checksum exactly as
 * wrong as it came: the endpoint drops it as it would have.
 */
#ifndef HPCLB_LB_NAT6_H
#define HPCLB_LB_NAT6_H

#include "lb_nat.h"

#define LB_IPPROTO_ICMPV6 58

/* ICMPv6 error messages (RFC 4443 section 3), all of which quote "as much of
 * the invoking packet as possible without the ICMPv6 packet exceeding the
 * minimum IPv6 MTU". Informational messages (128 and up) and the other
 * error types (none is assigned that quotes a TCP/UDP packet) are none of
 * NAT's business. */
#define LB_ICMP6_DEST_UNREACH 1   /* all codes (no route, prohibited, address, port...) */
#define LB_ICMP6_PACKET_TOO_BIG 2 /* code 0; the MTU in the 4 bytes after the checksum */
#define LB_ICMP6_TIME_EXCEEDED 3  /* 0 = hop limit (traceroute), 1 = reassembly */
#define LB_ICMP6_PARAMPROB 4      /* the pointer is an offset into the quote: it does not move */

#define LB_ICMP6_HLEN 8 /* type, code, checksum, 4 bytes of type-specific data */
#define LB_IPV6_HLEN 40

/* The offsets taken from a caller's struct: an L4 (or ICMPv6) header at most
 * LB_NAT6_MAX_L4_OFF into the frame; an ICMPv6 error's quoted IPv6 header
 * right after the ICMPv6 header, its L4 header right after that. The mask is
 * the smallest power of two minus one above them all (lb_nat6_off). */
#define LB_NAT6_MAX_INNER_L3_OFF (LB_NAT6_MAX_L4_OFF + LB_ICMP6_HLEN)
#define LB_NAT6_MAX_INNER_L4_OFF (LB_NAT6_MAX_INNER_L3_OFF + LB_IPV6_HLEN)
#define LB_NAT6_OFF_MASK 0x1ff
_Static_assert(LB_NAT6_MAX_INNER_L4_OFF <= LB_NAT6_OFF_MASK, "offsets fit the mask");
_Static_assert(LB_NAT6_MAX_L4_OFF >= LB_NAT_MAX_L3_OFF + LB_IPV6_HLEN, "room for the header");

/* An ICMPv6 error quoting a TCP/UDP packet, as lb_nat6_icmp_parse found it.
 * Offsets from the start of the frame. The inner 5-tuple is the quoted
 * packet's as it lies in the quote: as it left the gateway, translated (look
 * it up as such, lb_conn6_icmp_key). 52 bytes, no implicit padding. */
struct lb_nat6_icmp {
	__u16 l3_off;       /* outer IPv6 header (the parse's l3_off) */
	__u16 icmp_off;     /* ICMPv6 header (the parse's l4_off: after any extension headers) */
	__u16 inner_l3_off; /* quoted IPv6 header: icmp_off + 8 */
	__u16 inner_l4_off; /* quoted TCP/UDP header: inner_l3_off + 40 */
	__u16 l4_quoted;    /* bytes of L4 header and data quoted (>= 8): up to the end
			     * of the outer packet or of the quoted packet, whichever
			     * comes first */
	__u8 type;
	__u8 code;
	__u8 inner_proto; /* LB_IPPROTO_TCP or LB_IPPROTO_UDP */
	__u8 pad[3];      /* always 0 */
	__be16 inner_sport;
	__be16 inner_dport;
	union lb_addr inner_saddr; /* .v6 */
	union lb_addr inner_daddr;
};

_Static_assert(sizeof(struct lb_nat6_icmp) == 52, "struct lb_nat6_icmp has no implicit padding");

/* ---- helpers -------------------------------------------------------------- */

LB_NAT_INLINE int lb_icmp6_is_error(__u8 type)
{
	return type >= LB_ICMP6_DEST_UNREACH && type <= LB_ICMP6_PARAMPROB;
}

/* An offset already compared with its LB_NAT6_MAX_* bound, made one the
 * verifier knows is bounded too: clang may compare one load of the field
 * and add another (a reload from the caller's stack struct) to the pointer,
 * and it drops a mask it can prove redundant. The empty asm hides the value
 * from clang, so the mask stays, and the verifier sees [0, 511] on the very
 * register added. No cost natively beyond one AND. */
LB_NAT_INLINE __u32 lb_nat6_off(__u32 off)
{
	asm volatile("" : "+r"(off));
	return off & LB_NAT6_OFF_MASK;
}

/* p->l4_off (IPv6), as a value the verifier does not tie to the parse.
 * lb_parse_ipv6's unrolled walk of the extension chain leaves one verifier
 * state per chain shape, each with its own l4_off; a value used in pointer
 * arithmetic is "precise", and precise values keep those states apart, so
 * that every function here would be verified once per chain shape (some
 * hundred times: lb.bpf.c outgrew the verifier's million instructions). The
 * value goes through a stack slot and comes back as the upper half of what
 * was stored: a read of a spilled scalar's upper bytes, which the verifier
 * (kernel 6.18 here; any that reads part of a spilled scalar) answers with an
 * unknown 16-bit scalar and no history, which ends the precision chain
 * there; the bound checks that follow are then the only bounds it knows, and
 * the states merge (lb.bpf.c: from over 1,000,000 instructions processed to
 * about 136,000). Two stack accesses, BPF only; natively the field as it is. */
LB_NAT_INLINE __u32 lb_nat6_l4_off(const struct lb_parsed *p)
{
#if defined(__BPF__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	volatile union {
		__u64 word;
		__u16 half[4];
	} slot;

	slot.word = (__u64)p->l4_off << 16;
	return slot.half[1];
#else
	return p->l4_off;
#endif
}

LB_NAT_INLINE int lb_addr6_ne(const union lb_addr *a, const union lb_addr *b)
{
	return ((a->v6w[0] ^ b->v6w[0]) | (a->v6w[1] ^ b->v6w[1]) | (a->v6w[2] ^ b->v6w[2]) |
		(a->v6w[3] ^ b->v6w[3])) != 0;
}

/* The L4 checksum after the address (pseudo-header, 16 bytes) and the port
 * change; lb_nat_l4_csum's UDP rule. */
LB_NAT_INLINE __u16 lb_nat6_l4_csum(__u16 check, __u8 proto, const union lb_addr *old_addr,
				    const union lb_addr *new_addr, __be16 old_port,
				    __be16 new_port)
{
	if (proto == LB_IPPROTO_UDP && check == 0)
		return 0;
	check = lb_csum_replace16(check, old_addr->v6w, new_addr->v6w);
	check = lb_csum_replace2(check, old_port, new_port);
	return proto == LB_IPPROTO_UDP ? lb_nat_udp_csum(check) : check;
}

/* Whether the IPv6 header at l3_off contradicts the parse that put the L4
 * (or ICMPv6) header at l4_off: its version must be 6, and its next header
 * proto when l4_off follows it directly, an extension header otherwise. The
 * chain itself is the parse's, not walked again: a caller's stale struct
 * gives a wrong rewrite inside the frame at worst, as in lb_nat.h. */
LB_NAT_INLINE int lb_nat6_chain_differs(const struct lb_ipv6_hdr *ip6, __u32 l3_off,
					__u32 l4_off, __u8 proto)
{
	if ((((const __u8 *)ip6)[0] >> 4) != 6)
		return 1;
	if (l4_off == l3_off + LB_IPV6_HLEN)
		return ip6->nexthdr != proto;
	return !lb_ipv6_is_ext(ip6->nexthdr);
}

/* ---- IPv6 TCP/UDP: SNAT and DNAT ---------------------------------------- */

/* Rewrite the destination (daddr, unless NULL) to *daddr:dport, then the
 * source (saddr, unless NULL) to *saddr:sport, of the IPv6 TCP/UDP packet
 * that *p describes (lb_parse_untagged or lb_parse_frame gave LB_PARSE_OK for
 * this very frame), with the TCP/UDP checksum updated. The same bytes as
 * lb_nat6_dnat then lb_nat6_snat, the checksum arithmetic in that order, in
 * one pass: one set of checks, and few paths for the verifier (each branch
 * below joins again with the same live state, so that the states after it
 * merge instead of multiplying through the caller). LB_NAT_NOT_APPLICABLE:
 * not IPv6 TCP/UDP, a fragment, an L4 header beyond LB_NAT6_MAX_L4_OFF.
 * LB_NAT_MALFORMED: the frame does not hold what *p says. Nothing is written
 * unless LB_NAT_OK. */
LB_NAT_INLINE enum lb_nat_status lb_nat6_xlat(void *data, const void *data_end,
					      const struct lb_parsed *p,
					      const union lb_addr *daddr, __be16 dport,
					      const union lb_addr *saddr, __be16 sport)
{
	__u8 *pos = (__u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	struct lb_ipv6_hdr *ip6;
	struct lb_l4_ports *ports;
	__u8 *csum;
	__u32 l3_off, l4_off, pkt_len, need;
	union lb_addr old_addr;
	__u16 check;
	__u8 proto = p->proto;

	if (p->family != LB_FAMILY_IPV6 || !lb_l4_supported(proto) ||
	    (p->flags & LB_PF_FRAGMENT))
		return LB_NAT_NOT_APPLICABLE;
	l4_off = lb_nat6_l4_off(p);
	if (l4_off > LB_NAT6_MAX_L4_OFF)
		return LB_NAT_NOT_APPLICABLE;
	l3_off = p->l3_off;
	if (l3_off < LB_NAT_MIN_L3_OFF || l3_off > LB_NAT_MAX_L3_OFF ||
	    l4_off < l3_off + LB_IPV6_HLEN)
		return LB_NAT_MALFORMED;
	ip6 = (struct lb_ipv6_hdr *)(pos + l3_off);
	if (LB_PAST_END(ip6, sizeof(*ip6), end))
		return LB_NAT_MALFORMED;
	if (lb_nat6_chain_differs(ip6, l3_off, l4_off, proto))
		return LB_NAT_MALFORMED;
	/* The L4 header up to its checksum within the packet's own length
	 * (not in Ethernet padding): integers; the frame bound is checked on
	 * the pointers below. */
	need = proto == LB_IPPROTO_TCP ? LB_TCP_CSUM_END : LB_UDP_CSUM_END;
	pkt_len = LB_IPV6_HLEN + lb_ntohs(ip6->payload_len);
	if (l3_off + pkt_len < l4_off + need)
		return LB_NAT_MALFORMED;
	/* The ports and the checksum field, each through a pointer of its own
	 * checked for exactly what it reaches: the ports' pointer is the same
	 * for TCP and UDP, so that only csum differs between the two paths. */
	ports = (struct lb_l4_ports *)(pos + lb_nat6_off(l4_off));
	if (LB_PAST_END(ports, sizeof(*ports), end))
		return LB_NAT_MALFORMED;
	csum = pos + lb_nat6_off(l4_off + need - 2);
	if (LB_PAST_END(csum, 2, end))
		return LB_NAT_MALFORMED;

	/* All checked: compute, then write, the destination first. UDP's 0,
	 * "no checksum", stays 0 through both (lb_nat6_l4_csum). */
	__builtin_memcpy(&check, csum, 2);
	if (daddr) {
		__builtin_memcpy(old_addr.v6, ip6->daddr, 16);
		check = lb_nat6_l4_csum(check, proto, &old_addr, daddr, ports->dport, dport);
		__builtin_memcpy(ip6->daddr, daddr->v6, 16);
		ports->dport = dport;
	}
	if (saddr) {
		__builtin_memcpy(old_addr.v6, ip6->saddr, 16);
		check = lb_nat6_l4_csum(check, proto, &old_addr, saddr, ports->sport, sport);
		__builtin_memcpy(ip6->saddr, saddr->v6, 16);
		ports->sport = sport;
	}
	__builtin_memcpy(csum, &check, 2);
	return LB_NAT_OK;
}

/* Rewrite the `side` address and port of the IPv6 TCP/UDP packet that *p
 * describes to *addr (16 bytes, network order) : port, with the TCP/UDP
 * checksum updated (lb_nat6_xlat for one side). LB_NAT_MALFORMED for a bad
 * side; otherwise lb_nat6_xlat's answers. Nothing is written unless
 * LB_NAT_OK. */
LB_NAT_INLINE enum lb_nat_status lb_nat6_rewrite(void *data, const void *data_end,
						 const struct lb_parsed *p, enum lb_nat_side side,
						 const union lb_addr *addr, __be16 port)
{
	if (side == LB_NAT_DST)
		return lb_nat6_xlat(data, data_end, p, addr, port, 0, 0);
	if (side == LB_NAT_SRC)
		return lb_nat6_xlat(data, data_end, p, 0, 0, addr, port);
	/* An IPv6 TCP/UDP packet with a bad side is the caller's error; any
	 * other frame is still not applicable, as in lb_nat4_rewrite. */
	if (p->family != LB_FAMILY_IPV6 || !lb_l4_supported(p->proto) ||
	    (p->flags & LB_PF_FRAGMENT))
		return LB_NAT_NOT_APPLICABLE;
	return LB_NAT_MALFORMED;
}

LB_NAT_INLINE enum lb_nat_status lb_nat6_dnat(void *data, const void *data_end,
					      const struct lb_parsed *p, const union lb_addr *addr,
					      __be16 port)
{
	return lb_nat6_rewrite(data, data_end, p, LB_NAT_DST, addr, port);
}

LB_NAT_INLINE enum lb_nat_status lb_nat6_snat(void *data, const void *data_end,
					      const struct lb_parsed *p, const union lb_addr *addr,
					      __be16 port)
{
	return lb_nat6_rewrite(data, data_end, p, LB_NAT_SRC, addr, port);
}

/* ---- ICMPv6 errors quoting a translated packet -------------------------- */

/* Find the quoted packet of the ICMPv6 error that *p describes (the parse
 * gave LB_PARSE_UNSUPPORTED_L4 with proto LB_IPPROTO_ICMPV6 for this frame:
 * it sets l3_len and l4_off with that verdict) and fill *ic. LB_NAT_OK: an
 * error type above, not fragmented, its ICMPv6 header within the packet,
 * quoting a whole 40-byte IPv6 header (version 6, next header TCP or UDP)
 * and at least 8 bytes of its L4 header (the ports). LB_NAT_NOT_APPLICABLE:
 * not ICMPv6, another message, a quote whose next header is anything else
 * (an extension header included), an ICMPv6 header beyond
 * LB_NAT6_MAX_L4_OFF. LB_NAT_MALFORMED: too short for what it claims, or
 * contradicting the parse. Only the packet's own length counts (payload
 * length; p->l3_len), never Ethernet padding. *ic is written only with
 * LB_NAT_OK.
 *
 * RFC 4884 extensions (destination unreachable and time exceeded may carry
 * a length and objects after a quote padded to 128 bytes) need no special
 * case: the quoted packet's own payload length bounds the quote when it is
 * whole, and the furthest byte touched is 40 + 18 bytes into the quote. */
LB_NAT_INLINE enum lb_nat_status lb_nat6_icmp_parse(const void *data, const void *data_end,
						    const struct lb_parsed *p, struct lb_nat6_icmp *ic)
{
	const __u8 *pos = (const __u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	const struct lb_ipv6_hdr *ip6, *inner;
	const struct lb_icmp_hdr *icmp; /* ICMPv6's first 8 bytes have ICMPv4's layout */
	const struct lb_l4_ports *ports;
	__u32 l3_off, l4_off, pkt_len, inner_len, quote_end, inner_l3_off, inner_l4_off;

	if (p->family != LB_FAMILY_IPV6 || p->proto != LB_IPPROTO_ICMPV6)
		return LB_NAT_NOT_APPLICABLE;
	if (p->flags & LB_PF_FRAGMENT)
		return LB_NAT_NOT_APPLICABLE;
	l4_off = lb_nat6_l4_off(p);
	if (l4_off > LB_NAT6_MAX_L4_OFF)
		return LB_NAT_NOT_APPLICABLE;
	l3_off = p->l3_off;
	if (l3_off < LB_NAT_MIN_L3_OFF || l3_off > LB_NAT_MAX_L3_OFF ||
	    l4_off < l3_off + LB_IPV6_HLEN)
		return LB_NAT_MALFORMED;
	ip6 = (const struct lb_ipv6_hdr *)(pos + l3_off);
	if (LB_PAST_END(ip6, sizeof(*ip6), end))
		return LB_NAT_MALFORMED;
	if (lb_nat6_chain_differs(ip6, l3_off, l4_off, LB_IPPROTO_ICMPV6))
		return LB_NAT_MALFORMED;
	pkt_len = LB_IPV6_HLEN + lb_ntohs(ip6->payload_len);
	/* The packet's length is the one the parse checked against the frame. */
	if (pkt_len != p->l3_len)
		return LB_NAT_MALFORMED;

	icmp = (const struct lb_icmp_hdr *)(pos + lb_nat6_off(l4_off));
	if (l4_off + LB_ICMP6_HLEN > l3_off + pkt_len || LB_PAST_END(icmp, sizeof(*icmp), end))
		return LB_NAT_MALFORMED;
	if (!lb_icmp6_is_error(icmp->type))
		return LB_NAT_NOT_APPLICABLE;

	/* The quoted IPv6 header, whole. */
	inner_l3_off = l4_off + LB_ICMP6_HLEN;
	inner = (const struct lb_ipv6_hdr *)((const __u8 *)icmp + LB_ICMP6_HLEN);
	if (inner_l3_off + LB_IPV6_HLEN > l3_off + pkt_len ||
	    LB_PAST_END(inner, sizeof(*inner), end))
		return LB_NAT_MALFORMED;
	if ((((const __u8 *)inner)[0] >> 4) != 6)
		return LB_NAT_MALFORMED;
	if (!lb_l4_supported(inner->nexthdr))
		return LB_NAT_NOT_APPLICABLE;
	inner_len = LB_IPV6_HLEN + lb_ntohs(inner->payload_len);
	/* The quoted packet had at least its headers. */
	if (inner_len < LB_IPV6_HLEN + LB_ICMP_QUOTE_L4)
		return LB_NAT_MALFORMED;

	/* Where the quote ends: the outer packet's end, or the quoted packet's
	 * if it was quoted whole (what follows is then padding or RFC 4884
	 * objects, not the quoted packet). */
	inner_l4_off = inner_l3_off + LB_IPV6_HLEN;
	quote_end = l3_off + pkt_len;
	if (inner_l3_off + inner_len < quote_end)
		quote_end = inner_l3_off + inner_len;
	if (quote_end < inner_l4_off + LB_ICMP_QUOTE_L4)
		return LB_NAT_MALFORMED;
	ports = (const struct lb_l4_ports *)((const __u8 *)inner + LB_IPV6_HLEN);
	if (LB_PAST_END(ports, LB_ICMP_QUOTE_L4, end))
		return LB_NAT_MALFORMED;

	ic->l3_off = (__u16)l3_off;
	ic->icmp_off = (__u16)l4_off;
	ic->inner_l3_off = (__u16)inner_l3_off;
	ic->inner_l4_off = (__u16)inner_l4_off;
	ic->l4_quoted = (__u16)(quote_end - inner_l4_off);
	ic->type = icmp->type;
	ic->code = icmp->code;
	ic->inner_proto = inner->nexthdr;
	ic->pad[0] = 0;
	ic->pad[1] = 0;
	ic->pad[2] = 0;
	ic->inner_sport = ports->sport;
	ic->inner_dport = ports->dport;
	__builtin_memcpy(ic->inner_saddr.v6, inner->saddr, 16);
	__builtin_memcpy(ic->inner_daddr.v6, inner->daddr, 16);
	return LB_NAT_OK;
}

/* Translate the quoted packet of the error that lb_nat6_icmp_parse described
 * in *ic (for this very frame, unchanged since): its `side` address and port
 * become *addr:port, with its L4 checksum updated when the quote holds it
 * (UDP always, within the first 8 bytes; TCP with 18 bytes of L4 quoted; a
 * TCP checksum cut in half is left as it is) and the ICMPv6 checksum updated.
 *
 * outer_addr, unless NULL: the outer IPv6 header's address on the mirrored
 * side (inner SRC -> outer DST, inner DST -> outer SRC) becomes *outer_addr.
 * Unlike ICMPv4's, the ICMPv6 checksum covers a pseudo-header with both
 * outer addresses (RFC 4443 section 2.3), so that change enters it too.
 *
 * The order of operations, which the model (contract/model.py) follows one
 * for one: the new quoted L4 checksum from the old field values; the quoted
 * address, port and L4 checksum written; the ICMPv6 checksum updated for
 * the quoted address (16 bytes), the quoted port, the quoted L4 checksum
 * (old -> new, when quoted) and the outer address (16 bytes, when given),
 * and written; the outer address written. Nothing is written unless
 * LB_NAT_OK. */
LB_NAT_INLINE enum lb_nat_status lb_nat6_icmp_rewrite(void *data, const void *data_end,
						      const struct lb_nat6_icmp *ic,
						      enum lb_nat_side side,
						      const union lb_addr *addr, __be16 port,
						      const union lb_addr *outer_addr)
{
	__u8 *pos = (__u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	struct lb_ipv6_hdr *ip_in;
	struct lb_icmp_hdr *icmp;
	__u8 *l4, *in_addr, *out_addr = 0;
	__u32 l3_off, icmp_off;
	__u16 *l4_check = 0;
	__be16 *l4_port;
	union lb_addr old_addr, new_addr, old_outer, new_outer;
	__be16 old_port;
	__u16 old_l4_check = 0, new_l4_check = 0, check;

	if (side != LB_NAT_SRC && side != LB_NAT_DST)
		return LB_NAT_MALFORMED;
	if (!lb_l4_supported(ic->inner_proto))
		return LB_NAT_MALFORMED;
	/* The offsets: bounded, and each one where the one before says; then
	 * every header checked on the pointer that reaches it. */
	icmp_off = ic->icmp_off;
	if (icmp_off > LB_NAT6_MAX_L4_OFF)
		return LB_NAT_NOT_APPLICABLE;
	if (ic->inner_l3_off != icmp_off + LB_ICMP6_HLEN ||
	    ic->inner_l4_off != icmp_off + LB_ICMP6_HLEN + LB_IPV6_HLEN ||
	    ic->l4_quoted < LB_ICMP_QUOTE_L4)
		return LB_NAT_MALFORMED;
	icmp = (struct lb_icmp_hdr *)(pos + lb_nat6_off(icmp_off));
	ip_in = (struct lb_ipv6_hdr *)((__u8 *)icmp + LB_ICMP6_HLEN);
	l4 = (__u8 *)ip_in + LB_IPV6_HLEN;
	if (LB_PAST_END(icmp, sizeof(*icmp), end) || LB_PAST_END(ip_in, sizeof(*ip_in), end) ||
	    LB_PAST_END(l4, LB_ICMP_QUOTE_L4, end))
		return LB_NAT_MALFORMED;
	if ((((const __u8 *)ip_in)[0] >> 4) != 6 || ip_in->nexthdr != ic->inner_proto)
		return LB_NAT_MALFORMED;
	if (outer_addr) {
		/* The outer header, ICMPv6 at (or, after extension headers,
		 * behind) icmp_off. */
		struct lb_ipv6_hdr *ip6;

		l3_off = ic->l3_off;
		if (l3_off < LB_NAT_MIN_L3_OFF || l3_off > LB_NAT_MAX_L3_OFF ||
		    icmp_off < l3_off + LB_IPV6_HLEN)
			return LB_NAT_MALFORMED;
		ip6 = (struct lb_ipv6_hdr *)(pos + l3_off);
		if (LB_PAST_END(ip6, sizeof(*ip6), end))
			return LB_NAT_MALFORMED;
		if (lb_nat6_chain_differs(ip6, l3_off, icmp_off, LB_IPPROTO_ICMPV6))
			return LB_NAT_MALFORMED;
		out_addr = side == LB_NAT_SRC ? ip6->daddr : ip6->saddr;
	}
	if (ic->inner_proto == LB_IPPROTO_TCP) {
		struct lb_tcp_hdr *tcp = (struct lb_tcp_hdr *)l4;

		l4_port = side == LB_NAT_SRC ? &tcp->sport : &tcp->dport;
		if (ic->l4_quoted >= LB_TCP_CSUM_END) {
			if (LB_PAST_END(l4, LB_TCP_CSUM_END, end))
				return LB_NAT_MALFORMED;
			l4_check = &tcp->check;
		}
	} else {
		struct lb_udp_hdr *udp = (struct lb_udp_hdr *)l4;

		l4_port = side == LB_NAT_SRC ? &udp->sport : &udp->dport;
		l4_check = &udp->check; /* within the 8 bytes checked above */
	}

	/* All checked: write, in the order above. */
	in_addr = side == LB_NAT_SRC ? ip_in->saddr : ip_in->daddr;
	__builtin_memcpy(old_addr.v6, in_addr, 16);
	__builtin_memcpy(new_addr.v6, addr->v6, 16);
	old_port = *l4_port;
	if (l4_check) {
		old_l4_check = *l4_check;
		new_l4_check = lb_nat6_l4_csum(old_l4_check, ic->inner_proto, &old_addr,
					       &new_addr, old_port, port);
	}
	__builtin_memcpy(in_addr, new_addr.v6, 16);
	*l4_port = port;
	if (l4_check)
		*l4_check = new_l4_check;

	check = icmp->check;
	check = lb_csum_replace16(check, old_addr.v6w, new_addr.v6w);
	check = lb_csum_replace2(check, old_port, port);
	if (l4_check)
		check = lb_csum_replace2(check, old_l4_check, new_l4_check);
	if (out_addr) {
		__builtin_memcpy(old_outer.v6, out_addr, 16);
		__builtin_memcpy(new_outer.v6, outer_addr->v6, 16);
		check = lb_csum_replace16(check, old_outer.v6w, new_outer.v6w);
	}
	icmp->check = check;
	if (out_addr)
		__builtin_memcpy(out_addr, new_outer.v6, 16);
	return LB_NAT_OK;
}

#endif /* HPCLB_LB_NAT6_H */
