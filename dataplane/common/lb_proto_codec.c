/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_proto_codec.c - the table protocol's wire format (PROTOCOL.md): request
 * decoding with every field checked, reply encoding. See lb_proto_codec.h for
 * where its rules end and the op side's begin.
 *
 * Decoding a request takes two stages, both read-only:
 *   1. a structural scan of the raw bytes (complete, one object, bounded
 *      nesting and object count), so that msgpack-c never allocates for a
 *      container that the message cannot actually hold;
 *   2. field access with errors that name the field, called by the op side
 *      one field at a time.
 * Nothing here changes a table, so a request the codec rejects leaves no
 * trace.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>

#include "lb_proto_codec.h"

#define MAX_DEPTH 8          /* requests nest 3 deep (map > array > map) */
#define MAX_OBJECTS (1u << 18) /* bounds msgpack-c's zone to a few MiB */

static const char *const stat_names[LB_STAT_MAX] = LB_STAT_NAMES;
static const char *const conn_state_names[LB_CONN_STATES] = LB_CONN_STATE_NAMES;
static const __u32 conn_timeouts_default[LB_CONN_STATES] = LB_CONN_TIMEOUTS_DEFAULT;

#define NAT_PORT_MIN_DEFAULT 1024
#define NAT_PORT_MAX_DEFAULT 65535
#define NAT_TIMEOUT_MAX 2147483647u /* seconds; fits a signed 32-bit time delta */

static int out_write(void *data, const char *buf, size_t len)
{
	struct lb_codec_out *o = data;

	if (o->oom)
		return -1;
	if (msgpack_sbuffer_write(o->sb, buf, len) != 0) {
		o->oom = 1;
		return -1;
	}
	return 0;
}

static int vfail(struct lb_codec_req *r, const char *fmt, va_list ap)
{
	vsnprintf(r->err, LB_CODEC_ERR_LEN, fmt, ap);
	return -1;
}

/* The codec's own errors; lb_codec_fail is the same for the op side. */
static int fail(struct lb_codec_req *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(struct lb_codec_req *r, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vfail(r, fmt, ap);
	va_end(ap);
	return -1;
}

int lb_codec_fail(struct lb_codec_req *r, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vfail(r, fmt, ap);
	va_end(ap);
	return -1;
}

/* ---- stage 1: structural scan ------------------------------------------ */

static uint64_t be_read(const __u8 *p, size_t n)
{
	uint64_t v = 0;

	for (size_t i = 0; i < n; i++)
		v = v << 8 | p[i];
	return v;
}

/* Walks the encoding without building anything. Checks that the buffer is
 * exactly one complete msgpack object, nested at most MAX_DEPTH deep, with at
 * most MAX_OBJECTS objects, and that no container claims more elements than
 * there are bytes left (each element takes at least one byte). */
static int scan(struct lb_codec_req *r, const __u8 *p, size_t len)
{
	uint64_t left[MAX_DEPTH + 1];
	uint64_t objects = 0;
	size_t off = 0;
	int depth = 0;

	left[0] = 1;
	while (depth >= 0) {
		if (left[depth] == 0) {
			depth--;
			continue;
		}
		left[depth]--;
		if (off >= len)
			return fail(r, "truncated message: %zu bytes end inside an object", len);
		if (++objects > MAX_OBJECTS)
			return fail(r, "request has more than %u msgpack objects", MAX_OBJECTS);

		__u8 b = p[off++];
		size_t lenlen = 0;     /* bytes of a length field that follows */
		uint64_t payload = 0;  /* bytes of data that follow */
		uint64_t children = 0; /* objects nested in this one */
		int ext = 0;           /* ext types carry one type byte */

		if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
			/* fixint, nil, bool */
		} else if (b <= 0x8f) {
			children = 2ull * (b & 0x0f);
		} else if (b <= 0x9f) {
			children = b & 0x0f;
		} else if (b <= 0xbf) {
			payload = b & 0x1f;
		} else {
			switch (b) {
			case 0xc4: case 0xd9: lenlen = 1; break; /* bin8, str8 */
			case 0xc5: case 0xda: lenlen = 2; break; /* bin16, str16 */
			case 0xc6: case 0xdb: lenlen = 4; break; /* bin32, str32 */
			case 0xc7: lenlen = 1; ext = 1; break;    /* ext8 */
			case 0xc8: lenlen = 2; ext = 1; break;    /* ext16 */
			case 0xc9: lenlen = 4; ext = 1; break;    /* ext32 */
			case 0xca: payload = 4; break;            /* float32 */
			case 0xcb: payload = 8; break;            /* float64 */
			case 0xcc: case 0xd0: payload = 1; break; /* (u)int8 */
			case 0xcd: case 0xd1: payload = 2; break;
			case 0xce: case 0xd2: payload = 4; break;
			case 0xcf: case 0xd3: payload = 8; break;
			case 0xd4: payload = 2; break;            /* fixext1..16 */
			case 0xd5: payload = 3; break;
			case 0xd6: payload = 5; break;
			case 0xd7: payload = 9; break;
			case 0xd8: payload = 17; break;
			case 0xdc: case 0xde: lenlen = 2; break;  /* array16, map16 */
			case 0xdd: case 0xdf: lenlen = 4; break;  /* array32, map32 */
			default:
				return fail(r, "not msgpack: invalid byte 0x%02x at offset %zu",
					    b, off - 1);
			}
		}
		if (lenlen) {
			if (len - off < lenlen)
				return fail(r, "truncated message: %zu bytes end inside a length",
					    len);
			uint64_t n = be_read(p + off, lenlen);

			off += lenlen;
			if (b == 0xdc || b == 0xdd)
				children = n;
			else if (b == 0xde || b == 0xdf)
				children = 2 * n;
			else
				payload = n + (uint64_t)ext;
		}
		if (payload > len - off)
			return fail(r, "truncated message: %zu bytes end inside a string or bin",
				    len);
		off += (size_t)payload;
		if (children) {
			if (children > len - off)
				return fail(r, "truncated message: a container claims %llu elements "
					    "but %zu bytes are left",
					    (unsigned long long)children, len - off);
			if (depth == MAX_DEPTH)
				return fail(r, "request nests deeper than %d levels", MAX_DEPTH);
			left[++depth] = children;
		}
	}
	if (off != len)
		return fail(r, "%zu trailing bytes after the request", len - off);
	return 0;
}

/* ---- stage 2: field access with errors that name the field ------------- */

