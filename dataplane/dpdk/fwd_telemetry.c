/* SPDX-License-Identifier: Apache-2.0 */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <rte_cycles.h>
#include <rte_telemetry.h>

#include "fwd_telemetry.h"

/* Names in a telemetry dict may hold only letters, digits, '_' and '/', and a
 * dict holds at most RTE_TEL_MAX_DICT_ENTRIES (256): entries are "vip3",
 * "port0", "backend17", and /hpclb/backends pages by a first id parameter. */
#define BACKENDS_PER_PAGE 200

/* rte_telemetry callbacks take no user argument: the one view of this
 * process, set before the commands are registered, cleared (under the lock,
 * which every command holds while it reads) before what it points at is freed. */
static const struct fwd_telemetry_view *view;
static pthread_mutex_t view_lock = PTHREAD_MUTEX_INITIALIZER;

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

/* Adds t to d under name, or frees it (a failed add does not take it). */
static void add_container(struct rte_tel_data *d, const char *name, struct rte_tel_data *t)
{
	if (rte_tel_data_add_dict_container(d, name, t, 0))
		rte_tel_data_free(t);
}

static void stats(struct rte_tel_data *d)
{
	__u64 tx_dropped = 0, pin_failures = 0;

	rte_tel_data_start_dict(d);
	for (__u32 i = 0; i < LB_STAT_MAX; i++)
		rte_tel_data_add_dict_u64(d, stat_names[i],
					  sum(offsetof(struct fwd_counters, global), i).packets);
	for (unsigned int w = 0; w < view->ctx->nworkers; w++) {
		tx_dropped += view->workers[w].tx_dropped;
		pin_failures += view->workers[w].flows.pin_failures;
	}
	rte_tel_data_add_dict_u64(d, "tx_queue_full", tx_dropped);
	rte_tel_data_add_dict_u64(d, "flow_pin_failures", pin_failures);
	rte_tel_data_add_dict_u64(d, "table_swaps",
				  __atomic_load_n(&view->ctx->store.swaps, __ATOMIC_RELAXED));
	if (view->ctx->conns) {
		/* Both families' tables, as the protocol's stats sum them. */
		__u64 cap = view->ctx->conns->capacity, n = fwd_conn_count(view->ctx->conns);

		if (view->ctx->conns6) {
			cap += view->ctx->conns6->capacity;
			n += fwd_conn6_count(view->ctx->conns6);
		}
		rte_tel_data_add_dict_u64(d, "conn_capacity", cap);
		rte_tel_data_add_dict_u64(d, "conn_entries", n);
	}
	rte_tel_data_add_dict_u64(d, "workers", view->ctx->nworkers);
	rte_tel_data_add_dict_u64(d, "tsc_hz", rte_get_tsc_hz());
}

/* Per worker: frames moved, the cycles spent on loops that moved them, and
 * all cycles since the worker started, so cycles per frame and how busy the
 * core is can be read while traffic runs. */
