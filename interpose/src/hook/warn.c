/* Once-only warnings on stderr. The interposer lives inside someone else's
 * program: it never writes to stdout, and a problem that repeats on every call
 * (a double free in a loop, a bad config key) is reported once. */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

/* Hashes of the messages already printed. Distinct problems in one process are
 * few; past the table's size we stay quiet rather than grow. */
#define SEEN_SLOTS 256
static uint64_t seen[SEEN_SLOTS];
/* A leaf of the lock order (hook.h): nothing is taken under it. */
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t fnv1a(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h ? h : 1; /* 0 marks an empty slot */
}

static int first_time(uint64_t h)
{
    int first = 0;
    pthread_mutex_lock(&seen_lock);
    for (size_t i = 0, slot = h % SEEN_SLOTS; i < SEEN_SLOTS; i++, slot = (slot + 1) % SEEN_SLOTS) {
        if (seen[slot] == h)
            break;
        if (seen[slot] == 0) {
            seen[slot] = h;
            first = 1;
            break;
        }
    }
    pthread_mutex_unlock(&seen_lock);
    return first;
}

void npa_warn_once(const char *fmt, ...)
{
    char buf[600];
    const size_t prefix = sizeof("npualloc: ") - 1;
    memcpy(buf, "npualloc: ", prefix);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + prefix, sizeof(buf) - prefix - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t len = prefix + ((size_t)n < sizeof(buf) - prefix - 1 ? (size_t)n : sizeof(buf) - prefix - 2);
    buf[len] = '\0';
    if (!first_time(fnv1a(buf + prefix)))
        return;
    buf[len++] = '\n';
    /* One write(2): no stdio buffer to interleave with the program's own
     * output, and safe at exit when stdio may already be flushed and closed. */
    ssize_t unused = write(STDERR_FILENO, buf, len);
    (void)unused;
}

void npa_warn_lock_for_fork(void)
{
    pthread_mutex_lock(&seen_lock);
}

void npa_warn_unlock_after_fork(void)
{
    pthread_mutex_unlock(&seen_lock);
}
