/* The requester's side of the command slot (npualloc_shm.h). The process
 * (region.c's npa_region_poll_slow, pause.c) loads request_seq with acquire,
 * then reads code, device and arg, and answers by storing ack_status and then
 * ack_seq with release. So here: the fields first, request_seq last with
 * release; ack_seq with acquire before ack_status. On x86-64 program order
 * gives both; on aarch64 only these orderings do. */
#include "npualloc_reader.h"

uint64_t npualloc_reader_request_seq(const npualloc_region *region)
{
    return __atomic_load_n(&region->command.request_seq, __ATOMIC_RELAXED);
}

int32_t npualloc_reader_post(npualloc_region_file *file, int32_t code, int32_t device, double arg, uint64_t *seq)
{
    if (!file->writable)
        return NPUALLOC_POST_READ_ONLY;
    npualloc_command *command = &file->region->command;
    /* Requesters are serialised by the caller, and the process never writes
     * request_seq: nobody else moves it between this load and the store. */
    uint64_t last = __atomic_load_n(&command->request_seq, __ATOMIC_RELAXED);
    if (last == UINT64_MAX)
        return NPUALLOC_POST_SEQ_EXHAUSTED;
    /* The process reads code, device and arg one by one after it saw
     * request_seq move (region.c's npa_region_poll_slow, pause.c): while the
     * last command is unacknowledged it may be reading them now, and new
     * fields stored under it would be applied as a mix of two commands, and
     * acknowledged as the old one. Its release store of ack_seq comes after
     * its last read of them: once ack_seq (acquire) has caught up, they are
     * free to be rewritten. */
    if (__atomic_load_n(&command->ack_seq, __ATOMIC_ACQUIRE) != last)
        return NPUALLOC_POST_BUSY;
    __atomic_store_n(&command->code, code, __ATOMIC_RELAXED);
    __atomic_store_n(&command->device, device, __ATOMIC_RELAXED);
    __atomic_store(&command->arg, &arg, __ATOMIC_RELAXED);
    *seq = last + 1;
    __atomic_store_n(&command->request_seq, *seq, __ATOMIC_RELEASE);
    return NPUALLOC_POST_OK;
}

int32_t npualloc_reader_withdraw(npualloc_region_file *file, uint64_t seq)
{
    if (!file->writable || seq == 0)
        return 0;
    npualloc_command *command = &file->region->command;
    /* Only the request posted last: closing one past it would mark a request
     * nobody made as answered, and the slot stayed busy for every later post. */
    if (__atomic_load_n(&command->request_seq, __ATOMIC_RELAXED) != seq)
        return 0;
    /* Against the process's compare-and-swap of closed_seq (npa_region_take_command):
     * whichever comes first closes the request. The process never reads the
     * fields of a request it did not close; what it needs ordered is
     * request_seq before closed_seq (release), as a process that comes late
     * tells a later request withdrawn from a rewritten slot by it; then the
     * answer: the status, then ack_seq with release, as the process answers. */
    uint64_t open = seq - 1;
    if (!__atomic_compare_exchange_n(&command->closed_seq, &open, seq, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
        return 0;
    __atomic_store_n(&command->ack_status, NPUALLOC_CMD_WITHDRAWN, __ATOMIC_RELAXED);
    __atomic_store_n(&command->ack_seq, seq, __ATOMIC_RELEASE);
    return 1;
}

int32_t npualloc_reader_acked(const npualloc_region *region, uint64_t seq, int32_t *status)
{
    if (__atomic_load_n(&region->command.ack_seq, __ATOMIC_ACQUIRE) < seq)
        return 0;
    *status = __atomic_load_n(&region->command.ack_status, __ATOMIC_RELAXED);
    return 1;
}
