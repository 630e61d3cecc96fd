/* SPDX-License-Identifier: Apache-2.0
 *
 * nat_harness.c - runs dataplane/common/lb_nat.h on frames read from stdin, so
 * that tests/unit/test_nat_rewrite.py can compare its rewrites with scapy's
 * own build of the expected packet.
 *
 * One file, two roles (the test builds both):
 *   native (cc -Wall -Wextra -Werror -fsanitize=address,undefined): the
 *     harness. Every frame lies in a heap buffer of exactly its length, so
 *     ASan sees any access past its end; a refused call must leave the frame
 *     byte for byte as it was. With -DNAT_HARNESS_BPF and `--bpf OBJ` (root),
 *     every request of 14 bytes or more is also run through the BPF build of
 *     the same code (BPF_PROG_TEST_RUN): status, ICMP description and output
 *     frame must be the native build's, or the answer is a BPFDIFF line.
 *   clang -target bpf -D__BPF__: those XDP programs, nat_xdp (IPv4) and
 *     nat6_xdp (IPv6) (the verifier must accept lb_nat.h, lb_nat6.h and
 *     lb_conn.h's IPv6 translations behind lb_parse_frame).
 *
 * Input, one request per line (addresses as 8 hex digits in network order,
 * i.e. as written a.b.c.d -> aabbccdd; ports in decimal; frames in hex):
 *
 *   N <S|D> <addr> <port> <frame>
 *       lb_parse_frame, then lb_nat4_rewrite whatever the verdict (it must
 *       refuse on its own). Output: OK <frame> | ERR <status> <verdict>
 *   I <frame>
 *       lb_parse_frame, then lb_nat4_icmp_parse. Output:
 *       OK <type> <code> <proto> <saddr> <daddr> <sport> <dport> <l3_off>
 *          <icmp_off> <inner_l3_off> <inner_l4_off> <l4_quoted>
 *       | ERR <status> <verdict>
 *   X <S|D> <addr> <port> <outer addr, 00000000: leave alone> <frame>
 *       I's parse, then lb_nat4_icmp_rewrite. Output: OK <frame> | ERR <status>
 *   C
 *       Output: COUNT <requests> <requests also run through BPF>
 *
 * IPv6 (lb_nat6.h, lb_conn.h), addresses as 32 hex digits, the same parse:
 *
 *   n <S|D> <addr> <port> <frame>
 *       lb_nat6_rewrite. Output: OK <frame> | ERR <status> <verdict>
 *   i <frame>
 *       lb_nat6_icmp_parse, then lb_conn6_icmp_key (which must be the quote
 *       reversed, family 6, pad 0, or the answer is BUG). Output as I's.
 *   x <S|D> <addr> <port> <outer addr, -: leave alone> <frame>
 *       i's parse, then lb_nat6_icmp_rewrite. Output: OK <frame> | ERR <status>
 *   t <saddr> <daddr> <sport> <dport> <peer saddr> <peer daddr> <peer sport>
 *     <peer dport> <frame>
 *       lb_conn6_translate with that key and peer (proto: the parse's); the
 *       peer rebuilt by lb_conn6_reply_key must be the same 40 bytes.
 *       Output: OK <frame> | ERR <status> <verdict>
 *   y <saddr> <daddr> <sport> <dport> <frame>
 *       i's parse, then lb_conn6_icmp_translate with that orig key.
 *       Output: OK <frame> | ERR <status>
 *   f <frame>
 *       lb_tcp_flags6. Output: OK <flags, decimal>
 *
 * A line that cannot be read: a message on stderr and exit status 2. An
 * internal check failing (a refused call wrote, BPF differs): a BUG or
 * BPFDIFF answer line; the test fails on it.
 */
#include "lb_conn.h" /* lb_nat.h, lb_nat6.h and the IPv6 connection helpers */

/* What the BPF program is asked and answers: one request. */
struct nat_req {
	__u32 op; /* 'N', 'I', 'X'; IPv6: 'n', 'i', 'x', 't', 'y', 'f' */
	__u32 side;
	__be32 addr;
	__be32 outer;
	__be16 port;
	__u16 has_outer6;        /* x: 1 = rewrite the outer address to outer6 */
	union lb_addr addr6;     /* n, x */
	union lb_addr outer6;    /* x */
	struct lb_flow_key key;  /* t: the packet's key; y: orig */
	struct lb_flow_key peer; /* t */
};

