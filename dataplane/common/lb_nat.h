/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_nat.h - the packet rewrites of the stateful NAT gateway mode, written
 * once for both data planes: header-only, compiled the same two ways as
 * lb_parse.h (clang -target bpf into an XDP program, where the verifier must
 * prove every access; natively into the DPDK forwarder and the tests).
 *
 *   lb_nat4_rewrite       IPv4 TCP/UDP: the source (SNAT) or destination (DNAT)
 *                         address and port become a given pair; the IPv4 header
 *                         checksum and the TCP/UDP checksum are updated
 *                         incrementally (RFC 1624; the L4 checksum covers the
 *                         addresses through the pseudo-header, RFC 793/768).
 *   lb_nat4_icmp_parse    an ICMPv4 error (destination unreachable, all codes,
 *                         "fragmentation needed" included; time exceeded;
 *                         parameter problem) that quotes a TCP/UDP packet: where
 *                         the quote is and the quoted packet's 5-tuple, for the
 *                         connection-table lookup.
 *   lb_nat4_icmp_rewrite  translates the quoted packet back (address, port,
 *                         its IP checksum, its L4 checksum when quoted), the
 *                         ICMP checksum, and optionally the outer header's
 *                         address, so that the endpoint behind the gateway
 *                         recognises the error (RFC 5508 section 7, RFC 3022
 *                         section 4.3): path MTU discovery (RFC 1191) and
 *                         traceroute work through the gateway.
 *
 * Both data planes call them through lb_conn.h, which decides from the
 * connection table what each packet becomes. The IPv6 twins (lb_nat6_*) are
 * in lb_nat6.h, which this file includes at its end.
 *
 * Fragments never reach NAT. lb_parse_frame and lb_parse_untagged_ipv4 give
 * LB_PARSE_FRAGMENT for any IPv4 fragment, first or later, and the planes pass
 * those to the kernel; lb_nat4_rewrite refuses a parse with LB_PF_FRAGMENT
 * (a later fragment has no ports to rewrite, and the L4 checksum lives in the
 * first fragment only, so no fragment can be translated on its own).
 * lb_nat4_icmp_parse likewise refuses a fragmented ICMP message (its checksum
 * and the quote may lie in different fragments); the quoted packet itself may
 * be a first fragment (it carries the ports), never a later one.
 *
 * Safety, as in lb_parse.h: nothing is read or written before a bound check
 * (LB_PAST_END, the form the verifier learns a packet range from) has shown it
 * lies in [data, data_end). Each function checks again, on the very pointer it
 * goes through, every byte it touches, so that a caller's wrong struct
 * lb_parsed or struct lb_nat4_icmp can give a refusal or a wrong rewrite
 * inside the frame, never an access outside it. Every offset taken from such
 * a struct is bounded first (LB_NAT_MAX_*), because the verifier only adds a
 * bounded scalar to a packet pointer. A refused call has written nothing: all
 * checks come before the first store. There are no loops.
 *
 * Checksum arithmetic: lb_rewrite.h's RFC 1624 eqn. 3 helpers, on values as
 * they lie in the packet (no byte swaps). Every field rewritten here sits at
 * an even offset from the start of the data its checksum covers, so a 16-bit
 * word read in memory order is a word of that checksum's sum.
 */
#ifndef HPCLB_LB_NAT_H
#define HPCLB_LB_NAT_H

#include "lb_parse.h"
#include "lb_rewrite.h"

/* Every function here is inlined into its caller, as lb_parse.h wants for
 * its own (no packet pointer may cross a BPF-to-BPF call, and the BPF calling
 * convention has five argument registers). Spelt out rather than through
 * __always_inline: <linux/stddef.h>, which <linux/types.h> pulls in, defines
 * that name as a mere __inline__ hint before lb_parse.h can. */
#define LB_NAT_INLINE static inline __attribute__((always_inline))

#define LB_IPPROTO_ICMP 1

/* ICMPv4 error types that quote the offending packet (RFC 792). Source quench
 * (4) is deprecated (RFC 6633) and redirect (5) is not translated: a gateway
 * never forwards a redirect meant for itself. */
