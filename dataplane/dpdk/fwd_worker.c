/* SPDX-License-Identifier: Apache-2.0 */
#include <unistd.h>
#include <rte_cycles.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>
#include <rte_prefetch.h>

#include "fwd_bench.h"
#include "fwd_packet.h"
#include "fwd_worker.h"

#define BURST 32
#define EXPIRE_EVERY 16     /* loop iterations between two expiry slices */
#define EXPIRE_BUDGET 32    /* table positions looked at per slice (each table) */
#define IDLE_LOOPS 256      /* empty loops before an idle worker sleeps */
/* While the data ports deliver, the exception TAPs are read every this many
 * loops rather than every loop: reading a TAP is a readv() system call even
 * when it has nothing (net_tap), which on a busy worker cost more than the
 * frames it forwarded (a profile of the worker at 200 kpps on net_af_xdp:
 * readv and its kernel side more than a tenth of its time); 32 frames per
 * TAP every 8 loops still carries far more than exception traffic. A worker
 * whose data ports were idle in a loop reads them every loop. */
#define KERNEL_POLL_EVERY 8
#define PREFETCH_AHEAD 4    /* frames whose headers are fetched ahead of the one parsed */

struct tx_buffer {
	struct rte_mbuf *m[BURST];
	unsigned int n;
};

/* Sends what is buffered; frees (and counts) what the queue refused. */
static void flush(struct fwd_worker *w, uint16_t port_id, struct tx_buffer *b)
{
	uint16_t sent;

	if (!b->n || port_id == FWD_NO_PORT) {
		rte_pktmbuf_free_bulk(b->m, b->n);
		w->tx_dropped += b->n;
		b->n = 0;
		return;
	}
	sent = rte_eth_tx_burst(port_id, (uint16_t)w->index, b->m, (uint16_t)b->n);
	if (sent < b->n) {
		rte_pktmbuf_free_bulk(&b->m[sent], b->n - sent);
		w->tx_dropped += b->n - sent;
		w->counters->global[LB_STAT_DROP_TX_ERROR].packets += b->n - sent;
	}
	b->n = 0;
}

/* Moves m's bounds to the frame fwd_packet left in f: tunnel mode's outer
 * headers before it, a reply longer or shorter than the request. 0, or -1
 * if the mbuf cannot (fwd_packet kept within the rooms, so it can). */
static inline int fit(struct rte_mbuf *m, const struct fwd_frame *f)
{
	__u8 *start = rte_pktmbuf_mtod(m, __u8 *);
	__u32 len = rte_pktmbuf_data_len(m);

	if (f->data == start && f->len == len) /* DSR, NAT, ARP: in place */
		return 0;
	if (f->data > start) /* fwd_packet never moves the start forward */
		return -1;
	if (f->data < start && !rte_pktmbuf_prepend(m, (uint16_t)(start - f->data)))
		return -1;
	len = rte_pktmbuf_data_len(m);
	if (f->len > len)
		return rte_pktmbuf_append(m, (uint16_t)(f->len - len)) ? 0 : -1;
	if (f->len < len)
		return rte_pktmbuf_trim(m, (uint16_t)(len - f->len));
	return 0;
}

/* Where frames for the kernel go: the exception port; when it has none,
 * nowhere (dropped), except in a --bench-frames loop, where they go back out
 * of the data port as if a TAP had returned them at once, so that they keep
 * circulating. */
static inline uint16_t kernel_port(const struct fwd_worker *w, unsigned int in)
{
	const struct fwd_port *p = &w->ports[in];

	return p->tap_id == FWD_NO_PORT && w->bench_loop ? p->data_id : p->tap_id;
}

