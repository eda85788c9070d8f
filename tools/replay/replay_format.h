/* The replay event file: what npualloc/replay.py writes from a memory snapshot
 * and npualloc-replay executes. Little-endian, a header then fixed records,
 * so the replay loop does no parsing.
 *
 * Python keeps this layout in step (npualloc/replay.py: EVENT_FILE_*). */
#ifndef NPUALLOC_REPLAY_FORMAT_H
#define NPUALLOC_REPLAY_FORMAT_H

#include <stdint.h>

#define REPLAY_MAGIC "NPAREPLY"
#define REPLAY_VERSION 1u

enum replay_op {
    REPLAY_ALLOC = 0,          /* slot gets a new block of size bytes */
    REPLAY_FREE = 1,           /* the block in slot (of size bytes) is freed */
    REPLAY_ITERATION_END = 2,  /* the trace's iteration mark; slot and size 0 */
};

typedef struct replay_header {
    char magic[8];
    uint32_t version;
    uint32_t slot_count;       /* slots are 0..slot_count-1; the writer reuses freed ones */
    uint64_t event_count;
} replay_header;

typedef struct replay_event {
    uint64_t size;
    uint32_t slot;
    uint32_t op;
} replay_event;

_Static_assert(sizeof(replay_header) == 24, "header layout");
_Static_assert(sizeof(replay_event) == 16, "event layout");

#endif
