/* SPDX-License-Identifier: Apache-2.0
 *
 * maglev_fill.c - the sequential part of the control plane's Maglev build
 * (control/hpclb/balancing/maglev.py), loaded with ctypes as libhpclb_maglev.so.
 *
 * Each turn, member turns[t] claims the first free slot of its walk
 * (offset + j * skip) % size from where its cursor stands. The turns, the
 * offsets and the skips come from maglev.py, which keeps a Python loop that
 * gives the same table, byte for byte, when this library is absent
 * (tests/unit/test_maglev.py compares them). In C the fill of a 65537-slot
 * ring takes about a millisecond instead of a tenth of a second, which is
 * most of the time from a telemetry sample to the ring patch.
 */
#include <stdint.h>

/* cursor: nmembers entries of scratch (each member's next slot to look at).
 * Returns 0, or -1 on inconsistent input (a member index out of range, more
 * turns than slots, a skip outside 1..size-1, an offset outside the ring). */
int hpclb_maglev_fill(uint32_t size, uint32_t nmembers, const int64_t *offset,
		      const int64_t *skip, const int64_t *turns, uint64_t nturns,
		      int64_t *cursor, int64_t *table)
{
	uint64_t t;

	if (size < 2 || nturns > size)
		return -1;
	for (uint32_t i = 0; i < nmembers; i++)
		if (offset[i] < 0 || offset[i] >= (int64_t)size || skip[i] < 1 ||
		    skip[i] >= (int64_t)size)
			return -1;
	for (uint32_t s = 0; s < size; s++)
		table[s] = -1;
	for (uint32_t i = 0; i < nmembers; i++)
		cursor[i] = offset[i];
	for (t = 0; t < nturns; t++) {
		int64_t i = turns[t], c, s;
		uint32_t walked = 0;

		if (i < 0 || i >= (int64_t)nmembers)
			return -1;
		c = cursor[i];
		s = skip[i];
		/* size is prime, so a walk visits every slot: at most size steps. */
		while (table[c] >= 0 && walked++ < size) {
			c += s;
			if (c >= (int64_t)size)
				c -= size;
		}
		table[c] = i;
		c += s;
		if (c >= (int64_t)size)
			c -= size;
		cursor[i] = c;
	}
	return 0;
}
