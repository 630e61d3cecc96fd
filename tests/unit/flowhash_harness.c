/* SPDX-License-Identifier: Apache-2.0
 *
 * flowhash_harness.c - runs dataplane/common/lb_hash.h on lines read from
 * stdin, so that tests/unit/test_flowhash.py can compare the C hash with
 * control/hpclb/contract/flowhash.py bit for bit. Built by the test itself:
 *
 *   cc -O2 -Wall -Wextra -Werror -I dataplane/common flowhash_harness.c
 *
 * Input, one request per line (numbers in decimal, hex without 0x):
 *
 *   F <key hex32> <saddr> <daddr> <sport> <dport> <proto> <ring_size>
 *       An IPv4 flow. Addresses are the address's numeric value (host order, like
 *       Python's int(IPv4Address)); the harness stores every field in network
 *       order, as the data planes find it in the packet.
 *       Output: <hash hex16> <lb_flow_slot> <lb_probe_slot n=0> ... <n=LB_RING_PROBES-1>
 *
 *   S <key hex32> <saddr hex32> <daddr hex32> <sport> <dport> <proto> <ring_size>
 *       An IPv6 flow: the addresses as their 16 bytes (network order, as in
 *       the packet), family 6. Output as for F.
 *
 *   R <key hex32> <message hex32 or hex80>
 *       16 or 40 raw bytes hashed by the header's whole-word SipHash (the
 *       primitive under lb_flow_hash, for reference vectors).
 *       Output: <hash hex16>
 *
 *   K <key hex32> <flow key hex80>
 *       40 raw bytes used as the struct lb_flow_key (hashed by its family
 *       byte: all 40 bytes when it is 6). Output: <hash hex16>
 *
 *   P <hash hex16> <ring_size> <n>
 *       Output: <lb_probe_slot(hash, ring_size, n)>
 *
 * Any malformed line: a message on stderr and exit status 2.
 */
#include <arpa/inet.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lb_hash.h"

_Static_assert(sizeof(struct lb_flow_key) == 40, "an IPv6 flow hashes all 40 bytes");

static int parse_hex(const char *s, __u8 *out, size_t len)
{
	if (strlen(s) != 2 * len)
		return -1;
	for (size_t i = 0; i < len; i++) {
		unsigned int byte;
		if (sscanf(s + 2 * i, "%2x", &byte) != 1)
			return -1;
		out[i] = (__u8)byte;
	}
	return 0;
}

static void fail(unsigned long line_no, const char *line)
{
	fprintf(stderr, "flowhash_harness: bad line %lu: %s", line_no, line);
	exit(2);
}

/* A flow's answer line: its hash, its slot and the LB_RING_PROBES slots tried. */
static void print_slots(const __u8 *key, const struct lb_flow_key *flow, __u64 hash, __u32 ring)
{
	printf("%016llx %" PRIu32, (unsigned long long)hash, lb_flow_slot(key, flow, ring));
	for (__u32 i = 0; i < LB_RING_PROBES; i++)
		printf(" %" PRIu32, lb_probe_slot(hash, ring, i));
	printf("\n");
}

int main(void)
{
	char line[512];
	unsigned long line_no = 0;

	while (fgets(line, sizeof(line), stdin)) {
		char keyhex[64], msghex[128], shex[64], dhex[64];
		__u8 key[LB_HASH_KEY_LEN];
		unsigned long saddr, daddr, sport, dport, proto, ring, n;
		unsigned long long hash;
		struct lb_flow_key flow;

		line_no++;
		memset(&flow, 0, sizeof(flow));
		switch (line[0]) {
		case 'F':
			if (sscanf(line, "F %63s %lu %lu %lu %lu %lu %lu", keyhex, &saddr, &daddr,
				   &sport, &dport, &proto, &ring) != 7 ||
			    parse_hex(keyhex, key, sizeof(key)) || saddr > 0xffffffffUL ||
			    daddr > 0xffffffffUL || sport > 0xffff || dport > 0xffff ||
			    proto > 0xff || ring < 2 || ring > 0xffffffffUL)
				fail(line_no, line);
			flow.saddr.v4 = htonl((uint32_t)saddr);
			flow.daddr.v4 = htonl((uint32_t)daddr);
			flow.sport = htons((uint16_t)sport);
			flow.dport = htons((uint16_t)dport);
			flow.proto = (__u8)proto;
			flow.family = LB_FAMILY_V4;
			hash = lb_flow_hash(key, &flow);
			if (hash != lb_flow_hash_v4(key, &flow))
				fail(line_no, line);
			print_slots(key, &flow, hash, (__u32)ring);
			break;
		case 'S':
			if (sscanf(line, "S %63s %63s %63s %lu %lu %lu %lu", keyhex, shex, dhex,
				   &sport, &dport, &proto, &ring) != 7 ||
			    parse_hex(keyhex, key, sizeof(key)) ||
			    parse_hex(shex, flow.saddr.v6, 16) || parse_hex(dhex, flow.daddr.v6, 16) ||
			    sport > 0xffff || dport > 0xffff || proto > 0xff || ring < 2 ||
			    ring > 0xffffffffUL)
				fail(line_no, line);
			flow.sport = htons((uint16_t)sport);
			flow.dport = htons((uint16_t)dport);
			flow.proto = (__u8)proto;
			flow.family = LB_FAMILY_V6;
			hash = lb_flow_hash(key, &flow);
			if (hash != lb_flow_hash_v6(key, &flow))
				fail(line_no, line);
			print_slots(key, &flow, hash, (__u32)ring);
			break;
		case 'R': {
			__u64 m[LB_FLOW_HASH_MAX_WORDS];
			__u8 msg[8 * LB_FLOW_HASH_MAX_WORDS];
			size_t n;

			if (sscanf(line, "R %63s %127s", keyhex, msghex) != 2 ||
			    parse_hex(keyhex, key, sizeof(key)))
				fail(line_no, line);
			n = strlen(msghex) / 2;
			if ((n != 16 && n != 40) || parse_hex(msghex, msg, n))
				fail(line_no, line);
			for (size_t i = 0; i < n / 8; i++)
				m[i] = lb_load_le64(msg + i * 8);
			printf("%016llx\n",
			       (unsigned long long)lb_siphash24_words(key, m, (__u32)(n / 8)));
			break;
		}
		case 'K':
			if (sscanf(line, "K %63s %127s", keyhex, msghex) != 2 ||
			    parse_hex(keyhex, key, sizeof(key)) ||
			    parse_hex(msghex, (__u8 *)&flow, sizeof(flow)))
				fail(line_no, line);
			printf("%016llx\n", (unsigned long long)lb_flow_hash(key, &flow));
			break;
		case 'P':
			if (sscanf(line, "P %llx %lu %lu", &hash, &ring, &n) != 3 || ring < 2 ||
			    ring > 0xffffffffUL || n > 0xffffffffUL)
				fail(line_no, line);
			printf("%" PRIu32 "\n", lb_probe_slot(hash, (__u32)ring, (__u32)n));
			break;
		default:
			fail(line_no, line);
		}
	}
	if (ferror(stdin) || fflush(stdout) != 0)
		return 1;
	return 0;
}
