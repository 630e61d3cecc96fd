/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_conn_family.h - one family's connection table: its types, its inline
 * lookups and its operations' prototypes. Read only by fwd_conn.h, once per
 * family, with FC(), FC_KEY, FC_ENTRY, FC_ADDR, FC_KEY_HASH, FC_SLOT_SIZE,
 * FC_REPLY_KEY and FC_ADDR_ZERO defined (fwd_conn.h says what they are); it
 * undefines them at its end. Hence no include guard.
 */

struct FC(slot) {
	FC_ENTRY c;                /* the contract's entry */
	FC_KEY key;                /* this entry's own key (removal, the sweep) */
	__u32 peer_idx;            /* slot of the other direction's entry */
	__u8 used;                 /* written under the lock; read as a hint by the sweep */
	__u8 pad[3];
} __attribute__((aligned(64)));

_Static_assert(sizeof(struct FC(slot)) == FC_SLOT_SIZE, "slots are whole cache lines");
/* state and fin_dirs are updated together as one naturally aligned 16-bit word. */
_Static_assert(offsetof(FC_ENTRY, fin_dirs) == offsetof(FC_ENTRY, state) + 1 &&
		       offsetof(FC_ENTRY, state) % 2 == 0,
	       "state and fin_dirs form an aligned 16-bit word");

struct FC(table) {
	/* Read by every lookup, written only at init: a cache line of its own,
	 * so that the writers' lock and counts below do not bounce it. */
	struct rte_hash *h;
	struct FC(slot) *slots;      /* nslots; a slot's index is ours, not rte_hash's */
	__u32 nslots;                /* capacity + headroom: what the hash can hold */
	__u32 capacity;              /* entries (two per connection); exact */
	bool shared;                 /* several workers: lock, atomics, deferred reuse */
	struct rte_rcu_qsbr *qsbr;   /* the table store's; NULL when not shared */
	__u8 sig_key[LB_HASH_KEY_LEN];
	__u32 *free_slots;           /* free slot indices (a stack of nfree) */
	/* Original keys of embryonic connections in creation order: a ring of
	 * `capacity` keys; a push to a full ring drops the oldest. */
	FC_KEY *fifo;
	/* Removed entries in removal order (tokens ascend): nslots places, so it
	 * cannot overflow. */
	struct fwd_conn_retired *retired;

	/* The writers' state, under the lock (count and retired_len are also
	 * read without it, as hints and figures). */
	rte_spinlock_t lock __attribute__((aligned(64)));
	__u32 count;                 /* live entries */
	__u32 nfree;
	__u32 fifo_head, fifo_len;
	__u32 retired_head, retired_len;
};

/* What a new connection is made of (open). */
struct FC(req) {
	FC_KEY orig;                /* the original direction's key (a miss) */
	hash_sig_t orig_sig;
	FC_ADDR backend_addr;
	__be16 backend_port;
	bool snat;                  /* take a SNAT pair: snat_addr and a port */
	FC_ADDR snat_addr;
	__u16 port_min, port_max;   /* host order, inclusive */
	__u64 hash;                 /* the flow hash: picks the SNAT candidates */
	FC_ENTRY tmpl;              /* backend_id, vip_id, state, client_mac, client_port */
	__u64 now_ns;
};

/* capacity entries (even, LB_CONN_TABLE_MIN..MAX) for nworkers workers;
 * qsbr is the table store's (ignored with one worker). name must be unique in
 * the process. 0 or a negative errno. */
int FC(init)(struct FC(table) *ct, const char *name, __u32 capacity, unsigned int nworkers,
	     struct rte_rcu_qsbr *qsbr, int socket_id);
void FC(free)(struct FC(table) *ct);

/* Worker w's part of the sweep. */
void FC(sweep_init)(const struct FC(table) *ct, struct fwd_conn_sweep *sw, unsigned int w,
		    unsigned int nworkers);

/* The rte_hash signature of a key: SipHash-2-4 under the table's own random
 * key (as fwd_flow.c: an outsider cannot aim keys at a bucket). */
static inline hash_sig_t FC(sig)(const struct FC(table) *ct, const FC_KEY *k)
{
	return (hash_sig_t)FC_KEY_HASH(ct->sig_key, k);
}

/* The entry of key, or NULL. Lock-free; the entry stays readable until the
 * caller's next quiescent state. */
static inline struct FC(slot) *FC(lookup)(const struct FC(table) *ct, const FC_KEY *k,
					  hash_sig_t sig)
{
	void *data;

	if (rte_hash_lookup_with_hash_data(ct->h, k, sig, &data) < 0)
		return NULL;
	return data;
}

/* Live entries (for the fast path's "is there anything to look up" and the
 * figures). */
static inline __u32 FC(count)(const struct FC(table) *ct)
{
	return __atomic_load_n(&ct->count, __ATOMIC_RELAXED);
}

/* Nothing for the sweep to do: no live entry, none awaiting reuse. */
static inline bool FC(at_rest)(const struct FC(table) *ct)
{
	return !FC(count)(ct) && !__atomic_load_n(&ct->retired_len, __ATOMIC_RELAXED);
}

/* The original entry of the connection e belongs to (e itself, or its peer's
 * slot). */
static inline struct FC(slot) *FC(orig)(const struct FC(table) *ct, struct FC(slot) *e)
{
	if (e->c.dir == LB_CONN_ORIG)
		return e;
	return e->peer_idx < ct->nslots ? &ct->slots[e->peer_idx] : NULL;
}

/* The state of an original entry (FWD_CONN_DEAD once it is being removed). */
static inline __u8 FC(state)(const struct FC(slot) *o)
{
	const fwd_conn_word_t *w = (const fwd_conn_word_t *)&o->c.state;

	return fwd_conn_word_state(__atomic_load_n(w, __ATOMIC_RELAXED));
}

/* A packet in direction dir of the connection whose original entry is o:
 * stamps last_seen and moves the state (lb_conn_next_state). false when the
 * connection is being removed by another worker. */
bool FC(update)(struct FC(table) *ct, struct fwd_conn_figures *fig, struct FC(slot) *o, __u8 dir,
		__u8 proto, __u8 tcp_flags, __u64 now_ns);

/* Opens the connection req describes (lb_conn.h, "Miss"): picks the reply key
 * (with SNAT, the first free of LB_SNAT_PROBES candidates), makes room (the
 * oldest embryonic connection of the FIFO, *evicted = true) and inserts both
 * entries, the original first. *out: the original entry (OPENED, EXISTS). */
enum fwd_conn_open_status FC(open)(struct FC(table) *ct, struct fwd_conn_figures *fig,
				   const struct FC(req) *req, struct FC(slot) **out,
				   bool *evicted);

/* Removes both entries of the connection whose original entry is o (a
 * reschedule). Nothing happens if it is already gone. */
void FC(close)(struct FC(table) *ct, struct fwd_conn_figures *fig, struct FC(slot) *o);

/* Looks at the next `budget` slots of sw and removes the connections idle
 * for longer than their state's timeout (timeouts_s, by state). Returns how
 * many it removed (also added to fig->expired). Also reuses what the readers
 * have let go. */
unsigned int FC(expire)(struct FC(table) *ct, struct fwd_conn_figures *fig,
			struct fwd_conn_sweep *sw, const __u32 *timeouts_s, __u64 now_ns,
			unsigned int budget);

#undef FC
#undef FC_KEY
#undef FC_ENTRY
#undef FC_ADDR
#undef FC_KEY_HASH
#undef FC_SLOT_SIZE
#undef FC_REPLY_KEY
#undef FC_ADDR_ZERO
