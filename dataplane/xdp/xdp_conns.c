/* SPDX-License-Identifier: Apache-2.0
 *
 * xdp_conns.c - the NAT connection tables' sweeper and figures (xdp_conns.h).
 *
 * Each family has a table of its own (conn_map: IPv4, compact keys; conn6_map:
 * IPv6, the contract's struct lb_flow_key), with the same rules; a pass sweeps
 * both, one after the other, and sums their figures (the stats reply's
 * "conns"). The code below sees an entry of either through struct conn_view
 * (its keys widened to struct lb_flow_key) and goes back to the table's own
 * key layout only to look up or delete (raw_key).
 *
 * A pass walks each table with BPF_MAP_LOOKUP_BATCH (XDP_CONNS_CHUNK entries a
 * syscall), counts the connections by state (from their original entries,
 * where lb.bpf.c keeps the state) and deletes those idle past their state's
 * timeout: an original entry's last_seen_ns, stamped by bpf_ktime_get_ns(),
 * against CLOCK_MONOTONIC, the same clock. The reply entry goes with it
 * (through the peer key), first, and only while it still names the original
 * (a reply key another connection has since taken over is that one's).
 *
 * Why a thread, not slices of the serve loop's idle time: the serve loop is
 * lb_channel_serve, shared with the DPDK forwarder, which polls its socket
 * and has no idle hook; and a pass over a full table (millions of entries)
 * takes tens of milliseconds, which a request must not wait behind. The
 * thread sleeps on a condition variable between passes (every half of the
 * shortest timeout, 250 ms to 5 s), and a stats request runs a pass of its
 * own under the same lock, so that its figures are exact at that moment.
 *
 * Races with the fast path are benign by construction: a connection whose
 * original entry is refreshed between the walk and the delete is looked up
 * again first and kept; one deleted just as a packet arrives is opened again
 * by that packet (lb_conn.h: a mid-stream segment opens ESTABLISHED, on the
 * same backend while the ring is unchanged).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include "lb_log.h"
#include "xdp_conns.h"

#ifndef ENOTSUPP
#define ENOTSUPP 524 /* kernel-internal, leaks out of some bpf() paths */
#endif

#define NS_PER_S 1000000000ull
#define SWEEP_MIN_MS 250
#define SWEEP_MAX_MS 5000

static __u64 mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (__u64)ts.tv_sec * NS_PER_S + (__u64)ts.tv_nsec;
}

/* ---- the two layouts --------------------------------------------------------- */

/* A key as the table holds it: the IPv4 table's compact key or the IPv6
 * table's contract key. */
union raw_key {
	struct lb_flow_key_v4 v4;
	struct lb_flow_key v6;
};

union raw_conn {
	struct lb_conn v4;
	struct lb_conn6 v6;
};

/* What a pass needs of an entry of either table. */
struct conn_view {
	struct lb_flow_key peer; /* widened (family 4 or 6, every other byte 0) */
	__u64 last_seen_ns;
	__u8 dir, state, flags;
};

static void widen_v4(const struct lb_flow_key_v4 *k4, struct lb_flow_key *k)
{
	memset(k, 0, sizeof(*k));
	k->saddr.v4 = k4->saddr;
	k->daddr.v4 = k4->daddr;
	k->sport = k4->sport;
	k->dport = k4->dport;
	k->proto = k4->proto;
	k->family = LB_FAMILY_V4;
}

/* A raw key of table t, widened. */
static void widen_key(const struct xdp_conn_table *t, const void *raw, struct lb_flow_key *k)
{
	if (t->family == LB_FAMILY_V4)
		widen_v4(raw, k);
	else
		memcpy(k, raw, sizeof(*k));
}

/* The key table t looks k up under (in buf when it is narrowed). */
static const void *raw_key(const struct xdp_conn_table *t, const struct lb_flow_key *k,
			   union raw_key *buf)
{
	if (t->family != LB_FAMILY_V4)
		return k;
	memset(&buf->v4, 0, sizeof(buf->v4));
	buf->v4.saddr = k->saddr.v4;
	buf->v4.daddr = k->daddr.v4;
	buf->v4.sport = k->sport;
	buf->v4.dport = k->dport;
	buf->v4.proto = k->proto;
	return &buf->v4;
}

