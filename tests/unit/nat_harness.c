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
 *   clang -target bpf -D__BPF__: that XDP program (the verifier must accept
 *     lb_nat.h behind lb_parse_frame).
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
 * A line that cannot be read: a message on stderr and exit status 2. An
 * internal check failing (a refused call wrote, BPF differs): a BUG or
 * BPFDIFF answer line; the test fails on it.
 */
#include "lb_nat.h"

/* What the BPF program is asked and answers: one request. */
struct nat_req {
	__u32 op; /* 'N', 'I', 'X' */
	__u32 side;
	__be32 addr;
	__be32 outer;
	__be16 port;
	__u16 pad;
};

struct nat_res {
	__u32 verdict;
	__u32 status;
	struct lb_nat4_icmp ic;
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

static void fail(const char *why)
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
static int bpf_prog_fd = -1, req_fd = -1, res_fd = -1;

static void bpf_open(const char *path)
{
	struct bpf_program *prog;
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
	req = bpf_object__find_map_by_name(bpf_obj, "req_map");
	res = bpf_object__find_map_by_name(bpf_obj, "res_map");
	if (!prog || !req || !res) {
		fprintf(stderr, "nat_harness: %s lacks nat_xdp or its maps\n", path);
		exit(3);
	}
	bpf_prog_fd = bpf_program__fd(prog);
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

	if (bpf_prog_fd < 0 || len < sizeof(struct lb_eth_hdr) || len > 3000)
		return 0;
	memset(&r, 0xa5, sizeof(r));
	if (bpf_map_update_elem(req_fd, &zero, rq, BPF_ANY) ||
	    bpf_map_update_elem(res_fd, &zero, &r, BPF_ANY) ||
	    bpf_prog_test_run_opts(bpf_prog_fd, &opts) ||
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
	if (rq->op != 'N' && native->status == LB_NAT_OK &&
	    memcmp(&r.ic, &native->ic, sizeof(r.ic))) {
		snprintf(why, why_len, "BPF struct lb_nat4_icmp differs");
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
	} else {
		res.status = lb_nat4_icmp_parse(frame, frame + len, &p, &ic);
		if (res.status == LB_NAT_OK && rq->op == 'X')
			res.status = lb_nat4_icmp_rewrite(frame, frame + len, &ic, &x, rq->outer);
		res.ic = ic;
	}
	if (res.status != LB_NAT_OK && len && memcmp(orig, frame, len)) {
		snprintf(why, sizeof(why), "refused (%s) but the frame was written",
			 sname(res.status));
		bug = 1;
	}
#ifdef NAT_HARNESS_BPF
	if (!bug && bpf_cross_check(rq, orig, len, &res, frame, why, sizeof(why)))
		bug = 2;
#endif
	if (bug) {
		printf("%s %s\n", bug == 1 ? "BUG" : "BPFDIFF", why);
	} else if (res.status != LB_NAT_OK) {
		if (rq->op == 'X')
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
	} else {
		printf("OK ");
		print_hex(frame, len);
		printf("\n");
	}
	free(orig);
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
		if (strcmp(side, "S") && strcmp(side, "D") && strcmp(side, "0"))
			fail("side is S or D (0: an invalid side, for the refusal)");
		if (port > 0xffff)
			fail("port");
		rq.side = side[0] == 'S' ? LB_NAT_SRC : side[0] == 'D' ? LB_NAT_DST : 0;
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
