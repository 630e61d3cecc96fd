/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_telemetry.h - the forwarder's commands on DPDK's telemetry socket, so
 * `dpdk-telemetry.py` (and any monitoring that speaks it) reads the same
 * counters as the table protocol's stats: /hpclb/stats, /hpclb/workers,
 * /hpclb/vips, /hpclb/backends, /hpclb/ports.
 */
#ifndef HPCLB_FWD_TELEMETRY_H
#define HPCLB_FWD_TELEMETRY_H

#include "fwd_ports.h"
#include "fwd_tables.h"
#include "fwd_worker.h"

struct fwd_telemetry_view {
	struct fwd_context *ctx;
	const struct fwd_port *ports;
	unsigned int nports;
	const struct fwd_worker *workers;
};

/* Registers the commands; view must outlive the EAL. 0 or a negative errno. */
int fwd_telemetry_register(const struct fwd_telemetry_view *view);

#endif /* HPCLB_FWD_TELEMETRY_H */