struct nat_res {
	__u32 verdict;
	__u32 status;
	struct lb_nat4_icmp ic;
	struct lb_nat6_icmp ic6;
	__u32 flags; /* f */
};

#ifdef __BPF__

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_req);
	__uint(max_entries, 1);
} req_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct nat_res);
	__uint(max_entries, 1);
} res_map SEC(".maps");

SEC("xdp")
int nat_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct lb_parsed pkt; /* on the stack, as lb.bpf.c has it */
	struct lb_nat4_icmp ic;
	struct lb_nat4_xlat x;
	struct nat_req *req;
	struct nat_res *res;
	__u32 zero = 0;

	req = bpf_map_lookup_elem(&req_map, &zero);
	res = bpf_map_lookup_elem(&res_map, &zero);
	if (!req || !res)
		return XDP_ABORTED;
	x.addr = req->addr;
	x.port = req->port;
	x.side = (__u8)req->side;
	x.pad = 0;
	__builtin_memset(&ic, 0, sizeof(ic));
	res->verdict = lb_parse_frame(&pkt, data, data_end);
	if (req->op == 'N') {
		res->status = lb_nat4_rewrite(data, data_end, &pkt, &x);
	} else {
		res->status = lb_nat4_icmp_parse(data, data_end, &pkt, &ic);
		if (res->status == LB_NAT_OK && req->op == 'X')
			res->status = lb_nat4_icmp_rewrite(data, data_end, &ic, &x, req->outer);
		__builtin_memcpy(&res->ic, &ic, sizeof(ic));
	}
	return XDP_PASS;
}

SEC("xdp")
int nat6_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct lb_parsed pkt;
	struct lb_nat6_icmp ic;
	struct nat_req *req;
	struct nat_res *res;
	__u32 zero = 0;

	req = bpf_map_lookup_elem(&req_map, &zero);
	res = bpf_map_lookup_elem(&res_map, &zero);
	if (!req || !res)
		return XDP_ABORTED;
	__builtin_memset(&ic, 0, sizeof(ic));
	res->flags = 0;
	res->verdict = lb_parse_frame(&pkt, data, data_end);
	switch (req->op) {
	case 'n':
		res->status = lb_nat6_rewrite(data, data_end, &pkt, (enum lb_nat_side)req->side,
					      &req->addr6, req->port);
		break;
	case 't':
		res->status = lb_conn6_translate(data, data_end, &pkt, &req->key, &req->peer);
		break;
	case 'f':
		res->status = LB_NAT_OK;
		res->flags = lb_tcp_flags6(data, data_end, &pkt);
		break;
	default:
		res->status = lb_nat6_icmp_parse(data, data_end, &pkt, &ic);
		if (res->status == LB_NAT_OK && req->op == 'x')
			res->status = lb_nat6_icmp_rewrite(data, data_end, &ic,
							   (enum lb_nat_side)req->side,
							   &req->addr6, req->port,
							   req->has_outer6 ? &req->outer6 : 0);
		else if (res->status == LB_NAT_OK && req->op == 'y')
			res->status = lb_conn6_icmp_translate(data, data_end, &ic, &req->key);
		__builtin_memcpy(&res->ic6, &ic, sizeof(ic));
	}
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "GPL";

#else /* native */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef NAT_HARNESS_BPF
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#endif

static const char *const STATUS_NAMES[] = { "ok", "not_applicable", "malformed" };
static const char *const VERDICT_NAMES[] = {
	"ok", "not_ip", "malformed", "unsupported_l4", "fragment", "ext_too_long",
};

static const char *sname(unsigned v)
{
	return v < sizeof(STATUS_NAMES) / sizeof(STATUS_NAMES[0]) ? STATUS_NAMES[v] : "?";
}

static const char *vname(unsigned v)
{
	return v < sizeof(VERDICT_NAMES) / sizeof(VERDICT_NAMES[0]) ? VERDICT_NAMES[v] : "?";
}

static unsigned long line_no;
static unsigned long requests, bpf_checked;

