/* SPDX-License-Identifier: Apache-2.0
 *
 * parse_selftest.c - the shared packet code (dataplane/common/lb_parse.h,
 * lb_rewrite.h) against a corpus of frames: every truncation point of every
 * header, bad IHL, IPv4 total lengths beyond the frame, below the header and
 * zero, fragments (first, later, atomic), VLAN tags, IPv6 extension chains
 * (ok, too long, truncated, lengths past the packet), and the RFC 1624
 * checksum update against a full recomputation for random inputs.
 *
 * One file, two roles (tests/unit/test_parse_helpers.py builds both):
 *   native (cc -Wall -Wextra -Werror): the checks. Every frame is parsed from a
 *     heap buffer of exactly its length, so ASan or valgrind sees any read
 *     past the end. With -DPARSE_SELFTEST_BPF and `--bpf OBJ`, every frame of
 *     14 bytes or more is also run through the BPF build of the same parser
 *     (BPF_PROG_TEST_RUN, needs root), which must fill struct lb_parsed byte
 *     for byte as the native build did: the verifier accepted it, and the two
 *     compilations agree.
 *   Every frame also goes through lb_parse_untagged_ipv4, the one-pass parse
 *   lb.bpf.c uses, in both builds: its verdict must be lb_untagged_ipv4_only's
 *   of lb_parse_frame's, and with LB_PARSE_OK its struct lb_parsed must be
 *   lb_parse_frame's byte for byte, whatever the struct held before.
 *   And through lb_parse_untagged (untagged IPv4 and IPv6 in one pass, what
 *   lb.bpf.c uses since IPv6 forwarding), in both builds: its verdict must be
 *   untagged_only's of lb_parse_frame's (lb_parse_frame's own for an untagged
 *   IPv4 or IPv6 frame, LB_PARSE_NOT_IP for any other), with LB_PARSE_OK its
 *   struct lb_parsed lb_parse_frame's byte for byte, and with another
 *   verdict the fields it promises (family; proto with UNSUPPORTED_L4) too.
 *   clang -target bpf -D__BPF__: that XDP program.
 */
#include "lb_parse.h"
#include "lb_rewrite.h"

/* What the BPF program hands back for one frame. */
struct parse_result {
	__u32 verdict; /* lb_parse_frame's */
	__u32 policy;  /* lb_untagged_ipv4_only's */
	struct lb_parsed p;
	__u32 fast;    /* lb_parse_untagged_ipv4's */
	struct lb_parsed fp; /* its result, copied only with LB_PARSE_OK */
	__u32 both;    /* lb_parse_untagged's */
	struct lb_parsed bp; /* its result (over a 0x5a filling), whatever the verdict */
};

#ifdef __BPF__

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct parse_result);
	__uint(max_entries, 1);
} result_map SEC(".maps");

SEC("xdp")
int parse_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct lb_parsed pkt; /* on the stack, as lb.bpf.c has it */
	struct lb_parsed fpkt;
	struct lb_parsed bpkt;
	struct parse_result *r;
	enum lb_parse_verdict v;
	__u32 zero = 0;

	v = lb_parse_frame(&pkt, data, data_end);
	r = bpf_map_lookup_elem(&result_map, &zero);
	if (!r)
		return XDP_ABORTED;
	r->verdict = v;
	r->policy = lb_untagged_ipv4_only(&pkt, v);
	__builtin_memcpy(&r->p, &pkt, sizeof(pkt));
	r->fast = lb_parse_untagged_ipv4(&fpkt, data, data_end);
	if (r->fast == LB_PARSE_OK)
		__builtin_memcpy(&r->fp, &fpkt, sizeof(fpkt));
	__builtin_memset(&bpkt, 0x5a, sizeof(bpkt));
	r->both = lb_parse_untagged(&bpkt, data, data_end);
	__builtin_memcpy(&r->bp, &bpkt, sizeof(bpkt));
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "GPL";

#else /* native */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef PARSE_SELFTEST_BPF
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#endif

static int frames_checked;
static int frames_cross_checked;

#include "selftest.h"

static const char *const VERDICT_NAMES[] = {
	"ok", "not_ip", "malformed", "unsupported_l4", "fragment", "ext_too_long",
};

static const char *vname(unsigned v)
{
	return v < sizeof(VERDICT_NAMES) / sizeof(VERDICT_NAMES[0]) ? VERDICT_NAMES[v] : "?";
}

/* ---- the BPF build, for the cross-check ---------------------------------- */

/* The verdict lb_parse_untagged must give, from lb_parse_frame's: the same
 * for an untagged IPv4 or IPv6 frame, LB_PARSE_NOT_IP for a tagged or
 * non-IP one (a frame too short for Ethernet is MALFORMED in both). */
static __u32 untagged_only(const struct lb_parsed *p, __u32 v)
{
	if (p->flags & LB_PF_VLAN)
		return LB_PARSE_NOT_IP;
	if (p->l3_off == 0)
		return v;
	if (p->family != LB_FAMILY_IPV4 && p->family != LB_FAMILY_IPV6)
		return LB_PARSE_NOT_IP;
	return v;
}

/* lb_parse_untagged gave verdict bv and struct *bp on a frame lb_parse_frame
 * parsed into *p with verdict v: what it promises (the top of this file). */
static void check_untagged(__u32 bv, const struct lb_parsed *bp, const struct lb_parsed *p,
			   enum lb_parse_verdict v, const char *build, const char *what)
{
	__u32 want = untagged_only(p, v);

	CHECK(bv == want, "%s: %s untagged verdict %s, want %s", what, build, vname(bv),
	      vname(want));
	if (bv == LB_PARSE_OK)
		CHECK(memcmp(bp, p, sizeof(*p)) == 0, "%s: %s untagged struct differs", what, build);
	else if (bv != LB_PARSE_NOT_IP && p->l3_off != 0)
		CHECK(bp->family == p->family, "%s: %s untagged family %u, want %u", what, build,
		      bp->family, p->family);
	if (bv == LB_PARSE_UNSUPPORTED_L4)
		CHECK(bp->proto == p->proto, "%s: %s untagged proto %u, want %u", what, build,
		      bp->proto, p->proto);
}

#ifdef PARSE_SELFTEST_BPF
static struct bpf_object *bpf_obj;
static int bpf_prog_fd = -1, bpf_map_fd = -1;

