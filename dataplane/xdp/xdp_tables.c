/* SPDX-License-Identifier: Apache-2.0
 *
 * xdp_tables.c - table-protocol ops on the BPF maps of lb.bpf.c.
 *
 * Bulk writes go through BPF_MAP_UPDATE_BATCH in chunks of XDP_TABLES_CHUNK
 * entries (one syscall per chunk instead of one per slot: a 65537-slot ring
 * takes 9 syscalls), with a per-element fallback for kernels without batch
 * support on a map type. Arrays are written in index order, so a patch that
 * names a slot twice ends with its last value, as the shadow does.
 *
 * If lb.bpf.c declares ring_map with BPF_F_MMAPABLE, the rings are mapped into
 * the daemon and written with plain stores instead: the kernel spends about
 * 130 ns per batched element, which makes the start-up fill of the largest
 * rings (64 x 1048573 slots) take seconds; memory stores take milliseconds.
 * An aligned 4-byte store is atomic, so the program never sees a torn slot.
 *
 * VIPs live in two maps. vip_map holds every VIP of either family under the
 * contract's key (struct lb_vip_key, 20 bytes): it is the table a restarted
 * daemon adopts, and the one the program looks IPv6 VIPs up in. The program
 * looks IPv4 VIPs up in vip4_map, keyed by the compact struct
 * lb_vip_key_v4 (8 bytes; lb_tables.h says why). Both hold the contract's
 * whole 32-byte struct lb_vip_entry, tunnel mode's fields included. An IPv4 VIP
 * is written into vip_map first and vip4_map second, and deleted in the
 * opposite order, so vip4_map never names a VIP vip_map lacks for longer
 * than a call.
 */
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
#include <string.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/bpf.h>

#include "lb.skel.h"
#include "xdp_conns.h"
#include "xdp_tables.h"

#ifndef ENOTSUPP
#define ENOTSUPP 524 /* kernel-internal, leaks out of some bpf() paths */
#endif

static int batch_unsupported(int err)
{
	return err == -ENOTSUPP || err == -EOPNOTSUPP;
}

/* Writes n key/value pairs (keys __u32) with one batch syscall. */
static int update_n(int fd, const __u32 *keys, const void *values, size_t vsize, __u32 n)
{
	LIBBPF_OPTS(bpf_map_batch_opts, opts);
	__u32 count = n;
	int err;

	err = bpf_map_update_batch(fd, keys, values, &count, &opts);
	if (!batch_unsupported(err))
		return err;
	for (__u32 i = 0; i < n; i++) {
		err = bpf_map_update_elem(fd, &keys[i], (const char *)values + i * vsize, BPF_ANY);
		if (err)
			return err;
	}
	return 0;
}

/* Writes n values to consecutive array indices first..first+n-1. */
static int array_write(struct xdp_tables *t, int fd, __u32 first, const void *values,
		       size_t vsize, __u32 n)
{
	for (__u32 done = 0; done < n;) {
		__u32 cnt = n - done < XDP_TABLES_CHUNK ? n - done : XDP_TABLES_CHUNK;
		int err;

		for (__u32 i = 0; i < cnt; i++)
			t->keys[i] = first + done + i;
		err = update_n(fd, t->keys, (const char *)values + (size_t)done * vsize, vsize,
			       cnt);
		if (err)
			return err;
		done += cnt;
	}
	return 0;
}

/* Reads n consecutive array entries first..first+n-1; stride is the size of
 * one entry's value (ncpus * round_up(value_size, 8) for per-CPU maps). */
