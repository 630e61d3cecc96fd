/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_proto.c - the table-protocol server (version 1). See PROTOCOL.md for the
 * wire format and lb_proto.h for the contract with the data planes.
 *
 * Every request goes through three stages:
 *   1. a structural scan of the raw bytes (complete, one object, bounded
 *      nesting and object count), so that msgpack-c never allocates for a
 *      container that the message cannot actually hold;
 *   2. validation of every field against the shadow tables, with all new
 *      values staged in scratch buffers;
 *   3. the data plane's ops, then the shadow update. If an op fails, the
 *      previous contents are written back with the same ops.
 * Stages 1 and 2 change nothing, so a rejected request leaves no trace.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>

#include "lb_proto.h"

#define MAX_DEPTH 8          /* requests nest 3 deep (map > array > map) */
#define MAX_OBJECTS (1u << 18) /* bounds msgpack-c's zone to a few MiB */
#define ERR_LEN 256

static const char *const stat_names[LB_STAT_MAX] = LB_STAT_NAMES;

struct lb_proto_server {
	const struct lb_dataplane_ops *ops;
	void *ctx;
	struct lb_proto_info info;
	struct lb_proto_state st;
	__u32 *scratch_ring; /* ring_size slots: staged set_ring, swapped in */
	/* Staging for set_backends, indexed by position in the request. */
	__u32 ids[LB_MAX_BACKENDS];
	struct lb_backend new_b[LB_MAX_BACKENDS];
	struct lb_backend old_b[LB_MAX_BACKENDS];
	/* Counters for stats, filled by ops->read_stats. */
	struct lb_counter c_global[LB_STAT_MAX];
	struct lb_counter c_vips[LB_MAX_VIPS];
	struct lb_counter c_backends[LB_MAX_BACKENDS];
	char err[ERR_LEN];
};

/* A growable output that remembers an allocation failure, so that packing
 * code need not check every call: the buffer is checked once at the end. */
struct out {
	msgpack_sbuffer *sb;
	int oom;
};

static int out_write(void *data, const char *buf, size_t len)
{
	struct out *o = data;

	if (o->oom)
		return -1;
	if (msgpack_sbuffer_write(o->sb, buf, len) != 0) {
		o->oom = 1;
		return -1;
	}
	return 0;
}

/* One request in flight. */
struct req {
	struct lb_proto_server *srv;
	const msgpack_object *root;
	char *err;         /* srv->err */
	struct out body;   /* op-specific reply fields */
	msgpack_packer pk; /* packs into body */
	__u32 nfields;     /* key/value pairs in body */
	int changed;
};

