/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_conn_family.c.h - one family's connection table operations (fwd_conn.h
 * says what they do and why). Read only by fwd_conn.c, once per family, with
 * the FC_* names of fwd_conn_family.h defined; undefines them at its end.
 * Every static helper is named through FC() too, so that the two instances
 * do not clash.
 */

static inline void FC(lock)(struct FC(table) *ct)
{
	if (ct->shared)
		rte_spinlock_lock(&ct->lock);
}

static inline void FC(unlock)(struct FC(table) *ct)
{
	if (ct->shared)
		rte_spinlock_unlock(&ct->lock);
}

static inline bool FC(slot_used)(const struct FC(slot) *s)
{
	return __atomic_load_n(&s->used, __ATOMIC_RELAXED);
}

static inline void FC(set_count)(struct FC(table) *ct, __u32 n)
{
	__atomic_store_n(&ct->count, n, __ATOMIC_RELAXED);
}

int FC(init)(struct FC(table) *ct, const char *name, __u32 capacity,
		  unsigned int nworkers, struct rte_rcu_qsbr *qsbr, int socket_id)
{
	struct rte_hash_parameters p = {
		.name = name,
		.key_len = sizeof(FC_KEY),
		.socket_id = socket_id,
		/* Extendable buckets: the hash fills to the last position
		 * instead of failing on a full cuckoo path, so "full" is our
		 * count's decision alone. */
		.extra_flag = RTE_HASH_EXTRA_FLAGS_EXT_TABLE,
	};
	__u64 nslots;

	memset(ct, 0, sizeof(*ct));
	if (capacity < LB_CONN_TABLE_MIN || capacity > LB_CONN_TABLE_MAX || capacity % 2 ||
	    nworkers == 0 || nworkers > RTE_MAX_LCORE)
		return -EINVAL;
	ct->shared = nworkers > 1;
	if (ct->shared && !qsbr)
		return -EINVAL;
	nslots = (__u64)capacity + (ct->shared ? (__u64)FWD_CONN_HEADROOM * nworkers : 0);
	if (nslots < HASH_MIN_ENTRIES)
		nslots = HASH_MIN_ENTRIES;
	if (nslots > RTE_HASH_ENTRIES_MAX)
		return -EINVAL;
	if (ct->shared)
		p.extra_flag |= RTE_HASH_EXTRA_FLAGS_RW_CONCURRENCY_LF;
	p.entries = (__u32)nslots;
	if (getrandom(ct->sig_key, sizeof(ct->sig_key), 0) != sizeof(ct->sig_key))
		return -EIO;
	rte_spinlock_init(&ct->lock);
	ct->qsbr = ct->shared ? qsbr : NULL;
	ct->capacity = capacity;
	ct->nslots = (__u32)nslots;
	ct->h = rte_hash_create(&p);
	ct->slots = rte_zmalloc_socket("hpclb_conn_slots", nslots * sizeof(*ct->slots),
				       RTE_CACHE_LINE_SIZE, socket_id);
	ct->free_slots = rte_malloc_socket("hpclb_conn_free", nslots * sizeof(__u32), 0,
					   socket_id);
	ct->fifo = rte_malloc_socket("hpclb_conn_fifo", (size_t)capacity * sizeof(*ct->fifo), 0,
				     socket_id);
	if (ct->shared)
		ct->retired = rte_malloc_socket("hpclb_conn_retired",
						nslots * sizeof(*ct->retired), 0, socket_id);
	if (!ct->h || !ct->slots || !ct->free_slots || !ct->fifo ||
	    (ct->shared && !ct->retired)) {
		FC(free)(ct);
		return -ENOMEM;
	}
	/* A stack: slot 0 is taken first. */
	for (__u32 i = 0; i < ct->nslots; i++)
		ct->free_slots[i] = ct->nslots - 1 - i;
	ct->nfree = ct->nslots;
	return 0;
}

