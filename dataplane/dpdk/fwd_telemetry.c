/* SPDX-License-Identifier: Apache-2.0 */
#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>
#include <rte_cycles.h>
#include <rte_telemetry.h>

#include "fwd_telemetry.h"

/* rte_telemetry callbacks take no user argument: the one view of this
 * process, set once before the commands are registered. */
static const struct fwd_telemetry_view *view;

static const char *const stat_names[LB_STAT_MAX] = LB_STAT_NAMES;

/* Sums the workers' counters of one kind. */
static struct lb_counter sum(size_t offset, __u32 index)
{
	struct lb_counter s = { 0, 0 };

	for (unsigned int w = 0; w < view->ctx->nworkers; w++) {
		const struct lb_counter *c =
			(const void *)((const char *)view->ctx->counters[w] + offset);

		s.packets += c[index].packets;
		s.bytes += c[index].bytes;
	}
	return s;
}

static int cmd_stats(const char *cmd, const char *params, struct rte_tel_data *d)
{
	__u64 tx_dropped = 0;

	(void)cmd;
	(void)params;
	rte_tel_data_start_dict(d);
	for (__u32 i = 0; i < LB_STAT_MAX; i++)
		rte_tel_data_add_dict_u64(d, stat_names[i],
					  sum(offsetof(struct fwd_counters, global), i).packets);
	for (unsigned int w = 0; w < view->ctx->nworkers; w++)
		tx_dropped += view->workers[w].tx_dropped;
	rte_tel_data_add_dict_u64(d, "tx_queue_full", tx_dropped);
	rte_tel_data_add_dict_u64(d, "table_swaps",
				  __atomic_load_n(&view->ctx->store.swaps, __ATOMIC_RELAXED));
	rte_tel_data_add_dict_u64(d, "workers", view->ctx->nworkers);
	rte_tel_data_add_dict_u64(d, "tsc_hz", rte_get_tsc_hz());
	return 0;
}

/* Per worker: frames moved, the cycles spent on loops that moved them, and
 * all cycles since the worker started, so cycles per frame and how busy the
 * core is can be read while traffic runs. */
static int cmd_workers(const char *cmd, const char *params, struct rte_tel_data *d)
{
	(void)cmd;
	(void)params;
	rte_tel_data_start_dict(d);
	for (unsigned int i = 0; i < view->ctx->nworkers; i++) {
		const struct fwd_worker *w = &view->workers[i];
		struct rte_tel_data *t = rte_tel_data_alloc();
		char name[16];

		if (!t)
			break;
		rte_tel_data_start_dict(t);
		rte_tel_data_add_dict_u64(t, "lcore", w->lcore);
		rte_tel_data_add_dict_u64(t, "frames", w->frames);
		rte_tel_data_add_dict_u64(t, "busy_cycles", w->busy_cycles);
		rte_tel_data_add_dict_u64(t, "busy_loops", w->busy_loops);
		rte_tel_data_add_dict_u64(t, "total_cycles", w->total_cycles);
		rte_tel_data_add_dict_u64(t, "tx_queue_full", w->tx_dropped);
		snprintf(name, sizeof(name), "%u", i);
		rte_tel_data_add_dict_container(d, name, t, 0);
	}
	return 0;
}

static struct rte_tel_data *counter_dict(struct lb_counter c)
{
	struct rte_tel_data *t = rte_tel_data_alloc();

	if (!t)
		return NULL;
	rte_tel_data_start_dict(t);
	rte_tel_data_add_dict_u64(t, "packets", c.packets);
	rte_tel_data_add_dict_u64(t, "bytes", c.bytes);
	return t;
}