static int array_read(struct xdp_tables *t, int fd, __u32 first, void *values, size_t stride,
		      __u32 n)
{
	LIBBPF_OPTS(bpf_map_batch_opts, opts);

	for (__u32 done = 0; done < n;) {
		__u32 want = n - done < XDP_TABLES_CHUNK ? n - done : XDP_TABLES_CHUNK;
		__u32 start = first + done, prev = start - 1, out = 0, cnt = want;
		char *dst = (char *)values + (size_t)done * stride;
		int err;

		/* The batch cursor is the key *before* the first one returned. */
		err = bpf_map_lookup_batch(fd, start ? &prev : NULL, &out, t->keys, dst, &cnt,
					   &opts);
		if (batch_unsupported(err)) {
			for (__u32 i = 0; i < want; i++) {
				__u32 k = start + i;

				err = bpf_map_lookup_elem(fd, &k, dst + (size_t)i * stride);
				if (err)
					return err;
			}
			cnt = want;
		} else if (err && err != -ENOENT) {
			return err;
		}
		/* ENOENT: the map ended; fine only if it ended after what we want. */
		if (cnt == 0 || cnt > want || t->keys[0] != start)
			return -EIO;
		done += cnt;
	}
	return 0;
}

/* ---- ops ---------------------------------------------------------------- */

static int op_set_config(void *ctx, const struct lb_config *cfg)
{
	struct xdp_tables *t = ctx;
	__u32 k = 0;

	return bpf_map_update_elem(t->config_fd, &k, cfg, BPF_ANY);
}

/* The compact key of an IPv4 VIP; 0 for an IPv6 one (no vip4_map entry). */
static int vip4_key(const struct lb_vip_key *key, struct lb_vip_key_v4 *k4)
{
	if (key->family != LB_FAMILY_V4)
		return 0;
	memset(k4, 0, sizeof(*k4));
	k4->addr = key->addr.v4;
	k4->port = key->port;
	k4->proto = key->proto;
	return 1;
}

/* After every write of vip4_map, done or failed: the program's per-CPU VIP
 * caches hold nothing read before it (lb.bpf.c, vip_gen). */
static void vip_gen_bump(struct xdp_tables *t)
{
	if (t->vip_gen)
		__atomic_add_fetch(t->vip_gen, 1, __ATOMIC_SEQ_CST);
}

static int op_set_vip(void *ctx, const struct lb_vip_key *key, const struct lb_vip_entry *vip)
{
	struct xdp_tables *t = ctx;
	struct lb_vip_key_v4 k4;
	int nat = vip->mode == LB_MODE_NAT && t->conns, err;

	/* A NAT VIP: the program must look up the replies of its connections
	 * (nat_active) before its first connection can exist. */
	if (nat)
		xdp_conns_nat_vip_begin(t->conns);
	err = bpf_map_update_elem(t->vip_fd, key, vip, BPF_ANY);
	if (!err && vip4_key(key, &k4)) {
		err = bpf_map_update_elem(t->vip4_fd, &k4, vip, BPF_ANY);
		vip_gen_bump(t);
	}
	if (nat)
		xdp_conns_nat_vip_end(t->conns);
	return err;
}

static int op_del_vip(void *ctx, const struct lb_vip_key *key)
{
	struct xdp_tables *t = ctx;
	struct lb_vip_key_v4 k4;
	int err;

	if (vip4_key(key, &k4)) {
		err = bpf_map_delete_elem(t->vip4_fd, &k4);
		vip_gen_bump(t);
		if (err && err != -ENOENT)
			return err;
	}
	err = bpf_map_delete_elem(t->vip_fd, key);
	return err == -ENOENT ? 0 : err;
}

static int op_set_backends(void *ctx, const __u32 *ids, const struct lb_backend *b, size_t n)
{
	struct xdp_tables *t = ctx;

	if (n > LB_MAX_BACKENDS)
		return -EINVAL;
	return update_n(t->backend_fd, ids, b, sizeof(*b), (__u32)n);
}

/* Address of ring slot idx (= vip_id * ring_size + slot) in the mapped ring. */
static __u32 *ring_slot(struct xdp_tables *t, __u64 idx)
{
	return (__u32 *)(t->ring_mem + idx * t->ring_stride);
}

static int op_write_ring(void *ctx, __u32 vip_id, const __u32 *slots)
{
	struct xdp_tables *t = ctx;

	if (vip_id >= LB_MAX_VIPS)
		return -EINVAL;
	if (t->ring_mem) {
		for (__u32 i = 0; i < t->ring_size; i++)
			__atomic_store_n(ring_slot(t, (__u64)vip_id * t->ring_size + i), slots[i],
					 __ATOMIC_RELAXED);
		return 0;
	}
	return array_write(t, t->ring_fd, vip_id * t->ring_size, slots, sizeof(*slots),
			   t->ring_size);
}