static void view(const struct xdp_conn_table *t, const void *raw, struct conn_view *v)
{
	if (t->family == LB_FAMILY_V4) {
		const struct lb_conn *e = raw;

		widen_v4(&e->peer, &v->peer);
		v->last_seen_ns = e->last_seen_ns;
		v->dir = e->dir;
		v->state = e->state;
		v->flags = e->flags;
	} else {
		const struct lb_conn6 *e = raw;

		v->peer = e->peer;
		v->last_seen_ns = e->last_seen_ns;
		v->dir = e->dir;
		v->state = e->state;
		v->flags = e->flags;
	}
}

/* The entry under k in table t: 0, or the lookup's -errno. */
static int lookup(const struct xdp_conn_table *t, const struct lb_flow_key *k,
		  struct conn_view *v)
{
	union raw_key rk;
	union raw_conn rc;
	int err = bpf_map_lookup_elem(t->fd, raw_key(t, k, &rk), &rc);

	if (!err)
		view(t, &rc, v);
	return err;
}

static int delete(const struct xdp_conn_table *t, const struct lb_flow_key *k)
{
	union raw_key rk;

	return bpf_map_delete_elem(t->fd, raw_key(t, k, &rk));
}

/* The 5-tuples of two widened keys of one table are equal (the family is
 * the table's, the pad bytes are not the tuple's). */
static int same_flow(const struct lb_flow_key *a, const struct lb_flow_key *b)
{
	return !memcmp(&a->saddr, &b->saddr, sizeof(a->saddr)) &&
	       !memcmp(&a->daddr, &b->daddr, sizeof(a->daddr)) && a->sport == b->sport &&
	       a->dport == b->dport && a->proto == b->proto;
}

/* A connection's pair as one number: (original key, reply key) mixed. The
 * sum over original entries equals the sum over reply entries exactly when
 * (barring a collision of 64-bit sums) every entry's peer names it back:
 * a cheap test for orphans, which are then searched for (repair). Only the
 * 5-tuples are mixed (36 bytes each), so that a pad byte cannot tell two
 * names of one entry apart. */
static __u64 pair_mix(const struct lb_flow_key *orig, const struct lb_flow_key *reply)
{
	__u64 h = 0x9e3779b97f4a7c15ull;
	const struct lb_flow_key *k[2] = { orig, reply };

	for (int i = 0; i < 2; i++) {
		__u32 w[9];

		memcpy(&w[0], &k[i]->saddr, 16);
		memcpy(&w[4], &k[i]->daddr, 16);
		w[8] = (__u32)k[i]->sport << 16 ^ k[i]->dport ^ (__u32)k[i]->proto << 8;
		for (int j = 0; j < 9; j++) {
			h ^= w[j];
			h *= 0xff51afd7ed558ccdull;
			h ^= h >> 33;
		}
	}
	return h;
}

/* The idle timeout of a state in ns; a state the program never writes (a
 * corrupt entry) gets CLOSE's, the shortest by default. */
static __u64 timeout_ns(const struct xdp_conns *c, __u8 state)
{
	return (__u64)c->timeouts_s[state < LB_CONN_STATES ? state : LB_CONN_CLOSE] * NS_PER_S;
}

static int idle_past_timeout(const struct xdp_conns *c, const struct conn_view *v, __u64 now)
{
	return now > v->last_seen_ns && now - v->last_seen_ns > timeout_ns(c, v->state);
}

/* ---- walking a table ------------------------------------------------------- */

typedef void (*visit_fn)(struct xdp_conns *c, const struct lb_flow_key *key,
			 const struct conn_view *v, void *arg);

/* Per entry, by BPF_MAP_GET_NEXT_KEY: kernels without batch lookups on hash
 * maps. Bounded by the capacity (and a margin: entries come and go while
 * the walk runs; a key deleted under the cursor restarts the walk, which
 * the bound also stops). */