void FC(free)(struct FC(table) *ct)
{
	rte_hash_free(ct->h);
	rte_free(ct->slots);
	rte_free(ct->free_slots);
	rte_free(ct->fifo);
	rte_free(ct->retired);
	ct->h = NULL;
	ct->slots = NULL;
	ct->free_slots = NULL;
	ct->fifo = NULL;
	ct->retired = NULL;
}

void FC(sweep_init)(const struct FC(table) *ct, struct fwd_conn_sweep *sw,
			 unsigned int w, unsigned int nworkers)
{
	sw->lo = nworkers ? (__u32)((__u64)ct->nslots * w / nworkers) : 0;
	sw->hi = nworkers ? (__u32)((__u64)ct->nslots * (w + 1) / nworkers) : 0;
	sw->next = sw->lo;
}

/* ---- under the lock --------------------------------------------------- */

/* Makes reusable, oldest first, up to max removed entries that no reader can
 * still hold (every worker passed a quiescent state since the removal). */
static void FC(reclaim)(struct FC(table) *ct, __u32 max)
{
	for (__u32 n = 0; n < max && ct->retired_len; n++) {
		const struct fwd_conn_retired *r = &ct->retired[ct->retired_head];

		if (rte_rcu_qsbr_check(ct->qsbr, r->token, false) != 1)
			break; /* tokens ascend: the rest are younger */
		if (r->pos >= 0)
			rte_hash_free_key_with_position(ct->h, r->pos);
		ct->free_slots[ct->nfree++] = r->slot;
		ct->retired_head = ct->retired_head + 1 < ct->nslots ? ct->retired_head + 1 : 0;
		__atomic_store_n(&ct->retired_len, ct->retired_len - 1, __ATOMIC_RELAXED);
	}
}

/* An entry left the hash (position pos, -1 if it was not there). */
static void FC(retire)(struct FC(table) *ct, __s32 pos, __u32 slot, __u64 token)
{
	struct fwd_conn_retired *r;

	if (!ct->shared) {
		/* No other reader: the hash freed the position on delete. */
		ct->free_slots[ct->nfree++] = slot;
		return;
	}
	/* nslots places for nslots slots: never full. */
	r = &ct->retired[(ct->retired_head + ct->retired_len) % ct->nslots];
	r->token = token;
	r->pos = pos;
	r->slot = slot;
	__atomic_store_n(&ct->retired_len, ct->retired_len + 1, __ATOMIC_RELAXED);
}

/* Removes both entries of the live connection whose original entry is o. */
static void FC(remove_conn)(struct FC(table) *ct, struct fwd_conn_figures *fig,
			struct FC(slot) *o)
{
	fwd_conn_word_t *w = (fwd_conn_word_t *)&o->c.state;
	__u32 oi = (__u32)(o - ct->slots), ri = o->peer_idx;
	struct FC(slot) *r = ri < ct->nslots ? &ct->slots[ri] : NULL;
	__u16 old;
	__u8 st;
	__s32 po, pr = -1;
	__u64 token = 0;

	/* DEAD first: an update racing with us fails its compare-and-swap,
	 * so the state we account for leaving is the last one. */
	if (ct->shared) {
		old = __atomic_exchange_n(w, fwd_conn_word(FWD_CONN_DEAD, 0), __ATOMIC_RELAXED);
	} else {
		old = *w;
		*w = fwd_conn_word(FWD_CONN_DEAD, 0);
	}
	st = fwd_conn_word_state(old);
	if (st < LB_CONN_STATES)
		fig->by_state[st]--;
	if (o->c.flags & LB_CONN_F_SNAT)
		fig->snat_ports--;
	po = rte_hash_del_key_with_hash(ct->h, &o->key, FC(sig)(ct, &o->key));
	if (r)
		pr = rte_hash_del_key_with_hash(ct->h, &r->key, FC(sig)(ct, &r->key));
	/* After the deletes: a reader that can still hold the entries started
	 * before this token. */
	if (ct->shared)
		token = rte_rcu_qsbr_start(ct->qsbr);
	__atomic_store_n(&o->used, 0, __ATOMIC_RELAXED);
	FC(retire)(ct, po, oi, token);
	if (r) {
		__atomic_store_n(&r->used, 0, __ATOMIC_RELAXED);
		FC(retire)(ct, pr, ri, token);
	}
	FC(set_count)(ct, ct->count - (r ? 2 : 1));
}