static void __attribute__((noreturn)) fail(const char *why)
{
	fprintf(stderr, "nat_harness: bad line %lu: %s\n", line_no, why);
	exit(2);
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* A frame in hex: into a heap buffer of exactly its length (one byte for an
 * empty frame, which is then never read). */
static __u8 *parse_frame(const char *hex, size_t *len)
{
	size_t n = strlen(hex);
	__u8 *buf;

	if (n % 2)
		fail("odd hex length");
	buf = malloc(n / 2 ? n / 2 : 1);
	if (!buf)
		fail("out of memory");
	for (size_t i = 0; i < n / 2; i++) {
		int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);

		if (hi < 0 || lo < 0)
			fail("bad hex");
		buf[i] = (__u8)(hi << 4 | lo);
	}
	*len = n / 2;
	return buf;
}

static __be32 parse_addr(const char *s)
{
	size_t len;
	__u8 *b = parse_frame(s, &len);
	__be32 a;

	if (len != 4)
		fail("an address is 8 hex digits");
	memcpy(&a, b, 4);
	free(b);
	return a;
}

static void print_hex(const __u8 *b, size_t len)
{
	for (size_t i = 0; i < len; i++)
		printf("%02x", b[i]);
}

/* ---- the BPF build, for the cross-check ---------------------------------- */

#ifdef NAT_HARNESS_BPF
static struct bpf_object *bpf_obj;
static int bpf_prog_fd = -1, bpf6_prog_fd = -1, req_fd = -1, res_fd = -1;

static void bpf_open(const char *path)
{
	struct bpf_program *prog, *prog6;
	struct bpf_map *req, *res;

	bpf_obj = bpf_object__open_file(path, NULL);
	if (!bpf_obj || libbpf_get_error(bpf_obj)) {
		fprintf(stderr, "nat_harness: cannot open %s\n", path);
		exit(3);
	}
	if (bpf_object__load(bpf_obj)) {
		fprintf(stderr, "nat_harness: cannot load %s (verifier refused it?)\n", path);
		exit(3);
	}
	prog = bpf_object__find_program_by_name(bpf_obj, "nat_xdp");
	prog6 = bpf_object__find_program_by_name(bpf_obj, "nat6_xdp");
	req = bpf_object__find_map_by_name(bpf_obj, "req_map");
	res = bpf_object__find_map_by_name(bpf_obj, "res_map");
	if (!prog || !prog6 || !req || !res) {
		fprintf(stderr, "nat_harness: %s lacks nat_xdp, nat6_xdp or their maps\n", path);
		exit(3);
	}
	bpf_prog_fd = bpf_program__fd(prog);
	bpf6_prog_fd = bpf_program__fd(prog6);
	req_fd = bpf_map__fd(req);
	res_fd = bpf_map__fd(res);
}

/* Run the request through BPF; 0 when it agrees with the native answer. */
static int bpf_cross_check(const struct nat_req *rq, const __u8 *in, size_t len,
			   const struct nat_res *native, const __u8 *native_out, char *why,
			   size_t why_len)
{
	__u8 out[4096];
	struct nat_res r;
	__u32 zero = 0;
	LIBBPF_OPTS(bpf_test_run_opts, opts, .data_in = in, .data_size_in = (__u32)len,
		    .data_out = out, .data_size_out = sizeof(out), .repeat = 1);

	int v6 = rq->op >= 'a' && rq->op <= 'z';

	if (bpf_prog_fd < 0 || len < sizeof(struct lb_eth_hdr) || len > 3000)
		return 0;
	memset(&r, 0xa5, sizeof(r));
	if (bpf_map_update_elem(req_fd, &zero, rq, BPF_ANY) ||
	    bpf_map_update_elem(res_fd, &zero, &r, BPF_ANY) ||
	    bpf_prog_test_run_opts(v6 ? bpf6_prog_fd : bpf_prog_fd, &opts) ||
	    bpf_map_lookup_elem(res_fd, &zero, &r)) {
		snprintf(why, why_len, "BPF_PROG_TEST_RUN failed");
		return -1;
	}
	bpf_checked++;
	if (opts.retval != 2 /* XDP_PASS */) {
		snprintf(why, why_len, "BPF program returned %u", opts.retval);
		return -1;
	}
	if (r.verdict != native->verdict || r.status != native->status) {
		snprintf(why, why_len, "BPF verdict %s status %s, native %s %s", vname(r.verdict),
			 sname(r.status), vname(native->verdict), sname(native->status));
		return -1;
	}
	if ((rq->op == 'I' || rq->op == 'X') && native->status == LB_NAT_OK &&
	    memcmp(&r.ic, &native->ic, sizeof(r.ic))) {
		snprintf(why, why_len, "BPF struct lb_nat4_icmp differs");
		return -1;
	}
	if ((rq->op == 'i' || rq->op == 'x' || rq->op == 'y') && native->status == LB_NAT_OK &&
	    memcmp(&r.ic6, &native->ic6, sizeof(r.ic6))) {
		snprintf(why, why_len, "BPF struct lb_nat6_icmp differs");
		return -1;
	}
	if (rq->op == 'f' && r.flags != native->flags) {
		snprintf(why, why_len, "BPF TCP flags %u, native %u", r.flags, native->flags);
		return -1;
	}
	if (opts.data_size_out != len || memcmp(out, native_out, len)) {
		snprintf(why, why_len, "BPF output frame differs");
		return -1;
	}
	return 0;
}
#endif

