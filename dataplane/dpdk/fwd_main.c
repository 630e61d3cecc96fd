/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_main.c - hpclb-dpdk, the DPDK forwarder.
 *
 *   hpclb-dpdk [EAL options] -- --port DEV[:TAP] [--port DEV[:TAP]]...
 *              [--socket ENDPOINT] [--ring-size PRIME] [--flow-table-size N]
 *              [--flow-timeout S] [--conn-table-size N] [--netns NAME]
 *              [--idle-sleep-us N] [--numa strict|warn] [--log-level L]
 *              [--alive-interface NAME]
 *              [--bench-frames PCAP [--bench macswap|forget-flows]]
 *
 * The main lcore serves the table protocol (lb_proto_ops.c) as hpclb-xdp
 * does, with the same options, signals and control channel (lb_daemon.c),
 * and registers the telemetry commands; every other lcore of the EAL core
 * list is a worker (fwd_worker.c). Tables are swapped under RCU
 * (fwd_tables.c), so serving a request never stops a worker. NAT mode's
 * connection tables (fwd_conn.c: one per family, --conn-table-size entries
 * each) are each one for all workers. The control plane renders the EAL options from its templates.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <rte_cycles.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_lcore.h>
#include <rte_malloc.h>

#include "fwd_bench.h"
#include "fwd_ports.h"
#include "fwd_tables.h"
#include "fwd_telemetry.h"
#include "fwd_worker.h"
#include "lb_daemon.h"
#include "lb_host.h"
#include "lb_log.h"

#define PROG "hpclb-dpdk"
#define DEFAULT_FLOWS 262144      /* per worker */
#define MAX_FLOWS_OPT (1u << 26)  /* per worker */
#define DEFAULT_FLOW_TIMEOUT_S 300

/* Milliseconds from a to b (CLOCK_MONOTONIC): the start-up line's figures. */
static double ms_between(const struct timespec *a, const struct timespec *b)
{
	return (double)(b->tv_sec - a->tv_sec) * 1e3 + (double)(b->tv_nsec - a->tv_nsec) / 1e6;
}

struct opts {
	struct lb_daemon_opts common; /* --socket, --ring-size (--log-level) */
	struct fwd_port ports[LB_MAX_PORTS];
	unsigned int nports;
	const char *netns;
	__u32 flow_table_size;
	__u32 flow_timeout_s;
	__u32 conn_table_size; /* NAT connection-table entries, all workers together */
	__u32 idle_sleep_us;
	bool numa_strict;
	enum fwd_bench bench;
	const char *bench_frames; /* pcap whose frames circulate on port 0 (fwd_bench.h) */
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: " PROG " [EAL options] -- --port DEV[:TAP]... [--socket ENDPOINT]\n"
		"       [--ring-size PRIME] [--flow-table-size N] [--flow-timeout S]\n"
		"       [--conn-table-size N] [--netns NAME] [--idle-sleep-us N]\n"
		"       [--numa strict|warn] [--bench-frames PCAP [--bench macswap|forget-flows]]\n"
		"       [--alive-interface NAME] [--log-level error|warn|info|debug]\n"
		"--alive-interface: a TUN device that exists while this process lives (in the\n"
		"--netns namespace), for the BGP speaker's routes to the VIPs.\n"
		"DEV is a DPDK device name (net_af_xdp0, 0000:3b:00.0), TAP the net_tap vdev\n"
		"that is its exception path to the kernel. The first --port is port 0.\n"
		"defaults: --socket " LB_DAEMON_DEFAULT_SOCKET ", --ring-size %u, "
		"--flow-table-size %u\n"
		"          (per worker), --flow-timeout %u, --conn-table-size %u (entries, two\n"
		"          per NAT connection, in each family's table, shared by the workers),\n"
		"          --idle-sleep-us 0, --numa warn\n"
		"--bench-frames and --bench are for cost measurements only (hpclb.lab.dpdk_cost):\n"
		"port 0 is a net_ring loop fed once with the frames of PCAP, which circulate;\n"
		"--bench macswap sends every frame back with its MACs swapped, forget-flows\n"
		"empties the flow table whenever it is half full.\n",
		LB_RING_SIZE_DEFAULT, DEFAULT_FLOWS, DEFAULT_FLOW_TIMEOUT_S, LB_CONN_TABLE_DEFAULT);
}

