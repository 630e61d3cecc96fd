/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_proto_codec.h - the wire side of the table-protocol server (PROTOCOL.md):
 * msgpack in, msgpack out. Internal to the server: lb_proto_ops.c is its one
 * user, the daemons include lb_proto.h.
 *
 * The codec knows the message format and every rule a field can be checked
 * against on its own or against the server's fixed facts (ring_size, nports):
 * types, lengths, ranges, a unicast MAC, an id not repeated in one request.
 * It never calls the data plane and never changes the shadow tables. Rules
 * that depend on what is configured (is this VIP there? is that id free?)
 * belong to lb_proto_ops.c, which calls the field decoders below one at a
 * time, in the order that decides which error a request with several faults
 * gets: that order is part of the protocol's observable behaviour.
 *
 * Every decoder returns 0, or -1 with the request's error text set (naming the
 * field at fault), which the caller passes on as its own result.
 */
#ifndef HPCLB_LB_PROTO_CODEC_H
#define HPCLB_LB_PROTO_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <msgpack.h>

#include "lb_proto.h"

/* Room for one error text, the caller's buffer (the server keeps it past the
 * call: lb_proto_outcome.error points at it). */
#define LB_CODEC_ERR_LEN 256

/* A growable output that remembers an allocation failure, so that packing
 * code need not check every call: the buffer is checked once at the end. */
struct lb_codec_out {
	msgpack_sbuffer *sb;
	int oom;
};

/* One request in flight, from lb_codec_begin to lb_codec_end: the decoded
 * message, its envelope, the error text and the reply body an op fills. It
 * points into itself (body -> body_sb, root -> up): never copy one. The op
 * side uses it only through the functions below. */
struct lb_codec_req {
	char *err;                  /* LB_CODEC_ERR_LEN bytes, the caller's */
	msgpack_unpacked up;        /* owns the decoded objects */
	const msgpack_object *root; /* the request map, once the envelope is valid */
	int has_seq;                /* set once 'seq' is known valid: errors echo it */
	uint64_t seq;
	const char *op;             /* the 'op' str, not NUL-terminated */
	size_t oplen;
	msgpack_sbuffer body_sb;    /* op-specific reply fields... */
	struct lb_codec_out body;   /* ...written through this... */
	msgpack_packer pk;          /* ...by this packer */
	__u32 nfields;              /* key/value pairs in the body */
};

/* A ring slot's value: a backend id or LB_NO_BACKEND. Shared with the op
 * side, which checks adopted rings (lb_proto_server_restore) by the same rule
 * the wire's 'slots' and 'patch' are checked by. */
static inline int lb_codec_valid_backend_ref(__u32 b)
{
	return b < LB_MAX_BACKENDS || b == LB_NO_BACKEND;
}

/* ---- the request's life ------------------------------------------------- */

/* Empties err and prepares r; every begin is paired with one lb_codec_end. */
void lb_codec_begin(struct lb_codec_req *r, char *err);

/* Checks and decodes len bytes: the size limit, a structural scan of the raw
 * bytes (one complete object, bounded nesting and object count, no container
 * claiming more elements than bytes are left, so msgpack-c never allocates
 * for what the message cannot hold), then the envelope ('v', 'seq', 'op').
 * On success r->op names the op; nothing is known about the op's fields. */
int lb_codec_decode(struct lb_codec_req *r, const void *buf, size_t len);

/* Whether the decoded op is name. */
bool lb_codec_op_is(const struct lb_codec_req *r, const char *name);

/* Fails the request for an op nobody serves (the name echoed, sanitised). */
int lb_codec_unknown_op(struct lb_codec_req *r);