/* ---- one request ----------------------------------------------------------- */

/* The IPv6 requests (lb_nat6.h, lb_conn.h). */
static void handle6(const struct nat_req *rq, __u8 *frame, size_t len, struct lb_parsed *p,
		    struct nat_res *res, char *why, size_t why_len, int *bug)
{
	struct lb_nat6_icmp ic;
	struct lb_flow_key key;

	memset(&ic, 0, sizeof(ic));
	switch (rq->op) {
	case 'n':
		res->status = lb_nat6_rewrite(frame, frame + len, p, (enum lb_nat_side)rq->side,
					      &rq->addr6, rq->port);
		return;
	case 't':
		/* The peer as a reply key: every byte written (family 6, pad 0). */
		memset(&key, 0xa5, sizeof(key));
		lb_conn6_reply_key(&key, &rq->peer.saddr, rq->peer.sport, &rq->peer.daddr,
				   rq->peer.dport, rq->peer.proto);
		if (memcmp(&key, &rq->peer, sizeof(key))) {
			snprintf(why, why_len, "lb_conn6_reply_key is not the key given");
			*bug = 1;
		}
		res->status = lb_conn6_translate(frame, frame + len, p, &rq->key, &rq->peer);
		return;
	case 'f':
		res->status = LB_NAT_OK;
		res->flags = lb_tcp_flags6(frame, frame + len, p);
		return;
	}
	res->status = lb_nat6_icmp_parse(frame, frame + len, p, &ic);
	if (res->status == LB_NAT_OK) {
		/* The lookup key: the quote reversed, every byte written. */
		memset(&key, 0xa5, sizeof(key));
		lb_conn6_icmp_key(&key, &ic);
		if (memcmp(&key.saddr, &ic.inner_daddr, 16) ||
		    memcmp(&key.daddr, &ic.inner_saddr, 16) || key.sport != ic.inner_dport ||
		    key.dport != ic.inner_sport || key.proto != ic.inner_proto ||
		    key.family != LB_FAMILY_IPV6 || key.pad[0] || key.pad[1]) {
			snprintf(why, why_len, "lb_conn6_icmp_key is not the quote reversed");
			*bug = 1;
		}
	}
	if (res->status == LB_NAT_OK && rq->op == 'x')
		res->status = lb_nat6_icmp_rewrite(frame, frame + len, &ic,
						   (enum lb_nat_side)rq->side, &rq->addr6,
						   rq->port, rq->has_outer6 ? &rq->outer6 : NULL);
	else if (res->status == LB_NAT_OK && rq->op == 'y')
		res->status = lb_conn6_icmp_translate(frame, frame + len, &ic, &rq->key);
	res->ic6 = ic;
}