static int parse_args(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "port", required_argument, NULL, 'P' },
		LB_DAEMON_OPTION_SOCKET,
		LB_DAEMON_OPTION_RING_SIZE,
		{ "flow-table-size", required_argument, NULL, 'f' },
		{ "flow-timeout", required_argument, NULL, 't' },
		{ "conn-table-size", required_argument, NULL, 'C' },
		{ "netns", required_argument, NULL, 'n' },
		{ "idle-sleep-us", required_argument, NULL, 'i' },
		{ "numa", required_argument, NULL, 'N' },
		{ "bench", required_argument, NULL, 'B' },
		{ "bench-frames", required_argument, NULL, 'F' },
		LB_DAEMON_OPTION_ALIVE_INTERFACE,
		LB_DAEMON_OPTION_LOG_LEVEL,
		{ "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	int c, rc;

	memset(o, 0, sizeof(*o));
	lb_daemon_opts_init(&o->common);
	o->flow_table_size = DEFAULT_FLOWS;
	o->flow_timeout_s = DEFAULT_FLOW_TIMEOUT_S;
	o->conn_table_size = LB_CONN_TABLE_DEFAULT;
	optind = 1;
	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case 'P':
			if (o->nports == LB_MAX_PORTS) {
				lb_log(LB_LOG_ERR, "at most %d --port", LB_MAX_PORTS);
				return -1;
			}
			if (fwd_port_parse(optarg, &o->ports[o->nports])) {
				lb_log(LB_LOG_ERR, "bad --port '%s' (DEV or DEV:TAP)", optarg);
				return -1;
			}
			o->nports++;
			break;
		case 'f':
			if (lb_parse_u32(optarg, &o->flow_table_size) || o->flow_table_size < 64 ||
			    o->flow_table_size > MAX_FLOWS_OPT) {
				lb_log(LB_LOG_ERR, "--flow-table-size must be in 64..%u, got '%s'",
				       MAX_FLOWS_OPT, optarg);
				return -1;
			}
			break;
		case 't':
			if (lb_parse_u32(optarg, &o->flow_timeout_s) || o->flow_timeout_s < 1 ||
			    o->flow_timeout_s > 86400) {
				lb_log(LB_LOG_ERR, "--flow-timeout must be 1..86400 seconds");
				return -1;
			}
			break;
		case 'C':
			/* Even: two entries per connection, so "full" is exact. */
			if (lb_parse_u32(optarg, &o->conn_table_size) ||
			    o->conn_table_size < LB_CONN_TABLE_MIN ||
			    o->conn_table_size > LB_CONN_TABLE_MAX || o->conn_table_size % 2) {
				lb_log(LB_LOG_ERR, "--conn-table-size must be an even number in "
				       "%u..%u, got '%s'", LB_CONN_TABLE_MIN, LB_CONN_TABLE_MAX,
				       optarg);
				return -1;
			}
			break;
		case 'n':
			if (!lb_valid_netns(optarg)) {
				lb_log(LB_LOG_ERR, "bad --netns name '%s'", optarg);
				return -1;
			}
			o->netns = optarg;
			break;
		case 'i':
			if (lb_parse_u32(optarg, &o->idle_sleep_us) || o->idle_sleep_us > 100000) {
				lb_log(LB_LOG_ERR, "--idle-sleep-us must be 0..100000");
				return -1;
			}
			break;
		case 'N':
			if (strcmp(optarg, "strict") && strcmp(optarg, "warn")) {
				lb_log(LB_LOG_ERR, "--numa must be strict or warn");
				return -1;
			}
			o->numa_strict = !strcmp(optarg, "strict");
			break;
		case 'B':
			if (!strcmp(optarg, "macswap")) {
				o->bench = FWD_BENCH_MACSWAP;
			} else if (!strcmp(optarg, "forget-flows")) {
				o->bench = FWD_BENCH_FORGET_FLOWS;
			} else {
				lb_log(LB_LOG_ERR, "--bench must be macswap or forget-flows");
				return -1;
			}
			break;
		case 'F':
			o->bench_frames = optarg;
			break;
		case 'h':
			usage(stdout);
			exit(0);
		default:
			rc = lb_daemon_parse_opt(&o->common, c, optarg);
			if (rc > 0)
				break;
			if (rc == 0)
				usage(stderr);
			return -1;
		}
	}
	if (lb_daemon_check_operands(argc, argv))
		return -1;
	if (o->bench != FWD_BENCH_OFF && !o->bench_frames) {
		lb_log(LB_LOG_ERR, "--bench needs --bench-frames (a memory-fed port)");
		return -1;
	}
	if (!o->nports) {
		lb_log(LB_LOG_ERR, "at least one --port is required");
		usage(stderr);
		return -1;
	}
	return 0;
}