static int op_patch_ring(void *ctx, __u32 vip_id, const struct lb_ring_patch *p, size_t n)
{
	struct xdp_tables *t = ctx;
	__u32 base = vip_id * t->ring_size;

	if (vip_id >= LB_MAX_VIPS)
		return -EINVAL;
	if (t->ring_mem) {
		for (size_t i = 0; i < n; i++)
			if (p[i].slot >= t->ring_size)
				return -EINVAL;
		for (size_t i = 0; i < n; i++)
			__atomic_store_n(ring_slot(t, (__u64)base + p[i].slot), p[i].backend,
					 __ATOMIC_RELAXED);
		return 0;
	}
	for (size_t done = 0; done < n;) {
		__u32 cnt = n - done < XDP_TABLES_CHUNK ? (__u32)(n - done) : XDP_TABLES_CHUNK;
		int err;

		for (__u32 i = 0; i < cnt; i++) {
			if (p[done + i].slot >= t->ring_size)
				return -EINVAL;
			t->keys[i] = base + p[done + i].slot;
			t->vals[i] = p[done + i].backend;
		}
		err = update_n(t->ring_fd, t->keys, t->vals, sizeof(__u32), cnt);
		if (err)
			return err;
		done += cnt;
	}
	return 0;
}

/* Reads a per-CPU counter array of n entries and sums each over the CPUs. */
static int read_counters(struct xdp_tables *t, int fd, struct lb_counter *sum, __u32 n)
{
	const struct lb_counter *v = t->percpu_buf;
	size_t stride = (size_t)t->ncpus; /* in struct lb_counter units (16 bytes, 8-aligned) */
	int err;

	err = array_read(t, fd, 0, t->percpu_buf, stride * sizeof(*v), n);
	if (err)
		return err;
	for (__u32 i = 0; i < n; i++) {
		sum[i].packets = 0;
		sum[i].bytes = 0;
		for (int c = 0; c < t->ncpus; c++) {
			sum[i].packets += v[i * stride + c].packets;
			sum[i].bytes += v[i * stride + c].bytes;
		}
	}
	return 0;
}

static int op_read_stats(void *ctx, struct lb_counter *global, struct lb_counter *vips,
			 struct lb_counter *backends)
{
	struct xdp_tables *t = ctx;
	int err;

	err = read_counters(t, t->stats_fd, global, LB_STAT_MAX);
	if (!err)
		err = read_counters(t, t->vip_stats_fd, vips, LB_MAX_VIPS);
	if (!err)
		err = read_counters(t, t->backend_stats_fd, backends, LB_MAX_BACKENDS);
	return err;
}

/* The whole NAT configuration, both families' pools (struct lb_nat_config:
 * snat_addrs for IPv4 connections, snat_addrs6 for IPv6 ones): the program
 * reads the pool, the port range and the down policy from nat_config_map
 * when it opens a connection; the sweeper takes the timeouts. */
static int op_set_nat(void *ctx, const struct lb_nat_config *nat)
{
	struct xdp_tables *t = ctx;
	__u32 k = 0;
	int err;

	err = bpf_map_update_elem(t->nat_fd, &k, nat, BPF_ANY);
	if (!err && t->conns)
		xdp_conns_set_timeouts(t->conns, nat->timeouts_s);
	return err;
}

static int op_read_conns(void *ctx, struct lb_conn_stats *out)
{
	struct xdp_tables *t = ctx;

	return t->conns ? xdp_conns_read(t->conns, out) : -ENODEV;
}

const struct lb_dataplane_ops xdp_tables_ops = {
	.set_config = op_set_config,
	.set_vip = op_set_vip,
	.del_vip = op_del_vip,
	.set_backends = op_set_backends,
	.write_ring = op_write_ring,
	.patch_ring = op_patch_ring,
	.read_stats = op_read_stats,
	.set_nat = op_set_nat,
	.read_conns = op_read_conns,
};