static void FC(fifo_push)(struct FC(table) *ct, const FC_KEY *k)
{
	if (ct->fifo_len == ct->capacity) {
		/* Full of keys never taken: the oldest goes (a connection that
		 * old is the least likely still embryonic). */
		ct->fifo_head = ct->fifo_head + 1 < ct->capacity ? ct->fifo_head + 1 : 0;
		ct->fifo_len--;
	}
	ct->fifo[(ct->fifo_head + ct->fifo_len) % ct->capacity] = *k;
	ct->fifo_len++;
}

/* lb_conn.h "Full table": takes up to LB_CONN_EVICT_TRIES keys from the
 * FIFO's head and evicts the first that is still an embryonic connection. */
static bool FC(evict_embryonic)(struct FC(table) *ct, struct fwd_conn_figures *fig)
{
	for (__u32 n = 0; n < LB_CONN_EVICT_TRIES && ct->fifo_len; n++) {
		FC_KEY k = ct->fifo[ct->fifo_head];
		struct FC(slot) *e;

		ct->fifo_head = ct->fifo_head + 1 < ct->capacity ? ct->fifo_head + 1 : 0;
		ct->fifo_len--;
		e = FC(lookup)(ct, &k, FC(sig)(ct, &k));
		if (e && e->c.dir == LB_CONN_ORIG && lb_conn_embryonic(FC(state)(e))) {
			FC(remove_conn)(ct, fig, e);
			return true;
		}
	}
	return false;
}

static bool FC(key_eq)(const FC_KEY *a, const FC_KEY *b)
{
	return !memcmp(a, b, sizeof(*a));
}

/* The reply key of req: without SNAT the client's pair, with SNAT the first
 * candidate port whose key is free. false: none (drop_snat_exhausted). */
static bool FC(choose_reply_key)(struct FC(table) *ct, const struct FC(req) *req,
			     FC_KEY *reply, hash_sig_t *sig)
{
	if (!req->snat) {
		FC_REPLY_KEY(reply, req->backend_addr, req->backend_port, req->orig.saddr,
				  req->orig.sport, req->orig.proto);
		*sig = FC(sig)(ct, reply);
		/* Taken by another connection (the same client pair through two
		 * VIPs to one backend port): its replies could not be told
		 * apart. */
		return !FC(key_eq)(reply, &req->orig) && !FC(lookup)(ct, reply, *sig);
	}
	/* The server keeps 1 <= min <= max; a bad range must still not divide
	 * by zero in lb_snat_candidate. */
	if (req->port_min == 0 || req->port_min > req->port_max || FC_ADDR_ZERO(req->snat_addr))
		return false;
	for (__u32 n = 0; n < LB_SNAT_PROBES; n++) {
		__u16 port = lb_snat_candidate(req->hash, n, req->port_min, req->port_max);

		FC_REPLY_KEY(reply, req->backend_addr, req->backend_port, req->snat_addr,
				  rte_cpu_to_be_16(port), req->orig.proto);
		*sig = FC(sig)(ct, reply);
		if (!FC(key_eq)(reply, &req->orig) && !FC(lookup)(ct, reply, *sig))
			return true;
	}
	return false;
}

/* ---- the operations ------------------------------------------------------ */

enum fwd_conn_open_status FC(open)(struct FC(table) *ct, struct fwd_conn_figures *fig,
					const struct FC(req) *req,
					struct FC(slot) **out, bool *evicted)
{
	struct FC(slot) *o, *r;
	FC_KEY reply;
	hash_sig_t reply_sig = 0;
	__u32 oi, ri;
	__u8 st = req->tmpl.state;

