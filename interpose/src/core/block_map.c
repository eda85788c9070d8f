/* Live blocks by start address, so npa_free finds its block in O(1). Chained
 * through block->link (no per-entry allocation); the table doubles when the
 * load passes 1, and simply stays denser if that allocation fails. The
 * insert is inline (internal.h). */
#include <stdlib.h>

#include "internal.h"

bool npa_block_map_init(npa_block_map *map, size_t buckets) {
    map->buckets = calloc(buckets, sizeof *map->buckets);
    map->mask = buckets - 1;
    map->count = 0;
    return map->buckets != NULL;
}

void npa_block_map_destroy(npa_block_map *map) {
    free(map->buckets);
    map->buckets = NULL;
}

void npa_block_map_grow(npa_block_map *map) {
    size_t old_size = map->mask + 1;
    npa_block **old = map->buckets;
    npa_block **fresh = calloc(old_size * 2, sizeof *fresh);
    if (!fresh) return;
    map->buckets = fresh;
    map->mask = old_size * 2 - 1;
    for (size_t i = 0; i < old_size; i++) {
        for (npa_block *b = old[i], *next; b; b = next) {
            next = b->link;
            size_t k = npa_block_map_bucket(map, b->addr);
            b->link = fresh[k];
            fresh[k] = b;
        }
    }
    free(old);
}

npa_block *npa_block_map_take(npa_block_map *map, uintptr_t addr) {
    for (npa_block **link = &map->buckets[npa_block_map_bucket(map, addr)]; *link; link = &(*link)->link) {
        npa_block *b = *link;
        if (b->addr == addr) {
            *link = b->link;
            b->link = NULL;
            map->count--;
            return b;
        }
    }
    return NULL;
}

npa_block *npa_block_map_find(const npa_block_map *map, uintptr_t addr) {
    for (npa_block *b = map->buckets[npa_block_map_bucket(map, addr)]; b; b = b->link)
        if (b->addr == addr) return b;
    return NULL;
}
