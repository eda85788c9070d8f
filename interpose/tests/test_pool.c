/* The ordered free-block set (treap keyed (size, addr)) and the live-block
 * map, checked against brute force over random operations. */
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "core/internal.h"

#define N_BLOCKS 2000

static uint64_t rng_state = 0x2545f4914f6cdd1dULL;
static uint64_t rng(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static bool less(const npa_block *x, const npa_block *y) {
    return x->size < y->size || (x->size == y->size && x->addr < y->addr);
}

/* The brute-force answers over the blocks flagged in_pool. */
static npa_block *brute_lower_bound(npa_block *blocks, const bool *in_pool, size_t size) {
    npa_block *best = NULL;
    for (int i = 0; i < N_BLOCKS; i++)
        if (in_pool[i] && blocks[i].size >= size && (!best || less(&blocks[i], best))) best = &blocks[i];
    return best;
}

static npa_block *brute_largest(npa_block *blocks, const bool *in_pool) {
    npa_block *best = NULL;
    for (int i = 0; i < N_BLOCKS; i++)
        if (in_pool[i] && (!best || less(best, &blocks[i]))) best = &blocks[i];
    return best;
}

static void test_treap_matches_brute_force(void) {
    static npa_block blocks[N_BLOCKS];
    static bool in_pool[N_BLOCKS];
    bool moved = false;
    npa_pool pool = {.largest_moved = &moved};
    for (int i = 0; i < N_BLOCKS; i++) {
        blocks[i] = (npa_block){.addr = 0x10000000 + (uintptr_t)i * 512 * 64,
                                .size = 512 * (1 + rng() % 64)}; /* many equal sizes */
        in_pool[i] = false;
    }
    int mismatches = 0;
    for (int op = 0; op < 20000; op++) {
        int i = (int)(rng() % N_BLOCKS);
        if (in_pool[i]) npa_pool_remove(&pool, &blocks[i]);
        else npa_pool_insert(&pool, &blocks[i]);
        in_pool[i] = !in_pool[i];
        size_t query = 512 * (1 + rng() % 66);
        mismatches += npa_pool_lower_bound(&pool, query) != brute_lower_bound(blocks, in_pool, query);
        mismatches += pool.largest != brute_largest(blocks, in_pool);
    }
    CHECK_EQ(mismatches, 0);
    /* Empty it: every block was reachable. */
    for (int i = 0; i < N_BLOCKS; i++)
        if (in_pool[i]) npa_pool_remove(&pool, &blocks[i]);
    CHECK(pool.root == NULL);
    CHECK(pool.largest == NULL);
}

static int depth(const npa_block *t) {
    if (!t) return 0;
    int l = depth(t->left), r = depth(t->right);
    return 1 + (l > r ? l : r);
}

static void test_treap_stays_shallow_on_sorted_input(void) {
    /* Sizes and addresses both increasing: the worst case of an unbalanced tree. */
    static npa_block blocks[N_BLOCKS];
    bool moved = false;
    npa_pool pool = {.largest_moved = &moved};
    for (int i = 0; i < N_BLOCKS; i++) {
        blocks[i] = (npa_block){.addr = 0x20000000 + (uintptr_t)i * 2 * 1024 * 1024, .size = 512 * (size_t)(i + 1)};
        npa_pool_insert(&pool, &blocks[i]);
    }
    int d = depth(pool.root);
    CHECK(d < 40); /* log2(2000) is 11; a list would be 2000 */
    CHECK(pool.largest == &blocks[N_BLOCKS - 1]);
    CHECK(npa_pool_lower_bound(&pool, 512 * 1000 + 1) == &blocks[1000]);
}

static void test_block_map_grows_and_finds(void) {
    static npa_block blocks[N_BLOCKS];
    npa_block_map map;
    CHECK(npa_block_map_init(&map, 4));
    for (int i = 0; i < N_BLOCKS; i++) {
        blocks[i] = (npa_block){.addr = 0x30000000 + (uintptr_t)i * 512};
        npa_block_map_insert(&map, &blocks[i]);
    }
    CHECK(map.mask + 1 >= N_BLOCKS); /* grew from 4 buckets */
    CHECK(npa_block_map_take(&map, 0x30000000 + 100) == NULL); /* not a block start */
    int wrong = 0;
    for (int i = N_BLOCKS - 1; i >= 0; i -= 2) wrong += npa_block_map_take(&map, blocks[i].addr) != &blocks[i];
    CHECK_EQ(wrong, 0);
    CHECK_EQ(map.count, N_BLOCKS / 2);
    CHECK(npa_block_map_take(&map, blocks[N_BLOCKS - 1].addr) == NULL); /* already taken */
    CHECK(npa_block_map_take(&map, blocks[0].addr) == &blocks[0]);
    npa_block_map_destroy(&map);
}

static void test_slab_recycles(void) {
    npa_slab slab = {0};
    npa_block *a = npa_slab_get(&slab);
    npa_block *b = npa_slab_get(&slab);
    CHECK(a && b && a != b);
    a->size = 77;
    npa_slab_put(&slab, a);
    npa_block *c = npa_slab_get(&slab);
    CHECK(c == a);
    CHECK_EQ(c->size, 0); /* handed out cleared */
    npa_slab_destroy(&slab);
}

static void test_segment_table_lookup(void) {
    npa_segment_table t = {0};
    npa_block first[3];
    uintptr_t bases[3] = {0x9000000, 0x1000000, 0x5000000};
    for (int i = 0; i < 3; i++) CHECK(npa_segments_add(&t, bases[i], 0x100000, &first[i]));
    CHECK_EQ(npa_segments_find(&t, 0x1000000), 0);
    CHECK_EQ(npa_segments_find(&t, 0x10fffff), 0);
    CHECK_EQ(npa_segments_find(&t, 0x1100000), -1);
    CHECK_EQ(npa_segments_find(&t, 0x5000200), 1);
    CHECK_EQ(npa_segments_find(&t, 0x9000000), 2);
    CHECK_EQ(npa_segments_find(&t, 0x0fffff0), -1);
    CHECK(t.items[1].first == &first[2]);
    free(t.items);
}

int main(void) {
    RUN(test_treap_matches_brute_force);
    RUN(test_treap_stays_shallow_on_sorted_input);
    RUN(test_block_map_grows_and_finds);
    RUN(test_slab_recycles);
    RUN(test_segment_table_lookup);
    return check_report();
}
