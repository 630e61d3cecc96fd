/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>

#include "fwd_ports.h"
#include "lb_log.h"

/* Deep for PMDs that honour it. net_af_xdp (DPDK 22.11) posts only 2048 buffers to
 * its fill ring whatever is asked here: that, not this, bounds how long a stalled
 * worker can be away on AF_XDP (13.7 ms at 150 kpps). */
#define RX_DESC 4096
#define TX_DESC 1024
#define POOL_CACHE 256
#define MAX_XSTATS 512

int fwd_port_parse(const char *spec, struct fwd_port *p)
{
	const char *colon = strchr(spec, ':');
	size_t n = colon ? (size_t)(colon - spec) : strlen(spec);

	memset(p, 0, sizeof(*p));
	p->data_id = p->tap_id = FWD_NO_PORT;
	if (n == 0 || n >= sizeof(p->data_name) || (colon && (!colon[1] ||
	    strlen(colon + 1) >= sizeof(p->tap_name) || strchr(colon + 1, ':'))))
		return -1;
	memcpy(p->data_name, spec, n);
	if (colon)
		snprintf(p->tap_name, sizeof(p->tap_name), "%s", colon + 1);
	return 0;
}

static struct rte_mempool *pool_for(int socket_id, unsigned int nmbufs)
{
	char name[RTE_MEMPOOL_NAMESIZE];
	struct rte_mempool *mp;

	snprintf(name, sizeof(name), "hpclb_mbuf_%d", socket_id);
	mp = rte_mempool_lookup(name);
	if (mp)
		return mp;
	mp = rte_pktmbuf_pool_create(name, nmbufs, POOL_CACHE, 0, RTE_MBUF_DEFAULT_BUF_SIZE,
				     socket_id);
	if (!mp)
		lb_log(LB_LOG_ERR, "mbuf pool on socket %d: %s", socket_id,
		       rte_strerror(rte_errno));
	return mp;
}

static int start_dev(uint16_t id, const char *name, unsigned int nq, struct rte_mempool *mp)
{
	struct rte_eth_dev_info info;
	struct rte_eth_conf conf;
	uint16_t nrx = RX_DESC, ntx = TX_DESC;
	int rc;

	memset(&conf, 0, sizeof(conf));
	rc = rte_eth_dev_info_get(id, &info);
	if (rc)
		return rc;
	if (nq > info.max_rx_queues || nq > info.max_tx_queues) {
		lb_log(LB_LOG_ERR, "%s: %u queues asked, the device has %u RX / %u TX", name, nq,
		       info.max_rx_queues, info.max_tx_queues);
		return -EINVAL;
	}
	if (nq > 1) {
		/* Spread flows over the workers by their 5-tuple: a flow always
		 * lands on one worker, whose affinity table it lives in. */
		uint64_t hf = (RTE_ETH_RSS_IP | RTE_ETH_RSS_TCP | RTE_ETH_RSS_UDP) &
			      info.flow_type_rss_offloads;

		if (!hf && !strstr(name, "af_packet") && !strstr(name, "af_xdp")) {
			/* af_packet steers by its fanout hash, af_xdp by the kernel
			 * NIC's RSS; a device without either would spray a flow
			 * over the workers. */
			lb_log(LB_LOG_ERR, "%s: %u queues but no RSS on IP/TCP/UDP: run one "
			       "worker, or a NIC with RSS", name, nq);
			return -ENOTSUP;
		}
		if (hf) {
			conf.rxmode.mq_mode = RTE_ETH_MQ_RX_RSS;
			conf.rx_adv_conf.rss_conf.rss_hf = hf;
		}
	}
	rc = rte_eth_dev_configure(id, (uint16_t)nq, (uint16_t)nq, &conf);
	if (rc)
		return rc;
	rc = rte_eth_dev_adjust_nb_rx_tx_desc(id, &nrx, &ntx); /* the device's limits */
	if (rc)
		return rc;
	for (unsigned int q = 0; q < nq; q++) {
		rc = rte_eth_rx_queue_setup(id, (uint16_t)q, nrx, rte_eth_dev_socket_id(id),
					    NULL, mp);
		if (rc)
			return rc;
		rc = rte_eth_tx_queue_setup(id, (uint16_t)q, ntx, rte_eth_dev_socket_id(id),
					    NULL);
		if (rc)
			return rc;
	}
	return rte_eth_dev_start(id);
}

static int check_numa(const struct fwd_port *p, unsigned int nq, const unsigned int *lcores,
		      bool strict)
{
	for (unsigned int w = 0; w < nq; w++) {
		int ls = (int)rte_lcore_to_socket_id(lcores[w]);

		if (p->socket_id == SOCKET_ID_ANY || ls == p->socket_id)
			continue;
		lb_log(strict ? LB_LOG_ERR : LB_LOG_WARN,
		       "worker lcore %u is on NUMA socket %d, port %s on socket %d: every "
		       "packet crosses the interconnect%s", lcores[w], ls, p->data_name,
		       p->socket_id, strict ? " (refused: numa strict)" : "");
		if (strict)
			return -EINVAL;
	}
	return 0;
}