/* Index of "--" in argv, or argc: EAL options come before it, ours after. */
static int split_args(int argc, char **argv)
{
	for (int i = 1; i < argc; i++)
		if (!strcmp(argv[i], "--"))
			return i;
	return argc;
}

static const char *const capabilities[] = { "dsr", "nat", "nat6", "tunnel", "patch_ring",
					    "redirect", "arp_reply", "ndp_reply", "rcu_tables",
					    NULL };

static struct fwd_context ctx;
static struct fwd_port *ports_for_stats;

static int read_port_stats(void *c, __u32 port, struct lb_port_stats *out)
{
	(void)c;
	return fwd_port_read_stats(&ports_for_stats[port], out);
}

static int read_stats(void *c, struct lb_counter *g, struct lb_counter *v, struct lb_counter *b)
{
	return fwd_tables_ops.read_stats(c, g, v, b);
}

static int start_workers(struct fwd_worker *workers, const struct opts *o,
			 const unsigned int *lcores, unsigned int n, const __u8 (*macs)[6])
{
	__u64 timeout_tsc = (__u64)o->flow_timeout_s * rte_get_tsc_hz();

	for (unsigned int i = 0; i < n; i++) {
		struct fwd_worker *w = &workers[i];
		char name[32];
		/* Only this worker touches its flow table: its own NUMA node. */
		int socket = (int)rte_lcore_to_socket_id(lcores[i]);
		int rc;

		w->index = i;
		w->lcore = lcores[i];
		w->store = &ctx.store;
		w->ports = o->ports;
		w->nports = o->nports;
		w->port_macs = macs;
		w->idle_sleep_us = o->idle_sleep_us;
		w->bench = o->bench;
		w->bench_loop = o->bench_frames != NULL;
		w->bench_frames = i == 0 ? o->bench_frames : NULL;
		w->stop = &lb_daemon_stop;
		w->counters = ctx.counters[i];
		w->conns = ctx.conns;
		fwd_conn_sweep_init(ctx.conns, &w->conn_sweep, i, n);
		w->conns6 = ctx.conns6;
		fwd_conn6_sweep_init(ctx.conns6, &w->conn6_sweep, i, n);
		snprintf(name, sizeof(name), "hpclb_flows_%u", i);
		rc = fwd_flow_init(&w->flows, name, o->flow_table_size, timeout_tsc, socket);
		if (rc) {
			lb_log(LB_LOG_ERR, "flow table of worker %u (%u entries): %s", i,
			       o->flow_table_size, strerror(-rc));
			return rc;
		}
	}
	for (unsigned int i = 0; i < n; i++)
		rte_eal_remote_launch(fwd_worker_main, &workers[i], workers[i].lcore);
	return 0;
}

