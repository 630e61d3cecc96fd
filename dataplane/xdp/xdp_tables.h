/* SPDX-License-Identifier: Apache-2.0
 *
 * xdp_tables.h - the table-protocol ops (struct lb_dataplane_ops) implemented
 * on the BPF maps of lb.bpf.c, plus the start-up writes the protocol does not
 * cover: fresh initialisation, egress ports, and reading tables back from
 * pinned maps that outlived a previous daemon.
 */
#ifndef HPCLB_XDP_TABLES_H
#define HPCLB_XDP_TABLES_H

#include "lb_proto.h"

struct lb_bpf;
struct xdp_conns;

/* Batch syscalls move at most this many entries; bounds the scratch buffers. */
#define XDP_TABLES_CHUNK 8192

struct xdp_tables {
	int vip_fd, vip4_fd, backend_fd, ring_fd, config_fd, port_fd, devmap_fd;
	int stats_fd, vip_stats_fd, backend_stats_fd;
	int conn_fd, conn6_fd, nat_fd; /* NAT mode: conn_map, conn6_map, nat_config_map */
	struct xdp_conns *conns; /* the sweeper (set by the daemon); NULL: none yet */
	__u32 ring_size;
	__u32 devmap_value_size; /* 4 (ifindex) or 8 (struct bpf_devmap_val) */
	int ncpus;               /* possible CPUs: per-CPU values come in this many */
	__u32 keys[XDP_TABLES_CHUNK];
	__u32 vals[XDP_TABLES_CHUNK];
	void *percpu_buf; /* ncpus * sizeof(struct lb_counter) * LB_MAX_BACKENDS */
	char *ring_mem;   /* ring_map mapped, when it is BPF_F_MMAPABLE; else NULL */
	size_t ring_mem_len;
	size_t ring_stride; /* bytes between two slots in ring_mem */
	volatile __u64 *vip_gen; /* the program's vip_gen (lb.bpf.c: its VIP cache) */
};

extern const struct lb_dataplane_ops xdp_tables_ops; /* ctx = struct xdp_tables * */

/* Takes the map fds of a loaded skeleton. Returns 0 or -errno. */
int xdp_tables_open(struct xdp_tables *t, struct lb_bpf *skel, __u32 ring_size);
void xdp_tables_close(struct xdp_tables *t);

/* Empty tables: no VIP, every backend UNUSED, every ring slot LB_NO_BACKEND,
 * the configuration cfg, and the NAT configuration lb_proto_nat_defaults. */
int xdp_tables_reset(struct xdp_tables *t, const struct lb_config *cfg);

/* Writes port_map and tx_devmap entries 0..n-1. */
int xdp_tables_set_ports(struct xdp_tables *t, const struct lb_proto_port *ports, __u32 n);

/* Reads config, VIPs (their NAT flags too), backends, the rings of configured
 * VIPs and the NAT configuration back into st (rings allocated; free them
 * with xdp_tables_free_state), and makes vip4_map (the fast path's IPv4
 * index) agree with vip_map, the VIPs as read. */
int xdp_tables_read_state(struct xdp_tables *t, struct lb_proto_state *st);
void xdp_tables_free_state(struct lb_proto_state *st);

#endif /* HPCLB_XDP_TABLES_H */