	*evicted = false;
	*out = NULL;
	FC(lock)(ct);
	if (ct->shared) {
		FC(reclaim)(ct, RECLAIM_BATCH);
		/* Looked up without the lock by the caller: another worker
		 * (RSS rollover) may have opened it since. */
		o = FC(lookup)(ct, &req->orig, req->orig_sig);
		if (o) {
			FC(unlock)(ct);
			*out = o;
			return FWD_CONN_EXISTS;
		}
	}
	/* lb_conn.h's order: the reply key, then room. */
	if (!FC(choose_reply_key)(ct, req, &reply, &reply_sig)) {
		FC(unlock)(ct);
		return FWD_CONN_NO_REPLY_KEY;
	}
	if (ct->count + 2 > ct->capacity) {
		/* Evicting a connection frees two entries: room for one. */
		if (!FC(evict_embryonic)(ct, fig)) {
			FC(unlock)(ct);
			return FWD_CONN_FULL;
		}
		*evicted = true;
	}
	if (ct->nfree < 2 && ct->shared)
		FC(reclaim)(ct, ct->nslots);
	if (ct->nfree < 2) {
		/* Only when a stalled worker holds back more than the headroom
		 * of removed entries: they are not reusable yet. */
		FC(unlock)(ct);
		return FWD_CONN_FULL;
	}
	oi = ct->free_slots[--ct->nfree];
	ri = ct->free_slots[--ct->nfree];
	o = &ct->slots[oi];
	r = &ct->slots[ri];
	/* Both entries whole before rte_hash publishes them (it stores the
	 * data pointer with release semantics). */
	o->c = req->tmpl;
	o->c.peer = reply;
	o->c.last_seen_ns = req->now_ns;
	o->c.dir = LB_CONN_ORIG;
	o->c.state = st;
	o->c.fin_dirs = 0;
	o->c.flags = req->snat ? LB_CONN_F_SNAT : 0;
	o->key = req->orig;
	o->peer_idx = ri;
	r->c = o->c;
	r->c.peer = req->orig;
	r->c.dir = LB_CONN_REPLY;
	r->key = reply;
	r->peer_idx = oi;
	__atomic_store_n(&o->used, 1, __ATOMIC_RELAXED);
	__atomic_store_n(&r->used, 1, __ATOMIC_RELAXED);
	/* nfree >= 2 means the hash has two free positions, and its
	 * extendable buckets never refuse one: neither add fails. Checked all
	 * the same, as any call into a library. */
	if (rte_hash_add_key_with_hash_data(ct->h, &req->orig, req->orig_sig, o) < 0) {
		o->used = r->used = 0;
		ct->free_slots[ct->nfree++] = ri;
		ct->free_slots[ct->nfree++] = oi;
		FC(unlock)(ct);
		return FWD_CONN_FULL;
	}
	if (rte_hash_add_key_with_hash_data(ct->h, &reply, reply_sig, r) < 0) {
		__s32 pos = rte_hash_del_key_with_hash(ct->h, &req->orig, req->orig_sig);

		__atomic_store_n(&o->used, 0, __ATOMIC_RELAXED);
		r->used = 0;
		ct->free_slots[ct->nfree++] = ri;
		FC(retire)(ct, pos, oi, ct->shared ? rte_rcu_qsbr_start(ct->qsbr) : 0);
		FC(unlock)(ct);
		return FWD_CONN_FULL;
	}
	FC(set_count)(ct, ct->count + 2);
	if (st < LB_CONN_STATES)
		fig->by_state[st]++;
	if (req->snat)
		fig->snat_ports++;
	if (lb_conn_embryonic(st))
		FC(fifo_push)(ct, &req->orig);
	FC(unlock)(ct);
	*out = o;
	return FWD_CONN_OPENED;
}

