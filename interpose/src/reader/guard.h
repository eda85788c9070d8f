/* The reader's guard against a region file shrunk under its mapping
 * (guard.c): the mappings npualloc_reader_open made, registered until
 * npualloc_reader_close. */
#ifndef NPUALLOC_READER_GUARD_H
#define NPUALLOC_READER_GUARD_H

#include "npualloc_reader.h"

/* 0 once region is guarded; -1 when NPUALLOC_READER_OPEN_MAX are already. */
int npa_reader_guard(const npualloc_region *region);
void npa_reader_unguard(const npualloc_region *region);

#endif