static int bpf_open(const char *path)
{
	struct bpf_program *prog;
	struct bpf_map *map;

	bpf_obj = bpf_object__open_file(path, NULL);
	if (!bpf_obj || libbpf_get_error(bpf_obj)) {
		printf("cannot open %s\n", path);
		return -1;
	}
	if (bpf_object__load(bpf_obj)) {
		printf("cannot load %s (verifier refused it?)\n", path);
		return -1;
	}
	prog = bpf_object__find_program_by_name(bpf_obj, "parse_xdp");
	map = bpf_object__find_map_by_name(bpf_obj, "result_map");
	if (!prog || !map)
		return -1;
	bpf_prog_fd = bpf_program__fd(prog);
	bpf_map_fd = bpf_map__fd(map);
	return 0;
}

static void bpf_cross_check(const __u8 *frame, size_t len, enum lb_parse_verdict v,
			    const struct lb_parsed *p, const char *what)
{
	struct parse_result r;
	__u32 zero = 0;
	__u8 out[4096];
	LIBBPF_OPTS(bpf_test_run_opts, opts, .data_in = frame, .data_size_in = (__u32)len,
		    .data_out = out, .data_size_out = sizeof(out), .repeat = 1);

	/* XDP's test run refuses frames shorter than an Ethernet header. */
	if (bpf_prog_fd < 0 || len < sizeof(struct lb_eth_hdr))
		return;
	memset(&r, 0xa5, sizeof(r));
	if (bpf_map_update_elem(bpf_map_fd, &zero, &r, BPF_ANY) ||
	    bpf_prog_test_run_opts(bpf_prog_fd, &opts)) {
		CHECK(0, "%s: BPF_PROG_TEST_RUN failed", what);
		return;
	}
	CHECK(opts.retval == 2 /* XDP_PASS */, "%s: BPF program returned %u", what, opts.retval);
	CHECK(bpf_map_lookup_elem(bpf_map_fd, &zero, &r) == 0, "%s: result lookup", what);
	CHECK(r.verdict == (__u32)v, "%s: BPF verdict %s, native %s", what, vname(r.verdict),
	      vname(v));
	CHECK(r.policy == (__u32)lb_untagged_ipv4_only(p, v), "%s: BPF policy verdict differs",
	      what);
	CHECK(memcmp(&r.p, p, sizeof(*p)) == 0, "%s: BPF struct lb_parsed differs", what);
	CHECK(r.fast == (__u32)lb_untagged_ipv4_only(p, v), "%s: BPF one-pass verdict %s, want %s",
	      what, vname(r.fast), vname(lb_untagged_ipv4_only(p, v)));
	if (r.fast == LB_PARSE_OK)
		CHECK(memcmp(&r.fp, p, sizeof(*p)) == 0, "%s: BPF one-pass struct differs", what);
	check_untagged(r.both, &r.bp, p, v, "BPF", what);
	frames_cross_checked++;
}
#else
static void bpf_cross_check(const __u8 *frame, size_t len, enum lb_parse_verdict v,
			    const struct lb_parsed *p, const char *what)
{
	(void)frame, (void)len, (void)v, (void)p, (void)what;
}
#endif

/* ---- parsing a frame ----------------------------------------------------- */

/* Parse `len` bytes of `frame` from a heap copy of exactly that size. */
static enum lb_parse_verdict parse(const __u8 *frame, size_t len, struct lb_parsed *p,
				   const char *what)
{
	__u8 *copy = malloc(len ? len : 1);
	enum lb_parse_verdict v;

	if (!copy) {
		printf("out of memory\n");
		exit(2);
	}
	memcpy(copy, frame, len);
	memset(p, 0x5a, sizeof(*p)); /* the parse must clear it */
	v = lb_parse_frame(p, copy, copy + len);
	CHECK(memcmp(copy, frame, len) == 0, "%s: the parse wrote to the frame", what);
	/* The one-pass parse of lb.bpf.c, over two different fillings: what it
	 * promises with OK may depend on the frame only. */
	for (int fill = 0; fill < 2; fill++) {
		struct lb_parsed fp;
		enum lb_parse_verdict fv;

		memset(&fp, fill ? 0xa5 : 0x5a, sizeof(fp));
		fv = lb_parse_untagged_ipv4(&fp, copy, copy + len);
		CHECK(fv == lb_untagged_ipv4_only(p, v), "%s: one-pass verdict %s, want %s", what,
		      vname(fv), vname(lb_untagged_ipv4_only(p, v)));
		if (fv == LB_PARSE_OK)
			CHECK(memcmp(&fp, p, sizeof(fp)) == 0, "%s: one-pass struct differs", what);
		/* lb_parse_untagged, likewise over both fillings. */
		memset(&fp, fill ? 0xa5 : 0x5a, sizeof(fp));
		fv = lb_parse_untagged(&fp, copy, copy + len);
		check_untagged(fv, &fp, p, v, "native", what);
	}
	CHECK(memcmp(copy, frame, len) == 0, "%s: the one-pass parse wrote to the frame", what);
	bpf_cross_check(copy, len, v, p, what);
	free(copy);
	frames_checked++;
	return v;
}

static enum lb_parse_verdict expect(const __u8 *frame, size_t len, enum lb_parse_verdict want,
				    struct lb_parsed *p, const char *what)
{
	enum lb_parse_verdict v = parse(frame, len, p, what);

	CHECK(v == want, "%s (%zu bytes): verdict %s, want %s", what, len, vname(v), vname(want));
	return v;
}

/* ---- building frames ----------------------------------------------------- */

#define TCP 6
#define UDP 17
#define ICMP 1
#define ICMPV6 58
#define ESP 50
#define NONXT 59

struct frame {
	__u8 b[2048];
	size_t len;  /* bytes of frame */
	size_t l3;   /* IP header offset */
	size_t l4;   /* L4 header offset */
	size_t ends[32]; /* the end offset of every header, in order: truncation points */
	int nends;
};

static void put16(__u8 *b, __u16 v)
{
	b[0] = (__u8)(v >> 8);
	b[1] = (__u8)v;
}

static __u16 get16(const __u8 *b)
{
	return (__u16)(b[0] << 8 | b[1]);
}

static void mark_end(struct frame *f)
{
	f->ends[f->nends++] = f->len;
}

static const __u8 DST_MAC[6] = { 0x02, 0, 0, 0, 0, 1 };
static const __u8 SRC_MAC[6] = { 0x02, 0, 0, 0, 0, 2 };

