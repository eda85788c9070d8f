/* Once-only warnings on stderr. The interposer lives inside someone else's
 * program: it never writes to stdout, and a problem that repeats on every call
 * (a double free in a loop, a bad config key) is reported once; one call site
 * reports a few distinct problems, not hundreds. */
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

/* Hashes of the messages already printed. The per-site limit keeps the
 * texts of sites that carry the program's data few; forwarded ones are few
 * kinds per device, and the config parser shows 8 entries per string. Should
 * the table fill all the same (a defence: no test can reach it), a new
 * message is printed unrecorded rather than never: a full table once
 * silenced every later warning of the process, the double free after 256 bad
 * config keys. */
#define SEEN_SLOTS 1024
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

/* Whether a message with hash h is to be printed; records it. Under seen_lock. */
static bool first_time(uint64_t h)
{
    for (size_t i = 0, slot = h % SEEN_SLOTS; i < SEEN_SLOTS; i++, slot = (slot + 1) % SEEN_SLOTS) {
        if (seen[slot] == h)
            return false;
        if (seen[slot] == 0) {
            seen[slot] = h;
            return true;
        }
    }
    return true;
}

/* Every byte a terminal would act on as "?": ASCII controls (a newline would
 * forge a second "npualloc:" line, an escape would reach the terminal) and
 * the C1 controls as UTF-8 encodes them (0xC2 0x80-0x9F, e.g. a one-character
 * CSI). Messages carry text the program chose (paths, config keys); other
 * non-ASCII bytes stay, so a path in any script reads as it is. A lone 0x9B
 * stays too: only a terminal in an 8-bit mode reads it as CSI, and that
 * terminal misreads every UTF-8 path already. */
static void make_printable(char *s, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f) {
            s[i] = '?';
        } else if (c == 0xc2 && i + 1 < len && (unsigned char)s[i + 1] >= 0x80 && (unsigned char)s[i + 1] <= 0x9f) {
            s[i] = '?';
            s[i + 1] = '?';
            i++;
        }
    }
}

void npa_warn_once_at(npa_warn_site *site, const char *fmt, ...)
{
    static const char prefix[] = "npualloc: ", last[] = " (later warnings like this one are not shown)";
    char buf[600];
    const size_t start = sizeof prefix - 1, room = sizeof buf - start - (sizeof last - 1) - 1;
    memcpy(buf, prefix, start);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + start, room, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t len = start + ((size_t)n < room ? (size_t)n : room - 1);
    make_printable(buf + start, len - start);
    npa_mutex_lock(&seen_lock);
    bool print = (site == NULL || site->shown < NPA_WARNINGS_PER_SITE) && first_time(fnv1a(buf + start));
    bool is_last = print && site != NULL && ++site->shown == NPA_WARNINGS_PER_SITE;
    npa_mutex_unlock(&seen_lock);
    if (!print)
        return;
    if (is_last) {
        memcpy(buf + len, last, sizeof last - 1);
        len += sizeof last - 1;
    }
    buf[len++] = '\n';
    /* One write(2): no stdio buffer to interleave with the program's own
     * output, and safe at exit when stdio may already be flushed and closed.
     * Not under seen_lock: a stderr pipe nobody reads would block the write,
     * and fork_prepare takes that lock. So two threads of one site may print
     * its last line before another of its lines. Cancellation off: the
     * core warns under a device lock. */
    npa_cancel_off();
    ssize_t unused = write(STDERR_FILENO, buf, len);
    (void)unused;
    npa_cancel_on();
}

void npa_warn_lock_for_fork(void)
{
    npa_mutex_lock(&seen_lock);
}

void npa_warn_unlock_after_fork(void)
{
    npa_mutex_unlock(&seen_lock);
}
