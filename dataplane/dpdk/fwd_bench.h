/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_bench.h - feeding the forwarder from memory for cost measurements
 * (--bench-frames, control/hpclb/lab/dpdk_cost.py): never on an appliance.
 *
 * The port is a net_ring vdev, whose TX ring is its RX ring: what the worker
 * sends comes back to it. The frames of a pcap file are put on that loop
 * once, before the workers start; from then on the same mbufs circulate,
 * each pass through the worker's full path (RX burst, fwd_packet, TX burst)
 * with no copy and no kernel, so the worker's cycles per frame are its own
 * and the ring's.
 */
#ifndef HPCLB_FWD_BENCH_H
#define HPCLB_FWD_BENCH_H

#include <stdint.h>
#include <rte_mempool.h>

/* Sends the first max_frames frames of the pcap file at path (Ethernet link
 * type) out of queue 0 of port_id, each copied into an mbuf of mp; stops
 * early when the port takes no more. The number sent, or a negative errno. */
int fwd_bench_prime(uint16_t port_id, struct rte_mempool *mp, const char *path,
		    unsigned int max_frames);

#endif /* HPCLB_FWD_BENCH_H */