static void put_eth(struct frame *f, int vlan, __u16 type)
{
	memset(f, 0, sizeof(*f));
	memcpy(f->b, DST_MAC, 6);
	memcpy(f->b + 6, SRC_MAC, 6);
	f->len = 12;
	if (vlan) {
		put16(f->b + 12, LB_ETH_P_8021Q);
		f->len = 14;
		mark_end(f);
		put16(f->b + 14, 0x2064); /* PCP 1, VID 100 */
		f->len = 16;
	}
	put16(f->b + f->len, type);
	f->len += 2;
	mark_end(f);
	f->l3 = f->len;
}

static void put_l4(struct frame *f, __u8 proto, size_t payload)
{
	__u8 *l4 = f->b + f->len;

	f->l4 = f->len;
	if (proto == TCP) {
		put16(l4, 40000);
		put16(l4 + 2, 80);
		l4[12] = 5 << 4;
		f->len += LB_TCP_HLEN;
		mark_end(f);
	} else if (proto == UDP) {
		put16(l4, 40001);
		put16(l4 + 2, 53);
		put16(l4 + 4, (__u16)(LB_UDP_HLEN + payload));
		f->len += LB_UDP_HLEN;
		mark_end(f);
	}
	memset(f->b + f->len, 'p', payload);
	f->len += payload;
}

struct v4 {
	int vlan;
	unsigned ihl;   /* 5..15 */
	__u8 proto;
	__u16 frag;     /* host order: flags << 13 | offset */
	size_t payload; /* after the L4 header */
};

static void build_v4(struct frame *f, const struct v4 *o)
{
	__u8 *ip;
	size_t i;

	put_eth(f, o->vlan, LB_ETH_P_IP);
	ip = f->b + f->l3;
	ip[0] = (__u8)(4 << 4 | o->ihl);
	put16(ip + 6, o->frag);
	ip[8] = 64;
	ip[9] = o->proto;
	memcpy(ip + 12, (const __u8[]){ 198, 19, 1, 1 }, 4);
	memcpy(ip + 16, (const __u8[]){ 198, 18, 1, 10 }, 4);
	f->len += 20;
	mark_end(f);
	for (i = 20; i < o->ihl * 4u; i++) /* NOP options, each a truncation point */
		ip[i] = 1;
	for (i = 20; i < o->ihl * 4u; i += 4) {
		f->len += 4;
		mark_end(f);
	}
	put_l4(f, o->proto, o->payload);
	put16(ip + 2, (__u16)(f->len - f->l3));
}

/* One IPv6 extension header in a chain: type, and for the fragment header its
 * offset (8-byte units) and more-fragments bit; for the others hdrlen. */
struct ext {
	__u8 type;
	__u8 hdrlen;
	__u16 frag_offset;
	int more;
};

struct v6 {
	int vlan;
	int next;        /* number of extension headers */
	struct ext ext[16];
	__u8 proto;      /* after the chain */
	size_t payload;
};

static size_t ext_len(const struct ext *e)
{
	if (e->type == LB_IPPROTO_FRAGMENT)
		return 8;
	if (e->type == LB_IPPROTO_AH)
		return (e->hdrlen + 2u) * 4u;
	return (e->hdrlen + 1u) * 8u;
}

static void build_v6(struct frame *f, const struct v6 *o)
{
	__u8 *ip;
	int i;

	put_eth(f, o->vlan, LB_ETH_P_IPV6);
	ip = f->b + f->l3;
	ip[0] = 6 << 4;
	ip[6] = o->next ? o->ext[0].type : o->proto;
	ip[7] = 64;
	ip[8] = 0x20;
	ip[9] = 0x01;
	ip[23] = 1;
	ip[24] = 0x20;
	ip[25] = 0x01;
	ip[38] = 0xbe;
	ip[39] = 0xef;
	f->len += 40;
	mark_end(f);
	for (i = 0; i < o->next; i++) {
		const struct ext *e = &o->ext[i];
		__u8 *h = f->b + f->len;
		size_t n = ext_len(e);

		h[0] = i + 1 < o->next ? o->ext[i + 1].type : o->proto;
		if (e->type == LB_IPPROTO_FRAGMENT) {
			put16(h + 2, (__u16)(e->frag_offset << 3 | (e->more ? 1 : 0)));
			memcpy(h + 4, "\x12\x34\x56\x78", 4);
		} else {
			h[1] = e->hdrlen;
			memset(h + 2, 0, n - 2); /* PadN-free zeroes: Pad1 options */
		}
		f->len += n;
		mark_end(f);
	}
	put_l4(f, o->proto, o->payload);
	put16(ip + 4, (__u16)(f->len - f->l3 - 40));
}

/* ---- field checks ---------------------------------------------------------- */

static void check_ok_v4(const struct frame *f, const struct lb_parsed *p, int vlan,
			const char *what)
{
	__be32 s, d;

	memcpy(&s, f->b + f->l3 + 12, 4);
	memcpy(&d, f->b + f->l3 + 16, 4);
	CHECK(p->family == LB_FAMILY_IPV4, "%s: family %u", what, p->family);
	CHECK(p->l3_off == f->l3 && p->l4_off == f->l4, "%s: offsets %u/%u want %zu/%zu", what,
	      p->l3_off, p->l4_off, f->l3, f->l4);
	CHECK(p->src.v4 == s && p->dst.v4 == d, "%s: addresses", what);
	CHECK(lb_ntohs(p->sport) == get16(f->b + f->l4) &&
	      lb_ntohs(p->dport) == get16(f->b + f->l4 + 2), "%s: ports", what);
	CHECK(p->proto == f->b[f->l3 + 9], "%s: proto %u", what, p->proto);
	CHECK(p->eth_proto == lb_htons(LB_ETH_P_IP), "%s: eth_proto", what);
	CHECK(!!(p->flags & LB_PF_VLAN) == !!vlan, "%s: VLAN flag", what);
	CHECK(p->l3_len == get16(f->b + f->l3 + 2), "%s: l3_len %u", what, p->l3_len);
	CHECK(!(p->flags & (LB_PF_FRAGMENT | LB_PF_LATER_FRAGMENT)), "%s: fragment flag", what);
}