static int walk_keys(struct xdp_conns *c, const struct xdp_conn_table *t, visit_fn fn,
		     void *arg)
{
	union raw_key key, next;
	union raw_conn rv;
	struct lb_flow_key wide;
	struct conn_view v;
	__u64 limit = 2 * t->capacity + 16;

	for (__u64 i = 0; i < limit; i++) {
		int err = bpf_map_get_next_key(t->fd, i ? &key : NULL, &next);

		if (err == -ENOENT)
			return 0;
		if (err)
			return err;
		key = next;
		if (bpf_map_lookup_elem(t->fd, &key, &rv) == 0) {
			widen_key(t, &key, &wide);
			view(t, &rv, &v);
			fn(c, &wide, &v, arg);
		}
	}
	return 0;
}

/* Calls fn for every entry of t, XDP_CONNS_CHUNK a syscall. Nothing is
 * deleted while it runs (callers collect, then delete), so the kernel's
 * bucket cursor stays valid. Each batch ends at least one bucket further,
 * and a hash map has fewer than 2 * max_entries buckets: that bounds the
 * loop. */
static int walk(struct xdp_conns *c, const struct xdp_conn_table *t, visit_fn fn, void *arg)
{
	LIBBPF_OPTS(bpf_map_batch_opts, opts);
	__u32 in = 0, out = 0;
	int first = 1;

	for (__u64 batch = 0; batch <= 2 * t->capacity; batch++) {
		__u32 n = XDP_CONNS_CHUNK;
		int err = bpf_map_lookup_batch(t->fd, first ? NULL : &in, &out, c->keys, c->vals,
					       &n, &opts);

		if (first && (err == -ENOTSUPP || err == -EOPNOTSUPP || err == -EINVAL))
			return walk_keys(c, t, fn, arg);
		if (err && err != -ENOENT)
			return err;
		if (n > XDP_CONNS_CHUNK)
			return -EIO;
		for (__u32 i = 0; i < n; i++) {
			struct lb_flow_key wide;
			struct conn_view v;

			widen_key(t, (const char *)c->keys + (size_t)i * t->key_size, &wide);
			view(t, (const char *)c->vals + (size_t)i * t->value_size, &v);
			fn(c, &wide, &v, arg);
		}
		if (err == -ENOENT)
			return 0; /* the end of the table */
		in = out;
		first = 0;
	}
	return -EIO;
}

/* ---- a pass ----------------------------------------------------------------- */

struct pass {
	__u64 now;
	struct lb_conn_stats st;   /* both tables, summed */
	__u64 sum_orig, sum_reply; /* pair_mix sums (orphan test) of the table walked */
};

static void count_conn(struct pass *p, const struct lb_flow_key *key, const struct conn_view *v)
{
	if (v->state < LB_CONN_STATES)
		p->st.by_state[v->state]++;
	if (v->flags & LB_CONN_F_SNAT)
		p->st.snat_ports_in_use++;
	p->sum_orig += pair_mix(key, &v->peer);
}

static void visit(struct xdp_conns *c, const struct lb_flow_key *key, const struct conn_view *v,
		  void *arg)
{
	struct pass *p = arg;

	p->st.entries++;
	if (v->dir != LB_CONN_ORIG) {
		p->sum_reply += pair_mix(&v->peer, key);
		return;
	}
	if (!idle_past_timeout(c, v, p->now)) {
		count_conn(p, key, v);
		return;
	}
	if (c->ndoomed == c->doomed_cap) {
		size_t cap = c->doomed_cap ? 2 * c->doomed_cap : 1024;
		struct lb_flow_key *d = realloc(c->doomed, cap * sizeof(*d));

		if (!d) {
			/* Counted as alive; the next pass tries again. */
			count_conn(p, key, v);
			return;
		}
		c->doomed = d;
		c->doomed_cap = cap;
	}
	c->doomed[c->ndoomed++] = *key;
}

/* Deletes the connections of t whose original keys the walk found idle,
 * each checked again first: the fast path may have refreshed it since. */