static const char *type_name(const msgpack_object *o)
{
	switch (o->type) {
	case MSGPACK_OBJECT_NIL: return "nil";
	case MSGPACK_OBJECT_BOOLEAN: return "bool";
	case MSGPACK_OBJECT_POSITIVE_INTEGER: return "unsigned integer";
	case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "negative integer";
	case MSGPACK_OBJECT_FLOAT32:
	case MSGPACK_OBJECT_FLOAT64: return "float";
	case MSGPACK_OBJECT_STR: return "str";
	case MSGPACK_OBJECT_ARRAY: return "array";
	case MSGPACK_OBJECT_MAP: return "map";
	case MSGPACK_OBJECT_BIN: return "bin";
	case MSGPACK_OBJECT_EXT: return "ext";
	}
	return "unknown type";
}

/* Client text echoed into an error: printable ASCII only (the reply's error
 * is a msgpack str, which clients decode as UTF-8), at most 32 characters. */
static void sanitize(char *dst, size_t dstlen, const char *src, size_t n)
{
	size_t i, j = 0;

	for (i = 0; i < n && j + 4 < dstlen && i < 32; i++)
		dst[j++] = (src[i] >= 0x20 && src[i] < 0x7f) ? src[i] : '?';
	if (i < n && j + 4 < dstlen) {
		memcpy(dst + j, "...", 3);
		j += 3;
	}
	dst[j] = '\0';
}

/* Maps we read fields from must have string keys; a client that packs keys
 * as bin (bytes in Python) gets told so rather than "missing field". */
static int check_keys(struct lb_codec_req *r, const msgpack_object *map, const char *where)
{
	for (uint32_t i = 0; i < map->via.map.size; i++)
		if (map->via.map.ptr[i].key.type != MSGPACK_OBJECT_STR)
			return fail(r, "keys of %s must be str, found a %s key", where,
				    type_name(&map->via.map.ptr[i].key));
	return 0;
}

/* Looks key up in map; *val is NULL when absent. A key given twice is an
 * error: which one wins would be the encoder's accident. */
static int lookup(struct lb_codec_req *r, const msgpack_object *map, const char *where,
		  const char *key, const msgpack_object **val)
{
	size_t klen = strlen(key);

	*val = NULL;
	for (uint32_t i = 0; i < map->via.map.size; i++) {
		const msgpack_object *k = &map->via.map.ptr[i].key;

		if (k->via.str.size != klen || memcmp(k->via.str.ptr, key, klen) != 0)
			continue;
		if (*val)
			return fail(r, "field '%s%s' given twice", where, key);
		*val = &map->via.map.ptr[i].val;
	}
	return 0;
}

static int need(struct lb_codec_req *r, const msgpack_object *map, const char *where, const char *key,
		const msgpack_object **val)
{
	if (lookup(r, map, where, key, val))
		return -1;
	if (!*val)
		return fail(r, "missing field '%s%s'", where, key);
	return 0;
}

static int get_uint(struct lb_codec_req *r, const msgpack_object *map, const char *where, const char *key,
		    uint64_t min, uint64_t max, uint64_t *out)
{
	const msgpack_object *o;

	if (need(r, map, where, key, &o))
		return -1;
	if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
		return fail(r, "field '%s%s' out of range: %lld (allowed %llu..%llu)", where,
			    key, (long long)o->via.i64, (unsigned long long)min,
			    (unsigned long long)max);
	if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
		return fail(r, "field '%s%s' must be an unsigned integer, got %s", where, key,
			    type_name(o));
	if (o->via.u64 < min || o->via.u64 > max)
		return fail(r, "field '%s%s' out of range: %llu (allowed %llu..%llu)", where,
			    key, (unsigned long long)o->via.u64, (unsigned long long)min,
			    (unsigned long long)max);
	*out = o->via.u64;
	return 0;
}

/* A bin field; exact != 0 demands that many bytes. */
static int get_bin(struct lb_codec_req *r, const msgpack_object *map, const char *where, const char *key,
		   size_t exact, const __u8 **data, size_t *len)
{
	const msgpack_object *o;

	if (need(r, map, where, key, &o))
		return -1;
	if (o->type != MSGPACK_OBJECT_BIN)
		return fail(r, "field '%s%s' must be bin, got %s", where, key, type_name(o));
	if (exact && o->via.bin.size != exact)
		return fail(r, "field '%s%s' must be bin of %zu bytes, got %u", where, key,
			    exact, o->via.bin.size);
	*data = (const __u8 *)o->via.bin.ptr;
	*len = o->via.bin.size;
	return 0;
}

static __u32 le32(const __u8 *p)
{
	return (__u32)p[0] | (__u32)p[1] << 8 | (__u32)p[2] << 16 | (__u32)p[3] << 24;
}

static void put_le32(__u8 *p, __u32 v)
{
	p[0] = (__u8)v;
	p[1] = (__u8)(v >> 8);
	p[2] = (__u8)(v >> 16);
	p[3] = (__u8)(v >> 24);
}

/* An address field: bin 4 (IPv4) or bin 16 (IPv6), the family given by the
 * length. IPv4 goes to out->v4 with the other 12 bytes 0 (tables compare and
 * hash keys as raw bytes). */
static int get_addr(struct lb_codec_req *r, const msgpack_object *map, const char *where,
		    const char *key, union lb_addr *out, __u8 *family)
{
	const __u8 *data;
	size_t len;

	if (get_bin(r, map, where, key, 0, &data, &len))
		return -1;
	memset(out, 0, sizeof(*out));
	if (len == 4) {
		memcpy(&out->v4, data, 4); /* already network order */
		*family = LB_FAMILY_V4;
	} else if (len == 16) {
		memcpy(out->v6, data, 16);
		*family = LB_FAMILY_V6;
	} else {
		return fail(r, "field '%s%s' must be bin of 4 (IPv4) or 16 (IPv6) bytes, got %zu",
			    where, key, len);
	}
	return 0;
}

/* An optional unsigned integer field in min..max; *out is left alone when it
 * is absent. */
static int get_uint_opt(struct lb_codec_req *r, const msgpack_object *map, const char *where,
			const char *key, uint64_t min, uint64_t max, uint64_t *out)
{
	const msgpack_object *o;

	if (lookup(r, map, where, key, &o))
		return -1;
	return o ? get_uint(r, map, where, key, min, max, out) : 0;
}

/* ---- the NAT configuration's rules (also lb_proto_server_restore's) ------ */

void lb_proto_nat_defaults(struct lb_nat_config *nat)
{
	memset(nat, 0, sizeof(*nat));
	nat->snat_port_min = NAT_PORT_MIN_DEFAULT;
	nat->snat_port_max = NAT_PORT_MAX_DEFAULT;
	nat->on_backend_down = LB_NAT_DOWN_RESCHEDULE;
	memcpy(nat->timeouts_s, conn_timeouts_default, sizeof(nat->timeouts_s));
}

/* A SNAT pool address must be one a backend's reply can be routed back to:
 * not 0.0.0.0/8 (this network), 127.0.0.0/8 (loopback), nor 224.0.0.0/3
 * (multicast, reserved, the limited broadcast). a is in network order. */