static void check_ok_v6(const struct frame *f, const struct lb_parsed *p, const char *what)
{
	CHECK(p->family == LB_FAMILY_IPV6, "%s: family %u", what, p->family);
	CHECK(p->l3_off == f->l3 && p->l4_off == f->l4, "%s: offsets %u/%u want %zu/%zu", what,
	      p->l3_off, p->l4_off, f->l3, f->l4);
	CHECK(memcmp(p->src.v6, f->b + f->l3 + 8, 16) == 0 &&
	      memcmp(p->dst.v6, f->b + f->l3 + 24, 16) == 0, "%s: addresses", what);
	CHECK(lb_ntohs(p->sport) == get16(f->b + f->l4) &&
	      lb_ntohs(p->dport) == get16(f->b + f->l4 + 2), "%s: ports", what);
	CHECK(p->l3_len == 40 + get16(f->b + f->l3 + 4), "%s: l3_len %u", what, p->l3_len);
	CHECK(p->eth_proto == lb_htons(LB_ETH_P_IPV6), "%s: eth_proto", what);
	CHECK(lb_untagged_ipv4_only(p, LB_PARSE_OK) == LB_PARSE_NOT_IP,
	      "%s: IPv6 is not the planes' today", what);
}

/* Every truncation of a well-formed frame inside its headers (before
 * `limit`), at every byte: at a header boundary or inside a header, two ways:
 * the frame simply cut (the IP length then claims more than the frame:
 * malformed), and the IP length rewritten to end at the cut too (so it is the
 * header itself that is short: malformed as well, never read past). Whatever
 * is known before the cut must already be in the result. */
static void check_truncations_upto(const struct frame *f, int family, size_t limit,
				   const char *what)
{
	char name[160];
	size_t cut;

	for (cut = 0; cut < limit; cut++) {
		struct frame t = *f;
		struct lb_parsed p;

		snprintf(name, sizeof(name), "%s cut at %zu", what, cut);
		expect(t.b, cut, LB_PARSE_MALFORMED, &p, name);
		if (cut < 14) {
			CHECK(p.l3_off == 0 && p.family == 0, "%s: nothing past Ethernet", name);
			CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_MALFORMED) == LB_PARSE_MALFORMED,
			      "%s: the planes drop it", name);
			continue;
		}
		if (cut >= f->l3) {
			CHECK(p.l3_off == f->l3, "%s: l3_off %u", name, p.l3_off);
			CHECK(p.family == family, "%s: family %u", name, p.family);
		}
		if (cut < f->l3 + (family == LB_FAMILY_IPV4 ? 20 : 40))
			continue;
		/* Now with the length field agreeing with the cut. */
		if (family == LB_FAMILY_IPV4)
			put16(t.b + t.l3 + 2, (__u16)(cut - t.l3));
		else
			put16(t.b + t.l3 + 4, (__u16)(cut - t.l3 - 40));
		snprintf(name, sizeof(name), "%s cut at %zu, length agreeing", what, cut);
		expect(t.b, cut, LB_PARSE_MALFORMED, &p, name);
	}
}

/* ... up to the end of the last header (bytes past it are payload: a cut
 * there is fine once the length agrees). */
static void check_truncations(const struct frame *f, int family, const char *what)
{
	check_truncations_upto(f, family, f->ends[f->nends - 1], what);
}

/* ---- the corpus ------------------------------------------------------------ */

static void test_ethernet_and_vlan(void)
{
	struct frame f;
	struct lb_parsed p;
	__u8 arp[42] = { 0 };

	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP });
	expect(f.b, f.len, LB_PARSE_OK, &p, "plain TCP");
	check_ok_v4(&f, &p, 0, "plain TCP");
	CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_OK) == LB_PARSE_OK, "plain TCP is balanced");
	check_truncations(&f, LB_FAMILY_IPV4, "plain TCP");

	build_v4(&f, &(struct v4){ .ihl = 5, .proto = UDP, .payload = 12 });
	expect(f.b, f.len, LB_PARSE_OK, &p, "plain UDP");
	check_ok_v4(&f, &p, 0, "plain UDP");
	check_truncations(&f, LB_FAMILY_IPV4, "plain UDP");

	/* One 802.1Q tag: parsed through, and then not balanced by the planes
	 * (they never were); truncated in the tag: malformed, not balanced. */
	build_v4(&f, &(struct v4){ .vlan = 1, .ihl = 5, .proto = TCP });
	expect(f.b, f.len, LB_PARSE_OK, &p, "tagged TCP");
	check_ok_v4(&f, &p, 1, "tagged TCP");
	CHECK(p.vlan_tci == 0x2064 && p.l3_off == 18, "tagged: tci %#x l3 %u", p.vlan_tci,
	      p.l3_off);
	CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_OK) == LB_PARSE_NOT_IP, "tagged: not balanced");
	check_truncations(&f, LB_FAMILY_IPV4, "tagged TCP");
	for (size_t cut = 14; cut < 18; cut++) {
		expect(f.b, cut, LB_PARSE_MALFORMED, &p, "tag truncated");
		CHECK((p.flags & LB_PF_VLAN) && p.l3_off == 0, "tag truncated: flag, no l3");
		CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_MALFORMED) == LB_PARSE_NOT_IP,
		      "tag truncated: passes as not IPv4, as before");
	}
	/* A second tag, an 802.1ad tag: not IP. */
	put16(f.b + 16, LB_ETH_P_8021Q);
	expect(f.b, f.len, LB_PARSE_NOT_IP, &p, "two tags");
	CHECK(p.flags & LB_PF_VLAN, "two tags: the first is seen");
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP });
	put16(f.b + 12, 0x88a8);
	expect(f.b, f.len, LB_PARSE_NOT_IP, &p, "802.1ad");
	CHECK(!(p.flags & LB_PF_VLAN) && p.eth_proto == lb_htons(0x88a8), "802.1ad: eth_proto");

	/* ARP: not IP, its EtherType reported for the DPDK plane. */
	put16(arp + 12, LB_ETH_P_ARP);
	expect(arp, sizeof(arp), LB_PARSE_NOT_IP, &p, "ARP");
	CHECK(p.eth_proto == lb_htons(LB_ETH_P_ARP) && p.l3_off == 14 && p.family == 0, "ARP");
	CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_NOT_IP) == LB_PARSE_NOT_IP, "ARP passes");
	expect(arp, 14, LB_PARSE_NOT_IP, &p, "bare ARP EtherType");
	expect(arp, 0, LB_PARSE_MALFORMED, &p, "empty frame");
}