/* One burst from the data port in_port: decide, then send by port. */
static unsigned int data_burst(struct fwd_worker *w, struct fwd_packet_ctx *c, unsigned int in)
{
	struct tx_buffer out[LB_MAX_PORTS];
	struct tx_buffer kernel;
	struct rte_mbuf *pkts[BURST];
	uint16_t n = rte_eth_rx_burst(w->ports[in].data_id, (uint16_t)w->index, pkts, BURST);

	if (n == 0)
		return 0;
	for (unsigned int p = 0; p < w->nports; p++)
		out[p].n = 0;
	kernel.n = 0;
	c->in_port = in;
	for (uint16_t i = 0; i < n && i < PREFETCH_AHEAD; i++)
		rte_prefetch0(rte_pktmbuf_mtod(pkts[i], void *));
	for (uint16_t i = 0; i < n; i++) {
		struct rte_mbuf *m = pkts[i];
		struct fwd_frame f;
		__u32 port = 0;
		enum fwd_verdict v;

		/* The headers of a frame a few ahead: a NIC wrote them by DMA,
		 * so they are not in this core's cache yet. */
		if (i + PREFETCH_AHEAD < n)
			rte_prefetch0(rte_pktmbuf_mtod(pkts[i + PREFETCH_AHEAD], void *));

		/* The parser reads one contiguous buffer. */
		if (m->nb_segs > 1 && rte_pktmbuf_linearize(m)) {
			w->counters->global[LB_STAT_RX].packets++;
			w->counters->global[LB_STAT_DROP_MALFORMED].packets++;
			rte_pktmbuf_free(m);
			continue;
		}
		f.data = rte_pktmbuf_mtod(m, __u8 *);
		f.len = rte_pktmbuf_data_len(m);
		f.headroom = rte_pktmbuf_headroom(m);
		f.tailroom = rte_pktmbuf_tailroom(m);
		v = fwd_packet(c, &f, &port);
		if ((v == FWD_OUT || v == FWD_REPLY) && fit(m, &f)) {
			/* cannot happen: fwd_packet stays within the rooms */
			w->counters->global[LB_STAT_DROP_TX_ERROR].packets++;
			v = FWD_DROP;
		}
		switch (v) {
		case FWD_OUT:
			out[port].m[out[port].n++] = m;
			break;
		case FWD_REPLY:
			out[in].m[out[in].n++] = m;
			break;
		case FWD_TO_KERNEL:
			kernel.m[kernel.n++] = m;
			break;
		default:
			rte_pktmbuf_free(m);
		}
	}
	for (unsigned int p = 0; p < w->nports; p++)
		if (out[p].n)
			flush(w, w->ports[p].data_id, &out[p]);
	if (kernel.n)
		flush(w, kernel_port(w, in), &kernel);
	return n;
}

/* --bench macswap: data_burst's I/O with the least per-frame work a
 * forwarder does (swap the MACs, send back), so that the difference is
 * fwd_packet's cost. */
static unsigned int macswap_burst(struct fwd_worker *w, unsigned int in)
{
	struct tx_buffer out;
	uint16_t n = rte_eth_rx_burst(w->ports[in].data_id, (uint16_t)w->index, out.m, BURST);

	if (n == 0)
		return 0;
	for (uint16_t i = 0; i < n; i++) {
		struct rte_ether_hdr *eth = rte_pktmbuf_mtod(out.m[i], struct rte_ether_hdr *);
		struct rte_ether_addr tmp = eth->dst_addr;

		eth->dst_addr = eth->src_addr;
		eth->src_addr = tmp;
	}
	out.n = n;
	flush(w, w->ports[in].data_id, &out);
	return n;
}

/* What the kernel sends through the TAP leaves by the TAP's data port. */
static unsigned int kernel_burst(struct fwd_worker *w, unsigned int p)
{
	struct tx_buffer b;
	uint16_t n;

	if (w->ports[p].tap_id == FWD_NO_PORT)
		return 0;
	n = rte_eth_rx_burst(w->ports[p].tap_id, (uint16_t)w->index, b.m, BURST);
	b.n = n;
	if (n)
		flush(w, w->ports[p].data_id, &b);
	return n;
}

