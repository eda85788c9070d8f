/* The free-block sets: an intrusive treap ordered by (size, addr). Best fit
 * is a lower_bound; insert and remove are split/merge walks with no recursion
 * and no allocation. Priorities hash the block address (fixed per address,
 * well spread), which keeps the expected depth logarithmic. */
#include "internal.h"

static bool block_less(const npa_block *x, const npa_block *y) {
    return x->size < y->size || (x->size == y->size && x->addr < y->addr);
}

static uint32_t address_priority(uintptr_t addr) {
    uint64_t z = (uint64_t)addr;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return (uint32_t)(z ^ (z >> 31));
}

/* Splits subtree t into the keys below key (*lo) and the rest (*hi). */
static void treap_split(npa_block *t, const npa_block *key, npa_block **lo, npa_block **hi) {
    while (t) {
        if (block_less(t, key)) {
            *lo = t;
            lo = &t->right;
            t = t->right;
        } else {
            *hi = t;
            hi = &t->left;
            t = t->left;
        }
    }
    *lo = NULL;
    *hi = NULL;
}

/* Joins two subtrees where every key of lo is below every key of hi. */
static npa_block *treap_merge(npa_block *lo, npa_block *hi) {
    npa_block *root = NULL;
    npa_block **link = &root;
    while (lo && hi) {
        if (lo->priority > hi->priority) {
            *link = lo;
            link = &lo->right;
            lo = lo->right;
        } else {
            *link = hi;
            link = &hi->left;
            hi = hi->left;
        }
    }
    *link = lo ? lo : hi;
    return root;
}

static npa_block *rightmost(npa_block *t) {
    if (t)
        while (t->right) t = t->right;
    return t;
}

/* seq odd before a count changes: the release fence orders it before the
 * count for a reader that sees the count. */
static void summary_open(npa_pool_summary *s) {
    if (s->seq & 1) return;
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

/* A block of the summary's pool came or went. */
static void summary_count(npa_pool_summary *s, size_t size, uint32_t by) {
    size_t at = size >> NPA_SUMMARY_SHIFT;
    if (at >= NPA_SUMMARY_BUCKETS) return;
    summary_open(s);
    __atomic_store_n(&s->counts[at], s->counts[at] + by, __ATOMIC_RELAXED);
}

void npa_pool_summary_start(npa_pool *pool, npa_pool_summary *s) {
    /* seq odd since the stop, perhaps another thread's: the fence orders it
     * before the rebuilt counts here, as summary_open does for its own. */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (size_t i = 0; i < NPA_SUMMARY_BUCKETS; i++) __atomic_store_n(&s->counts[i], 0, __ATOMIC_RELAXED);
    /* In (size, addr) order: the counted range ends at the first block past it. */
    for (const npa_block *b = npa_pool_lower_bound(pool, 0); b && b->size >> NPA_SUMMARY_SHIFT < NPA_SUMMARY_BUCKETS;
         b = npa_pool_next(pool, b)) {
        uint32_t *count = &s->counts[b->size >> NPA_SUMMARY_SHIFT];
        __atomic_store_n(count, *count + 1, __ATOMIC_RELAXED);
    }
    pool->summary = s;
}

void npa_pool_summary_stop(npa_pool *pool, npa_pool_summary *s) {
    summary_open(s);
    pool->summary = NULL;
}

void npa_pool_insert(npa_pool *pool, npa_block *b) {
    if (pool->summary) summary_count(pool->summary, b->size, 1);
    b->priority = address_priority(b->addr);
    b->age_base = pool->search_count;
    npa_block **link = &pool->root;
    while (*link && (*link)->priority > b->priority) link = block_less(b, *link) ? &(*link)->left : &(*link)->right;
    treap_split(*link, b, &b->left, &b->right);
    *link = b;
    if (!pool->largest || block_less(pool->largest, b)) {
        pool->largest = b;
        *pool->largest_moved = true;
    }
}

void npa_pool_remove(npa_pool *pool, npa_block *b) {
    if (pool->summary) summary_count(pool->summary, b->size, UINT32_MAX); /* minus one, modulo 2^32 */
    npa_block **link = &pool->root;
    while (*link != b) link = block_less(b, *link) ? &(*link)->left : &(*link)->right;
    *link = treap_merge(b->left, b->right);
    b->left = b->right = NULL;
    if (pool->largest == b) {
        pool->largest = rightmost(pool->root);
        *pool->largest_moved = true;
    }
}

npa_block *npa_pool_lower_bound(const npa_pool *pool, size_t size) {
    npa_block *best = NULL;
    for (npa_block *t = pool->root; t;) {
        if (t->size >= size) {
            best = t;
            t = t->left;
        } else {
            t = t->right;
        }
    }
    return best;
}

npa_block *npa_pool_next(const npa_pool *pool, const npa_block *b) {
    npa_block *best = NULL;
    for (npa_block *t = pool->root; t;) {
        if (block_less(b, t)) {
            best = t;
            t = t->left;
        } else {
            t = t->right;
        }
    }
    return best;
}