int fwd_ports_start(struct fwd_port *ports, unsigned int nports, unsigned int nqueues,
		    const unsigned int *worker_lcores, bool numa_strict)
{
	/* Every queue's ring full, plus the per-lcore caches, plus bursts in flight. */
	unsigned int nmbufs = 2 * nports * nqueues * (RX_DESC + TX_DESC) +
			      (nqueues + 1) * POOL_CACHE + 4096;

	for (unsigned int i = 0; i < nports; i++) {
		struct fwd_port *p = &ports[i];
		struct rte_ether_addr mac;
		int rc;

		if (rte_eth_dev_get_port_by_name(p->data_name, &p->data_id)) {
			lb_log(LB_LOG_ERR, "no DPDK port named %s (is its --vdev or PCI device "
			       "in the EAL arguments?)", p->data_name);
			return -ENODEV;
		}
		p->socket_id = rte_eth_dev_socket_id(p->data_id);
		if (check_numa(p, nqueues, worker_lcores, numa_strict))
			return -EINVAL;
		p->pool = pool_for(p->socket_id, nmbufs);
		if (!p->pool)
			return -ENOMEM;
		rc = start_dev(p->data_id, p->data_name, nqueues, p->pool);
		if (rc) {
			lb_log(LB_LOG_ERR, "starting %s: %s", p->data_name, rte_strerror(-rc));
			return rc;
		}
		rte_eth_macaddr_get(p->data_id, &mac);
		memcpy(p->mac, mac.addr_bytes, 6);
		/* DSR frames arrive for the VIP's MAC, which is this port's; the
		 * kernel behind the TAP also wants broadcasts and its multicast. */
		rc = rte_eth_promiscuous_enable(p->data_id);
		if (rc)
			lb_log(LB_LOG_WARN, "%s: promiscuous mode: %s", p->data_name,
			       rte_strerror(-rc));
		if (!p->tap_name[0])
			continue;
		if (rte_eth_dev_get_port_by_name(p->tap_name, &p->tap_id)) {
			lb_log(LB_LOG_ERR, "no DPDK port named %s (exception path of %s)",
			       p->tap_name, p->data_name);
			return -ENODEV;
		}
		rc = rte_eth_dev_default_mac_addr_set(p->tap_id, &mac);
		if (rc)
			lb_log(LB_LOG_WARN, "%s: cannot take the MAC of %s: %s", p->tap_name,
			       p->data_name, rte_strerror(-rc));
		rc = start_dev(p->tap_id, p->tap_name, nqueues, p->pool);
		if (rc) {
			lb_log(LB_LOG_ERR, "starting %s: %s", p->tap_name, rte_strerror(-rc));
			return rc;
		}
	}
	return 0;
}

void fwd_ports_stop(struct fwd_port *ports, unsigned int nports)
{
	for (unsigned int i = 0; i < nports; i++) {
		uint16_t ids[2] = { ports[i].data_id, ports[i].tap_id };

		for (int k = 0; k < 2; k++) {
			if (ids[k] == FWD_NO_PORT)
				continue;
			rte_eth_dev_stop(ids[k]);
			rte_eth_dev_close(ids[k]);
		}
	}
}

void fwd_port_info(const struct fwd_port *p, struct lb_proto_port *out)
{
	struct rte_eth_dev_info info;

	memset(out, 0, sizeof(*out));
	/* IFNAMSIZ-long in the protocol: a longer device name is cut. */
	memcpy(out->ifname, p->data_name, sizeof(out->ifname) - 1);
	if (p->data_id != FWD_NO_PORT && rte_eth_dev_info_get(p->data_id, &info) == 0)
		out->ifindex = info.if_index;
	memcpy(out->mac, p->mac, 6);
}

int fwd_port_read_stats(const struct fwd_port *p, struct lb_port_stats *out)
{
	struct rte_eth_xstat_name names[MAX_XSTATS];
	struct rte_eth_xstat xs[MAX_XSTATS];
	struct rte_eth_stats st;
	int n;

	memset(out, 0, sizeof(*out));
	if (p->data_id == FWD_NO_PORT || rte_eth_stats_get(p->data_id, &st))
		return -ENODEV;
	out->rx_packets = st.ipackets;
	out->rx_bytes = st.ibytes;
	out->tx_packets = st.opackets;
	out->tx_bytes = st.obytes;
	out->rx_missed = st.imissed;
	out->rx_errors = st.ierrors;
	out->tx_errors = st.oerrors;
	out->rx_nombuf = st.rx_nombuf;
	n = rte_eth_xstats_get_names(p->data_id, names, MAX_XSTATS);
	if (n <= 0 || n > MAX_XSTATS || rte_eth_xstats_get(p->data_id, xs, (unsigned int)n) != n)
		return 0; /* the basic counters stand on their own */
	for (int i = 0; i < n; i++)
		if (xs[i].id < (uint64_t)n && strstr(names[xs[i].id].name, "crc"))
			out->rx_crc_errors += xs[i].value;
	return 0;
}