static int snat_addr_ok(__u32 a)
{
	const __u8 *b = (const __u8 *)&a;

	return b[0] != 0 && b[0] != 127 && b[0] < 224;
}

/* The IPv6 rule, same reason: not :: (unspecified), ::1 (loopback),
 * ff00::/8 (multicast), fe80::/10 (link-local: a reply to it would need a
 * zone, and the backends may sit on another link) nor ::ffff:0:0/96
 * (IPv4-mapped: an IPv4 address in disguise, never on an IPv6 wire). */
static int snat_addr6_ok(const union lb_addr *a)
{
	static const __u8 zero[10];
	const __u8 *b = a->v6;
	bool head0 = memcmp(b, zero, sizeof(zero)) == 0;

	if (head0 && b[10] == 0 && b[11] == 0 && !a->v6w[3])
		return 0; /* :: */
	if (head0 && b[10] == 0 && b[11] == 0 && a->v6w[3] == htonl(1))
		return 0; /* ::1 */
	if (head0 && b[10] == 0xff && b[11] == 0xff)
		return 0; /* ::ffff:0:0/96 */
	return b[0] != 0xff && !(b[0] == 0xfe && (b[1] & 0xc0) == 0x80);
}

static void fmt_ip4(char *buf, size_t n, __u32 a)
{
	const __u8 *b = (const __u8 *)&a;

	snprintf(buf, n, "%u.%u.%u.%u", b[0], b[1], b[2], b[3]);
}

static void fmt_ip6(char *buf, size_t n, const union lb_addr *a)
{
	if (!inet_ntop(AF_INET6, a->v6, buf, (socklen_t)n))
		snprintf(buf, n, "?");
}

/* Where the i-th pool address of a family came from, for errors: on the
 * wire, snat_addrs[wire[i]] (one array, both families mixed); adopted
 * tables (wire NULL), the struct's own arrays snat_addrs[i], snat_addrs6[i]. */
static void pool_entry_name(char *buf, size_t n, bool v6, __u32 i, const __u8 *wire)
{
	if (wire)
		snprintf(buf, n, "snat_addrs[%u]", wire[i]);
	else
		snprintf(buf, n, "%s[%u]", v6 ? "snat_addrs6" : "snat_addrs", i);
}

/* The per-family count, unicast, distinct, zero past the count. wire as
 * for pool_entry_name. */
static int nat_check_pool(const struct lb_nat_config *nat, bool v6, const __u8 *wire,
			  char *err, size_t errlen)
{
	__u32 naddrs = v6 ? nat->snat_naddrs6 : nat->snat_naddrs;
	const char *fam = v6 ? "IPv6" : "IPv4";
	char ip[INET6_ADDRSTRLEN], name[32], other[32];

	if (naddrs > LB_MAX_SNAT_ADDRS) {
		snprintf(err, errlen, "field 'snat_addrs' has %u %s entries, at most %u of each "
			 "family allowed", naddrs, fam, LB_MAX_SNAT_ADDRS);
		return -EINVAL;
	}
	for (__u32 i = 0; i < LB_MAX_SNAT_ADDRS; i++) {
		const union lb_addr *a6 = &nat->snat_addrs6[i];
		__u32 a4 = nat->snat_addrs[i];
		bool set = v6 ? (a6->v6w[0] || a6->v6w[1] || a6->v6w[2] || a6->v6w[3]) : a4 != 0;

		if (v6)
			fmt_ip6(ip, sizeof(ip), a6);
		else
			fmt_ip4(ip, sizeof(ip), a4);
		if (i >= naddrs) {
			if (set) {
				snprintf(err, errlen, "field '%s': entry %u past the %u "
					 "addresses is %s, not 0",
					 v6 ? "snat_addrs6" : "snat_addrs", i, naddrs, ip);
				return -EINVAL;
			}
			continue;
		}
		pool_entry_name(name, sizeof(name), v6, i, wire);
		if (v6 ? !snat_addr6_ok(a6) : !snat_addr_ok(a4)) {
			snprintf(err, errlen, "field '%s': %s is not a unicast address (%s are "
				 "refused)", name, ip,
				 v6 ? "::, ::1, ff00::/8, fe80::/10 and ::ffff:0:0/96" :
				 "0.0.0.0/8, 127.0.0.0/8 and 224.0.0.0/3");
			return -EINVAL;
		}
		for (__u32 j = 0; j < i; j++) {
			if (v6 ? memcmp(&nat->snat_addrs6[j], a6, sizeof(*a6)) == 0 :
			    nat->snat_addrs[j] == a4) {
				pool_entry_name(other, sizeof(other), v6, j, wire);
				snprintf(err, errlen, "field '%s': %s appears twice (also %s)", name,
					 ip, other);
				return -EINVAL;
			}
		}
	}
	return 0;
}

static int nat_check(const struct lb_nat_config *nat, const __u8 *wire4, const __u8 *wire6,
		     char *err, size_t errlen)
{
	if (nat_check_pool(nat, false, wire4, err, errlen) ||
	    nat_check_pool(nat, true, wire6, err, errlen))
		return -EINVAL;
	if (nat->snat_port_min == 0 || nat->snat_port_max == 0) {
		snprintf(err, errlen, "field '%s' out of range: 0 (allowed 1..65535)",
			 nat->snat_port_min == 0 ? "snat_port_min" : "snat_port_max");
		return -EINVAL;
	}
	if (nat->snat_port_min > nat->snat_port_max) {
		snprintf(err, errlen, "field 'snat_port_min': %u is above snat_port_max %u",
			 nat->snat_port_min, nat->snat_port_max);
		return -EINVAL;
	}
	if (nat->on_backend_down > LB_NAT_DOWN_DROP) {
		snprintf(err, errlen, "field 'on_backend_down' out of range: %u (allowed 0..1)",
			 nat->on_backend_down);
		return -EINVAL;
	}
	if (nat->pad[0] || nat->pad[1] || nat->pad[2]) {
		snprintf(err, errlen, "NAT configuration: pad is not 0");
		return -EINVAL;
	}
	for (__u32 s = 0; s < LB_CONN_STATES; s++) {
		if (nat->timeouts_s[s] == 0 || nat->timeouts_s[s] > NAT_TIMEOUT_MAX) {
			snprintf(err, errlen, "field 'timeouts.%s' out of range: %u (allowed 1..%u)",
				 conn_state_names[s], nat->timeouts_s[s], NAT_TIMEOUT_MAX);
			return -EINVAL;
		}
	}
	return 0;
}

int lb_proto_nat_check(const struct lb_nat_config *nat, char *err, size_t errlen)
{
	return nat_check(nat, NULL, NULL, err, errlen);
}