static int fail(struct req *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(struct req *r, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(r->err, ERR_LEN, fmt, ap);
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
static int scan(struct req *r, const __u8 *p, size_t len)
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
static int check_keys(struct req *r, const msgpack_object *map, const char *where)
{
	for (uint32_t i = 0; i < map->via.map.size; i++)
		if (map->via.map.ptr[i].key.type != MSGPACK_OBJECT_STR)
			return fail(r, "keys of %s must be str, found a %s key", where,
				    type_name(&map->via.map.ptr[i].key));
	return 0;
}

/* Looks key up in map; *val is NULL when absent. A key given twice is an
 * error: which one wins would be the encoder's accident. */
static int lookup(struct req *r, const msgpack_object *map, const char *where,
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

static int need(struct req *r, const msgpack_object *map, const char *where, const char *key,
		const msgpack_object **val)
{
	if (lookup(r, map, where, key, val))
		return -1;
	if (!*val)
		return fail(r, "missing field '%s%s'", where, key);
	return 0;
}

static int get_uint(struct req *r, const msgpack_object *map, const char *where, const char *key,
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
static int get_bin(struct req *r, const msgpack_object *map, const char *where, const char *key,
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

static int valid_backend_ref(__u32 b)
{
	return b < LB_MAX_BACKENDS || b == LB_NO_BACKEND;
}

/* Writes an all-LB_NO_BACKEND ring for vip_id (through the scratch ring). */
static int write_empty_ring(struct lb_proto_server *srv, __u32 vip_id)
{
	for (__u32 i = 0; i < srv->st.config.ring_size; i++)
		srv->scratch_ring[i] = LB_NO_BACKEND;
	return srv->ops->write_ring(srv->ctx, vip_id, srv->scratch_ring);
}

/* Field 'slots' (ring_size little-endian u32 backend ids) validated into dst. */
static int stage_slots(struct req *r, __u32 *dst)
{
	__u32 rs = r->srv->st.config.ring_size;
	const __u8 *data;
	size_t len;

	if (get_bin(r, r->root, "", "slots", (size_t)rs * 4, &data, &len))
		return -1;
	for (__u32 i = 0; i < rs; i++) {
		__u32 b = le32(data + (size_t)i * 4);

		if (!valid_backend_ref(b))
			return fail(r, "field 'slots': slot %u holds %u (must be < %u or "
				    "0xffffffff)", i, b, LB_MAX_BACKENDS);
		dst[i] = b;
	}
	return 0;
}

/* vip_id of a configured VIP. */
static int get_vip_id(struct req *r, __u32 *vip_id)
{
	uint64_t v;

	if (get_uint(r, r->root, "", "vip_id", 0, LB_MAX_VIPS - 1, &v))
		return -1;
	if (!r->srv->st.vips[v].used)
		return fail(r, "field 'vip_id': VIP %llu is not configured",
			    (unsigned long long)v);
	*vip_id = (__u32)v;
	return 0;
}

/* addr/port/proto of set_vip and del_vip. */
static int get_vip_key(struct req *r, struct lb_vip_key *key)
{
	const __u8 *addr;
	size_t len;
	uint64_t port, proto;

	if (get_bin(r, r->root, "", "addr", 4, &addr, &len) ||
	    get_uint(r, r->root, "", "port", 1, 65535, &port) ||
	    get_uint(r, r->root, "", "proto", 0, 255, &proto))
		return -1;
	if (proto != 6 && proto != 17)
		return fail(r, "field 'proto' must be 6 (tcp) or 17 (udp), got %llu",
			    (unsigned long long)proto);
	memset(key, 0, sizeof(*key));
	memcpy(&key->addr, addr, 4); /* already network order */
	key->port = htons((__u16)port);
	key->proto = (__u8)proto;
	return 0;
}

static int find_vip(const struct lb_proto_server *srv, const struct lb_vip_key *key)
{
	for (int i = 0; i < LB_MAX_VIPS; i++)
		if (srv->st.vips[i].used && memcmp(&srv->st.vips[i].key, key, sizeof(*key)) == 0)
			return i;
	return -1;
}

/* ---- stage 3 helpers ---------------------------------------------------- */

/* Reports a failed op; rb is the result of the attempt to restore. */
static int fail_apply(struct req *r, const char *what, int err, int rb)
{
	if (rb == 0)
		return fail(r, "data plane failed to apply %s: %s (previous contents restored)",
			    what, strerror(-err));
	return fail(r, "data plane failed to apply %s: %s; restoring the previous contents "
		    "failed too (%s): dump may differ from the data plane", what,
		    strerror(-err), strerror(-rb));
}

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

/* Starts one reply field. */
static void field(struct req *r, const char *key)
{
	pack_str(&r->pk, key);
	r->nfields++;
}

/* ---- ops ---------------------------------------------------------------- */

static int op_hello(struct req *r)
{
	const struct lb_proto_info *in = &r->srv->info;
	msgpack_packer *pk = &r->pk;
	uint32_t ncap = 0;

	while (in->capabilities && in->capabilities[ncap])
		ncap++;
	field(r, "dataplane");
	pack_str(pk, in->dataplane);
	field(r, "version");
	msgpack_pack_uint32(pk, LB_PROTOCOL_VERSION);
	field(r, "ring_size");
	msgpack_pack_uint32(pk, r->srv->st.config.ring_size);
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
	return 0;
}

static int op_set_config(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	struct lb_config cfg = srv->st.config;
	const __u8 *key;
	size_t len;
	int err;

	if (get_bin(r, r->root, "", "hash_key", LB_HASH_KEY_LEN, &key, &len))
		return -1;
	memcpy(cfg.hash_key, key, LB_HASH_KEY_LEN);
	err = srv->ops->set_config(srv->ctx, &cfg);
	if (err)
		return fail_apply(r, "set_config", err,
				  srv->ops->set_config(srv->ctx, &srv->st.config));
	srv->st.config = cfg;
	r->changed = 1;
	return 0;
}

static int op_set_vip(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	const msgpack_object *slots;
	struct lb_vip_key key;
	struct lb_vip_entry e;
	__u32 *ring = NULL;
	uint64_t vip_id, mode;
	int cur, err;

	if (get_uint(r, r->root, "", "vip_id", 0, LB_MAX_VIPS - 1, &vip_id) ||
	    get_vip_key(r, &key) ||
	    get_uint(r, r->root, "", "mode", LB_MODE_DSR, LB_MODE_TUNNEL, &mode))
		return -1;
	if (mode != LB_MODE_DSR)
		return fail(r, "mode not supported by this data plane: field 'mode' is %llu, "
			    "only 0 (dsr) is implemented", (unsigned long long)mode);
	cur = find_vip(srv, &key);
	if (cur >= 0 && (uint64_t)cur != vip_id)
		return fail(r, "field 'vip_id': this addr/port/proto is already VIP %d "
			    "(del_vip it first to change its id)", cur);
	if (cur < 0 && srv->st.vips[vip_id].used)
		return fail(r, "field 'vip_id': %llu is already used by another VIP",
			    (unsigned long long)vip_id);
	if (lookup(r, r->root, "", "slots", &slots))
		return -1;
	if (slots && cur >= 0)
		return fail(r, "field 'slots': VIP %d exists, use set_ring or patch_ring", cur);
	if (cur < 0) {
		/* A new VIP: its ring in the data plane is all LB_NO_BACKEND
		 * (initialised so, and reset by del_vip), unless 'slots' gives it
		 * one, written before the VIP goes live so that its first packet
		 * already finds a backend. */
		ring = malloc((size_t)srv->st.config.ring_size * sizeof(*ring));
		if (!ring)
			return fail(r, "out of memory for the ring of VIP %llu",
				    (unsigned long long)vip_id);
		for (__u32 i = 0; i < srv->st.config.ring_size; i++)
			ring[i] = LB_NO_BACKEND;
		if (slots && stage_slots(r, ring)) {
			free(ring);
			return -1;
		}
	}
	if (slots) {
		err = srv->ops->write_ring(srv->ctx, (__u32)vip_id, ring);
		if (err) {
			free(ring);
			return fail_apply(r, "set_vip (ring)", err,
					  write_empty_ring(srv, (__u32)vip_id));
		}
	}
	memset(&e, 0, sizeof(e));
	e.vip_id = (__u32)vip_id;
	e.mode = (__u8)mode;
	err = srv->ops->set_vip(srv->ctx, &key, &e);
	if (err) {
		free(ring);
		if (slots) /* the ring of a free vip_id is always empty */
			return fail_apply(r, "set_vip", err,
					  write_empty_ring(srv, (__u32)vip_id));
		/* One element update: either applied or not, nothing to undo. */
		return fail(r, "data plane failed to apply set_vip: %s", strerror(-err));
	}
	if (ring) {
		srv->st.rings[vip_id] = ring;
		srv->st.vips[vip_id].used = true;
		srv->st.vips[vip_id].key = key;
	}
	srv->st.vips[vip_id].mode = (__u8)mode;
	r->changed = 1;
	return 0;
}

static int op_del_vip(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	struct lb_vip_key key;
	int id, err;

	if (get_vip_key(r, &key))
		return -1;
	id = find_vip(srv, &key);
	if (id < 0)
		return fail(r, "no VIP with this addr/port/proto");
	/* Empty the ring first, then remove the VIP: a failure of either can be
	 * undone, and the ring of a free vip_id is always empty. */
	err = write_empty_ring(srv, (__u32)id);
	if (err)
		return fail_apply(r, "del_vip (ring reset)", err,
				  srv->ops->write_ring(srv->ctx, (__u32)id, srv->st.rings[id]));
	err = srv->ops->del_vip(srv->ctx, &key);
	if (err)
		return fail_apply(r, "del_vip", err,
				  srv->ops->write_ring(srv->ctx, (__u32)id, srv->st.rings[id]));
	free(srv->st.rings[id]);
	srv->st.rings[id] = NULL;
	memset(&srv->st.vips[id], 0, sizeof(srv->st.vips[id]));
	r->changed = 1;
	return 0;
}

/* Stages n backends (ids/new_b/old_b are filled) and applies them. */
static int apply_backends(struct req *r, size_t n, const char *what)
{
	struct lb_proto_server *srv = r->srv;
	int err;

	if (n == 0)
		return 0;
	err = srv->ops->set_backends(srv->ctx, srv->ids, srv->new_b, n);
	if (err)
		return fail_apply(r, what, err,
				  srv->ops->set_backends(srv->ctx, srv->ids, srv->old_b, n));
	for (size_t i = 0; i < n; i++)
		srv->st.backends[srv->ids[i]] = srv->new_b[i];
	r->changed = 1;
	return 0;
}

static int op_set_backends(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
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
		struct lb_backend *b = &srv->new_b[i];
		uint64_t id, state, port;
		const __u8 *addr, *mac;
		size_t len;

		snprintf(where, sizeof(where), "backends[%u].", i);
		snprintf(name, sizeof(name), "backends[%u]", i);
		if (m->type != MSGPACK_OBJECT_MAP)
			return fail(r, "field 'backends[%u]' must be a map, got %s", i,
				    type_name(m));
		if (check_keys(r, m, name) ||
		    get_uint(r, m, where, "id", 0, LB_MAX_BACKENDS - 1, &id) ||
		    get_bin(r, m, where, "addr", 4, &addr, &len) ||
		    get_bin(r, m, where, "mac", 6, &mac, &len) ||
		    get_uint(r, m, where, "state", LB_BACKEND_UP, LB_BACKEND_UNUSED, &state) ||
		    get_uint(r, m, where, "port", 0, srv->info.nports - 1, &port))
			return -1;
		/* What the configuration refuses (hpclb/config.py): a frame sent to a
		 * group address would reach every host that listens to it. All zeros
		 * stays allowed: the control plane writes it for a backend whose MAC is
		 * unknown, with state down. */
		if (mac[0] & 1)
			return fail(r, "field 'backends[%u].mac' must be a unicast address, "
				    "%02x:%02x:%02x:%02x:%02x:%02x has the multicast bit set",
				    i, mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]);
		if (seen[id / 8] & (1u << (id % 8)))
			return fail(r, "field 'backends[%u].id': id %llu appears twice", i,
				    (unsigned long long)id);
		seen[id / 8] |= (__u8)(1u << (id % 8));
		memset(b, 0, sizeof(*b));
		memcpy(&b->addr, addr, 4);
		memcpy(b->mac, mac, 6);
		b->state = (__u8)state;
		b->port = (__u8)port;
		srv->ids[i] = (__u32)id;
		srv->old_b[i] = srv->st.backends[id];
	}
	return apply_backends(r, arr->via.array.size, "set_backends");
}

static int op_set_backend_state(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	uint64_t id, state;

	if (get_uint(r, r->root, "", "id", 0, LB_MAX_BACKENDS - 1, &id) ||
	    get_uint(r, r->root, "", "state", LB_BACKEND_UP, LB_BACKEND_UNUSED, &state))
		return -1;
	if (srv->st.backends[id].state == LB_BACKEND_UNUSED)
		return fail(r, "field 'id': backend %llu is not configured (set_backends first)",
			    (unsigned long long)id);
	srv->ids[0] = (__u32)id;
	srv->old_b[0] = srv->st.backends[id];
	srv->new_b[0] = srv->st.backends[id];
	srv->new_b[0].state = (__u8)state;
	return apply_backends(r, 1, "set_backend_state");
}

static int op_set_ring(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	__u32 vip_id, *tmp;
	int err;

	if (get_vip_id(r, &vip_id) || stage_slots(r, srv->scratch_ring))
		return -1;
	err = srv->ops->write_ring(srv->ctx, vip_id, srv->scratch_ring);
	if (err)
		return fail_apply(r, "set_ring", err,
				  srv->ops->write_ring(srv->ctx, vip_id, srv->st.rings[vip_id]));
	/* The staged ring becomes the shadow; the old one is the next scratch. */
	tmp = srv->st.rings[vip_id];
	srv->st.rings[vip_id] = srv->scratch_ring;
	srv->scratch_ring = tmp;
	r->changed = 1;
	return 0;
}

static int op_patch_ring(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	struct lb_ring_patch *p;
	const __u8 *data;
	__u32 vip_id;
	size_t len, n;
	int err;

	if (get_vip_id(r, &vip_id) || get_bin(r, r->root, "", "patch", 0, &data, &len))
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
		if (p[i].slot >= srv->st.config.ring_size) {
			fail(r, "field 'patch': entry %zu names slot %u, ring_size is %u", i,
			     p[i].slot, srv->st.config.ring_size);
			goto out;
		}
		if (!valid_backend_ref(p[i].backend)) {
			fail(r, "field 'patch': entry %zu sets backend %u (must be < %u or "
			     "0xffffffff)", i, p[i].backend, LB_MAX_BACKENDS);
			goto out;
		}
	}
	err = srv->ops->patch_ring(srv->ctx, vip_id, p, n);
	if (err) {
		fail_apply(r, "patch_ring", err,
			   srv->ops->write_ring(srv->ctx, vip_id, srv->st.rings[vip_id]));
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		srv->st.rings[vip_id][p[i].slot] = p[i].backend;
	r->changed = 1;
	free(p);
	return 0;
out:
	free(p);
	return -1;
}

static int op_get_ring(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	__u32 rs = srv->st.config.ring_size, vip_id;
	__u8 chunk[4096];

	if (get_vip_id(r, &vip_id))
		return -1;
	field(r, "slots");
	msgpack_pack_bin(&r->pk, (size_t)rs * 4);
	for (__u32 i = 0; i < rs;) {
		__u32 k;

		for (k = 0; k < sizeof(chunk) / 4 && i < rs; k++, i++)
			put_le32(chunk + k * 4, srv->st.rings[vip_id][i]);
		msgpack_pack_bin_body(&r->pk, chunk, (size_t)k * 4);
	}
	return 0;
}

static void pack_vip(msgpack_packer *pk, __u32 id, const struct lb_proto_vip *v)
{
	msgpack_pack_map(pk, 5);
	pack_str(pk, "vip_id");
	msgpack_pack_uint32(pk, id);
	pack_str(pk, "addr");
	pack_bin(pk, &v->key.addr, 4);
	pack_str(pk, "port");
	msgpack_pack_uint16(pk, ntohs(v->key.port));
	pack_str(pk, "proto");
	msgpack_pack_uint8(pk, v->key.proto);
	pack_str(pk, "mode");
	msgpack_pack_uint8(pk, v->mode);
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

static int op_dump(struct req *r)
{
	const struct lb_proto_state *st = &r->srv->st;
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
		pack_bin(pk, &b->addr, 4);
		pack_str(pk, "mac");
		pack_bin(pk, b->mac, 6);
		pack_str(pk, "state");
		msgpack_pack_uint8(pk, b->state);
		pack_str(pk, "port");
		msgpack_pack_uint8(pk, b->port);
	}
	return 0;
}

static void pack_counter_row(msgpack_packer *pk, __u32 id, const struct lb_counter *c)
{
	msgpack_pack_array(pk, 3);
	msgpack_pack_uint32(pk, id);
	msgpack_pack_uint64(pk, c->packets);
	msgpack_pack_uint64(pk, c->bytes);
}

/* "ports": one map of NIC counters per port, by port index. A port whose
 * counters cannot be read reports an empty map rather than failing stats. */
static int pack_port_stats(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	msgpack_packer *pk = &r->pk;

	field(r, "ports");
	msgpack_pack_array(pk, srv->info.nports);
	for (__u32 p = 0; p < srv->info.nports; p++) {
		struct lb_port_stats ps;

		memset(&ps, 0, sizeof(ps));
		if (srv->ops->read_port_stats(srv->ctx, p, &ps)) {
			msgpack_pack_map(pk, 0);
			continue;
		}
		{
			const struct {
				const char *name;
				__u64 v;
			} rows[LB_PORT_STAT_FIELDS] = {
				{ "rx_packets", ps.rx_packets }, { "rx_bytes", ps.rx_bytes },
				{ "tx_packets", ps.tx_packets }, { "tx_bytes", ps.tx_bytes },
				{ "rx_missed", ps.rx_missed },   { "rx_errors", ps.rx_errors },
				{ "tx_errors", ps.tx_errors },   { "rx_nombuf", ps.rx_nombuf },
				{ "rx_crc_errors", ps.rx_crc_errors },
			};

			msgpack_pack_map(pk, LB_PORT_STAT_FIELDS);
			for (int i = 0; i < LB_PORT_STAT_FIELDS; i++) {
				pack_str(pk, rows[i].name);
				msgpack_pack_uint64(pk, rows[i].v);
			}
		}
	}
	return 0;
}

static int op_stats(struct req *r)
{
	struct lb_proto_server *srv = r->srv;
	const struct lb_proto_state *st = &srv->st;
	msgpack_packer *pk = &r->pk;
	uint32_t nv, nb;
	int err;

	memset(srv->c_global, 0, sizeof(srv->c_global));
	memset(srv->c_vips, 0, sizeof(srv->c_vips));
	memset(srv->c_backends, 0, sizeof(srv->c_backends));
	err = srv->ops->read_stats(srv->ctx, srv->c_global, srv->c_vips, srv->c_backends);
	if (err)
		return fail(r, "data plane failed to read stats: %s", strerror(-err));
	count_configured(st, &nv, &nb);
	field(r, "counters");
	msgpack_pack_map(pk, LB_STAT_MAX);
	for (__u32 i = 0; i < LB_STAT_MAX; i++) {
		pack_str(pk, stat_names[i]);
		msgpack_pack_uint64(pk, srv->c_global[i].packets);
	}
	field(r, "vips");
	msgpack_pack_array(pk, nv);
	for (__u32 i = 0; i < LB_MAX_VIPS; i++)
		if (st->vips[i].used)
			pack_counter_row(pk, i, &srv->c_vips[i]);
	field(r, "backends");
	msgpack_pack_array(pk, nb);
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++)
		if (st->backends[i].state != LB_BACKEND_UNUSED)
			pack_counter_row(pk, i, &srv->c_backends[i]);
	if (srv->ops->read_port_stats)
		return pack_port_stats(r);
	return 0;
}

static const struct {
	const char *name;
	int (*fn)(struct req *r);
} op_table[] = {
	{ "hello", op_hello },
	{ "set_config", op_set_config },
	{ "set_vip", op_set_vip },
	{ "del_vip", op_del_vip },
	{ "set_backends", op_set_backends },
	{ "set_backend_state", op_set_backend_state },
	{ "set_ring", op_set_ring },
	{ "patch_ring", op_patch_ring },
	{ "get_ring", op_get_ring },
	{ "dump", op_dump },
	{ "stats", op_stats },
};

/* ---- the request ------------------------------------------------------- */

/* Envelope checks and dispatch. *seq is set once the seq field is known to
 * be valid, so that later errors still echo it. */
static int dispatch(struct req *r, const msgpack_object *root, int *has_seq, uint64_t *seq,
		    const char **opname)
{
	const msgpack_object *o;
	uint64_t v;
	char name[48];

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
		*seq = o->via.u64;
		*has_seq = 1;
	}
	if (need(r, root, "", "v", &o))
		return -1;
	if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
		return fail(r, "field 'v' must be an unsigned integer, got %s", type_name(o));
	v = o->via.u64;
	if (v != LB_PROTOCOL_VERSION)
		return fail(r, "field 'v': protocol version %llu not supported (this data plane "
			    "speaks %d)", (unsigned long long)v, LB_PROTOCOL_VERSION);
	if (need(r, root, "", "op", &o))
		return -1;
	if (o->type != MSGPACK_OBJECT_STR)
		return fail(r, "field 'op' must be str, got %s", type_name(o));
	for (size_t i = 0; i < sizeof(op_table) / sizeof(op_table[0]); i++) {
		if (strlen(op_table[i].name) == o->via.str.size &&
		    memcmp(op_table[i].name, o->via.str.ptr, o->via.str.size) == 0) {
			*opname = op_table[i].name;
			return op_table[i].fn(r);
		}
	}
	sanitize(name, sizeof(name), o->via.str.ptr, o->via.str.size);
	return fail(r, "unknown op '%s'", name);
}

/* Writes the reply envelope, then the op's fields (ok) or the error. */
static int build_reply(struct req *r, msgpack_sbuffer *reply, int ok, int has_seq,
		       uint64_t seq)
{
	struct out o = { .sb = reply, .oom = 0 };
	msgpack_packer pk;

	msgpack_packer_init(&pk, &o, out_write);
	msgpack_pack_map(&pk, 2 + (has_seq ? 1 : 0) + (ok ? r->nfields : 1));
	pack_str(&pk, "v");
	msgpack_pack_uint32(&pk, LB_PROTOCOL_VERSION);
	pack_str(&pk, "ok");
	if (ok)
		msgpack_pack_true(&pk);
	else
		msgpack_pack_false(&pk);
	if (has_seq) {
		pack_str(&pk, "seq");
		msgpack_pack_uint64(&pk, seq);
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

int lb_proto_handle(struct lb_proto_server *srv, const void *buf, size_t len,
		    msgpack_sbuffer *reply, struct lb_proto_outcome *outcome)
{
	msgpack_sbuffer body;
	msgpack_unpacked up;
	struct req r;
	const char *opname = "?";
	uint64_t seq = 0;
	int has_seq = 0, rc = -1;
	size_t off = 0;
	size_t start = reply->size;

	memset(&r, 0, sizeof(r));
	r.srv = srv;
	r.err = srv->err;
	srv->err[0] = '\0';
	msgpack_sbuffer_init(&body);
	r.body.sb = &body;
	msgpack_packer_init(&r.pk, &r.body, out_write);
	msgpack_unpacked_init(&up);

	if (len > LB_MAX_MSG_BYTES) {
		fail(&r, "message of %zu bytes exceeds the limit of %u bytes", len,
		     LB_MAX_MSG_BYTES);
	} else if (len == 0) {
		fail(&r, "empty message");
	} else if (scan(&r, buf, len) == 0) {
		switch (msgpack_unpack_next(&up, buf, len, &off)) {
		case MSGPACK_UNPACK_SUCCESS:
			rc = dispatch(&r, &up.data, &has_seq, &seq, &opname);
			if (rc == 0 && r.body.oom)
				rc = fail(&r, "out of memory building the reply");
			break;
		case MSGPACK_UNPACK_NOMEM_ERROR:
			fail(&r, "out of memory decoding the request");
			break;
		default: /* the scan accepted it: should not happen */
			fail(&r, "malformed msgpack");
			break;
		}
	}
	if (build_reply(&r, reply, rc == 0, has_seq, seq) != 0) {
		/* Drop a half-written reply and try the short error. */
		reply->size = start;
		rc = -1;
		fail(&r, "out of memory building the reply");
		if (build_reply(&r, reply, 0, has_seq, seq) != 0) {
			reply->size = start;
			rc = -ENOMEM;
		}
	}
	if (outcome) {
		outcome->op = opname;
		outcome->ok = rc == 0;
		outcome->changed = r.changed;
		outcome->error = srv->err;
	}
	msgpack_unpacked_destroy(&up);
	msgpack_sbuffer_destroy(&body);
	return rc == 0 ? 0 : (rc == -ENOMEM ? -ENOMEM : -1);
}

int lb_proto_error_reply(msgpack_sbuffer *reply, const char *msg)
{
	struct req r;
	char err[ERR_LEN];

	memset(&r, 0, sizeof(r));
	r.err = err;
	snprintf(err, sizeof(err), "%s", msg);
	return build_reply(&r, reply, 0, 0, 0);
}

/* ---- life cycle -------------------------------------------------------- */

struct lb_proto_server *lb_proto_server_new(const struct lb_dataplane_ops *ops, void *ctx,
					    const struct lb_proto_info *info,
					    const struct lb_config *cfg)
{
	struct lb_proto_server *srv;

	if (!ops || !info || !cfg || info->nports < 1 || info->nports > LB_MAX_PORTS ||
	    cfg->ring_size < 2 || cfg->ring_size > LB_RING_SIZE_MAX || !info->dataplane ||
	    !info->attach_mode)
		return NULL;
	srv = calloc(1, sizeof(*srv));
	if (!srv)
		return NULL;
	srv->scratch_ring = malloc((size_t)cfg->ring_size * sizeof(__u32));
	if (!srv->scratch_ring) {
		free(srv);
		return NULL;
	}
	srv->ops = ops;
	srv->ctx = ctx;
	srv->info = *info;
	srv->st.config = *cfg;
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++)
		srv->st.backends[i].state = LB_BACKEND_UNUSED;
	return srv;
}

void lb_proto_server_free(struct lb_proto_server *srv)
{
	if (!srv)
		return;
	for (int i = 0; i < LB_MAX_VIPS; i++)
		free(srv->st.rings[i]);
	free(srv->scratch_ring);
	free(srv);
}

int lb_proto_server_set_info(struct lb_proto_server *srv, const struct lb_proto_info *info)
{
	if (info->nports < 1 || info->nports > LB_MAX_PORTS || !info->dataplane ||
	    !info->attach_mode)
		return -EINVAL;
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++)
		if (srv->st.backends[i].state != LB_BACKEND_UNUSED &&
		    srv->st.backends[i].port >= info->nports)
			return -EINVAL;
	srv->info = *info;
	return 0;
}

const struct lb_proto_state *lb_proto_server_state(const struct lb_proto_server *srv)
{
	return &srv->st;
}

int lb_proto_server_restore(struct lb_proto_server *srv, const struct lb_proto_state *st,
			    char *err, size_t errlen)
{
	__u32 rs = srv->st.config.ring_size;
	__u32 *rings[LB_MAX_VIPS] = { 0 };

	if (st->config.ring_size != rs) {
		snprintf(err, errlen, "ring_size %u, expected %u", st->config.ring_size, rs);
		return -EINVAL;
	}
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++) {
		const struct lb_backend *b = &st->backends[i];

		if (b->state > LB_BACKEND_UNUSED ||
		    (b->state != LB_BACKEND_UNUSED && b->port >= srv->info.nports)) {
			snprintf(err, errlen, "backend %u: state %u, port %u", i, b->state,
				 b->port);
			return -EINVAL;
		}
	}
	for (__u32 i = 0; i < LB_MAX_VIPS; i++) {
		const struct lb_proto_vip *v = &st->vips[i];

		if (!v->used)
			continue;
		for (__u32 j = 0; j < i; j++) {
			if (st->vips[j].used &&
			    memcmp(&st->vips[j].key, &v->key, sizeof(v->key)) == 0) {
				snprintf(err, errlen, "VIPs %u and %u have the same key", j, i);
				return -EINVAL;
			}
		}
		if ((v->key.proto != 6 && v->key.proto != 17) || v->key.port == 0 ||
		    v->key.pad || v->mode != LB_MODE_DSR || !st->rings[i]) {
			snprintf(err, errlen, "VIP %u: bad key or mode", i);
			return -EINVAL;
		}
		for (__u32 s = 0; s < rs; s++) {
			if (!valid_backend_ref(st->rings[i][s])) {
				snprintf(err, errlen, "VIP %u: slot %u holds %u", i, s,
					 st->rings[i][s]);
				return -EINVAL;
			}
		}
	}
	/* Valid: copy the rings, then commit everything. */
	for (__u32 i = 0; i < LB_MAX_VIPS; i++) {
		if (!st->vips[i].used)
			continue;
		rings[i] = malloc((size_t)rs * sizeof(__u32));
		if (!rings[i]) {
			for (__u32 j = 0; j < i; j++)
				free(rings[j]);
			snprintf(err, errlen, "out of memory");
			return -ENOMEM;
		}
		memcpy(rings[i], st->rings[i], (size_t)rs * sizeof(__u32));
	}
	for (__u32 i = 0; i < LB_MAX_VIPS; i++) {
		free(srv->st.rings[i]);
		srv->st.rings[i] = rings[i];
		srv->st.vips[i] = st->vips[i];
	}
	srv->st.config = st->config;
	memcpy(srv->st.backends, st->backends, sizeof(srv->st.backends));
	return 0;
}
