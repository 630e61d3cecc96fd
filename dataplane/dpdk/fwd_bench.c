/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>

#include "fwd_bench.h"
#include "lb_log.h"

#define PCAP_MAGIC_US 0xa1b2c3d4u
#define PCAP_MAGIC_NS 0xa1b23c4du
#define PCAP_LINKTYPE_ETHERNET 1
#define MAX_FRAME 2048

struct pcap_file_hdr {
	uint32_t magic;
	uint16_t major, minor;
	int32_t zone;
	uint32_t sigfigs, snaplen, linktype;
};

struct pcap_rec_hdr {
	uint32_t sec, frac, incl_len, orig_len;
};

static uint32_t swap32_if(uint32_t v, bool swap)
{
	return swap ? __builtin_bswap32(v) : v;
}

/* Sends one frame (copied into a fresh mbuf) on queue 0 of port_id. */
static int send_one(uint16_t port_id, struct rte_mempool *mp, const uint8_t *frame,
		    uint32_t len)
{
	struct rte_mbuf *m = rte_pktmbuf_alloc(mp);
	char *dst;

	if (!m)
		return -ENOMEM;
	dst = rte_pktmbuf_append(m, (uint16_t)len);
	if (!dst) {
		rte_pktmbuf_free(m);
		return -ENOSPC;
	}
	memcpy(dst, frame, len);
	if (rte_eth_tx_burst(port_id, 0, &m, 1) != 1) {
		rte_pktmbuf_free(m); /* the loop is full: the frames sent so far circulate */
		return -ENOBUFS;
	}
	return 0;
}

int fwd_bench_prime(uint16_t port_id, struct rte_mempool *mp, const char *path,
		    unsigned int max_frames)
{
	static uint8_t frame[MAX_FRAME];
	struct pcap_file_hdr fh;
	struct pcap_rec_hdr rh;
	unsigned int sent = 0;
	bool swap;
	int rc = 0;
	FILE *f = fopen(path, "rb");

	if (!f) {
		lb_log(LB_LOG_ERR, "--bench-frames %s: %s", path, strerror(errno));
		return -errno;
	}
	if (fread(&fh, sizeof(fh), 1, f) != 1) {
		rc = -EINVAL;
		goto out;
	}
	swap = fh.magic == __builtin_bswap32(PCAP_MAGIC_US) ||
	       fh.magic == __builtin_bswap32(PCAP_MAGIC_NS);
	if ((swap32_if(fh.magic, swap) != PCAP_MAGIC_US &&
	     swap32_if(fh.magic, swap) != PCAP_MAGIC_NS) ||
	    swap32_if(fh.linktype, swap) != PCAP_LINKTYPE_ETHERNET) {
		rc = -EINVAL;
		goto out;
	}
	while (sent < max_frames && fread(&rh, sizeof(rh), 1, f) == 1) {
		uint32_t len = swap32_if(rh.incl_len, swap);

		if (len < 14 || len > MAX_FRAME ||
		    len > (uint32_t)rte_pktmbuf_data_room_size(mp) - RTE_PKTMBUF_HEADROOM ||
		    fread(frame, len, 1, f) != 1) {
			rc = -EINVAL;
			goto out;
		}
		rc = send_one(port_id, mp, frame, len);
		if (rc == -ENOBUFS) {
			rc = 0;
			break;
		}
		if (rc)
			goto out;
		sent++;
	}
out:
	fclose(f);
	if (rc) {
		lb_log(LB_LOG_ERR, "--bench-frames %s: %s (a pcap of Ethernet frames up to "
		       "%d bytes)", path, strerror(-rc), MAX_FRAME);
		return rc;
	}
	lb_log(LB_LOG_INFO, "--bench-frames: %u frames circulate on port %u", sent, port_id);
	return (int)sent;
}