/* ---- field decoders ------------------------------------------------------ */

int lb_codec_uint(struct lb_codec_req *r, const char *key, uint64_t min, uint64_t max,
		  uint64_t *out)
{
	return get_uint(r, r->root, "", key, min, max, out);
}

int lb_codec_hash_key(struct lb_codec_req *r, __u8 key[LB_HASH_KEY_LEN])
{
	const __u8 *data;
	size_t len;

	if (get_bin(r, r->root, "", "hash_key", LB_HASH_KEY_LEN, &data, &len))
		return -1;
	memcpy(key, data, LB_HASH_KEY_LEN);
	return 0;
}

int lb_codec_vip_key(struct lb_codec_req *r, struct lb_vip_key *key)
{
	union lb_addr addr;
	uint64_t port, proto;
	__u8 family;

	if (get_addr(r, r->root, "", "addr", &addr, &family) ||
	    get_uint(r, r->root, "", "port", 1, 65535, &port) ||
	    get_uint(r, r->root, "", "proto", 0, 255, &proto))
		return -1;
	if (proto != 6 && proto != 17)
		return fail(r, "field 'proto' must be 6 (tcp) or 17 (udp), got %llu",
			    (unsigned long long)proto);
	memset(key, 0, sizeof(*key));
	key->addr = addr;
	key->port = htons((__u16)port);
	key->proto = (__u8)proto;
	key->family = family;
	return 0;
}

int lb_codec_vip_extras(struct lb_codec_req *r, struct lb_vip_entry *e)
{
	const msgpack_object *o;
	uint64_t nat_port = 0;

	if (lookup(r, r->root, "", "nat_port", &o))
		return -1;
	if (o && get_uint(r, r->root, "", "nat_port", 0, 65535, &nat_port))
		return -1;
	e->nat_port = htons((__u16)nat_port);
	e->tunnel_family = 0;
	memset(&e->tunnel_src, 0, sizeof(e->tunnel_src));
	if (lookup(r, r->root, "", "tunnel_src", &o))
		return -1;
	if (o && get_addr(r, r->root, "", "tunnel_src", &e->tunnel_src, &e->tunnel_family))
		return -1;
	return 0;
}

int lb_codec_vip_tunnel(struct lb_codec_req *r, struct lb_vip_entry *e,
			struct lb_codec_tunnel_given *given)
{
	const msgpack_object *enc, *gue, *bits;
	uint64_t v;

	memset(given, 0, sizeof(*given));
	e->tunnel_encap = LB_ENCAP_IPIP;
	e->gue_port = 0;
	e->tunnel_src_bits = 0;
	if (lookup(r, r->root, "", "tunnel_encap", &enc) ||
	    (enc && get_uint(r, r->root, "", "tunnel_encap", LB_ENCAP_IPIP, LB_ENCAP_GUE, &v)))
		return -1;
	if (enc) {
		e->tunnel_encap = (__u8)v;
		given->tunnel_encap = true;
	}
	if (lookup(r, r->root, "", "gue_port", &gue) ||
	    (gue && get_uint(r, r->root, "", "gue_port", 1, 65535, &v)))
		return -1;
	if (gue) {
		e->gue_port = htons((__u16)v);
		given->gue_port = true;
	}
	if (lookup(r, r->root, "", "tunnel_src_bits", &bits) ||
	    (bits && get_uint(r, r->root, "", "tunnel_src_bits", 0, LB_TUNNEL_SRC_BITS_MAX, &v)))
		return -1;
	if (bits) {
		e->tunnel_src_bits = (__u8)v;
		given->tunnel_src_bits = true;
	}
	return 0;
}

int lb_codec_has(struct lb_codec_req *r, const char *key, bool *present)
{
	const msgpack_object *o;

	if (lookup(r, r->root, "", key, &o))
		return -1;
	*present = o != NULL;
	return 0;
}

int lb_codec_bool(struct lb_codec_req *r, const char *key, bool dflt, bool *out)
{
	const msgpack_object *o;

	*out = dflt;
	if (lookup(r, r->root, "", key, &o))
		return -1;
	if (!o)
		return 0;
	if (o->type != MSGPACK_OBJECT_BOOLEAN)
		return fail(r, "field '%s' must be bool, got %s", key, type_name(o));
	*out = o->via.boolean;
	return 0;
}

/* set_nat's 'snat_addrs': bin 4 and bin 16 mixed, each into its family's
 * pool in order; wire4/wire6 record where each came from (errors name the
 * wire's entry). IPv6 only where the data plane has NAT mode for IPv6. The
 * per-family count is checked after every entry's type, so that a request
 * with 20 IPv6 entries is told 20, not 17. */
static int nat_addrs(struct lb_codec_req *r, const msgpack_object *arr, bool nat6,
		     struct lb_nat_config *nat, __u8 *wire4, __u8 *wire6)
{
	__u32 n4 = 0, n6 = 0;

	if (arr->type != MSGPACK_OBJECT_ARRAY)
		return fail(r, "field 'snat_addrs' must be an array, got %s", type_name(arr));
	if (arr->via.array.size > 2 * LB_MAX_SNAT_ADDRS)
		return fail(r, "field 'snat_addrs' has %u entries, at most %u allowed (%u of each "
			    "family)", arr->via.array.size, 2 * LB_MAX_SNAT_ADDRS,
			    LB_MAX_SNAT_ADDRS);
	for (uint32_t i = 0; i < arr->via.array.size; i++) {
		const msgpack_object *e = &arr->via.array.ptr[i];

		if (e->type != MSGPACK_OBJECT_BIN)
			return fail(r, "field 'snat_addrs[%u]' must be bin, got %s", i,
				    type_name(e));
		if (e->via.bin.size != 4 && e->via.bin.size != 16)
			return fail(r, "field 'snat_addrs[%u]' must be bin of 4 (IPv4) or 16 (IPv6) "
				    "bytes, got %u", i, e->via.bin.size);
		if (e->via.bin.size == 16 && !nat6)
			return fail(r, "field 'snat_addrs[%u]' is IPv6: this data plane has no NAT "
				    "mode for IPv6 (no \"nat6\" capability)", i);
		if (e->via.bin.size == 4) {
			if (n4 < LB_MAX_SNAT_ADDRS) { /* network order */
				memcpy(&nat->snat_addrs[n4], e->via.bin.ptr, 4);
				wire4[n4] = (__u8)i;
			}
			n4++;
		} else {
			if (n6 < LB_MAX_SNAT_ADDRS) {
				memcpy(nat->snat_addrs6[n6].v6, e->via.bin.ptr, 16);
				wire6[n6] = (__u8)i;
			}
			n6++;
		}
	}
	if (n4 > LB_MAX_SNAT_ADDRS || n6 > LB_MAX_SNAT_ADDRS)
		return fail(r, "field 'snat_addrs' has %u %s entries, at most %u of each family "
			    "allowed", n4 > LB_MAX_SNAT_ADDRS ? n4 : n6,
			    n4 > LB_MAX_SNAT_ADDRS ? "IPv4" : "IPv6", LB_MAX_SNAT_ADDRS);
	nat->snat_naddrs = n4;
	nat->snat_naddrs6 = n6;
	return 0;
}