#define LB_ICMP_DEST_UNREACH 3  /* all codes; 4 = fragmentation needed (RFC 1191) */
#define LB_ICMP_TIME_EXCEEDED 11 /* 0 = TTL (traceroute), 1 = reassembly */
#define LB_ICMP_PARAMETERPROB 12

#define LB_ICMP_HLEN 8     /* type, code, checksum, 4 bytes of type-specific data */
#define LB_ICMP_QUOTE_L4 8 /* RFC 792: the quote holds the IP header + 64 bits */

/* Bounds on the offsets the functions take from a caller's struct, so that
 * the verifier sees a bounded pointer and a native build cannot be sent far
 * past its buffer by a garbage offset. l3: Ethernet + one 802.1Q tag (the
 * parse allows no more). IPv4 header: at most 60 bytes (IHL 15). */
#define LB_NAT_MIN_L3_OFF 14
#define LB_NAT_MAX_L3_OFF 18
#define LB_NAT_MAX_ICMP_OFF (LB_NAT_MAX_L3_OFF + 60)
#define LB_NAT_MAX_INNER_L3_OFF (LB_NAT_MAX_ICMP_OFF + LB_ICMP_HLEN)
#define LB_NAT_MAX_INNER_L4_OFF (LB_NAT_MAX_INNER_L3_OFF + 60)

/* IPv6 (lb_nat6.h): NAT translates a packet whose L4 header starts at most
 * 256 bytes of extension headers after an untagged IPv6 header; the planes
 * pass one beyond to the kernel (pass_ext_headers). */
#define LB_NAT6_MAX_EXT_LEN 256
#define LB_NAT6_MAX_L4_OFF (14 + 40 + LB_NAT6_MAX_EXT_LEN)

/* TCP's checksum is at offset 16, UDP's at 6 (RFC 793, RFC 768). */
#define LB_TCP_CSUM_END 18 /* bytes of a TCP header up to and with its checksum */
#define LB_UDP_CSUM_END 8

struct lb_tcp_hdr {
	__be16 sport;
	__be16 dport;
	__be32 seq;
	__be32 ack_seq;
	__be16 off_flags;
	__be16 window;
	__u16 check;
	__be16 urg_ptr;
} LB_WIRE;

struct lb_icmp_hdr {
	__u8 type;
	__u8 code;
	__u16 check;
	__be32 rest; /* unused; next-hop MTU (RFC 1191); pointer; RFC 4884 length */
} LB_WIRE;

_Static_assert(sizeof(struct lb_tcp_hdr) == 20, "TCP header is 20 bytes");
_Static_assert(sizeof(struct lb_icmp_hdr) == LB_ICMP_HLEN, "ICMP header is 8 bytes");
_Static_assert(__builtin_offsetof(struct lb_tcp_hdr, check) + 2 == LB_TCP_CSUM_END,
	       "TCP checksum ends at 18");
_Static_assert(__builtin_offsetof(struct lb_udp_hdr, check) + 2 == LB_UDP_CSUM_END,
	       "UDP checksum ends at 8");

/* ---- the API's types ------------------------------------------------------ */

enum lb_nat_status {
	LB_NAT_OK = 0,
	LB_NAT_NOT_APPLICABLE, /* not IPv4 TCP/UDP (or not an ICMP error quoting
				* one), a fragment, a quote of a later fragment */
	LB_NAT_MALFORMED,      /* a header truncated, or contradicting the parse or
				* its own lengths; or a bad argument */
};

/* Which endpoint of a packet a translation rewrites. */
enum lb_nat_side {
	LB_NAT_SRC = 1, /* SNAT: source address and port */
	LB_NAT_DST = 2, /* DNAT: destination address and port */
};

/* One translation: the `side` endpoint becomes addr:port (network order). */
struct lb_nat4_xlat {
	__be32 addr;
	__be16 port;
	__u8 side; /* enum lb_nat_side */
	__u8 pad;
};

/* An ICMPv4 error quoting a TCP/UDP packet, as lb_nat4_icmp_parse found it.
 * Offsets are from the start of the frame. The inner 5-tuple is the quoted
 * packet's, as it lies in the quote: the packet this side of the network sent,
 * i.e. as it left the gateway, translated (look it up as such). */
