/* SPDX-License-Identifier: Apache-2.0
 *
 * xdp_conns.h - the XDP plane's NAT connection table seen from the daemon:
 * the sweeper that enforces the idle timeouts (lb_conn.h: "a sweep outside
 * the fast path"), the figures the stats reply's "conns" reports (both
 * families' tables summed: lb_tables.h gives each family a table of its own),
 * and the nat_active flag of lb.bpf.c (whether frames for no VIP look the
 * tables up).
 */
#ifndef HPCLB_XDP_CONNS_H
#define HPCLB_XDP_CONNS_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#include "lb_tables.h"

/* Entries one batch syscall reads (bounds the scratch buffers: 416 KiB,
 * sized for the larger family's keys and entries). */
#define XDP_CONNS_CHUNK 4096

/* Orphan entries (a reply entry whose original no longer names it) can only
 * come from races between CPUs or a daemon killed mid-delete; looking for
 * them costs a lookup per reply entry, so at most this often (per table). */
#define XDP_CONNS_REPAIR_NS (60ull * 1000000000ull)

/* One family's connection table (lb_tables.h: each family has its own, with
 * the same rules): conn_map (struct lb_flow_key_v4 keys, struct lb_conn
 * entries) or conn6_map (struct lb_flow_key, struct lb_conn6). */
struct xdp_conn_table {
	int fd;
	__u8 family;          /* LB_FAMILY_V4 or LB_FAMILY_V6: which layouts */
	__u32 key_size, value_size;
	__u64 capacity;       /* the map's max_entries */
	__u64 last_repair_ns; /* CLOCK_MONOTONIC of the last orphan search */
};

#define XDP_CONNS_TABLES 2 /* [0] IPv4 (conn_map), [1] IPv6 (conn6_map) */

struct xdp_conns {
	struct xdp_conn_table tables[XDP_CONNS_TABLES];
	int vip_fd;                 /* vip_map: every VIP, either family */
	volatile __u32 *nat_active; /* lb.bpf.c's nat_active, in the mapped .bss */
	__u64 capacity;             /* both tables' max_entries, summed */
	/* lock: one sweep pass at a time (the sweeper thread's or a stats
	 * request's), and everything below. flag_lock: nat_active against the
	 * writes of NAT VIPs (xdp_conns_nat_vip_begin), held only briefly so
	 * that a long pass never delays a set_vip. */
	pthread_mutex_t lock, flag_lock;
	pthread_cond_t wake;
	pthread_t thread;
	bool thread_started, stop;
	__u32 timeouts_s[LB_CONN_STATES];
	__u64 expired;                /* connections removed by the idle timeouts, ever */
	struct lb_conn_stats figures; /* of the last pass, both tables summed */
	void *keys, *vals;            /* XDP_CONNS_CHUNK raw keys and entries: batch buffers */
	struct lb_flow_key *doomed;   /* original keys found idle in a pass (family-aware) */
	size_t ndoomed, doomed_cap;
};

/* conn_fd, conn6_fd: lb.bpf.c's conn_map and conn6_map; vip_fd: its vip_map
 * (to see whether a NAT VIP of either family is configured); nat_active: the
 * program's flag. The timeouts are those of the NAT configuration in force.
 * 0 or -errno (-EINVAL: a map of another layout). No thread yet. */
int xdp_conns_init(struct xdp_conns *c, int conn_fd, int conn6_fd, int vip_fd,
		   volatile __u32 *nat_active, const __u32 timeouts_s[LB_CONN_STATES]);

/* Starts the sweeper thread. 0 or -errno. */
int xdp_conns_start(struct xdp_conns *c);

/* Stops the thread (if started) and frees the buffers. */
void xdp_conns_fini(struct xdp_conns *c);

/* The timeouts of a new NAT configuration (set_nat): the next pass, which
 * this wakes, applies them to every connection. */
void xdp_conns_set_timeouts(struct xdp_conns *c, const __u32 timeouts_s[LB_CONN_STATES]);

/* Runs a pass now over both tables (expiring what is idle) and gives their
 * figures summed. 0 or -errno. */
int xdp_conns_read(struct xdp_conns *c, struct lb_conn_stats *out);

/* Around the write of a NAT VIP: begin sets nat_active (before the VIP can
 * open a connection) and holds the flag lock, so that a pass cannot clear
 * the flag between the two; end releases it. */
void xdp_conns_nat_vip_begin(struct xdp_conns *c);
void xdp_conns_nat_vip_end(struct xdp_conns *c);

/* After adopting pinned maps: nat_active set when a NAT VIP is configured or
 * a table holds entries (a fresh program instance starts with it clear). */
void xdp_conns_refresh_active(struct xdp_conns *c);

#endif /* HPCLB_XDP_CONNS_H */