void FC(close)(struct FC(table) *ct, struct fwd_conn_figures *fig,
		    struct FC(slot) *o)
{
	FC(lock)(ct);
	/* The caller's entry cannot have been reused (it has not passed a
	 * quiescent state since its lookup), only removed. */
	if (FC(slot_used)(o) && o->c.dir == LB_CONN_ORIG && FC(state)(o) != FWD_CONN_DEAD)
		FC(remove_conn)(ct, fig, o);
	FC(unlock)(ct);
}

bool FC(update)(struct FC(table) *ct, struct fwd_conn_figures *fig,
		     struct FC(slot) *o, __u8 dir, __u8 proto, __u8 tcp_flags, __u64 now_ns)
{
	fwd_conn_word_t *w = (fwd_conn_word_t *)&o->c.state;

	__atomic_store_n(&o->c.last_seen_ns, now_ns, __ATOMIC_RELAXED);
	/* Bounded: a worker that loses the race this often lets the winners'
	 * states stand (they saw newer packets of the same connection). */
	for (__u32 n = 0; n < 4; n++) {
		__u16 old = __atomic_load_n(w, __ATOMIC_RELAXED), next;
		__u8 st = fwd_conn_word_state(old), fin = fwd_conn_word_fin(old), nst;

		if (st >= LB_CONN_STATES)
			return false; /* being removed */
		nst = lb_conn_next_state(st, &fin, dir, proto, tcp_flags);
		next = fwd_conn_word(nst, fin);
		if (next == old)
			return true;
		if (!ct->shared)
			*w = next;
		else if (!__atomic_compare_exchange_n(w, &old, next, false, __ATOMIC_RELAXED,
						      __ATOMIC_RELAXED))
			continue;
		if (nst != st) {
			fig->by_state[st]--;
			fig->by_state[nst]++;
		}
		return true;
	}
	return true;
}

static bool FC(idle)(const struct FC(slot) *o, const __u32 *timeouts_s, __u64 now_ns)
{
	__u8 st = FC(state)(o);
	__u64 last;

	if (st >= LB_CONN_STATES)
		return false;
	last = __atomic_load_n(&o->c.last_seen_ns, __ATOMIC_RELAXED);
	/* Another worker's clock may be a little ahead of ours. */
	return now_ns > last && now_ns - last > (__u64)timeouts_s[st] * CONN_NS_PER_S;
}

unsigned int FC(expire)(struct FC(table) *ct, struct fwd_conn_figures *fig,
			     struct fwd_conn_sweep *sw, const __u32 *timeouts_s, __u64 now_ns,
			     unsigned int budget)
{
	unsigned int removed = 0;

	if (sw->hi <= sw->lo || sw->hi > ct->nslots)
		return 0;
	/* Reuse keeps moving when no connection is opened. */
	if (ct->shared && __atomic_load_n(&ct->retired_len, __ATOMIC_RELAXED)) {
		FC(lock)(ct);
		FC(reclaim)(ct, RECLAIM_BATCH);
		FC(unlock)(ct);
	}
	for (unsigned int n = 0; n < budget; n++) {
		struct FC(slot) *s = &ct->slots[sw->next];

		sw->next = sw->next + 1 < sw->hi ? sw->next + 1 : sw->lo;
		/* A hint without the lock, checked again under it. */
		if (!FC(slot_used)(s) || s->c.dir != LB_CONN_ORIG || !FC(idle)(s, timeouts_s, now_ns))
			continue;
		FC(lock)(ct);
		if (FC(slot_used)(s) && s->c.dir == LB_CONN_ORIG && FC(idle)(s, timeouts_s, now_ns)) {
			FC(remove_conn)(ct, fig, s);
			fig->expired++;
			removed++;
		}
		FC(unlock)(ct);
	}
	return removed;
}

#undef FC
#undef FC_KEY
#undef FC_ENTRY
#undef FC_ADDR
#undef FC_KEY_HASH
#undef FC_SLOT_SIZE
#undef FC_REPLY_KEY
#undef FC_ADDR_ZERO