struct lb_nat4_icmp {
	__u16 l3_off;       /* outer IPv4 header (the parse's l3_off) */
	__u16 icmp_off;     /* ICMP header: l3_off + the outer IHL */
	__u16 inner_l3_off; /* quoted IPv4 header: icmp_off + 8 */
	__u16 inner_l4_off; /* quoted TCP/UDP header */
	__u16 l4_quoted;    /* bytes of L4 header and data quoted (>= 8): up to the end
			     * of the outer packet or of the quoted packet, whichever
			     * comes first */
	__u16 pad16;
	__u8 type;
	__u8 code;
	__u8 inner_proto; /* LB_IPPROTO_TCP or LB_IPPROTO_UDP */
	__u8 pad;
	__be32 inner_saddr;
	__be32 inner_daddr;
	__be16 inner_sport;
	__be16 inner_dport;
};

/* ---- helpers -------------------------------------------------------------- */

LB_NAT_INLINE int lb_icmp_is_error(__u8 type)
{
	return type == LB_ICMP_DEST_UNREACH || type == LB_ICMP_TIME_EXCEEDED ||
	       type == LB_ICMP_PARAMETERPROB;
}

/* UDP over IPv4 (RFC 768): a checksum field of 0 means "not computed" and is
 * left alone; a computed checksum of 0 is sent as 0xFFFF (the same value in
 * one's complement), since 0 would read as "none". */
LB_NAT_INLINE __u16 lb_nat_udp_csum(__u16 check)
{
	return check ? check : 0xffff;
}

/* The L4 checksum after the address (pseudo-header) and the port change. */
LB_NAT_INLINE __u16 lb_nat_l4_csum(__u16 check, __u8 proto, __be32 old_addr,
				   __be32 new_addr, __be16 old_port, __be16 new_port)
{
	if (proto == LB_IPPROTO_UDP && check == 0)
		return 0;
	check = lb_csum_replace4(check, old_addr, new_addr);
	check = lb_csum_replace2(check, old_port, new_port);
	return proto == LB_IPPROTO_UDP ? lb_nat_udp_csum(check) : check;
}

/* ---- IPv4 TCP/UDP: SNAT and DNAT ---------------------------------------- */

/* Rewrite the x->side address and port of the IPv4 TCP/UDP packet that *p
 * describes (lb_parse_frame or lb_parse_untagged_ipv4 gave LB_PARSE_OK for
 * this very frame), with the IPv4 header checksum and the TCP/UDP checksum
 * updated. LB_NAT_NOT_APPLICABLE for anything else the parse can describe
 * (IPv6, another protocol, a fragment); LB_NAT_MALFORMED when the frame does
 * not hold what *p says. Nothing is written unless LB_NAT_OK. */