static void expire(struct xdp_conns *c, const struct xdp_conn_table *t, struct pass *p)
{
	for (size_t i = 0; i < c->ndoomed; i++) {
		const struct lb_flow_key *key = &c->doomed[i];
		struct conn_view v, r;

		if (lookup(t, key, &v))
			continue; /* gone meanwhile (evicted, rescheduled) */
		if (v.dir != LB_CONN_ORIG || !idle_past_timeout(c, &v, mono_ns())) {
			if (v.dir == LB_CONN_ORIG)
				count_conn(p, key, &v);
			continue;
		}
		/* The reply entry first: a reply in between finds no entry and
		 * goes to the kernel, where deleting the original first could
		 * let a new connection on the same tuple reuse the reply key
		 * just before it is deleted. */
		if (lookup(t, &v.peer, &r) == 0 && r.dir == LB_CONN_REPLY &&
		    same_flow(&r.peer, key) && delete(t, &v.peer) == 0) {
			p->st.entries--;
			p->sum_reply -= pair_mix(key, &v.peer);
		}
		if (delete(t, key) == 0) {
			p->st.entries--;
			c->expired++;
		}
	}
	c->ndoomed = 0;
}

struct repair {
	const struct xdp_conn_table *t;
	__u64 now;
	size_t removed;
};

/* A reply entry whose original is gone or names another reply key: an
 * orphan (xdp_conns.h, XDP_CONNS_REPAIR_NS). One created within the last second is left for
 * the next search, in case its original is being written. */
static void visit_orphan(struct xdp_conns *c, const struct lb_flow_key *key,
			 const struct conn_view *v, void *arg)
{
	struct repair *rp = arg;
	struct conn_view o;

	if (v->dir != LB_CONN_REPLY || rp->now < v->last_seen_ns + NS_PER_S)
		return;
	if (lookup(rp->t, &v->peer, &o) == 0 && o.dir == LB_CONN_ORIG && same_flow(&o.peer, key))
		return;
	if (c->ndoomed == c->doomed_cap)
		return; /* the buffer the idle pass grew; the rest next time */
	c->doomed[c->ndoomed++] = *key;
}

static void repair(struct xdp_conns *c, struct xdp_conn_table *t, struct pass *p)
{
	struct repair rp = { .t = t, .now = mono_ns(), .removed = 0 };

	t->last_repair_ns = rp.now;
	c->ndoomed = 0;
	if (walk(c, t, visit_orphan, &rp) == 0) {
		for (size_t i = 0; i < c->ndoomed; i++) {
			if (delete(t, &c->doomed[i]) == 0) {
				rp.removed++;
				p->st.entries--;
			}
		}
	}
	c->ndoomed = 0;
	if (rp.removed)
		lb_log(LB_LOG_INFO, "removed %zu orphan NAT reply entries (IPv%u)", rp.removed,
		       t->family);
}

/* Whether vip_map holds a NAT VIP (either family); 1 when it cannot tell.
 * vip_map rather than vip4_map: it holds every VIP, and an IPv4 VIP is in
 * it before it is in vip4_map and after it has left it. */
static int nat_vip_configured(const struct xdp_conns *c)
{
	struct lb_vip_key key, next;
	struct lb_vip_entry e;

	for (int i = 0; i <= LB_MAX_VIPS; i++) {
		int err = bpf_map_get_next_key(c->vip_fd, i ? &key : NULL, &next);

		if (err == -ENOENT)
			return 0;
		if (err)
			return 1;
		key = next;
		if (bpf_map_lookup_elem(c->vip_fd, &key, &e) == 0 && e.mode == LB_MODE_NAT)
			return 1;
	}
	return 1;
}

static int tables_empty(const struct xdp_conns *c)
{
	for (int i = 0; i < XDP_CONNS_TABLES; i++) {
		union raw_key key;

		if (bpf_map_get_next_key(c->tables[i].fd, NULL, &key) != -ENOENT)
			return 0;
	}
	return 1;
}

/* One table's share of a pass, c->lock held. */
static int sweep_table(struct xdp_conns *c, struct xdp_conn_table *t, struct pass *p)
{
	int err;

	p->sum_orig = 0;
	p->sum_reply = 0;
	c->ndoomed = 0;
	err = walk(c, t, visit, p);
	if (err) {
		c->ndoomed = 0;
		return err;
	}
	expire(c, t, p);
	if (p->sum_orig != p->sum_reply && p->now - t->last_repair_ns >= XDP_CONNS_REPAIR_NS)
		repair(c, t, p);
	return 0;
}