/* set_nat's 'timeouts': a map of connection-state names to seconds. */
static int nat_timeouts(struct lb_codec_req *r, const msgpack_object *map,
			struct lb_nat_config *nat)
{
	if (map->type != MSGPACK_OBJECT_MAP)
		return fail(r, "field 'timeouts' must be a map, got %s", type_name(map));
	if (check_keys(r, map, "timeouts"))
		return -1;
	/* Unknown names are errors here (not ignored as unknown request keys
	 * are): a misspelt state would silently keep its default. */
	for (uint32_t i = 0; i < map->via.map.size; i++) {
		const msgpack_object_str *k = &map->via.map.ptr[i].key.via.str;
		__u32 s;

		for (s = 0; s < LB_CONN_STATES; s++)
			if (strlen(conn_state_names[s]) == k->size &&
			    memcmp(conn_state_names[s], k->ptr, k->size) == 0)
				break;
		if (s == LB_CONN_STATES) {
			char name[48];

			sanitize(name, sizeof(name), k->ptr, k->size);
			return fail(r, "field 'timeouts': unknown connection state '%s' (known: "
				    "syn_sent, syn_recv, established, fin_wait, time_wait, close, "
				    "udp_unreplied, udp_replied)", name);
		}
	}
	for (__u32 s = 0; s < LB_CONN_STATES; s++) {
		uint64_t v = nat->timeouts_s[s];

		if (get_uint_opt(r, map, "timeouts.", conn_state_names[s], 1, NAT_TIMEOUT_MAX, &v))
			return -1;
		nat->timeouts_s[s] = (__u32)v;
	}
	return 0;
}

int lb_codec_nat(struct lb_codec_req *r, bool nat6, struct lb_nat_config *nat)
{
	__u8 wire4[LB_MAX_SNAT_ADDRS] = { 0 }, wire6[LB_MAX_SNAT_ADDRS] = { 0 };
	const msgpack_object *o;
	uint64_t pmin = NAT_PORT_MIN_DEFAULT, pmax = NAT_PORT_MAX_DEFAULT;
	uint64_t down = LB_NAT_DOWN_RESCHEDULE;

	lb_proto_nat_defaults(nat);
	if (lookup(r, r->root, "", "snat_addrs", &o))
		return -1;
	if (o && nat_addrs(r, o, nat6, nat, wire4, wire6))
		return -1;
	if (get_uint_opt(r, r->root, "", "snat_port_min", 1, 65535, &pmin) ||
	    get_uint_opt(r, r->root, "", "snat_port_max", 1, 65535, &pmax) ||
	    get_uint_opt(r, r->root, "", "on_backend_down", LB_NAT_DOWN_RESCHEDULE,
			 LB_NAT_DOWN_DROP, &down))
		return -1;
	nat->snat_port_min = (__u16)pmin;
	nat->snat_port_max = (__u16)pmax;
	nat->on_backend_down = (__u8)down;
	if (lookup(r, r->root, "", "timeouts", &o))
		return -1;
	if (o && nat_timeouts(r, o, nat))
		return -1;
	/* What no single field shows: unicast, distinct addresses (IPv4 ones
	 * first, then IPv6); min <= max. */
	return nat_check(nat, wire4, wire6, r->err, LB_CODEC_ERR_LEN) ? -1 : 0;
}

int lb_codec_slots(struct lb_codec_req *r, __u32 ring_size, __u32 *dst)
{
	const __u8 *data;
	size_t len;

	if (get_bin(r, r->root, "", "slots", (size_t)ring_size * 4, &data, &len))
		return -1;
	for (__u32 i = 0; i < ring_size; i++) {
		__u32 b = le32(data + (size_t)i * 4);

		if (!lb_codec_valid_backend_ref(b))
			return fail(r, "field 'slots': slot %u holds %u (must be < %u or "
				    "0xffffffff)", i, b, LB_MAX_BACKENDS);
		dst[i] = b;
	}
	return 0;
}

int lb_codec_backends(struct lb_codec_req *r, __u32 nports, __u32 *ids, struct lb_backend *out,
		      size_t *n)
{
	__u8 seen[LB_MAX_BACKENDS / 8];
	const msgpack_object *arr;
	char where[32], name[32];

	if (need(r, r->root, "", "backends", &arr))
		return -1;
	if (arr->type != MSGPACK_OBJECT_ARRAY)
		return fail(r, "field 'backends' must be an array, got %s", type_name(arr));
	if (arr->via.array.size > LB_MAX_BACKENDS)
		return fail(r, "field 'backends' has %u entries, at most %u allowed",
			    arr->via.array.size, LB_MAX_BACKENDS);
	memset(seen, 0, sizeof(seen));
	for (uint32_t i = 0; i < arr->via.array.size; i++) {
		const msgpack_object *m = &arr->via.array.ptr[i];
		struct lb_backend *b = &out[i];
		uint64_t id, state, port;
		const __u8 *mac;
		union lb_addr addr;
		__u8 family;
		size_t len;

		snprintf(where, sizeof(where), "backends[%u].", i);
		snprintf(name, sizeof(name), "backends[%u]", i);
		if (m->type != MSGPACK_OBJECT_MAP)
			return fail(r, "field 'backends[%u]' must be a map, got %s", i,
				    type_name(m));
		if (check_keys(r, m, name) ||
		    get_uint(r, m, where, "id", 0, LB_MAX_BACKENDS - 1, &id) ||
		    get_addr(r, m, where, "addr", &addr, &family) ||
		    get_bin(r, m, where, "mac", 6, &mac, &len) ||
		    get_uint(r, m, where, "state", LB_BACKEND_UP, LB_BACKEND_UNUSED, &state) ||
		    get_uint(r, m, where, "port", 0, nports - 1, &port))
			return -1;
		/* What the configuration refuses (BackendConfig.mac in
		 * control/hpclb/config/schema.py): a frame sent to a group
		 * address would reach every host that listens to it. All zeros
		 * stays allowed: the control plane writes it for a backend whose
		 * MAC is unknown, with state down. */
		if (mac[0] & 1)
			return fail(r, "field 'backends[%u].mac' must be a unicast address, "
				    "%02x:%02x:%02x:%02x:%02x:%02x has the multicast bit set",
				    i, mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]);
		if (seen[id / 8] & (1u << (id % 8)))
			return fail(r, "field 'backends[%u].id': id %llu appears twice", i,
				    (unsigned long long)id);
		seen[id / 8] |= (__u8)(1u << (id % 8));
		memset(b, 0, sizeof(*b));
		b->addr = addr;
		b->family = family;
		memcpy(b->mac, mac, 6);
		b->state = (__u8)state;
		b->port = (__u8)port;
		ids[i] = (__u32)id;
	}
	*n = arr->via.array.size;
	return 0;
}

