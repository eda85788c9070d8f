/* Block structs in chunks of many, recycled through a free list: a split on
 * the hit path costs a pointer pop, not a malloc. Chunks live until destroy
 * (a device's peak block count is small next to its memory). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define BLOCKS_PER_CHUNK 256

typedef struct slab_chunk {
    struct slab_chunk *next;
    npa_block blocks[BLOCKS_PER_CHUNK];
} slab_chunk;

npa_block *npa_slab_get(npa_slab *slab) {
    if (!slab->free_list) {
        slab_chunk *chunk = malloc(sizeof *chunk);
        if (!chunk) return NULL;
        chunk->next = slab->chunks;
        slab->chunks = chunk;
        for (size_t i = 0; i < BLOCKS_PER_CHUNK; i++) npa_slab_put(slab, &chunk->blocks[i]);
    }
    npa_block *b = slab->free_list;
    slab->free_list = b->link;
    memset(b, 0, sizeof *b);
    return b;
}

void npa_slab_put(npa_slab *slab, npa_block *b) {
    b->link = slab->free_list;
    slab->free_list = b;
}

void npa_slab_destroy(npa_slab *slab) {
    for (slab_chunk *c = slab->chunks, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    slab->chunks = NULL;
    slab->free_list = NULL;
}