static void test_ipv4_header(void)
{
	struct frame f;
	struct lb_parsed p;
	char name[96];
	unsigned ihl;

	/* Options: IHL 6..15, every one skipped; every truncation inside them. */
	for (ihl = 6; ihl <= 15; ihl++) {
		snprintf(name, sizeof(name), "IHL %u TCP", ihl);
		build_v4(&f, &(struct v4){ .ihl = ihl, .proto = TCP, .payload = 3 });
		expect(f.b, f.len, LB_PARSE_OK, &p, name);
		check_ok_v4(&f, &p, 0, name);
		CHECK(p.flags & LB_PF_IP_OPTIONS, "%s: options flag", name);
		check_truncations(&f, LB_FAMILY_IPV4, name);
		snprintf(name, sizeof(name), "IHL %u UDP", ihl);
		build_v4(&f, &(struct v4){ .ihl = ihl, .proto = UDP });
		expect(f.b, f.len, LB_PARSE_OK, &p, name);
		check_ok_v4(&f, &p, 0, name);
		check_truncations(&f, LB_FAMILY_IPV4, name);
	}

	/* Bad IHL: below 5, or options beyond the frame. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP });
	for (ihl = 0; ihl < 5; ihl++) {
		f.b[14] = (__u8)(0x40 | ihl);
		expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "IHL < 5");
		CHECK(p.family == LB_FAMILY_IPV4 && p.l4_off == 0, "IHL < 5: no L4");
	}
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = UDP }); /* 14 + 20 + 8 bytes */
	for (ihl = 8; ihl <= 15; ihl++) {                    /* 32..60 > 28 bytes of IP */
		f.b[14] = (__u8)(0x40 | ihl);
		expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "IHL beyond the frame");
		put16(f.b + 16, (__u16)(ihl * 4)); /* total length agreeing with the IHL */
		expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "IHL and total length beyond the frame");
		put16(f.b + 16, 28);
	}
	f.b[14] = 0x65; /* version 6 in an IPv4 EtherType */
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "version 6 as IPv4");

	/* Total length: beyond the frame, below the header, zero. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP, .payload = 10 });
	{
		__u16 lies[] = { (__u16)(f.len - 14 + 1), 1500, 0xffff, 19, 1, 0 };

		for (size_t i = 0; i < sizeof(lies) / sizeof(lies[0]); i++) {
			snprintf(name, sizeof(name), "total length %u", lies[i]);
			put16(f.b + 16, lies[i]);
			expect(f.b, f.len, LB_PARSE_MALFORMED, &p, name);
		}
	}
	build_v4(&f, &(struct v4){ .ihl = 6, .proto = TCP }); /* 24-byte header */
	put16(f.b + 16, 20);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "total length 20 below a 24-byte header");
	put16(f.b + 16, 23);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "total length 23 below a 24-byte header");
	/* Below the header is malformed whatever follows, not just where the
	 * L4 header then fails to fit: another protocol, a fragment. */
	build_v4(&f, &(struct v4){ .ihl = 6, .proto = ICMP, .payload = 8 });
	for (__u16 l = 20; l < 24; l++) {
		put16(f.b + 16, l);
		expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "ICMP, total length below the header");
	}
	build_v4(&f, &(struct v4){ .ihl = 6, .proto = TCP, .frag = 8 });
	put16(f.b + 16, 20);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "fragment, total length below the header");
	/* ...and a lie passes nothing through that would pass: ICMP and
	 * fragments with a total length beyond the frame are malformed. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = ICMP, .payload = 8 });
	put16(f.b + 16, (__u16)(f.len - 14 + 1));
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "ICMP, total length beyond the frame");

	/* The L4 header must fit in the packet, not just the frame. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP });
	for (__u16 l = 20; l < 40; l++) {
		put16(f.b + 16, l);
		expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "TCP beyond the total length");
	}
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = UDP });
	put16(f.b + 16, 27);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "UDP beyond the total length");
	put16(f.b + 16, 28);
	expect(f.b, f.len, LB_PARSE_OK, &p, "UDP, no payload");

	/* Ethernet padding after a short packet: not part of it. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = UDP });
	memset(f.b + f.len, 0xee, 60 - f.len);
	expect(f.b, 60, LB_PARSE_OK, &p, "padded UDP");
	CHECK(p.l3_len == 28, "padded UDP: l3_len %u", p.l3_len);

	/* Another protocol. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = ICMP, .payload = 8 });
	expect(f.b, f.len, LB_PARSE_UNSUPPORTED_L4, &p, "ICMP");
	CHECK(p.proto == ICMP && p.l4_off == 34 && p.sport == 0, "ICMP: proto, offset, no ports");
	CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_UNSUPPORTED_L4) == LB_PARSE_UNSUPPORTED_L4,
	      "ICMP: passes as not for a VIP");
}

static void test_ipv4_fragments(void)
{
	struct frame f;
	struct lb_parsed p;

	/* First fragment (MF, offset 0): ports there, but a fragment. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP, .frag = LB_IP_MF, .payload = 16 });
	expect(f.b, f.len, LB_PARSE_FRAGMENT, &p, "first fragment");
	CHECK((p.flags & LB_PF_FRAGMENT) && !(p.flags & LB_PF_LATER_FRAGMENT),
	      "first fragment: flags %#x", p.flags);
	CHECK(p.sport == 0 && p.dport == 0 && p.l4_off == 34, "first fragment: no ports read");
	/* Later fragments (offset != 0, with and without MF), even ones too
	 * short to hold an L4 header. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = UDP, .frag = 8 | LB_IP_MF, .payload = 64 });
	expect(f.b, f.len, LB_PARSE_FRAGMENT, &p, "middle fragment");
	CHECK((p.flags & LB_PF_FRAGMENT) && (p.flags & LB_PF_LATER_FRAGMENT), "middle: flags");
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = 255, .frag = 1 });
	f.b[14 + 9] = UDP;
	put16(f.b + 16, 20 + 3);
	f.len = 14 + 23;
	expect(f.b, f.len, LB_PARSE_FRAGMENT, &p, "last fragment, 3 bytes");
	CHECK(p.flags & LB_PF_LATER_FRAGMENT, "last fragment: later");
	/* Don't-fragment alone is no fragment. */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP, .frag = 0x4000 });
	expect(f.b, f.len, LB_PARSE_OK, &p, "DF");
	check_ok_v4(&f, &p, 0, "DF");
	/* A fragment of another protocol is that protocol first (the model). */
	build_v4(&f, &(struct v4){ .ihl = 5, .proto = ICMP, .frag = LB_IP_MF, .payload = 8 });
	expect(f.b, f.len, LB_PARSE_UNSUPPORTED_L4, &p, "ICMP fragment");
	CHECK(p.flags & LB_PF_FRAGMENT, "ICMP fragment: flagged");
	/* A fragment with options, and a fragment with a length lie. */
	build_v4(&f, &(struct v4){ .ihl = 7, .proto = TCP, .frag = 100, .payload = 8 });
	expect(f.b, f.len, LB_PARSE_FRAGMENT, &p, "fragment with options");
	CHECK(p.l4_off == 14 + 28, "fragment with options: l4_off %u", p.l4_off);
	put16(f.b + 16, (__u16)(f.len - 14 + 1));
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "fragment, total length beyond the frame");
}

