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

/* Registers the commands. 0 or a negative errno. */
int fwd_telemetry_register(const struct fwd_telemetry_view *view);

/* From now on the commands answer an error: call it before the tables and
 * ports the view points at go away (telemetry threads outlive them). */
void fwd_telemetry_stop(void);

#endif /* HPCLB_FWD_TELEMETRY_H */