/* ---- start-up ----------------------------------------------------------- */

int xdp_tables_open(struct xdp_tables *t, struct lb_bpf *skel, __u32 ring_size)
{
	memset(t, 0, sizeof(*t));
	t->ring_size = ring_size;
	t->ncpus = libbpf_num_possible_cpus();
	if (t->ncpus <= 0)
		return t->ncpus < 0 ? t->ncpus : -EINVAL;
	t->vip_fd = bpf_map__fd(skel->maps.vip_map);
	t->vip4_fd = bpf_map__fd(skel->maps.vip4_map);
	t->backend_fd = bpf_map__fd(skel->maps.backend_map);
	t->ring_fd = bpf_map__fd(skel->maps.ring_map);
	t->config_fd = bpf_map__fd(skel->maps.config_map);
	t->port_fd = bpf_map__fd(skel->maps.port_map);
	t->devmap_fd = bpf_map__fd(skel->maps.tx_devmap);
	t->stats_fd = bpf_map__fd(skel->maps.stats_map);
	t->vip_stats_fd = bpf_map__fd(skel->maps.vip_stats_map);
	t->backend_stats_fd = bpf_map__fd(skel->maps.backend_stats_map);
	t->conn_fd = bpf_map__fd(skel->maps.conn_map);
	t->conn6_fd = bpf_map__fd(skel->maps.conn6_map);
	t->nat_fd = bpf_map__fd(skel->maps.nat_config_map);
	/* The VIP cache on from here: every later write of vip4_map goes
	 * through this file, which bumps the generation after it. */
	t->vip_gen = &skel->bss->vip_gen;
	__atomic_store_n(t->vip_gen, 1, __ATOMIC_SEQ_CST);
	t->devmap_value_size = bpf_map__value_size(skel->maps.tx_devmap);
	if (bpf_map__max_entries(skel->maps.ring_map) < (__u64)LB_MAX_VIPS * ring_size ||
	    (t->devmap_value_size != 4 && t->devmap_value_size != 8))
		return -EINVAL;
	t->percpu_buf = calloc((size_t)t->ncpus * LB_MAX_BACKENDS, sizeof(struct lb_counter));
	if (!t->percpu_buf)
		return -ENOMEM;
	if (bpf_map__map_flags(skel->maps.ring_map) & BPF_F_MMAPABLE) {
		long page = sysconf(_SC_PAGESIZE);
		/* array elements are laid out at round_up(value_size, 8) */
		size_t stride = (bpf_map__value_size(skel->maps.ring_map) + 7) & ~(size_t)7;
		size_t len = (size_t)bpf_map__max_entries(skel->maps.ring_map) * stride;
		void *mem;

		len = (len + (size_t)page - 1) & ~((size_t)page - 1);
		mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, t->ring_fd, 0);
		if (mem == MAP_FAILED)
			return -errno;
		t->ring_mem = mem;
		t->ring_mem_len = len;
		t->ring_stride = stride;
	}
	return 0;
}

void xdp_tables_close(struct xdp_tables *t)
{
	free(t->percpu_buf);
	t->percpu_buf = NULL;
	if (t->ring_mem)
		munmap(t->ring_mem, t->ring_mem_len);
	t->ring_mem = NULL;
}

/* Deletes every key of a hash map of at most LB_MAX_VIPS keys of ksize bytes. */
static int clear_vips(int fd, size_t ksize)
{
	char key[sizeof(struct lb_vip_key)];

	if (ksize > sizeof(key))
		return -EINVAL;
	for (int i = 0; i < LB_MAX_VIPS + 1; i++) {
		int err;

		if (bpf_map_get_next_key(fd, NULL, key))
			break;
		err = bpf_map_delete_elem(fd, key);
		if (err)
			return err;
	}
	return 0;
}