int lb_codec_patch(struct lb_codec_req *r, __u32 ring_size, struct lb_ring_patch **pp, size_t *np)
{
	struct lb_ring_patch *p;
	const __u8 *data;
	size_t len, n;

	if (get_bin(r, r->root, "", "patch", 0, &data, &len))
		return -1;
	if (len == 0 || len % 8)
		return fail(r, "field 'patch' must be bin of n*8 bytes with n >= 1, got %zu bytes",
			    len);
	n = len / 8;
	p = malloc(n * sizeof(*p));
	if (!p)
		return fail(r, "out of memory for a patch of %zu slots", n);
	for (size_t i = 0; i < n; i++) {
		p[i].slot = le32(data + i * 8);
		p[i].backend = le32(data + i * 8 + 4);
		if (p[i].slot >= ring_size) {
			fail(r, "field 'patch': entry %zu names slot %u, ring_size is %u", i,
			     p[i].slot, ring_size);
			free(p);
			return -1;
		}
		if (!lb_codec_valid_backend_ref(p[i].backend)) {
			fail(r, "field 'patch': entry %zu sets backend %u (must be < %u or "
			     "0xffffffff)", i, p[i].backend, LB_MAX_BACKENDS);
			free(p);
			return -1;
		}
	}
	*pp = p;
	*np = n;
	return 0;
}

/* ---- reply encoders ------------------------------------------------------ */

static void pack_str(msgpack_packer *pk, const char *s)
{
	size_t n = strlen(s);

	msgpack_pack_str(pk, n);
	msgpack_pack_str_body(pk, s, n);
}

static void pack_bin(msgpack_packer *pk, const void *p, size_t n)
{
	msgpack_pack_bin(pk, n);
	msgpack_pack_bin_body(pk, p, n);
}

/* Starts one reply field: the envelope's map size counts them. */
static void field(struct lb_codec_req *r, const char *key)
{
	pack_str(&r->pk, key);
	r->nfields++;
}

void lb_codec_reply_hello(struct lb_codec_req *r, const struct lb_proto_info *in,
			  __u32 ring_size, __u32 conn_table_size)
{
	msgpack_packer *pk = &r->pk;
	uint32_t ncap = 0;

	while (in->capabilities && in->capabilities[ncap])
		ncap++;
	field(r, "dataplane");
	pack_str(pk, in->dataplane);
	field(r, "version");
	msgpack_pack_uint32(pk, LB_PROTOCOL_VERSION);
	field(r, "ring_size");
	msgpack_pack_uint32(pk, ring_size);
	field(r, "max_vips");
	msgpack_pack_uint32(pk, LB_MAX_VIPS);
	field(r, "max_backends");
	msgpack_pack_uint32(pk, LB_MAX_BACKENDS);
	field(r, "max_ports");
	msgpack_pack_uint32(pk, LB_MAX_PORTS);
	field(r, "attach_mode");
	pack_str(pk, in->attach_mode);
	field(r, "ports");
	msgpack_pack_array(pk, in->nports);
	for (__u32 i = 0; i < in->nports; i++) {
		msgpack_pack_map(pk, 4);
		pack_str(pk, "index");
		msgpack_pack_uint32(pk, i);
		pack_str(pk, "ifname");
		pack_str(pk, in->ports[i].ifname);
		pack_str(pk, "ifindex");
		msgpack_pack_uint32(pk, in->ports[i].ifindex);
		pack_str(pk, "mac");
		pack_bin(pk, in->ports[i].mac, 6);
	}
	field(r, "capabilities");
	msgpack_pack_array(pk, ncap);
	for (uint32_t i = 0; i < ncap; i++)
		pack_str(pk, in->capabilities[i]);
	field(r, "conn_table_size");
	msgpack_pack_uint32(pk, conn_table_size);
}

void lb_codec_reply_ring(struct lb_codec_req *r, const __u32 *ring, __u32 rs)
{
	__u8 chunk[4096];

	field(r, "slots");
	msgpack_pack_bin(&r->pk, (size_t)rs * 4);
	for (__u32 i = 0; i < rs;) {
		__u32 k;

		for (k = 0; k < sizeof(chunk) / 4 && i < rs; k++, i++)
			put_le32(chunk + k * 4, ring[i]);
		msgpack_pack_bin_body(&r->pk, chunk, (size_t)k * 4);
	}
}

/* An address as the wire carries it: 4 bytes for IPv4, 16 for IPv6. */
static void pack_addr(msgpack_packer *pk, const union lb_addr *a, __u8 family)
{
	if (family == LB_FAMILY_V6)
		pack_bin(pk, a->v6, 16);
	else
		pack_bin(pk, &a->v4, 4);
}

static void pack_vip(msgpack_packer *pk, __u32 id, const struct lb_proto_vip *v)
{
	bool src = v->tunnel_family != 0;
	/* The tunnel fields only with a tunnel VIP (set_vip refuses them with
	 * another mode), gue_port only with GUE (refused with IPIP): a dumped
	 * VIP sent back as set_vip is the same VIP. */
	bool tunnel = v->mode == LB_MODE_TUNNEL;
	bool gue = tunnel && v->tunnel_encap == LB_ENCAP_GUE;

	msgpack_pack_map(pk, 7 + (src ? 1 : 0) + (tunnel ? 2 : 0) + (gue ? 1 : 0));
	pack_str(pk, "vip_id");
	msgpack_pack_uint32(pk, id);
	pack_str(pk, "addr");
	pack_addr(pk, &v->key.addr, v->key.family);
	pack_str(pk, "port");
	msgpack_pack_uint16(pk, ntohs(v->key.port));
	pack_str(pk, "proto");
	msgpack_pack_uint8(pk, v->key.proto);
	pack_str(pk, "mode");
	msgpack_pack_uint8(pk, v->mode);
	pack_str(pk, "nat_port");
	msgpack_pack_uint16(pk, ntohs(v->nat_port));
	pack_str(pk, "snat");
	if (v->nat_flags & LB_VIP_F_SNAT)
		msgpack_pack_true(pk);
	else
		msgpack_pack_false(pk);
	if (src) {
		pack_str(pk, "tunnel_src");
		pack_addr(pk, &v->tunnel_src, v->tunnel_family);
	}
	if (tunnel) {
		pack_str(pk, "tunnel_encap");
		msgpack_pack_uint8(pk, v->tunnel_encap);
		pack_str(pk, "tunnel_src_bits");
		msgpack_pack_uint8(pk, v->tunnel_src_bits);
	}
	if (gue) {
		pack_str(pk, "gue_port");
		msgpack_pack_uint16(pk, ntohs(v->gue_port));
	}
}