static void test_ipv6(void)
{
	struct frame f;
	struct lb_parsed p;
	char name[96];

	build_v6(&f, &(struct v6){ .proto = TCP, .payload = 5 });
	expect(f.b, f.len, LB_PARSE_OK, &p, "IPv6 TCP");
	check_ok_v6(&f, &p, "IPv6 TCP");
	CHECK(!(p.flags & LB_PF_IP_OPTIONS), "IPv6 TCP: no extension flag");
	check_truncations(&f, LB_FAMILY_IPV6, "IPv6 TCP");

	build_v6(&f, &(struct v6){ .vlan = 1, .proto = UDP });
	expect(f.b, f.len, LB_PARSE_OK, &p, "tagged IPv6 UDP");
	check_ok_v6(&f, &p, "tagged IPv6 UDP");
	check_truncations(&f, LB_FAMILY_IPV6, "tagged IPv6 UDP");

	/* Payload length: beyond the frame, cutting the L4 header, zero, and
	 * shorter than the frame (padding). */
	build_v6(&f, &(struct v6){ .proto = UDP, .payload = 4 });
	put16(f.b + 18, (__u16)(f.len - 54 + 1));
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "payload length beyond the frame");
	CHECK(p.family == LB_FAMILY_IPV6, "malformed IPv6 keeps its family");
	CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_MALFORMED) == LB_PARSE_NOT_IP,
	      "malformed IPv6 passes as not IPv4, as before");
	put16(f.b + 18, 0xffff);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "payload length 65535");
	put16(f.b + 18, 7);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "payload length cuts UDP");
	put16(f.b + 18, 0);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "payload length 0");
	put16(f.b + 18, 8);
	expect(f.b, f.len, LB_PARSE_OK, &p, "payload length 8: padding after");
	CHECK(p.l3_len == 48, "padding: l3_len %u", p.l3_len);
	f.b[54 - 40] = 0x45;
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "version 4 as IPv6");

	/* Other protocols: ICMPv6, no next header, ESP. */
	build_v6(&f, &(struct v6){ .proto = ICMPV6, .payload = 8 });
	expect(f.b, f.len, LB_PARSE_UNSUPPORTED_L4, &p, "ICMPv6");
	CHECK(p.proto == ICMPV6 && p.l4_off == 54, "ICMPv6: proto and offset");
	build_v6(&f, &(struct v6){ .proto = NONXT });
	expect(f.b, f.len, LB_PARSE_UNSUPPORTED_L4, &p, "no next header");
	build_v6(&f, &(struct v6){ .next = 1, .ext = { { .type = LB_IPPROTO_DSTOPTS } },
				   .proto = ESP, .payload = 16 });
	expect(f.b, f.len, LB_PARSE_UNSUPPORTED_L4, &p, "ESP after destination options");
	CHECK(p.proto == ESP && p.l4_off == 54 + 8, "ESP: where the walk stopped");

	/* Chains that parse: each kind, mixed lengths, the longest allowed. */
	{
		static const struct v6 chains[] = {
			{ .next = 1, .ext = { { .type = LB_IPPROTO_HOPOPTS } }, .proto = TCP },
			{ .next = 1, .ext = { { .type = LB_IPPROTO_ROUTING, .hdrlen = 2 } },
			  .proto = UDP },
			{ .next = 1, .ext = { { .type = LB_IPPROTO_DSTOPTS, .hdrlen = 1 } },
			  .proto = TCP },
			{ .next = 1, .ext = { { .type = LB_IPPROTO_AH, .hdrlen = 4 } }, .proto = TCP },
			{ .next = 1, .ext = { { .type = LB_IPPROTO_FRAGMENT } }, .proto = UDP },
			{ .next = 4,
			  .ext = { { .type = LB_IPPROTO_HOPOPTS }, { .type = LB_IPPROTO_DSTOPTS, .hdrlen = 3 },
				   { .type = LB_IPPROTO_ROUTING, .hdrlen = 1 },
				   { .type = LB_IPPROTO_FRAGMENT } },
			  .proto = TCP, .payload = 9 },
			{ .next = 8,
			  .ext = { { .type = LB_IPPROTO_HOPOPTS }, { .type = LB_IPPROTO_DSTOPTS },
				   { .type = LB_IPPROTO_ROUTING }, { .type = LB_IPPROTO_AH, .hdrlen = 1 },
				   { .type = LB_IPPROTO_FRAGMENT }, { .type = LB_IPPROTO_DSTOPTS, .hdrlen = 2 },
				   { .type = LB_IPPROTO_DSTOPTS }, { .type = LB_IPPROTO_DSTOPTS } },
			  .proto = UDP },
		};

		for (size_t i = 0; i < sizeof(chains) / sizeof(chains[0]); i++) {
			snprintf(name, sizeof(name), "IPv6 chain %zu (%d headers)", i, chains[i].next);
			build_v6(&f, &chains[i]);
			expect(f.b, f.len, LB_PARSE_OK, &p, name);
			check_ok_v6(&f, &p, name);
			CHECK(p.flags & LB_PF_IP_OPTIONS, "%s: extension flag", name);
			CHECK(!(p.flags & LB_PF_FRAGMENT), "%s: atomic fragment is none", name);
			check_truncations(&f, LB_FAMILY_IPV6, name);
		}
	}

	/* Too long: one more than LB_IPV6_MAX_EXT_HDRS; and far more. */
	{
		struct v6 o = { .next = LB_IPV6_MAX_EXT_HDRS + 1, .proto = TCP };

		for (int i = 0; i < o.next; i++)
			o.ext[i].type = LB_IPPROTO_DSTOPTS;
		build_v6(&f, &o);
		expect(f.b, f.len, LB_PARSE_EXT_TOO_LONG, &p, "chain one too long");
		CHECK(p.family == LB_FAMILY_IPV6 && p.l4_off == 0, "too long: no L4");
		CHECK(lb_untagged_ipv4_only(&p, LB_PARSE_EXT_TOO_LONG) == LB_PARSE_NOT_IP,
		      "too long: passes as not IPv4 today");
		o.next = 16;
		for (int i = 0; i < o.next; i++)
			o.ext[i].type = i & 1 ? LB_IPPROTO_DSTOPTS : LB_IPPROTO_ROUTING;
		build_v6(&f, &o);
		expect(f.b, f.len, LB_PARSE_EXT_TOO_LONG, &p, "chain of 16");
		/* Truncated inside the first headers of a too-long chain:
		 * malformed (the truncation is met first). */
		expect(f.b, 54 + 4, LB_PARSE_MALFORMED, &p, "too long and truncated");
	}

	/* An extension header longer than the packet (payload length), while
	 * the frame holds it; and the largest hdrlen in a short frame. */
	build_v6(&f, &(struct v6){ .next = 1, .ext = { { .type = LB_IPPROTO_DSTOPTS, .hdrlen = 2 } },
				   .proto = TCP, .payload = 40 });
	put16(f.b + 18, 16);
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "extension header past the payload length");
	build_v6(&f, &(struct v6){ .next = 1, .ext = { { .type = LB_IPPROTO_DSTOPTS } },
				   .proto = TCP, .payload = 40 });
	f.b[54 + 1] = 255;
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "hdrlen 255 in a short packet");
	/* ...followed by a protocol that is not walked: the header's own end
	 * must be checked, not only the next header's start. */
	build_v6(&f, &(struct v6){ .next = 1, .ext = { { .type = LB_IPPROTO_DSTOPTS, .hdrlen = 2 } },
				   .proto = ICMPV6, .payload = 16 });
	for (__u16 l = 8; l < 24; l++) {
		snprintf(name, sizeof(name), "24-byte options in a %u-byte payload, then ICMPv6", l);
		put16(f.b + 18, l);
		expect(f.b, f.len, LB_PARSE_MALFORMED, &p, name);
	}
	put16(f.b + 18, 24);
	expect(f.b, f.len, LB_PARSE_UNSUPPORTED_L4, &p, "24-byte options, then ICMPv6");
	build_v6(&f, &(struct v6){ .next = 1, .ext = { { .type = LB_IPPROTO_DSTOPTS } },
				   .proto = TCP, .payload = 40 });
	f.b[14 + 6] = LB_IPPROTO_AH;
	f.b[54 + 1] = 255;
	expect(f.b, f.len, LB_PARSE_MALFORMED, &p, "AH hdrlen 255 in a short packet");
}