/* One pass over both tables, c->lock held. */
static int sweep_locked(struct xdp_conns *c)
{
	struct pass p;
	int err = 0;

	memset(&p, 0, sizeof(p));
	p.now = mono_ns();
	/* Both tables even when one fails: its figures are then missing from
	 * this pass, and the error is reported. */
	for (int i = 0; i < XDP_CONNS_TABLES; i++) {
		int e = sweep_table(c, &c->tables[i], &p);

		if (e && !err)
			err = e;
	}
	if (err)
		return err;
	p.st.capacity = c->capacity;
	p.st.expired = c->expired;
	c->figures = p.st;
	/* NAT mode no longer in use: frames for no VIP may skip the lookup.
	 * Under the flag lock, against a NAT VIP being written right now. */
	if (p.st.entries == 0 && c->nat_active && *c->nat_active) {
		pthread_mutex_lock(&c->flag_lock);
		if (!nat_vip_configured(c) && tables_empty(c))
			*c->nat_active = 0;
		pthread_mutex_unlock(&c->flag_lock);
	}
	return 0;
}

/* ---- the thread ------------------------------------------------------------ */

/* Half the shortest timeout, within SWEEP_MIN_MS..SWEEP_MAX_MS: a connection
 * outlives its timeout by at most that (plus a pass). */
static __u64 interval_ms(const struct xdp_conns *c)
{
	__u64 min_s = c->timeouts_s[0];

	for (int s = 1; s < LB_CONN_STATES; s++)
		if (c->timeouts_s[s] < min_s)
			min_s = c->timeouts_s[s];
	min_s = min_s * 1000 / 2;
	return min_s < SWEEP_MIN_MS ? SWEEP_MIN_MS : min_s > SWEEP_MAX_MS ? SWEEP_MAX_MS : min_s;
}

static void *sweeper(void *arg)
{
	struct xdp_conns *c = arg;
	int failing = 0;

	pthread_mutex_lock(&c->lock);
	while (!c->stop) {
		struct timespec until;
		__u64 ms;
		int err = sweep_locked(c);

		if (err && !failing)
			lb_log(LB_LOG_WARN, "sweeping the NAT connection table: %s",
			       strerror(-err));
		else if (!err && failing)
			lb_log(LB_LOG_INFO, "sweeping the NAT connection table works again");
		failing = err != 0;
		ms = interval_ms(c);
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_sec += (time_t)(ms / 1000);
		until.tv_nsec += (long)(ms % 1000) * 1000000L;
		if (until.tv_nsec >= 1000000000L) {
			until.tv_sec++;
			until.tv_nsec -= 1000000000L;
		}
		/* Woken early by set_timeouts and by stop; a spurious wake-up
		 * only makes a pass early. */
		if (!c->stop)
			pthread_cond_timedwait(&c->wake, &c->lock, &until);
	}
	pthread_mutex_unlock(&c->lock);
	return NULL;
}

/* ---- API -------------------------------------------------------------------- */

/* Table t of fd: its layout checked against family's. */
static int table_init(struct xdp_conn_table *t, int fd, __u8 family)
{
	struct bpf_map_info info;
	__u32 len = sizeof(info);
	int err;

	memset(t, 0, sizeof(*t));
	t->fd = fd;
	t->family = family;
	t->key_size = family == LB_FAMILY_V4 ? sizeof(struct lb_flow_key_v4)
					     : sizeof(struct lb_flow_key);
	t->value_size = family == LB_FAMILY_V4 ? sizeof(struct lb_conn) : sizeof(struct lb_conn6);
	memset(&info, 0, sizeof(info));
	err = bpf_obj_get_info_by_fd(fd, &info, &len);
	if (err)
		return err;
	if (info.key_size != t->key_size || info.value_size != t->value_size)
		return -EINVAL;
	t->capacity = info.max_entries;
	return 0;
}