LB_NAT_INLINE enum lb_nat_status lb_nat4_rewrite(void *data, const void *data_end,
						 const struct lb_parsed *p,
						 const struct lb_nat4_xlat *x)
{
	__u8 *pos = (__u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	struct lb_ipv4_hdr *iph;
	__u8 *l4;
	__u32 l3_off, ihl, ip_len, need;
	__u16 *l4_check;
	__be16 *l4_port;
	__be32 old_addr;
	__be16 old_port;
	__u16 check;

	if (p->family != LB_FAMILY_IPV4 || !lb_l4_supported(p->proto) ||
	    (p->flags & LB_PF_FRAGMENT))
		return LB_NAT_NOT_APPLICABLE;
	if (x->side != LB_NAT_SRC && x->side != LB_NAT_DST)
		return LB_NAT_MALFORMED;
	l3_off = p->l3_off;
	if (l3_off < LB_NAT_MIN_L3_OFF || l3_off > LB_NAT_MAX_L3_OFF)
		return LB_NAT_MALFORMED;
	iph = (struct lb_ipv4_hdr *)(pos + l3_off);
	if (LB_PAST_END(iph, sizeof(*iph), end))
		return LB_NAT_MALFORMED;
	/* The header must still be the one the parse saw: version, protocol,
	 * not a fragment, IHL pointing where p->l4_off says. */
	if ((iph->ver_ihl >> 4) != 4 || (iph->ver_ihl & 0xf) < 5 || iph->proto != p->proto ||
	    (iph->frag_off & lb_htons(LB_IP_MF | LB_IP_OFFSET)))
		return LB_NAT_MALFORMED;
	ihl = (iph->ver_ihl & 0xf) * 4u;
	if (l3_off + ihl != p->l4_off)
		return LB_NAT_MALFORMED;
	need = p->proto == LB_IPPROTO_TCP ? LB_TCP_CSUM_END : LB_UDP_CSUM_END;
	/* The L4 header within the packet's own length (not in Ethernet
	 * padding); an integer comparison: the frame bound is checked on the
	 * pointer below. */
	ip_len = lb_ntohs(iph->tot_len);
	if (ip_len < ihl + need)
		return LB_NAT_MALFORMED;
	/* Offset re-derived from the header byte (see lb_parse_ipv4): a
	 * bounded scalar the verifier can add to a packet pointer. */
	l4 = (__u8 *)iph + (iph->ver_ihl & 0xf) * 4u;
	if (p->proto == LB_IPPROTO_TCP) {
		struct lb_tcp_hdr *tcp = (struct lb_tcp_hdr *)l4;

		if (LB_PAST_END(l4, LB_TCP_CSUM_END, end))
			return LB_NAT_MALFORMED;
		l4_check = &tcp->check;
		l4_port = x->side == LB_NAT_SRC ? &tcp->sport : &tcp->dport;
	} else {
		struct lb_udp_hdr *udp = (struct lb_udp_hdr *)l4;

		if (LB_PAST_END(l4, LB_UDP_CSUM_END, end))
			return LB_NAT_MALFORMED;
		l4_check = &udp->check;
		l4_port = x->side == LB_NAT_SRC ? &udp->sport : &udp->dport;
	}

	/* All checked: write. */
	old_addr = x->side == LB_NAT_SRC ? iph->saddr : iph->daddr;
	old_port = *l4_port;
	iph->check = lb_csum_replace4(iph->check, old_addr, x->addr);
	if (x->side == LB_NAT_SRC)
		iph->saddr = x->addr;
	else
		iph->daddr = x->addr;
	check = *l4_check;
	*l4_check = lb_nat_l4_csum(check, p->proto, old_addr, x->addr, old_port, x->port);
	*l4_port = x->port;
	return LB_NAT_OK;
}

LB_NAT_INLINE enum lb_nat_status lb_nat4_dnat(void *data, const void *data_end,
					      const struct lb_parsed *p, __be32 addr, __be16 port)
{
	struct lb_nat4_xlat x = { .addr = addr, .port = port, .side = LB_NAT_DST, .pad = 0 };

	return lb_nat4_rewrite(data, data_end, p, &x);
}

LB_NAT_INLINE enum lb_nat_status lb_nat4_snat(void *data, const void *data_end,
					      const struct lb_parsed *p, __be32 addr, __be16 port)
{
	struct lb_nat4_xlat x = { .addr = addr, .port = port, .side = LB_NAT_SRC, .pad = 0 };

	return lb_nat4_rewrite(data, data_end, p, &x);
}

/* ---- ICMPv4 errors quoting a translated packet -------------------------- */

/* Find the quoted packet of the ICMPv4 error that *p describes (the parse gave
 * LB_PARSE_UNSUPPORTED_L4 with proto LB_IPPROTO_ICMP for this frame) and fill
 * *ic. LB_NAT_OK: an error of a type above, not fragmented, quoting an IPv4
 * TCP/UDP packet that is not a later fragment, with the whole quoted IP
 * header (options too) and at least the first 8 bytes of its L4 header
 * (RFC 792; RFC 1812 section 4.3.2.3 lets routers quote more, Linux quotes up
 * to 576 bytes in all, and ic->l4_quoted says how much is there).
 * LB_NAT_NOT_APPLICABLE: any other ICMP message, or not ICMP; it is none of
 * NAT's business. LB_NAT_MALFORMED: an error too short for what it claims.
 * Only the packet's own length counts (p->l3_len's IPv4 total length), never
 * the Ethernet padding after it. *ic is written only with LB_NAT_OK.
 *
 * RFC 4884 extensions (a length in the ICMP header, objects after the
 * padded quote) need no special case: they follow at least 128 bytes of
 * quote, and the furthest byte read or written here is at most 60 + 18 = 78
 * bytes into the quoted packet. */
LB_NAT_INLINE enum lb_nat_status lb_nat4_icmp_parse(const void *data, const void *data_end,
						    const struct lb_parsed *p, struct lb_nat4_icmp *ic)
{
	const __u8 *pos = (const __u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	const struct lb_ipv4_hdr *iph, *inner;
	const struct lb_icmp_hdr *icmp;
	const struct lb_l4_ports *ports;
	__u32 l3_off, ihl, ip_len, inner_ihl, inner_len, quote_end, inner_l4_off;

	if (p->family != LB_FAMILY_IPV4 || p->proto != LB_IPPROTO_ICMP)
		return LB_NAT_NOT_APPLICABLE;
	if (p->flags & LB_PF_FRAGMENT)
		return LB_NAT_NOT_APPLICABLE;
	l3_off = p->l3_off;
	if (l3_off < LB_NAT_MIN_L3_OFF || l3_off > LB_NAT_MAX_L3_OFF)
		return LB_NAT_MALFORMED;
	iph = (const struct lb_ipv4_hdr *)(pos + l3_off);
	if (LB_PAST_END(iph, sizeof(*iph), end))
		return LB_NAT_MALFORMED;
	if ((iph->ver_ihl >> 4) != 4 || (iph->ver_ihl & 0xf) < 5 ||
	    iph->proto != LB_IPPROTO_ICMP || (iph->frag_off & lb_htons(LB_IP_MF | LB_IP_OFFSET)))
		return LB_NAT_MALFORMED;
	ihl = (iph->ver_ihl & 0xf) * 4u;
	ip_len = lb_ntohs(iph->tot_len);
	/* The packet's length is the one the parse checked against the frame. */
	if (l3_off + ihl != p->l4_off || ip_len != p->l3_len || ip_len < ihl)
		return LB_NAT_MALFORMED;

	icmp = (const struct lb_icmp_hdr *)((const __u8 *)iph + (iph->ver_ihl & 0xf) * 4u);
	if (ip_len < ihl + sizeof(*icmp) || LB_PAST_END(icmp, sizeof(*icmp), end))
		return LB_NAT_MALFORMED;
	if (!lb_icmp_is_error(icmp->type))
		return LB_NAT_NOT_APPLICABLE;

	/* The quoted IPv4 header, whole. */
	inner = (const struct lb_ipv4_hdr *)((const __u8 *)icmp + sizeof(*icmp));
	if (ip_len < ihl + sizeof(*icmp) + sizeof(*inner) ||
	    LB_PAST_END(inner, sizeof(*inner), end))
		return LB_NAT_MALFORMED;
	if ((inner->ver_ihl >> 4) != 4 || (inner->ver_ihl & 0xf) < 5)
		return LB_NAT_MALFORMED;
	if (!lb_l4_supported(inner->proto))
		return LB_NAT_NOT_APPLICABLE;
	/* A later fragment quotes no L4 header: nothing to look up. */
	if (inner->frag_off & lb_htons(LB_IP_OFFSET))
		return LB_NAT_NOT_APPLICABLE;
	inner_ihl = (inner->ver_ihl & 0xf) * 4u;
	inner_len = lb_ntohs(inner->tot_len);
	/* The quoted packet had at least its headers. */
	if (inner_len < inner_ihl + LB_ICMP_QUOTE_L4)
		return LB_NAT_MALFORMED;

	/* Where the quote ends, relative to the frame: the outer packet's end,
	 * or the quoted packet's if it was quoted whole (then what follows is
	 * padding or RFC 4884 objects, not the quoted packet). */
	inner_l4_off = l3_off + ihl + sizeof(*icmp) + inner_ihl;
	quote_end = l3_off + ip_len;
	if (l3_off + ihl + sizeof(*icmp) + inner_len < quote_end)
		quote_end = l3_off + ihl + sizeof(*icmp) + inner_len;
	if (quote_end < inner_l4_off + LB_ICMP_QUOTE_L4)
		return LB_NAT_MALFORMED;
	ports = (const struct lb_l4_ports *)((const __u8 *)inner + (inner->ver_ihl & 0xf) * 4u);
	if (LB_PAST_END(ports, LB_ICMP_QUOTE_L4, end))
		return LB_NAT_MALFORMED;

	ic->l3_off = (__u16)l3_off;
	ic->icmp_off = (__u16)(l3_off + ihl);
	ic->inner_l3_off = (__u16)(l3_off + ihl + sizeof(*icmp));
	ic->inner_l4_off = (__u16)inner_l4_off;
	ic->l4_quoted = (__u16)(quote_end - inner_l4_off);
	ic->pad16 = 0;
	ic->type = icmp->type;
	ic->code = icmp->code;
	ic->inner_proto = inner->proto;
	ic->pad = 0;
	ic->inner_saddr = inner->saddr;
	ic->inner_daddr = inner->daddr;
	ic->inner_sport = ports->sport;
	ic->inner_dport = ports->dport;
	return LB_NAT_OK;
}

/* Translate the quoted packet of the error that lb_nat4_icmp_parse described
 * in *ic (for this very frame, unchanged since): its inner->side address and
 * port become inner->addr:port, with the quoted IP header checksum, the
 * quoted L4 checksum when the quote holds it (UDP always: it is in the first
 * 8 bytes; TCP only with 18 bytes of L4 quoted: RFC 792 quotes 8, Linux and
 * RFC 1812 routers more) and the ICMP checksum (which covers the whole ICMP
 * message, so every word changed in the quote) updated. The quoted checksums
 * cannot be verified (the quote is cut), but updated incrementally they are
 * again the ones the endpoint sent, which is what it may compare. A TCP
 * checksum the quote cuts in half (17 bytes of L4 quoted) is left as it is.
 *
 * outer_addr, unless 0: the outer IPv4 header's address on the mirrored side
 * (the quoted packet's source is the error's destination: inner SRC -> outer
 * DST, inner DST -> outer SRC) becomes outer_addr, with the outer header
 * checksum updated (ICMPv4 has no pseudo-header: its checksum does not cover
 * it). Typically: an error about a packet that was DNATed is sent back
 * towards the client, the quoted destination becomes the VIP again, and the
 * outer source (the backend, or a router between) may become the VIP; an
 * error about an SNATed packet arrives at the gateway's address, so the
 * outer destination and the quoted source become the inside host's. Nothing
 * is written unless LB_NAT_OK. */
LB_NAT_INLINE enum lb_nat_status lb_nat4_icmp_rewrite(void *data, const void *data_end,
						      const struct lb_nat4_icmp *ic,
						      const struct lb_nat4_xlat *inner,
						      __be32 outer_addr)
{
	__u8 *pos = (__u8 *)data;
	const __u8 *end = (const __u8 *)data_end;
	struct lb_ipv4_hdr *iph, *ip_in;
	struct lb_icmp_hdr *icmp;
	__u8 *l4;
	__u32 l3_off, icmp_off, in_l3_off, in_l4_off;
	__u16 *l4_check = 0;
	__be16 *l4_port;
	__be32 old_addr;
	__be16 old_port;
	__u16 old_ip_check, new_ip_check, old_l4_check = 0, new_l4_check = 0, check;

	if (inner->side != LB_NAT_SRC && inner->side != LB_NAT_DST)
		return LB_NAT_MALFORMED;
	if (!lb_l4_supported(ic->inner_proto))
		return LB_NAT_MALFORMED;
	/* Offsets bounded before they move a pointer, then each header
	 * checked on the pointer that reaches it. The outer IPv4 header ends
	 * where the ICMP header starts. */
	icmp_off = ic->icmp_off;
	in_l3_off = ic->inner_l3_off;
	in_l4_off = ic->inner_l4_off;
	if (icmp_off > LB_NAT_MAX_ICMP_OFF || in_l3_off != icmp_off + LB_ICMP_HLEN ||
	    in_l4_off > LB_NAT_MAX_INNER_L4_OFF || ic->l4_quoted < LB_ICMP_QUOTE_L4)
		return LB_NAT_MALFORMED;

	icmp = (struct lb_icmp_hdr *)(pos + icmp_off);
	ip_in = (struct lb_ipv4_hdr *)(pos + in_l3_off);
	l4 = pos + in_l4_off;
	if (LB_PAST_END(icmp, sizeof(*icmp), end) || LB_PAST_END(ip_in, sizeof(*ip_in), end) ||
	    LB_PAST_END(l4, LB_ICMP_QUOTE_L4, end))
		return LB_NAT_MALFORMED;
	if (in_l4_off != in_l3_off + (ip_in->ver_ihl & 0xf) * 4u || (ip_in->ver_ihl & 0xf) < 5)
		return LB_NAT_MALFORMED;
	if (outer_addr) {
		/* The outer header, whose IHL must end where the ICMP header
		 * begins. */
		l3_off = ic->l3_off;
		if (l3_off < LB_NAT_MIN_L3_OFF || l3_off > LB_NAT_MAX_L3_OFF)
			return LB_NAT_MALFORMED;
		iph = (struct lb_ipv4_hdr *)(pos + l3_off);
		if (LB_PAST_END(iph, sizeof(*iph), end))
			return LB_NAT_MALFORMED;
		if ((iph->ver_ihl >> 4) != 4 || (iph->ver_ihl & 0xf) < 5 ||
		    iph->proto != LB_IPPROTO_ICMP || l3_off + (iph->ver_ihl & 0xf) * 4u != icmp_off)
			return LB_NAT_MALFORMED;
	} else {
		iph = 0;
	}
	if (ic->inner_proto == LB_IPPROTO_TCP) {
		struct lb_tcp_hdr *tcp = (struct lb_tcp_hdr *)l4;

		l4_port = inner->side == LB_NAT_SRC ? &tcp->sport : &tcp->dport;
		if (ic->l4_quoted >= LB_TCP_CSUM_END) {
			if (LB_PAST_END(l4, LB_TCP_CSUM_END, end))
				return LB_NAT_MALFORMED;
			l4_check = &tcp->check;
		}
	} else {
		struct lb_udp_hdr *udp = (struct lb_udp_hdr *)l4;

		l4_port = inner->side == LB_NAT_SRC ? &udp->sport : &udp->dport;
		l4_check = &udp->check; /* within the 8 bytes checked above */
	}

	/* All checked: write. The quoted packet first, gathering the old and
	 * new value of every word of the ICMP message that changes. */
	old_addr = inner->side == LB_NAT_SRC ? ip_in->saddr : ip_in->daddr;
	old_port = *l4_port;
	old_ip_check = ip_in->check;
	new_ip_check = lb_csum_replace4(old_ip_check, old_addr, inner->addr);
	if (l4_check) {
		old_l4_check = *l4_check;
		new_l4_check = lb_nat_l4_csum(old_l4_check, ic->inner_proto, old_addr, inner->addr,
					      old_port, inner->port);
	}
	ip_in->check = new_ip_check;
	if (inner->side == LB_NAT_SRC)
		ip_in->saddr = inner->addr;
	else
		ip_in->daddr = inner->addr;
	*l4_port = inner->port;
	if (l4_check)
		*l4_check = new_l4_check;

	check = icmp->check;
	check = lb_csum_replace4(check, old_addr, inner->addr);
	check = lb_csum_replace2(check, old_port, inner->port);
	check = lb_csum_replace2(check, old_ip_check, new_ip_check);
	if (l4_check)
		check = lb_csum_replace2(check, old_l4_check, new_l4_check);
	icmp->check = check;

	/* The mirrored side of the outer header. */
	if (iph && inner->side == LB_NAT_SRC) {
		iph->check = lb_csum_replace4(iph->check, iph->daddr, outer_addr);
		iph->daddr = outer_addr;
	} else if (iph) {
		iph->check = lb_csum_replace4(iph->check, iph->saddr, outer_addr);
		iph->saddr = outer_addr;
	}
	return LB_NAT_OK;
}

/* The IPv6 rewrites, beside these (lb_nat6.h includes this file back: its
 * guard makes either include order work). */
#include "lb_nat6.h"

#endif /* HPCLB_LB_NAT_H */