int fwd_worker_main(void *arg)
{
	struct fwd_worker *w = arg;
	struct rte_rcu_qsbr *qsbr = w->store->qsbr;
	__u64 hz = rte_get_tsc_hz(), loops = 0, idle = 0, started = rte_rdtsc();
	struct fwd_packet_ctx c = {
		.flows = &w->flows,
		.conns = w->conns,
		.conns6 = w->conns6,
		.counters = w->counters,
		.port_macs = w->port_macs,
		.nports = w->nports,
	};

	rte_rcu_qsbr_thread_register(qsbr, w->index);
	rte_rcu_qsbr_thread_online(qsbr, w->index);
	while (!*w->stop) {
		unsigned int got = 0;
		__u64 tsc = rte_rdtsc();

		/* One table version per loop: loaded here, released by the
		 * quiescent state below, after its last use. */
		c.tables = fwd_tables_current(w->store);
		c.now_tsc = tsc;
		c.now_ns = (__u64)((double)tsc * 1e9 / (double)hz);
		/* --bench-frames: the frames go on the loop once the tables are
		 * in (before, fwd_packet would drop them), sent by the worker,
		 * the loop's only sender. */
		if (w->bench_frames && (c.tables->configured || w->bench == FWD_BENCH_MACSWAP)) {
			if (fwd_bench_prime(w->ports[0].data_id, w->ports[0].pool, w->bench_frames,
					    UINT32_MAX) <= 0)
				*w->stop = 1;
			w->bench_frames = NULL;
			continue;
		}
		bool expire = ++loops % EXPIRE_EVERY == 0;

		for (unsigned int p = 0; p < w->nports; p++)
			got += w->bench == FWD_BENCH_MACSWAP ? macswap_burst(w, p)
							     : data_burst(w, &c, p);
		if (!got || loops % KERNEL_POLL_EVERY == 0)
			for (unsigned int p = 0; p < w->nports; p++)
				got += kernel_burst(w, p);
		/* Before the quiescent state: the sweep reads the timeouts from
		 * this loop's tables. Skipped while a table is empty, which
		 * keeps DSR-only loops as they were. Each table has its own
		 * budget: one family's connections never wait on the other's. */
		if (expire && w->conns && !fwd_conn_at_rest(w->conns))
			fwd_conn_expire(w->conns, &w->counters->conns, &w->conn_sweep,
					c.tables->nat.timeouts_s, c.now_ns, EXPIRE_BUDGET);
		if (expire && w->conns6 && !fwd_conn6_at_rest(w->conns6))
			fwd_conn6_expire(w->conns6, &w->counters->conns, &w->conn6_sweep,
					 c.tables->nat.timeouts_s, c.now_ns, EXPIRE_BUDGET);
		rte_rcu_qsbr_quiescent(qsbr, w->index);
		if (got) {
			w->busy_cycles += rte_rdtsc() - tsc;
			w->busy_loops++;
			w->frames += got;
		}
		/* After the busy cycles are counted: emptying the table is the
		 * measurement's doing, not the forwarder's. */
		if (w->bench == FWD_BENCH_FORGET_FLOWS &&
		    fwd_flow_count(&w->flows) >= w->flows.capacity / 2)
			fwd_flow_reset(&w->flows);
		w->total_cycles = rte_rdtsc() - started;
		if (expire)
			fwd_flow_expire(&w->flows, tsc, EXPIRE_BUDGET);
		idle = got ? 0 : idle + 1;
		if (w->idle_sleep_us && idle >= IDLE_LOOPS) {
			/* Offline while asleep, so a table swap does not wait on us. */
			rte_rcu_qsbr_thread_offline(qsbr, w->index);
			usleep(w->idle_sleep_us);
			rte_rcu_qsbr_thread_online(qsbr, w->index);
		}
	}
	rte_rcu_qsbr_thread_offline(qsbr, w->index);
	rte_rcu_qsbr_thread_unregister(qsbr, w->index);
	return 0;
}