int xdp_conns_init(struct xdp_conns *c, int conn_fd, int conn6_fd, int vip_fd,
		   volatile __u32 *nat_active, const __u32 timeouts_s[LB_CONN_STATES])
{
	pthread_condattr_t ca;
	int err;

	memset(c, 0, sizeof(*c));
	c->vip_fd = vip_fd;
	c->nat_active = nat_active;
	memcpy(c->timeouts_s, timeouts_s, sizeof(c->timeouts_s));
	err = table_init(&c->tables[0], conn_fd, LB_FAMILY_V4);
	if (!err)
		err = table_init(&c->tables[1], conn6_fd, LB_FAMILY_V6);
	if (err)
		return err;
	c->capacity = c->tables[0].capacity + c->tables[1].capacity;
	c->keys = calloc(XDP_CONNS_CHUNK, sizeof(union raw_key));
	c->vals = calloc(XDP_CONNS_CHUNK, sizeof(union raw_conn));
	if (!c->keys || !c->vals) {
		free(c->keys);
		free(c->vals);
		c->keys = NULL;
		c->vals = NULL;
		return -ENOMEM;
	}
	pthread_mutex_init(&c->lock, NULL);
	pthread_mutex_init(&c->flag_lock, NULL);
	/* The sweeper's deadlines are on CLOCK_MONOTONIC: a wall-clock step
	 * must not stall or hurry it. */
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&c->wake, &ca);
	pthread_condattr_destroy(&ca);
	c->figures.capacity = c->capacity;
	/* Room for the keys a pass deletes; grown when a pass finds more. */
	c->doomed = calloc(1024, sizeof(*c->doomed));
	c->doomed_cap = c->doomed ? 1024 : 0;
	return 0;
}

int xdp_conns_start(struct xdp_conns *c)
{
	sigset_t all, old;
	int err;

	/* The thread blocks every signal it can: SIGTERM and SIGINT must reach
	 * the main thread, whose zmq_poll they interrupt. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	err = pthread_create(&c->thread, NULL, sweeper, c);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (err)
		return -err;
	c->thread_started = true;
	return 0;
}

void xdp_conns_fini(struct xdp_conns *c)
{
	if (!c->keys)
		return; /* never initialised */
	if (c->thread_started) {
		pthread_mutex_lock(&c->lock);
		c->stop = true;
		pthread_cond_signal(&c->wake);
		pthread_mutex_unlock(&c->lock);
		pthread_join(c->thread, NULL);
		c->thread_started = false;
	}
	pthread_cond_destroy(&c->wake);
	pthread_mutex_destroy(&c->lock);
	pthread_mutex_destroy(&c->flag_lock);
	free(c->keys);
	free(c->vals);
	free(c->doomed);
	c->keys = NULL;
	c->vals = NULL;
	c->doomed = NULL;
}

void xdp_conns_set_timeouts(struct xdp_conns *c, const __u32 timeouts_s[LB_CONN_STATES])
{
	pthread_mutex_lock(&c->lock);
	memcpy(c->timeouts_s, timeouts_s, sizeof(c->timeouts_s));
	pthread_cond_signal(&c->wake);
	pthread_mutex_unlock(&c->lock);
}

int xdp_conns_read(struct xdp_conns *c, struct lb_conn_stats *out)
{
	int err;

	pthread_mutex_lock(&c->lock);
	err = sweep_locked(c);
	if (!err)
		*out = c->figures;
	pthread_mutex_unlock(&c->lock);
	return err;
}

void xdp_conns_nat_vip_begin(struct xdp_conns *c)
{
	pthread_mutex_lock(&c->flag_lock);
	if (c->nat_active)
		*c->nat_active = 1;
}

void xdp_conns_nat_vip_end(struct xdp_conns *c)
{
	pthread_mutex_unlock(&c->flag_lock);
}

void xdp_conns_refresh_active(struct xdp_conns *c)
{
	pthread_mutex_lock(&c->flag_lock);
	if (c->nat_active && (nat_vip_configured(c) || !tables_empty(c)))
		*c->nat_active = 1;
	pthread_mutex_unlock(&c->flag_lock);
}