int xdp_tables_reset(struct xdp_tables *t, const struct lb_config *cfg)
{
	struct lb_nat_config nat;
	struct lb_backend b;
	__u32 zero = 0;
	int err;

	/* The NAT configuration the server starts with (lb_proto.h: it never
	 * calls set_nat at start). Fresh connection tables and FIFOs are empty. */
	lb_proto_nat_defaults(&nat);
	err = bpf_map_update_elem(t->nat_fd, &zero, &nat, BPF_ANY);
	if (err)
		return err;

	/* VIPs: delete whatever is there (fresh maps are empty). */
	err = clear_vips(t->vip4_fd, sizeof(struct lb_vip_key_v4));
	vip_gen_bump(t);
	if (!err)
		err = clear_vips(t->vip_fd, sizeof(struct lb_vip_key));
	if (err)
		return err;
	/* Backends: an array reads as zeroes, which is state UP; make them UNUSED. */
	memset(&b, 0, sizeof(b));
	b.state = LB_BACKEND_UNUSED;
	for (__u32 first = 0; first < LB_MAX_BACKENDS; first += XDP_TABLES_CHUNK / 4) {
		struct lb_backend vals[XDP_TABLES_CHUNK / 4];
		__u32 n = LB_MAX_BACKENDS - first < XDP_TABLES_CHUNK / 4 ?
			  LB_MAX_BACKENDS - first : XDP_TABLES_CHUNK / 4;

		for (__u32 i = 0; i < n; i++)
			vals[i] = b;
		err = array_write(t, t->backend_fd, first, vals, sizeof(b), n);
		if (err)
			return err;
	}
	/* Rings: every slot of every VIP belongs to nobody. */
	for (__u32 i = 0; i < XDP_TABLES_CHUNK; i++)
		t->vals[i] = LB_NO_BACKEND;
	if (t->ring_mem) {
		memset(t->ring_mem, 0xff, (size_t)LB_MAX_VIPS * t->ring_size * t->ring_stride);
		return op_set_config(t, cfg);
	}
	for (__u64 first = 0; first < (__u64)LB_MAX_VIPS * t->ring_size;
	     first += XDP_TABLES_CHUNK) {
		__u64 left = (__u64)LB_MAX_VIPS * t->ring_size - first;
		__u32 n = left < XDP_TABLES_CHUNK ? (__u32)left : XDP_TABLES_CHUNK;

		/* array_write overwrites t->keys, not t->vals. */
		err = array_write(t, t->ring_fd, (__u32)first, t->vals, sizeof(__u32), n);
		if (err)
			return err;
	}
	return op_set_config(t, cfg);
}

int xdp_tables_set_ports(struct xdp_tables *t, const struct lb_proto_port *ports, __u32 n)
{
	for (__u32 i = 0; i < n && i < LB_MAX_PORTS; i++) {
		struct lb_port p;
		struct bpf_devmap_val dv;
		int err;

		memset(&p, 0, sizeof(p));
		p.ifindex = ports[i].ifindex;
		memcpy(p.mac, ports[i].mac, 6);
		err = bpf_map_update_elem(t->port_fd, &i, &p, BPF_ANY);
		if (err)
			return err;
		memset(&dv, 0, sizeof(dv));
		dv.ifindex = ports[i].ifindex;
		if (t->devmap_value_size == 8)
			dv.bpf_prog.fd = -1; /* no program on the egress device */
		err = bpf_map_update_elem(t->devmap_fd, &i, &dv, BPF_ANY);
		if (err)
			return err;
	}
	return 0;
}

void xdp_tables_free_state(struct lb_proto_state *st)
{
	for (int i = 0; i < LB_MAX_VIPS; i++) {
		free(st->rings[i]);
		st->rings[i] = NULL;
	}
}

/* Makes vip4_map hold exactly the IPv4 VIPs of st: each written (an entry
 * already there is overwritten with the same value: no lookup misses it),
 * then every key that names no such VIP deleted. */
