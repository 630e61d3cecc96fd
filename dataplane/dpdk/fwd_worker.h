/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_worker.h - a worker lcore: RX bursts from its queue of every port,
 * fwd_packet() on each frame, TX bursts out, the exception path both ways,
 * and between bursts a quiescent state for the table store and a slice of
 * flow and NAT connection expiry.
 */
#ifndef HPCLB_FWD_WORKER_H
#define HPCLB_FWD_WORKER_H

#include <signal.h>
#include <stdbool.h>
#include <rte_common.h>

#include "fwd_flow.h"
#include "fwd_ports.h"
#include "fwd_tables.h"

/* Measurement modes (--bench), for the per-frame cost on memory-fed ports
 * (control/hpclb/lab/dpdk_cost.py): never set on an appliance. */
enum fwd_bench {
	FWD_BENCH_OFF = 0,
	/* Each frame's MACs swapped and sent back by the port it came in on,
	 * with the same RX/TX bursts and accounting as the forwarding loop:
	 * the loop's own cost, against which fwd_packet's is read. */
	FWD_BENCH_MACSWAP,
	/* The flow table is emptied (outside the busy cycles) whenever it is
	 * half full, so a stream of more distinct flows than half the table
	 * meets every flow as new, in a table that is never full. */
	FWD_BENCH_FORGET_FLOWS,
};

struct fwd_worker {
	unsigned int index;  /* RCU thread id and queue number on every port */
	unsigned int lcore;
	struct fwd_table_store *store;
	struct fwd_flow_table flows;
	struct fwd_conn_table *conns;     /* shared by every worker (fwd_conn.h) */
	struct fwd_conn_sweep conn_sweep; /* this worker's share of its idle sweep */
	struct fwd_conn6_table *conns6;   /* the IPv6 one, shared the same way */
	struct fwd_conn_sweep conn6_sweep;
	struct fwd_counters *counters;
	const struct fwd_port *ports;
	unsigned int nports;
	const __u8 (*port_macs)[6];
	unsigned int idle_sleep_us; /* 0: poll without pause (a dedicated core) */
	enum fwd_bench bench;       /* FWD_BENCH_OFF but under a cost measurement */
	bool bench_loop;            /* --bench-frames: frames circulate (fwd_bench.h) */
	const char *bench_frames;   /* the pcap this worker puts on the loop, or NULL */
	__u64 tx_dropped;           /* frames a full TX queue refused */
	/* Where the worker's time goes (read by telemetry, written only here):
	 * cycles of loops that moved frames, frames moved, all loop cycles. */
	__u64 busy_cycles;
	__u64 busy_loops; /* loops that moved frames: frames / busy_loops = mean burst */
	__u64 frames;
	__u64 total_cycles;
	volatile sig_atomic_t *stop; /* set by the main lcore's signal handler */
} __rte_cache_aligned; /* each worker writes its own: no shared cache lines */

/* rte_eal_remote_launch entry point; arg is a struct fwd_worker *. */
int fwd_worker_main(void *arg);

#endif /* HPCLB_FWD_WORKER_H */