static int cmd_vips(const char *cmd, const char *params, struct rte_tel_data *d)
{
	struct fwd_table_store *s = &view->ctx->store;

	(void)cmd;
	(void)params;
	rte_tel_data_start_dict(d);
	pthread_mutex_lock(&s->lock);
	for (__u32 v = 0; v < LB_MAX_VIPS; v++) {
		const struct lb_vip_key *k = &s->current->vip_keys[v];
		struct rte_tel_data *t;
		char name[64], addr[INET_ADDRSTRLEN];

		if (!s->current->vip_used[v])
			continue;
		t = counter_dict(sum(offsetof(struct fwd_counters, vips), v));
		if (!t)
			break;
		inet_ntop(AF_INET, &k->addr, addr, sizeof(addr));
		snprintf(name, sizeof(name), "%u %s:%u/%s", v, addr, ntohs(k->port),
			 k->proto == 6 ? "tcp" : "udp");
		rte_tel_data_add_dict_container(d, name, t, 0);
	}
	pthread_mutex_unlock(&s->lock);
	return 0;
}

static int cmd_backends(const char *cmd, const char *params, struct rte_tel_data *d)
{
	static const char *const states[] = { "up", "draining", "down" };
	struct fwd_table_store *s = &view->ctx->store;

	(void)cmd;
	(void)params;
	rte_tel_data_start_dict(d);
	pthread_mutex_lock(&s->lock);
	for (__u32 b = 0; b < LB_MAX_BACKENDS; b++) {
		const struct lb_backend *be = &s->current->backends[b];
		struct rte_tel_data *t;
		char name[16];

		if (be->state >= LB_BACKEND_UNUSED)
			continue;
		t = counter_dict(sum(offsetof(struct fwd_counters, backends), b));
		if (!t)
			break;
		rte_tel_data_add_dict_string(t, "state", states[be->state]);
		snprintf(name, sizeof(name), "%u", b);
		rte_tel_data_add_dict_container(d, name, t, 0);
	}
	pthread_mutex_unlock(&s->lock);
	return 0;
}

static int cmd_ports(const char *cmd, const char *params, struct rte_tel_data *d)
{
	(void)cmd;
	(void)params;
	rte_tel_data_start_dict(d);
	for (unsigned int p = 0; p < view->nports; p++) {
		struct rte_tel_data *t = rte_tel_data_alloc();
		struct lb_port_stats ps;

		if (!t)
			break;
		fwd_port_read_stats(&view->ports[p], &ps);
		rte_tel_data_start_dict(t);
		rte_tel_data_add_dict_u64(t, "rx_packets", ps.rx_packets);
		rte_tel_data_add_dict_u64(t, "tx_packets", ps.tx_packets);
		rte_tel_data_add_dict_u64(t, "rx_missed", ps.rx_missed);
		rte_tel_data_add_dict_u64(t, "rx_errors", ps.rx_errors);
		rte_tel_data_add_dict_u64(t, "tx_errors", ps.tx_errors);
		rte_tel_data_add_dict_u64(t, "rx_nombuf", ps.rx_nombuf);
		rte_tel_data_add_dict_u64(t, "rx_crc_errors", ps.rx_crc_errors);
		rte_tel_data_add_dict_container(d, view->ports[p].data_name, t, 0);
	}
	return 0;
}

int fwd_telemetry_register(const struct fwd_telemetry_view *v)
{
	int rc = 0;

	view = v;
	rc |= rte_telemetry_register_cmd("/hpclb/stats", cmd_stats,
					 "hpclb global counters (LB_STAT_NAMES). No parameters");
	rc |= rte_telemetry_register_cmd("/hpclb/workers", cmd_workers,
					 "hpclb per-worker frames and cycles. No parameters");
	rc |= rte_telemetry_register_cmd("/hpclb/vips", cmd_vips,
					 "hpclb per-VIP packets and bytes. No parameters");
	rc |= rte_telemetry_register_cmd("/hpclb/backends", cmd_backends,
					 "hpclb per-backend packets, bytes, state. No parameters");
	rc |= rte_telemetry_register_cmd("/hpclb/ports", cmd_ports,
					 "hpclb port counters (rx_missed, errors, CRC). No parameters");
	return rc ? -EINVAL : 0;
}