/* dump's "nat": set_nat's fields, the timeouts of every state. */
static void pack_nat(msgpack_packer *pk, const struct lb_nat_config *nat)
{
	__u32 n = nat->snat_naddrs < LB_MAX_SNAT_ADDRS ? nat->snat_naddrs : LB_MAX_SNAT_ADDRS;
	__u32 n6 = nat->snat_naddrs6 < LB_MAX_SNAT_ADDRS ? nat->snat_naddrs6 : LB_MAX_SNAT_ADDRS;

	msgpack_pack_map(pk, 5);
	pack_str(pk, "snat_addrs");
	/* IPv4 then IPv6, each in its configured order: the order set_nat
	 * stores a mixed array in, so that the dump sent back changes nothing. */
	msgpack_pack_array(pk, n + n6);
	for (__u32 i = 0; i < n; i++)
		pack_bin(pk, &nat->snat_addrs[i], 4);
	for (__u32 i = 0; i < n6; i++)
		pack_bin(pk, nat->snat_addrs6[i].v6, 16);
	pack_str(pk, "snat_port_min");
	msgpack_pack_uint16(pk, nat->snat_port_min);
	pack_str(pk, "snat_port_max");
	msgpack_pack_uint16(pk, nat->snat_port_max);
	pack_str(pk, "on_backend_down");
	msgpack_pack_uint8(pk, nat->on_backend_down);
	pack_str(pk, "timeouts");
	msgpack_pack_map(pk, LB_CONN_STATES);
	for (__u32 s = 0; s < LB_CONN_STATES; s++) {
		pack_str(pk, conn_state_names[s]);
		msgpack_pack_uint32(pk, nat->timeouts_s[s]);
	}
}

/* How many VIPs and backends are configured (the array lengths of replies). */
static void count_configured(const struct lb_proto_state *st, uint32_t *nv, uint32_t *nb)
{
	*nv = 0;
	*nb = 0;
	for (__u32 i = 0; i < LB_MAX_VIPS; i++)
		*nv += st->vips[i].used;
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++)
		*nb += st->backends[i].state != LB_BACKEND_UNUSED;
}

void lb_codec_reply_dump(struct lb_codec_req *r, const struct lb_proto_state *st)
{
	msgpack_packer *pk = &r->pk;
	uint32_t nv, nb;

	count_configured(st, &nv, &nb);
	field(r, "hash_key");
	pack_bin(pk, st->config.hash_key, LB_HASH_KEY_LEN);
	field(r, "ring_size");
	msgpack_pack_uint32(pk, st->config.ring_size);
	field(r, "vips");
	msgpack_pack_array(pk, nv);
	for (__u32 i = 0; i < LB_MAX_VIPS; i++)
		if (st->vips[i].used)
			pack_vip(pk, i, &st->vips[i]);
	field(r, "backends");
	msgpack_pack_array(pk, nb);
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++) {
		const struct lb_backend *b = &st->backends[i];

		if (b->state == LB_BACKEND_UNUSED)
			continue;
		msgpack_pack_map(pk, 5);
		pack_str(pk, "id");
		msgpack_pack_uint32(pk, i);
		pack_str(pk, "addr");
		pack_addr(pk, &b->addr, b->family);
		pack_str(pk, "mac");
		pack_bin(pk, b->mac, 6);
		pack_str(pk, "state");
		msgpack_pack_uint8(pk, b->state);
		pack_str(pk, "port");
		msgpack_pack_uint8(pk, b->port);
	}
	field(r, "nat");
	pack_nat(pk, &st->nat);
}

static void pack_counter_row(msgpack_packer *pk, __u32 id, const struct lb_counter *c)
{
	msgpack_pack_array(pk, 3);
	msgpack_pack_uint32(pk, id);
	msgpack_pack_uint64(pk, c->packets);
	msgpack_pack_uint64(pk, c->bytes);
}

/* "ports": one map of NIC counters per port, by port index. A port whose
 * counters could not be read reports an empty map rather than failing stats. */
static void pack_port_stats(struct lb_codec_req *r, const struct lb_port_stats *ports,
			    const bool *port_ok, __u32 nports)
{
	msgpack_packer *pk = &r->pk;

	field(r, "ports");
	msgpack_pack_array(pk, nports);
	for (__u32 p = 0; p < nports; p++) {
		const struct lb_port_stats *ps = &ports[p];

		if (!port_ok[p]) {
			msgpack_pack_map(pk, 0);
			continue;
		}
		{
			const struct {
				const char *name;
				__u64 v;
			} rows[LB_PORT_STAT_FIELDS] = {
				{ "rx_packets", ps->rx_packets }, { "rx_bytes", ps->rx_bytes },
				{ "tx_packets", ps->tx_packets }, { "tx_bytes", ps->tx_bytes },
				{ "rx_missed", ps->rx_missed },   { "rx_errors", ps->rx_errors },
				{ "tx_errors", ps->tx_errors },   { "rx_nombuf", ps->rx_nombuf },
				{ "rx_crc_errors", ps->rx_crc_errors },
			};

			msgpack_pack_map(pk, LB_PORT_STAT_FIELDS);
			for (int i = 0; i < LB_PORT_STAT_FIELDS; i++) {
				pack_str(pk, rows[i].name);
				msgpack_pack_uint64(pk, rows[i].v);
			}
		}
	}
}

/* "conns": the connection table's figures; an empty map when they could not
 * be read. */
static void pack_conns(struct lb_codec_req *r, const struct lb_conn_stats *cs, bool ok)
{
	msgpack_packer *pk = &r->pk;

	field(r, "conns");
	if (!ok) {
		msgpack_pack_map(pk, 0);
		return;
	}
	msgpack_pack_map(pk, 5);
	pack_str(pk, "capacity");
	msgpack_pack_uint64(pk, cs->capacity);
	pack_str(pk, "entries");
	msgpack_pack_uint64(pk, cs->entries);
	pack_str(pk, "by_state");
	msgpack_pack_map(pk, LB_CONN_STATES);
	for (__u32 s = 0; s < LB_CONN_STATES; s++) {
		pack_str(pk, conn_state_names[s]);
		msgpack_pack_uint64(pk, cs->by_state[s]);
	}
	pack_str(pk, "snat_ports_in_use");
	msgpack_pack_uint64(pk, cs->snat_ports_in_use);
	pack_str(pk, "expired");
	msgpack_pack_uint64(pk, cs->expired);
}

