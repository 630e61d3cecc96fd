/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_ports.h - the forwarder's ports: each data port (a NIC bound to
 * vfio-pci, or a vdev such as net_af_xdp/net_af_packet on a kernel interface)
 * is paired with an exception port, a net_tap interface that gives the kernel
 * what is not for a VIP and sends what the kernel says out of the data port.
 * The TAP takes the data port's MAC, so the kernel's ARP and neighbour
 * traffic speaks for the same address the wire sees.
 *
 * Every worker has its own RX and TX queue on every port (RSS spreads flows
 * over the RX queues when there are several); mempools live on the port's
 * NUMA socket.
 */
#ifndef HPCLB_FWD_PORTS_H
#define HPCLB_FWD_PORTS_H

#include <stdbool.h>
#include <stdint.h>
#include <rte_mempool.h>

#include "lb_proto.h"

#define FWD_NO_PORT UINT16_MAX

struct fwd_port {
	char data_name[64]; /* DPDK device name, e.g. net_af_xdp0 or 0000:3b:00.0 */
	char tap_name[64];  /* exception vdev name (net_tapN), "" for none */
	uint16_t data_id;
	uint16_t tap_id;    /* FWD_NO_PORT without an exception path */
	int socket_id;      /* NUMA node of the data port, SOCKET_ID_ANY if unknown */
	__u8 mac[6];
	struct rte_mempool *pool;
};

/* Parses "DATA[:TAP]" into p (names only). 0 or -1. */
int fwd_port_parse(const char *spec, struct fwd_port *p);

/* Finds the devices, configures nqueues RX/TX queues on each, starts them and
 * copies the data port's MAC to its TAP. numa_strict refuses a worker lcore
 * on another socket than its port; otherwise it is a warning. */
int fwd_ports_start(struct fwd_port *ports, unsigned int nports, unsigned int nqueues,
		    const unsigned int *worker_lcores, bool numa_strict);
void fwd_ports_stop(struct fwd_port *ports, unsigned int nports);

/* hello's view of a port: ifname (device name), ifindex of the kernel
 * interface behind a vdev (0 for a NIC DPDK owns), MAC. */
void fwd_port_info(const struct fwd_port *p, struct lb_proto_port *out);

/* NIC counters: rte_eth_stats plus the CRC errors found in xstats. */
int fwd_port_read_stats(const struct fwd_port *p, struct lb_port_stats *out);

#endif /* HPCLB_FWD_PORTS_H */