static void test_ipv6_fragments(void)
{
	struct frame f;
	struct lb_parsed p;

	build_v6(&f, &(struct v6){ .next = 1,
				   .ext = { { .type = LB_IPPROTO_FRAGMENT, .more = 1 } },
				   .proto = TCP, .payload = 16 });
	expect(f.b, f.len, LB_PARSE_FRAGMENT, &p, "IPv6 first fragment");
	CHECK((p.flags & LB_PF_FRAGMENT) && !(p.flags & LB_PF_LATER_FRAGMENT), "first: flags");
	CHECK(p.proto == TCP && p.l4_off == 54 + 8 && p.sport == 0, "first: proto, offset");
	/* Cut inside the fragment header: malformed; past it, a fragment
	 * (its L4 header is not looked at). */
	check_truncations_upto(&f, LB_FAMILY_IPV6, f.l4, "IPv6 first fragment");
	put16(f.b + 18, 8 + 3);
	expect(f.b, 54 + 8 + 3, LB_PARSE_FRAGMENT, &p, "IPv6 first fragment, 3 bytes of TCP");

	build_v6(&f, &(struct v6){ .next = 2,
				   .ext = { { .type = LB_IPPROTO_HOPOPTS },
					    { .type = LB_IPPROTO_FRAGMENT, .frag_offset = 100 } },
				   .proto = UDP, .payload = 3 });
	/* A later fragment holds no UDP header: cut it to just payload. */
	f.len = 54 + 16 + 3;
	put16(f.b + 18, 16 + 3);
	expect(f.b, f.len, LB_PARSE_FRAGMENT, &p, "IPv6 last fragment");
	CHECK(p.flags & LB_PF_LATER_FRAGMENT, "IPv6 last fragment: later");

	build_v6(&f, &(struct v6){ .next = 1,
				   .ext = { { .type = LB_IPPROTO_FRAGMENT, .more = 1 } },
				   .proto = ICMPV6, .payload = 8 });
	expect(f.b, f.len, LB_PARSE_UNSUPPORTED_L4, &p, "ICMPv6 fragment");
	CHECK(p.flags & LB_PF_FRAGMENT, "ICMPv6 fragment: flagged");

	/* Reserved bits (RFC 8200: ignored on reception) do not make an atomic
	 * fragment a fragment. */
	build_v6(&f, &(struct v6){ .next = 1, .ext = { { .type = LB_IPPROTO_FRAGMENT } },
				   .proto = TCP });
	f.b[54 + 3] |= 0x06;
	f.b[54 + 1] = 0xff;
	expect(f.b, f.len, LB_PARSE_OK, &p, "atomic fragment, reserved bits set");
	CHECK(!(p.flags & LB_PF_FRAGMENT), "reserved bits: no fragment");

	/* Destination options in the fragmentable part hide the protocol. */
	build_v6(&f, &(struct v6){ .next = 2,
				   .ext = { { .type = LB_IPPROTO_FRAGMENT, .frag_offset = 1 },
					    { .type = LB_IPPROTO_DSTOPTS } },
				   .proto = ICMPV6, .payload = 8 });
	expect(f.b, f.len, LB_PARSE_FRAGMENT, &p, "fragment, then destination options");
	CHECK(p.proto == LB_IPPROTO_DSTOPTS, "fragment: proto is the next header %u", p.proto);
}

/* ---- rewrite --------------------------------------------------------------- */