static void handle(const struct nat_req *rq, __u8 *frame, size_t len)
{
	__u8 *orig = malloc(len ? len : 1);
	struct lb_parsed p;
	struct lb_nat4_icmp ic;
	struct lb_nat4_xlat x = { .addr = rq->addr, .port = rq->port, .side = (__u8)rq->side };
	struct nat_res res;
	char why[160] = "";
	int bug = 0;

	if (!orig)
		fail("out of memory");
	if (len)
		memcpy(orig, frame, len);
	memset(&res, 0, sizeof(res));
	memset(&ic, 0, sizeof(ic));
	requests++;
	res.verdict = lb_parse_frame(&p, frame, frame + len);
	if (rq->op == 'N') {
		res.status = lb_nat4_rewrite(frame, frame + len, &p, &x);
	} else if (rq->op == 'I' || rq->op == 'X') {
		res.status = lb_nat4_icmp_parse(frame, frame + len, &p, &ic);
		if (res.status == LB_NAT_OK && rq->op == 'X')
			res.status = lb_nat4_icmp_rewrite(frame, frame + len, &ic, &x, rq->outer);
		res.ic = ic;
	} else {
		handle6(rq, frame, len, &p, &res, why, sizeof(why), &bug);
	}
	if (!bug && res.status != LB_NAT_OK && len && memcmp(orig, frame, len)) {
		snprintf(why, sizeof(why), "refused (%s) but the frame was written",
			 sname(res.status));
		bug = 1;
	}
	if (!bug && rq->op == 'f' && len && memcmp(orig, frame, len)) {
		snprintf(why, sizeof(why), "lb_tcp_flags6 wrote the frame");
		bug = 1;
	}
#ifdef NAT_HARNESS_BPF
	if (!bug && bpf_cross_check(rq, orig, len, &res, frame, why, sizeof(why)))
		bug = 2;
#endif
	if (bug) {
		printf("%s %s\n", bug == 1 ? "BUG" : "BPFDIFF", why);
	} else if (res.status != LB_NAT_OK) {
		if (rq->op == 'X' || rq->op == 'x' || rq->op == 'y')
			printf("ERR %s\n", sname(res.status));
		else
			printf("ERR %s %s\n", sname(res.status), vname(res.verdict));
	} else if (rq->op == 'I') {
		printf("OK %u %u %u ", ic.type, ic.code, ic.inner_proto);
		print_hex((const __u8 *)&ic.inner_saddr, 4);
		printf(" ");
		print_hex((const __u8 *)&ic.inner_daddr, 4);
		printf(" %u %u %u %u %u %u %u\n", lb_ntohs(ic.inner_sport), lb_ntohs(ic.inner_dport),
		       ic.l3_off, ic.icmp_off, ic.inner_l3_off, ic.inner_l4_off, ic.l4_quoted);
	} else if (rq->op == 'i') {
		printf("OK %u %u %u ", res.ic6.type, res.ic6.code, res.ic6.inner_proto);
		print_hex(res.ic6.inner_saddr.v6, 16);
		printf(" ");
		print_hex(res.ic6.inner_daddr.v6, 16);
		printf(" %u %u %u %u %u %u %u\n", lb_ntohs(res.ic6.inner_sport),
		       lb_ntohs(res.ic6.inner_dport), res.ic6.l3_off, res.ic6.icmp_off,
		       res.ic6.inner_l3_off, res.ic6.inner_l4_off, res.ic6.l4_quoted);
	} else if (rq->op == 'f') {
		printf("OK %u\n", res.flags);
	} else {
		printf("OK ");
		print_hex(frame, len);
		printf("\n");
	}
	free(orig);
}

/* The next whitespace-separated word of *s, advanced past it (NULL: none). */
static char *word(char **s)
{
	char *w;

	while (**s == ' ')
		(*s)++;
	if (!**s)
		return NULL;
	w = *s;
	while (**s && **s != ' ')
		(*s)++;
	if (**s)
		*(*s)++ = '\0';
	return w;
}

static void parse_addr6(const char *s, union lb_addr *a)
{
	size_t len;
	__u8 *b;

	if (!s)
		fail("missing address");
	b = parse_frame(s, &len);
	if (len != 16)
		fail("an IPv6 address is 32 hex digits");
	memcpy(a->v6, b, 16);
	free(b);
}

static __be16 parse_port(const char *s)
{
	char *e;
	unsigned long v;

	if (!s)
		fail("missing port");
	v = strtoul(s, &e, 10);
	if (*e || v > 0xffff)
		fail("port");
	return lb_htons((__u16)v);
}

static __u32 parse_side(const char *s)
{
	if (!s || (strcmp(s, "S") && strcmp(s, "D") && strcmp(s, "0")))
		fail("side is S or D (0: an invalid side, for the refusal)");
	return s[0] == 'S' ? LB_NAT_SRC : s[0] == 'D' ? LB_NAT_DST : 0;
}