static void workers(struct rte_tel_data *d)
{
	rte_tel_data_start_dict(d);
	for (unsigned int i = 0; i < view->ctx->nworkers; i++) {
		const struct fwd_worker *w = &view->workers[i];
		struct rte_tel_data *t = rte_tel_data_alloc();
		char name[32];

		if (!t)
			break;
		rte_tel_data_start_dict(t);
		rte_tel_data_add_dict_u64(t, "lcore", w->lcore);
		rte_tel_data_add_dict_u64(t, "frames", w->frames);
		rte_tel_data_add_dict_u64(t, "busy_cycles", w->busy_cycles);
		rte_tel_data_add_dict_u64(t, "busy_loops", w->busy_loops);
		rte_tel_data_add_dict_u64(t, "total_cycles", w->total_cycles);
		rte_tel_data_add_dict_u64(t, "tx_queue_full", w->tx_dropped);
		rte_tel_data_add_dict_u64(t, "flow_pin_failures", w->flows.pin_failures);
		snprintf(name, sizeof(name), "worker%u", i);
		add_container(d, name, t);
	}
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

static void vips(struct rte_tel_data *d)
{
	struct fwd_table_store *s = &view->ctx->store;

	rte_tel_data_start_dict(d);
	pthread_mutex_lock(&s->lock);
	for (__u32 v = 0; v < LB_MAX_VIPS; v++) {
		const struct lb_vip_key *k = &s->current->vip_keys[v];
		struct rte_tel_data *t;
		char name[32], addr[INET6_ADDRSTRLEN];

		if (!s->current->vip_used[v])
			continue;
		t = counter_dict(sum(offsetof(struct fwd_counters, vips), v));
		if (!t)
			break;
		inet_ntop(k->family == LB_FAMILY_V6 ? AF_INET6 : AF_INET, &k->addr, addr,
			  sizeof(addr));
		rte_tel_data_add_dict_string(t, "addr", addr);
		rte_tel_data_add_dict_u64(t, "port", ntohs(k->port));
		rte_tel_data_add_dict_string(t, "proto", k->proto == 6 ? "tcp" : "udp");
		snprintf(name, sizeof(name), "vip%u", v);
		add_container(d, name, t);
	}
	pthread_mutex_unlock(&s->lock);
}

static void backends(struct rte_tel_data *d, const char *params)
{
	static const char *const states[] = { "up", "draining", "down" };
	struct fwd_table_store *s = &view->ctx->store;
	unsigned long first = params && *params ? strtoul(params, NULL, 10) : 0;
	__u32 listed = 0;

	rte_tel_data_start_dict(d);
	pthread_mutex_lock(&s->lock);
	for (__u32 b = first < LB_MAX_BACKENDS ? (__u32)first : LB_MAX_BACKENDS;
	     b < LB_MAX_BACKENDS && listed < BACKENDS_PER_PAGE; b++) {
		const struct lb_backend *be = &s->current->backends[b];
		struct rte_tel_data *t;
		char name[32], addr[INET6_ADDRSTRLEN];

		if (be->state >= LB_BACKEND_UNUSED)
			continue;
		t = counter_dict(sum(offsetof(struct fwd_counters, backends), b));
		if (!t)
			break;
		inet_ntop(be->family == LB_FAMILY_V6 ? AF_INET6 : AF_INET, &be->addr, addr,
			  sizeof(addr));
		rte_tel_data_add_dict_string(t, "addr", addr);
		rte_tel_data_add_dict_string(t, "state", states[be->state]);
		snprintf(name, sizeof(name), "backend%u", b);
		add_container(d, name, t);
		listed++;
	}
	pthread_mutex_unlock(&s->lock);
}

static void ports(struct rte_tel_data *d)
{
	rte_tel_data_start_dict(d);
	for (unsigned int p = 0; p < view->nports; p++) {
		struct rte_tel_data *t = rte_tel_data_alloc();
		struct lb_port_stats ps;
		char name[32];

		if (!t)
			break;
		fwd_port_read_stats(&view->ports[p], &ps);
		rte_tel_data_start_dict(t);
		rte_tel_data_add_dict_string(t, "device", view->ports[p].data_name);
		rte_tel_data_add_dict_u64(t, "rx_packets", ps.rx_packets);
		rte_tel_data_add_dict_u64(t, "tx_packets", ps.tx_packets);
		rte_tel_data_add_dict_u64(t, "rx_missed", ps.rx_missed);
		rte_tel_data_add_dict_u64(t, "rx_errors", ps.rx_errors);
		rte_tel_data_add_dict_u64(t, "tx_errors", ps.tx_errors);
		rte_tel_data_add_dict_u64(t, "rx_nombuf", ps.rx_nombuf);
		rte_tel_data_add_dict_u64(t, "rx_crc_errors", ps.rx_crc_errors);
		snprintf(name, sizeof(name), "port%u", p);
		add_container(d, name, t);
	}
}

/* One entry point: the view is read only under its lock. */
static int command(const char *cmd, const char *params, struct rte_tel_data *d)
{
	int rc = 0;

	pthread_mutex_lock(&view_lock);
	if (!view)
		rc = -1; /* shutting down */
	else if (!strcmp(cmd, "/hpclb/stats"))
		stats(d);
	else if (!strcmp(cmd, "/hpclb/workers"))
		workers(d);
	else if (!strcmp(cmd, "/hpclb/vips"))
		vips(d);
	else if (!strcmp(cmd, "/hpclb/backends"))
		backends(d, params);
	else if (!strcmp(cmd, "/hpclb/ports"))
		ports(d);
	else
		rc = -1;
	pthread_mutex_unlock(&view_lock);
	return rc;
}

int fwd_telemetry_register(const struct fwd_telemetry_view *v)
{
	static const struct {
		const char *cmd, *help;
	} cmds[] = {
		{ "/hpclb/stats", "hpclb global counters (LB_STAT_NAMES) and totals. No parameters" },
		{ "/hpclb/workers", "hpclb per-worker frames, cycles, burst size. No parameters" },
		{ "/hpclb/vips", "hpclb per-VIP packets and bytes. No parameters" },
		{ "/hpclb/backends", "hpclb per-backend packets, bytes, state: 200 configured "
				     "backends from id Parameter (default 0)" },
		{ "/hpclb/ports", "hpclb port counters (rx_missed, errors, CRC). No parameters" },
	};
	int rc = 0;

	pthread_mutex_lock(&view_lock);
	view = v;
	pthread_mutex_unlock(&view_lock);
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		rc |= rte_telemetry_register_cmd(cmds[i].cmd, command, cmds[i].help);
	return rc ? -EINVAL : 0;
}

void fwd_telemetry_stop(void)
{
	pthread_mutex_lock(&view_lock);
	view = NULL;
	pthread_mutex_unlock(&view_lock);
}