/* Sets the error text; returns -1. For the op side's own errors. */
int lb_codec_fail(struct lb_codec_req *r, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* Appends the reply to reply: the envelope, then the body when rc is 0, else
 * the error. An allocation failure drops what was half written and tries the
 * short error reply. Releases r. Returns 0 (request succeeded), -1 (rejected
 * or failed, error reply written) or -ENOMEM (no reply written). */
int lb_codec_end(struct lb_codec_req *r, msgpack_sbuffer *reply, int rc);

/* ---- field decoders (top-level fields of the request map) ---------------- */

/* An unsigned integer field in min..max. */
int lb_codec_uint(struct lb_codec_req *r, const char *key, uint64_t min, uint64_t max,
		  uint64_t *out);

/* 'hash_key': bin of LB_HASH_KEY_LEN bytes. */
int lb_codec_hash_key(struct lb_codec_req *r, __u8 key[LB_HASH_KEY_LEN]);

/* An address as the tables hold it: family 4 with the 12 bytes after v4
 * zero, or family 6. Shared with the op side, which checks adopted tables
 * (lb_proto_server_restore) by the rule the wire's 'addr' fields follow. */
static inline int lb_codec_valid_addr(const union lb_addr *a, __u8 family)
{
	if (family == LB_FAMILY_V6)
		return 1;
	return family == LB_FAMILY_V4 && !a->v6w[1] && !a->v6w[2] && !a->v6w[3];
}

/* 'addr', 'port', 'proto' of set_vip and del_vip, as a table key (network
 * order). 'addr' is bin 4 (IPv4, family 4, the other 12 bytes 0) or bin 16
 * (IPv6, family 6). proto must be 6 (tcp) or 17 (udp). */
int lb_codec_vip_key(struct lb_codec_req *r, struct lb_vip_key *key);

/* set_vip's optional 'nat_port' (uint 0..65535, default 0; stored in network
 * order) and 'tunnel_src' (bin 4 or 16; absent: tunnel_family 0, address 0)
 * into e. The other fields of e are left alone. */
int lb_codec_vip_extras(struct lb_codec_req *r, struct lb_vip_entry *e);

/* Which of set_vip's tunnel fields the request gave: the mode rules refuse
 * them with a mode other than 2, and gue_port with IPIP. */
struct lb_codec_tunnel_given {
	bool tunnel_encap, gue_port, tunnel_src_bits;
};

/* set_vip's optional tunnel fields into e: 'tunnel_encap' (uint 0..1, enum
 * lb_encap, default LB_ENCAP_IPIP), 'gue_port' (uint 1..65535, network order;
 * absent: 0, the op side puts LB_GUE_PORT_DEFAULT in for GUE), and
 * 'tunnel_src_bits' (uint 0..LB_TUNNEL_SRC_BITS_MAX, default 0). Only their
 * own type and range: the rules across fields are the op side's. */
int lb_codec_vip_tunnel(struct lb_codec_req *r, struct lb_vip_entry *e,
			struct lb_codec_tunnel_given *given);

/* Whether the optional field key is present (given twice is an error). */
int lb_codec_has(struct lb_codec_req *r, const char *key, bool *present);

/* An optional bool field; *out is dflt when it is absent. */
int lb_codec_bool(struct lb_codec_req *r, const char *key, bool dflt, bool *out);

/* set_nat's fields into *nat, the whole configuration: every field optional,
 * an absent one takes its lb_proto_nat_defaults value. 'snat_addrs' array of
 * at most 2 x LB_MAX_SNAT_ADDRS bin 4 (into snat_addrs) and bin 16 (into
 * snat_addrs6, only when nat6: the data plane has NAT mode for IPv6), mixed,
 * each family's order kept, at most LB_MAX_SNAT_ADDRS of each;
 * 'snat_port_min', 'snat_port_max' uint 1..65535; 'on_backend_down' uint
 * 0..1; 'timeouts' map of LB_CONN_STATE_NAMES names to uint 1..INT32_MAX (an
 * unknown name is an error; a missing one keeps its default). Then
 * lb_proto_nat_check's rules (unicast, distinct addresses, IPv4 first, each
 * error naming the wire's entry; min <= max). */
int lb_codec_nat(struct lb_codec_req *r, bool nat6, struct lb_nat_config *nat);

/* 'slots': exactly ring_size little-endian u32 backend references, into dst
 * (ring_size entries). dst may be partly written on error. */
int lb_codec_slots(struct lb_codec_req *r, __u32 ring_size, __u32 *dst);

/* 'backends': an array of at most LB_MAX_BACKENDS maps {id, addr (bin 4 or
 * 16: the family), mac, state, port < nports}, ids distinct, MACs not multicast. Entry i goes to ids[i]
 * and b[i] (both LB_MAX_BACKENDS long); *n is the entry count. */
int lb_codec_backends(struct lb_codec_req *r, __u32 nports, __u32 *ids, struct lb_backend *b,
		      size_t *n);

/* 'patch': n >= 1 (slot, backend) pairs, little-endian u32 each, slot below
 * ring_size. *p is allocated (the caller frees it) only when 0 is returned. */
int lb_codec_patch(struct lb_codec_req *r, __u32 ring_size, struct lb_ring_patch **p, size_t *n);

/* ---- reply encoders: add an op's fields to the body --------------------- */

/* conn_table_size: what hello reports (0 for a data plane without NAT mode,
 * whatever info says). */
void lb_codec_reply_hello(struct lb_codec_req *r, const struct lb_proto_info *info,
			  __u32 ring_size, __u32 conn_table_size);

/* 'slots': the ring as ring_size little-endian u32. */
void lb_codec_reply_ring(struct lb_codec_req *r, const __u32 *ring, __u32 ring_size);

/* The configuration, every configured VIP and backend, the NAT configuration. */
void lb_codec_reply_dump(struct lb_codec_req *r, const struct lb_proto_state *st);

/* Counters of what st configures (global[LB_STAT_MAX], vips[LB_MAX_VIPS],
 * backends[LB_MAX_BACKENDS]). ports NULL: no "ports" field; else nports NIC
 * counter maps, an empty map where port_ok[i] is false (its driver failed).
 * conns NULL: no "conns" field; else the connection table's figures, an
 * empty map when conns_ok is false (reading them failed). */
void lb_codec_reply_stats(struct lb_codec_req *r, const struct lb_proto_state *st,
			  const struct lb_counter *global, const struct lb_counter *vips,
			  const struct lb_counter *backends, const struct lb_port_stats *ports,
			  const bool *port_ok, __u32 nports, const struct lb_conn_stats *conns,
			  bool conns_ok);

#endif /* HPCLB_LB_PROTO_CODEC_H */