static void test_rewrite_macs(void)
{
	struct frame f;
	const __u8 nd[6] = { 0xaa, 1, 2, 3, 4, 5 }, ns[6] = { 0xbb, 6, 7, 8, 9, 10 };
	__u8 *buf;

	build_v4(&f, &(struct v4){ .ihl = 5, .proto = TCP });
	buf = malloc(f.len);
	memcpy(buf, f.b, f.len);
	CHECK(lb_rewrite_macs(buf, buf + f.len, nd, ns) == 0, "rewrite");
	CHECK(memcmp(buf, nd, 6) == 0 && memcmp(buf + 6, ns, 6) == 0, "rewrite: MACs");
	CHECK(memcmp(buf + 12, f.b + 12, f.len - 12) == 0, "rewrite: the rest untouched");
	free(buf);
	for (size_t n = 0; n < 14; n++) {
		buf = malloc(n ? n : 1);
		memset(buf, 0x11, n);
		CHECK(lb_rewrite_macs(buf, buf + n, nd, ns) == -1, "rewrite of %zu bytes refused", n);
		for (size_t i = 0; i < n; i++)
			CHECK(buf[i] == 0x11, "refused rewrite wrote byte %zu", i);
		free(buf);
	}
}

/* ---- checksums ------------------------------------------------------------- */

/* The Internet checksum of `len` (even) bytes, every 16-bit word read in
 * memory order, as the helpers take them. */
static __u16 csum_full(const __u8 *b, size_t len)
{
	__u64 sum = 0;

	for (size_t i = 0; i < len; i += 2) {
		__u16 w;

		memcpy(&w, b + i, 2);
		sum += w;
	}
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

static __u64 rng_state = 0x9e3779b97f4a7c15ull;

static __u64 rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

static void test_checksums(void)
{
	/* A known header (RFC 1071 style example): 0xb861. */
	__u8 hdr[20] = { 0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11,
			 0x00, 0x00, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7 };
	__u16 check, got;
	__u32 from, to;
	int iter;

	check = csum_full(hdr, sizeof(hdr));
	CHECK(get16((const __u8 *)&check) == 0xb861, "known header: %#x", get16((__u8 *)&check));
	memcpy(hdr + 10, &check, 2);
	CHECK(csum_full(hdr, sizeof(hdr)) == 0, "known header verifies");
	memcpy(&from, hdr + 16, 4);
	memcpy(hdr + 16, (const __u8[]){ 10, 1, 2, 3 }, 4);
	memcpy(&to, hdr + 16, 4);
	got = lb_csum_replace4(check, from, to);
	memset(hdr + 10, 0, 2);
	CHECK(got == csum_full(hdr, sizeof(hdr)), "known header, new source");
	CHECK(lb_csum_fold(0x1ffffu) == 1 && lb_csum_fold(0xffffffffu) == 0xffff, "fold");

	for (iter = 0; iter < 200000; iter++) {
		__u8 buf[64], old[16];
		size_t len = 20 + 2 * (rnd() % 23);       /* 20..64, even */
		size_t width = (size_t[]){ 2, 4, 16 }[rnd() % 3];
		/* The changed field at an even offset, the checksum in another
		 * word, and one more word kept non-zero so that the data is never
		 * all zeroes (see lb_rewrite.h): len >= 20 > 16 + 2 + 2. */
		size_t foff = 2 * (rnd() % ((len - width) / 2 + 1));
		size_t coff, nz = 0;
		__u16 want;

		do
			coff = 2 * (rnd() % (len / 2));
		while (coff + 2 > foff && coff < foff + width);
		while ((nz >= foff && nz < foff + width) || nz == coff)
			nz += 2;
		for (size_t i = 0; i < len; i++)
			buf[i] = (__u8)rnd();
		if (rnd() % 8 == 0) /* runs of zeroes and ones: the carry corner cases */
			memset(buf + 2 * (rnd() % (len / 2 - 2)), rnd() & 1 ? 0xff : 0, 4);
		buf[nz] |= 1;
		memset(buf + coff, 0, 2);
		check = csum_full(buf, len);
		memcpy(buf + coff, &check, 2);
		memcpy(old, buf + foff, width);
		for (size_t i = 0; i < width; i++)
			buf[foff + i] = rnd() % 4 == 0 ? 0 : (__u8)rnd();
		if (width == 2) {
			__u16 a, b;

			memcpy(&a, old, 2);
			memcpy(&b, buf + foff, 2);
			got = lb_csum_replace2(check, a, b);
		} else if (width == 4) {
			memcpy(&from, old, 4);
			memcpy(&to, buf + foff, 4);
			got = lb_csum_replace4(check, from, to);
		} else {
			__u32 f4[4], t4[4];

			memcpy(f4, old, 16);
			memcpy(t4, buf + foff, 16);
			got = lb_csum_replace16(check, f4, t4);
		}
		memset(buf + coff, 0, 2);
		want = csum_full(buf, len);
		if (got != want) {
			CHECK(0, "csum replace%zu at %zu of %zu (check at %zu): %#x, full %#x", width,
			      foff, len, coff, got, want);
			break;
		}
		memcpy(buf + coff, &got, 2);
		CHECK(csum_full(buf, len) == 0, "updated checksum verifies");
	}
}

int main(int argc, char **argv)
{
	if (argc == 3 && strcmp(argv[1], "--bpf") == 0) {
#ifdef PARSE_SELFTEST_BPF
		if (bpf_open(argv[2])) {
			printf("parse_selftest: cannot load the BPF build\n");
			return 2;
		}
#else
		printf("parse_selftest: built without -DPARSE_SELFTEST_BPF\n");
		return 2;
#endif
	} else if (argc != 1) {
		printf("usage: %s [--bpf parse_selftest.bpf.o]\n", argv[0]);
		return 2;
	}
	test_ethernet_and_vlan();
	test_ipv4_header();
	test_ipv4_fragments();
	test_ipv6();
	test_ipv6_fragments();
	test_rewrite_macs();
	test_checksums();
#ifdef PARSE_SELFTEST_BPF
	if (bpf_obj)
		bpf_object__close(bpf_obj);
#endif
	printf("parse_selftest: %d frames (%d also through BPF), %d failures\n", frames_checked,
	       frames_cross_checked, failures);
	if (failures)
		return 1;
	printf("parse_selftest: ok\n");
	return 0;
}

#endif /* __BPF__ */