int main(int argc, char **argv)
{
	static struct fwd_worker workers[RTE_MAX_LCORE];
	static unsigned int lcores[RTE_MAX_LCORE];
	static __u8 macs[LB_MAX_PORTS][6];
	struct lb_dataplane_ops ops = fwd_tables_ops;
	struct lb_proto_server *srv = NULL;
	struct fwd_telemetry_view tview;
	struct lb_proto_info info;
	struct lb_config cfg;
	struct lb_daemon_ctl ctl = { 0 };
	unsigned int nworkers = 0, lcore;
	int split = split_args(argc, argv), ret = 1, eal_up = 0, ports_up = 0, rc;
	struct timespec wall0, t0, t_eal, t_ports, t_ready;
	struct opts o;

	/* Where a restart's time goes: the "start-up" line (read by
	 * perf/dpdk_restart.py and the lab's restart test). */
	clock_gettime(CLOCK_REALTIME, &wall0);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	lb_log_init(PROG);
	if (split == argc) {
		lb_log(LB_LOG_ERR, "missing '--' between the EAL options and the forwarder's");
		usage(stderr);
		return 2;
	}
	/* getopt names the program by the vector's first element: "--" here,
	 * which the EAL (given argv[0..split-1]) never sees. */
	argv[split] = argv[0];
	if (parse_args(argc - split, argv + split, &o))
		return 2;
	/* Before the EAL: vdevs bind to interfaces, and create TAPs, in the
	 * namespace the process is in when they probe. */
	if (o.netns && lb_enter_netns(o.netns))
		return 1;
	lb_daemon_signals(); /* only SIGTERM/SIGINT stop the forwarder */

	rc = rte_eal_init(split, argv);
	if (rc < 0) {
		lb_log(LB_LOG_ERR, "EAL init failed: %s", rte_strerror(rte_errno));
		return 1;
	}
	eal_up = 1;
	clock_gettime(CLOCK_MONOTONIC, &t_eal);
	RTE_LCORE_FOREACH_WORKER(lcore)
		lcores[nworkers++] = lcore;
	if (!nworkers) {
		lb_log(LB_LOG_ERR, "no worker lcore: give the EAL at least two cores (-l)");
		goto out;
	}
	/* Before starting them: a start that fails half way still closes what
	 * it opened (AF_XDP removes its program and net_tap its interface only
	 * on close). */
	ports_up = 1;
	if (fwd_ports_start(o.ports, o.nports, nworkers, lcores, o.numa_strict))
		goto out;
	clock_gettime(CLOCK_MONOTONIC, &t_ports);
	for (unsigned int p = 0; p < o.nports; p++) {
		memcpy(macs[p], o.ports[p].mac, 6);
		if (o.ports[p].tap_id == FWD_NO_PORT)
			lb_log(LB_LOG_WARN, "%s has no exception path: what is not for a VIP is "
			       "dropped", o.ports[p].data_name);
	}

	if (lb_daemon_initial_config(&cfg, o.common.ring_size))
		goto out;
	if (fwd_store_init(&ctx.store, &cfg, nworkers, o.ports[0].socket_id)) {
		lb_log(LB_LOG_ERR, "tables: out of hugepage memory");
		goto out;
	}
	ctx.nworkers = nworkers;
	ctx.counters = rte_zmalloc("hpclb_counter_ptrs", nworkers * sizeof(*ctx.counters), 0);
	for (unsigned int i = 0; ctx.counters && i < nworkers; i++)
		ctx.counters[i] = rte_zmalloc_socket("hpclb_counters", sizeof(struct fwd_counters),
						     RTE_CACHE_LINE_SIZE,
						     (int)rte_lcore_to_socket_id(lcores[i]));
	for (unsigned int i = 0; ctx.counters && i < nworkers; i++)
		if (!ctx.counters[i])
			ctx.counters = NULL;
	if (!ctx.counters) {
		lb_log(LB_LOG_ERR, "counters: out of hugepage memory");
		goto out;
	}
	/* One connection table for every worker (fwd_conn.h says why), on the
	 * first port's node like the tables. */
	ctx.conns = rte_zmalloc("hpclb_conn_table", sizeof(*ctx.conns), RTE_CACHE_LINE_SIZE);
	rc = ctx.conns ? fwd_conn_init(ctx.conns, "hpclb_conns", o.conn_table_size, nworkers,
				       ctx.store.qsbr, o.ports[0].socket_id)
		       : -ENOMEM;
	if (rc) {
		lb_log(LB_LOG_ERR, "NAT connection table (%u entries): %s", o.conn_table_size,
		       strerror(-rc));
		rte_free(ctx.conns);
		ctx.conns = NULL;
		goto out;
	}
	/* The IPv6 one beside it, as large (--conn-table-size entries each). */
	ctx.conns6 = rte_zmalloc("hpclb_conn6_table", sizeof(*ctx.conns6), RTE_CACHE_LINE_SIZE);
	rc = ctx.conns6 ? fwd_conn6_init(ctx.conns6, "hpclb_conns6", o.conn_table_size, nworkers,
					 ctx.store.qsbr, o.ports[0].socket_id)
			: -ENOMEM;
	if (rc) {
		lb_log(LB_LOG_ERR, "IPv6 NAT connection table (%u entries): %s", o.conn_table_size,
		       strerror(-rc));
		rte_free(ctx.conns6);
		ctx.conns6 = NULL;
		goto out;
	}

	memset(&info, 0, sizeof(info));
	info.dataplane = "dpdk";
	info.attach_mode = "poll";
	info.capabilities = capabilities;
	info.tunnel = true; /* tunnel mode (fwd_packet.c, lb_encap.h): set_vip takes mode 2 */
	info.nat6 = true; /* NAT mode for IPv6 VIPs (fwd_packet.c, the IPv6 table) */
	info.conn_table_size = o.conn_table_size; /* entries per family's table */
	info.nports = o.nports;
	for (unsigned int p = 0; p < o.nports; p++)
		fwd_port_info(&o.ports[p], &info.ports[p]);
	ports_for_stats = o.ports;
	ops.read_stats = read_stats;
	ops.read_port_stats = read_port_stats;
	srv = lb_proto_server_new(&ops, &ctx, &info, &cfg);
	if (!srv) {
		lb_log(LB_LOG_ERR, "creating the protocol server: out of memory");
		goto out;
	}
	if (lb_daemon_ctl_open(&ctl, o.common.socket))
		goto out;
	if (start_workers(workers, &o, lcores, nworkers, (const __u8(*)[6])macs))
		goto out;
	tview.ctx = &ctx;
	tview.ports = o.ports;
	tview.nports = o.nports;
	tview.workers = workers;
	if (fwd_telemetry_register(&tview))
		lb_log(LB_LOG_WARN, "registering the telemetry commands failed");
	lb_log(LB_LOG_INFO, "%u worker(s), %u port(s), ring %u slots, %u flows per worker, "
	       "%u NAT connection entries per family", nworkers, o.nports, o.common.ring_size,
	       o.flow_table_size, o.conn_table_size);
	if (o.bench_frames)
		lb_log(LB_LOG_WARN, "--bench-frames%s: a cost measurement, not a load balancer",
		       o.bench == FWD_BENCH_MACSWAP ? " --bench macswap" :
		       o.bench == FWD_BENCH_FORGET_FLOWS ? " --bench forget-flows" : "");
	/* The workers forward: the speaker may announce through it. */
	lb_daemon_alive_up(o.common.alive_iface);
	lb_log(LB_LOG_INFO, "serving %s", o.common.socket);
	clock_gettime(CLOCK_MONOTONIC, &t_ready);
	lb_log(LB_LOG_INFO, "start-up: main at %lld.%06ld, EAL init %.1f ms, ports %.1f ms, "
	       "tables and workers %.1f ms, ready after %.1f ms", (long long)wall0.tv_sec,
	       wall0.tv_nsec / 1000, ms_between(&t0, &t_eal), ms_between(&t_eal, &t_ports),
	       ms_between(&t_ports, &t_ready), ms_between(&t0, &t_ready));
	if (lb_daemon_ctl_serve(&ctl, srv) == 0)
		ret = 0;
out:
	lb_daemon_stop = 1; /* the workers' stop too */
	if (eal_up)
		rte_eal_mp_wait_lcore();
	fwd_telemetry_stop();
	lb_daemon_ctl_close(&ctl);
	lb_proto_server_free(srv);
	if (ports_up)
		fwd_ports_stop(o.ports, o.nports);
	for (unsigned int i = 0; i < nworkers; i++)
		fwd_flow_free(&workers[i].flows);
	if (ctx.conns) {
		fwd_conn_free(ctx.conns);
		rte_free(ctx.conns);
	}
	if (ctx.conns6) {
		fwd_conn6_free(ctx.conns6);
		rte_free(ctx.conns6);
	}
	if (ctx.store.current)
		fwd_store_free(&ctx.store);
	if (eal_up)
		rte_eal_cleanup();
	return ret;
}