static int sync_vip4_writes(struct xdp_tables *t, const struct lb_proto_state *st)
{
	struct lb_vip_key_v4 k4, keys[LB_MAX_VIPS + 1];
	struct lb_vip_entry e;
	int err, n = 0;

	for (int id = 0; id < LB_MAX_VIPS; id++) {
		if (!st->vips[id].used || !vip4_key(&st->vips[id].key, &k4))
			continue;
		/* Every field (tunnel mode's too), as set_vip writes it. */
		lb_proto_vip_entry(&st->vips[id], (__u32)id, &e);
		err = bpf_map_update_elem(t->vip4_fd, &k4, &e, BPF_ANY);
		if (err)
			return err;
	}
	/* Collect first, then delete: deleting while walking restarts the walk. */
	for (n = 0; n <= LB_MAX_VIPS; n++) {
		err = bpf_map_get_next_key(t->vip4_fd, n ? &keys[n - 1] : NULL, &keys[n]);
		if (err == -ENOENT)
			break;
		if (err)
			return err;
	}
	if (n > LB_MAX_VIPS)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		int id;

		if (bpf_map_lookup_elem(t->vip4_fd, &keys[i], &e))
			continue;
		id = e.vip_id < LB_MAX_VIPS ? (int)e.vip_id : -1;
		if (id >= 0 && st->vips[id].used && vip4_key(&st->vips[id].key, &k4) &&
		    memcmp(&k4, &keys[i], sizeof(k4)) == 0)
			continue;
		err = bpf_map_delete_elem(t->vip4_fd, &keys[i]);
		if (err && err != -ENOENT)
			return err;
	}
	return 0;
}

static int sync_vip4(struct xdp_tables *t, const struct lb_proto_state *st)
{
	int err = sync_vip4_writes(t, st);

	vip_gen_bump(t);
	return err;
}

int xdp_tables_read_state(struct xdp_tables *t, struct lb_proto_state *st)
{
	struct lb_vip_key key, next;
	struct lb_vip_entry e;
	__u32 k = 0;
	int err, i;

	memset(st, 0, sizeof(*st));
	err = bpf_map_lookup_elem(t->config_fd, &k, &st->config);
	if (!err)
		err = bpf_map_lookup_elem(t->nat_fd, &k, &st->nat);
	if (err)
		return err;
	err = array_read(t, t->backend_fd, 0, st->backends, sizeof(struct lb_backend),
			 LB_MAX_BACKENDS);
	if (err)
		return err;
	/* The VIP hash holds at most LB_MAX_VIPS keys; one more step finds the end. */
	for (i = 0; i <= LB_MAX_VIPS; i++) {
		err = bpf_map_get_next_key(t->vip_fd, i ? &key : NULL, &next);
		if (err == -ENOENT)
			break;
		if (err)
			goto fail;
		key = next;
		err = bpf_map_lookup_elem(t->vip_fd, &key, &e);
		if (err)
			goto fail;
		err = -EINVAL;
		if (i == LB_MAX_VIPS || e.vip_id >= LB_MAX_VIPS || st->vips[e.vip_id].used)
			goto fail;
		st->vips[e.vip_id].used = true;
		/* Every field of the entry (tunnel mode's too): the server
		 * checks them (lb_proto_server_restore) before adopting. */
		lb_proto_vip_from_entry(&e, &st->vips[e.vip_id]);
		st->vips[e.vip_id].key = key;
		st->rings[e.vip_id] = malloc((size_t)t->ring_size * sizeof(__u32));
		err = -ENOMEM;
		if (!st->rings[e.vip_id])
			goto fail;
		if (t->ring_mem) {
			for (__u32 s = 0; s < t->ring_size; s++)
				st->rings[e.vip_id][s] = __atomic_load_n(
					ring_slot(t, (__u64)e.vip_id * t->ring_size + s),
					__ATOMIC_RELAXED);
			err = 0;
		} else {
			err = array_read(t, t->ring_fd, e.vip_id * t->ring_size,
					 st->rings[e.vip_id], sizeof(__u32), t->ring_size);
		}
		if (err)
			goto fail;
	}
	/* A daemon that died between the two writes of a VIP left them apart. */
	err = sync_vip4(t, st);
	if (err)
		goto fail;
	return 0;
fail:
	xdp_tables_free_state(st);
	return err;
}