void lb_codec_reply_stats(struct lb_codec_req *r, const struct lb_proto_state *st,
			  const struct lb_counter *global, const struct lb_counter *vips,
			  const struct lb_counter *backends, const struct lb_port_stats *ports,
			  const bool *port_ok, __u32 nports, const struct lb_conn_stats *conns,
			  bool conns_ok)
{
	msgpack_packer *pk = &r->pk;
	uint32_t nv, nb;

	count_configured(st, &nv, &nb);
	field(r, "counters");
	msgpack_pack_map(pk, LB_STAT_MAX);
	for (__u32 i = 0; i < LB_STAT_MAX; i++) {
		pack_str(pk, stat_names[i]);
		msgpack_pack_uint64(pk, global[i].packets);
	}
	field(r, "vips");
	msgpack_pack_array(pk, nv);
	for (__u32 i = 0; i < LB_MAX_VIPS; i++)
		if (st->vips[i].used)
			pack_counter_row(pk, i, &vips[i]);
	field(r, "backends");
	msgpack_pack_array(pk, nb);
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++)
		if (st->backends[i].state != LB_BACKEND_UNUSED)
			pack_counter_row(pk, i, &backends[i]);
	if (ports)
		pack_port_stats(r, ports, port_ok, nports);
	if (conns)
		pack_conns(r, conns, conns_ok);
}

/* ---- the envelope -------------------------------------------------------- */

/* The request map's own fields. seq is recorded as soon as it is known to be
 * valid, so that later errors still echo it. */
static int envelope(struct lb_codec_req *r, const msgpack_object *root)
{
	const msgpack_object *o;
	uint64_t v;

	if (root->type != MSGPACK_OBJECT_MAP)
		return fail(r, "request must be a msgpack map, got %s", type_name(root));
	r->root = root;
	if (check_keys(r, root, "the request"))
		return -1;
	if (lookup(r, root, "", "seq", &o))
		return -1;
	if (o) {
		if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
			return fail(r, "field 'seq' must be an unsigned integer, got %s",
				    type_name(o));
		r->seq = o->via.u64;
		r->has_seq = 1;
	}
	if (need(r, root, "", "v", &o))
		return -1;
	if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
		return fail(r, "field 'v' must be an unsigned integer, got %s", type_name(o));
	v = o->via.u64;
	if (v != LB_PROTOCOL_VERSION)
		return fail(r, "protocol version %llu not supported: this data plane speaks %d",
			    (unsigned long long)v, LB_PROTOCOL_VERSION);
	if (need(r, root, "", "op", &o))
		return -1;
	if (o->type != MSGPACK_OBJECT_STR)
		return fail(r, "field 'op' must be str, got %s", type_name(o));
	r->op = o->via.str.ptr;
	r->oplen = o->via.str.size;
	return 0;
}

bool lb_codec_op_is(const struct lb_codec_req *r, const char *name)
{
	return strlen(name) == r->oplen && memcmp(name, r->op, r->oplen) == 0;
}

int lb_codec_unknown_op(struct lb_codec_req *r)
{
	char name[48];

	sanitize(name, sizeof(name), r->op, r->oplen);
	return fail(r, "unknown op '%s'", name);
}

/* Writes the reply envelope, then the op's fields (ok) or the error. */
static int build_reply(struct lb_codec_req *r, msgpack_sbuffer *reply, int ok)
{
	struct lb_codec_out o = { .sb = reply, .oom = 0 };
	msgpack_packer pk;

	msgpack_packer_init(&pk, &o, out_write);
	msgpack_pack_map(&pk, 2 + (r->has_seq ? 1 : 0) + (ok ? r->nfields : 1));
	pack_str(&pk, "v");
	msgpack_pack_uint32(&pk, LB_PROTOCOL_VERSION);
	pack_str(&pk, "ok");
	if (ok)
		msgpack_pack_true(&pk);
	else
		msgpack_pack_false(&pk);
	if (r->has_seq) {
		pack_str(&pk, "seq");
		msgpack_pack_uint64(&pk, r->seq);
	}
	if (ok) {
		if (r->body.sb->size)
			out_write(&o, r->body.sb->data, r->body.sb->size);
	} else {
		pack_str(&pk, "error");
		pack_str(&pk, r->err);
	}
	return o.oom ? -ENOMEM : 0;
}

/* ---- the request's life -------------------------------------------------- */

void lb_codec_begin(struct lb_codec_req *r, char *err)
{
	memset(r, 0, sizeof(*r));
	r->err = err;
	err[0] = '\0';
	msgpack_sbuffer_init(&r->body_sb);
	r->body.sb = &r->body_sb;
	msgpack_packer_init(&r->pk, &r->body, out_write);
	msgpack_unpacked_init(&r->up);
}

int lb_codec_decode(struct lb_codec_req *r, const void *buf, size_t len)
{
	size_t off = 0;

	if (len > LB_MAX_MSG_BYTES)
		return fail(r, "message of %zu bytes exceeds the limit of %u bytes", len,
			    LB_MAX_MSG_BYTES);
	if (len == 0)
		return fail(r, "empty message");
	if (scan(r, buf, len))
		return -1;
	switch (msgpack_unpack_next(&r->up, buf, len, &off)) {
	case MSGPACK_UNPACK_SUCCESS:
		return envelope(r, &r->up.data);
	case MSGPACK_UNPACK_NOMEM_ERROR:
		return fail(r, "out of memory decoding the request");
	default: /* the scan accepted it: should not happen */
		return fail(r, "malformed msgpack");
	}
}

int lb_codec_end(struct lb_codec_req *r, msgpack_sbuffer *reply, int rc)
{
	size_t start = reply->size;

	if (rc == 0 && r->body.oom)
		rc = fail(r, "out of memory building the reply");
	if (build_reply(r, reply, rc == 0) != 0) {
		/* Drop a half-written reply and try the short error. */
		reply->size = start;
		rc = -1;
		fail(r, "out of memory building the reply");
		if (build_reply(r, reply, 0) != 0) {
			reply->size = start;
			rc = -ENOMEM;
		}
	}
	msgpack_unpacked_destroy(&r->up);
	msgpack_sbuffer_destroy(&r->body_sb);
	return rc == 0 ? 0 : (rc == -ENOMEM ? -ENOMEM : -1);
}

int lb_proto_error_reply(msgpack_sbuffer *reply, const char *msg)
{
	struct lb_codec_req r;
	char err[LB_CODEC_ERR_LEN];

	memset(&r, 0, sizeof(r));
	r.err = err;
	snprintf(err, sizeof(err), "%s", msg);
	return build_reply(&r, reply, 0);
}