/* A key's addresses and ports (proto, family 6 and pad are set here). */
static void parse_key6(char **rest, struct lb_flow_key *k)
{
	memset(k, 0, sizeof(*k));
	parse_addr6(word(rest), &k->saddr);
	parse_addr6(word(rest), &k->daddr);
	k->sport = parse_port(word(rest));
	k->dport = parse_port(word(rest));
	k->family = LB_FAMILY_IPV6;
}

/* An IPv6 request line after its letter: fills *rq, returns the frame's hex. */
static char *parse_request6(char *rest, struct nat_req *rq)
{
	char *w;

	switch (rq->op) {
	case 'n':
	case 'x':
		rq->side = parse_side(word(&rest));
		parse_addr6(word(&rest), &rq->addr6);
		rq->port = parse_port(word(&rest));
		if (rq->op == 'x') {
			w = word(&rest);
			if (!w)
				fail("x <S|D> <addr> <port> <outer|-> <frame>");
			if (strcmp(w, "-")) {
				parse_addr6(w, &rq->outer6);
				rq->has_outer6 = 1;
			}
		}
		break;
	case 't':
		parse_key6(&rest, &rq->key);
		parse_key6(&rest, &rq->peer);
		break;
	case 'y':
		parse_key6(&rest, &rq->key);
		break;
	default: /* i, f */
		break;
	}
	w = word(&rest);
	return w ? w : rest; /* an empty frame: the empty string */
}

int main(int argc, char **argv)
{
	char *line = NULL;
	size_t cap = 0;
	ssize_t got;

	if (argc == 3 && strcmp(argv[1], "--bpf") == 0) {
#ifdef NAT_HARNESS_BPF
		bpf_open(argv[2]);
#else
		fprintf(stderr, "nat_harness: built without -DNAT_HARNESS_BPF\n");
		return 2;
#endif
	} else if (argc != 1) {
		fprintf(stderr, "usage: nat_harness [--bpf OBJ] < requests\n");
		return 2;
	}
	while ((got = getline(&line, &cap, stdin)) >= 0) {
		char side[4], addr[16], outer[16];
		char *hex;
		struct nat_req rq;
		unsigned long port;
		int used = 0;
		__u8 *frame;
		size_t len;

		line_no++;
		if (got > 0 && line[got - 1] == '\n')
			line[--got] = '\0';
		memset(&rq, 0, sizeof(rq));
		rq.op = (__u8)line[0];
		switch (line[0]) {
		case 'C':
			printf("COUNT %lu %lu\n", requests, bpf_checked);
			fflush(stdout);
			continue;
		case 'n':
		case 'i':
		case 'x':
		case 't':
		case 'y':
		case 'f':
			if (line[1] != ' ' && line[1] != '\0')
				fail("an IPv6 request is a letter, a space and its words");
			hex = parse_request6(line + 1, &rq);
			frame = parse_frame(hex, &len);
			handle(&rq, frame, len);
			free(frame);
			fflush(stdout);
			continue;
		case 'N':
			if (sscanf(line, "N %3s %15s %lu %n", side, addr, &port, &used) != 3 || !used)
				fail("N <S|D> <addr> <port> <frame>");
			break;
		case 'X':
			if (sscanf(line, "X %3s %15s %lu %15s %n", side, addr, &port, outer, &used) !=
				    4 ||
			    !used)
				fail("X <S|D> <addr> <port> <outer> <frame>");
			rq.outer = parse_addr(outer);
			break;
		case 'I':
			if (line[1] != ' ' && line[1] != '\0')
				fail("I <frame>");
			used = line[1] ? 2 : 1;
			strcpy(side, "D");
			strcpy(addr, "00000000");
			port = 0;
			break;
		default:
			fail("unknown request");
		}
		if (port > 0xffff)
			fail("port");
		rq.side = parse_side(side);
		rq.addr = parse_addr(addr);
		rq.port = lb_htons((__u16)port);
		hex = line + used;
		frame = parse_frame(hex, &len);
		handle(&rq, frame, len);
		free(frame);
		fflush(stdout);
	}
	free(line);
#ifdef NAT_HARNESS_BPF
	if (bpf_obj)
		bpf_object__close(bpf_obj);
#endif
	if (ferror(stdin) || fflush(stdout) != 0)
		return 1;
	return 0;
}

#endif /* __BPF__ */
