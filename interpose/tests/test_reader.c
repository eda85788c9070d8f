/* libnpualloc_reader (interpose/src/reader): opening crafted region files,
 * the seqlock copy, the command slot, and both against concurrent writers: the
 * real core publishing into a region while reader threads copy it, and a
 * process-side thread answering commands while a requester posts them.
 * `make ctest-aarch64` runs this under qemu-aarch64 too. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "fake_backend.h"
#include "npualloc_reader.h"
#include "region/region.h"
#include "region_lock.h"
#include "test_util.h"

static char dir[] = "/tmp/npualloc-test-reader.XXXXXX";

static void region_template(npualloc_region *r) {
    memset(r, 0, sizeof *r);
    r->header.magic = NPUALLOC_SHM_MAGIC;
    r->header.version = NPUALLOC_SHM_VERSION;
    r->header.size = sizeof *r;
    r->header.pid = (int32_t)getpid();
    r->header.uid = (uint32_t)geteuid();
}

/* Writes len bytes of data as <dir>/name (replacing it); returns its path. */
static const char *write_file(const char *name, const void *data, size_t len) {
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    CHECK(fd >= 0);
    CHECK_EQ(write(fd, data, len), (long long)len);
    close(fd);
    return path;
}

static int32_t open_path(const char *path, int32_t writable, npualloc_region_file *file) {
    return npualloc_reader_open(AT_FDCWD, path, (uint32_t)geteuid(), writable, file);
}

/* Opens a region file made from the template after `damage`, expecting `verdict`. */
static npualloc_region_file open_damaged(void (*damage)(npualloc_region *), size_t len, int32_t verdict) {
    static npualloc_region r;
    region_template(&r);
    if (damage) damage(&r);
    npualloc_region_file file;
    CHECK_EQ(open_path(write_file("region", &r, len), 0, &file), verdict);
    if (verdict != NPUALLOC_OPEN_OK) {
        CHECK(file.region == NULL);
        CHECK_EQ(file.fd, -1);
    }
    return file;
}

static void bad_magic(npualloc_region *r) { r->header.magic ^= 1; }
static void newer_version(npualloc_region *r) { r->header.version = NPUALLOC_SHM_VERSION + 1; }
static void older_version(npualloc_region *r) { r->header.version = NPUALLOC_SHM_VERSION - 1; }
static void wrong_size(npualloc_region *r) { r->header.size = sizeof *r + 8; }
static void too_many_devices(npualloc_region *r) { r->header.device_count = NPUALLOC_MAX_DEVICES + 1; }

static void test_open_validates_in_order(void) {
    npualloc_region_file file = open_damaged(NULL, sizeof(npualloc_region), NPUALLOC_OPEN_OK);
    CHECK(file.region != NULL);
    CHECK_EQ(file.region->header.pid, getpid());
    CHECK_EQ(file.size, sizeof(npualloc_region));
    npualloc_reader_close(&file);
    npualloc_reader_close(&file); /* idempotent */
    CHECK_EQ(file.fd, -1);

    file = open_damaged(NULL, sizeof(npualloc_region) - 1, NPUALLOC_OPEN_TRUNCATED);
    CHECK_EQ(file.size, sizeof(npualloc_region) - 1);
    open_damaged(NULL, 0, NPUALLOC_OPEN_TRUNCATED);
    open_damaged(bad_magic, sizeof(npualloc_region), NPUALLOC_OPEN_BAD_MAGIC);
    file = open_damaged(newer_version, sizeof(npualloc_region), NPUALLOC_OPEN_BAD_VERSION);
    CHECK_EQ(file.version, NPUALLOC_SHM_VERSION + 1);
    file = open_damaged(wrong_size, sizeof(npualloc_region), NPUALLOC_OPEN_BAD_SIZE);
    CHECK_EQ(file.declared_size, sizeof(npualloc_region) + 8);
    open_damaged(too_many_devices, sizeof(npualloc_region), NPUALLOC_OPEN_BAD_DEVICES);

    /* Magic and version before size: an older layout, shorter or longer, is
     * another version; a short file of something else is not a region. */
    file = open_damaged(older_version, sizeof(npualloc_region) / 2, NPUALLOC_OPEN_BAD_VERSION);
    CHECK_EQ(file.version, NPUALLOC_SHM_VERSION - 1);
    open_damaged(bad_magic, sizeof(npualloc_region) / 2, NPUALLOC_OPEN_BAD_MAGIC);
    open_damaged(NULL, offsetof(npualloc_region_header, config_seq) - 1, NPUALLOC_OPEN_TRUNCATED);
}

static void test_open_refuses_what_is_not_our_regular_file(void) {
    char path[256], target[256];
    npualloc_region_file file;
    snprintf(path, sizeof path, "%s/planted", dir);

    /* A FIFO nobody writes to: the open must neither block nor read it. */
    CHECK_EQ(mkfifo(path, 0666), 0);
    CHECK_EQ(open_path(path, 0, &file), NPUALLOC_OPEN_NOT_REGULAR);
    CHECK(S_ISFIFO(file.mode));
    CHECK_EQ(open_path(path, 1, &file), NPUALLOC_OPEN_NOT_REGULAR);
    unlink(path);

    /* A link to a well-formed region is not followed. */
    npualloc_region r;
    region_template(&r);
    snprintf(target, sizeof target, "%s", write_file("target", &r, sizeof r));
    CHECK_EQ(symlink(target, path), 0);
    CHECK_EQ(open_path(path, 0, &file), NPUALLOC_OPEN_ERRNO);
    CHECK_EQ(file.error, ELOOP);
    unlink(path);

    CHECK_EQ(open_path(path, 0, &file), NPUALLOC_OPEN_ERRNO);
    CHECK_EQ(file.error, ENOENT);
    CHECK_EQ(open_path(dir, 0, &file), NPUALLOC_OPEN_NOT_REGULAR);

    /* Relative to a directory descriptor, as the package opens regions;
     * owned by someone else than the process it should belong to: refused. */
    int dir_fd = open(dir, O_RDONLY | O_DIRECTORY);
    CHECK_EQ(npualloc_reader_open(dir_fd, "target", (uint32_t)geteuid(), 0, &file), NPUALLOC_OPEN_OK);
    npualloc_reader_close(&file);
    CHECK_EQ(npualloc_reader_open(dir_fd, "target", (uint32_t)geteuid() + 1, 0, &file), NPUALLOC_OPEN_OTHER_OWNER);
    CHECK_EQ(file.uid, geteuid());
    close(dir_fd);
    unlink(target);
}

/* A region's lock tells whether its process lives (region_lock.h): held
 * by another open file description, as the process holds it, it is seen;
 * dropped with that description's last descriptor, it is gone. Only the
 * inode asked about, and only a regular file, is answered for. */
static void test_locked_tells_whether_the_region_is_held(void) {
    npualloc_region r;
    region_template(&r);
    const char *path = write_file("region", &r, sizeof r);
    struct stat info;
    CHECK_EQ(stat(path, &info), 0);
    int dir_fd = open(dir, O_RDONLY | O_DIRECTORY);
    CHECK_EQ(npualloc_reader_locked(dir_fd, "region", info.st_ino), 0);
    int holder = open(path, O_RDWR);
    CHECK_EQ(npa_region_lock(holder), 0);
    CHECK_EQ(npualloc_reader_locked(dir_fd, "region", info.st_ino), 1);
    CHECK_EQ(npualloc_reader_locked(dir_fd, "region", info.st_ino + 1), -1);
    close(holder);
    CHECK_EQ(npualloc_reader_locked(dir_fd, "region", info.st_ino), 0);
    CHECK_EQ(npualloc_reader_locked(dir_fd, "missing", info.st_ino), -1);
    struct stat fifo;
    CHECK_EQ(mkfifoat(dir_fd, "fifo", 0600), 0);
    CHECK_EQ(fstatat(dir_fd, "fifo", &fifo, 0), 0);
    CHECK_EQ(npualloc_reader_locked(dir_fd, "fifo", fifo.st_ino), -1); /* and no wait for a writer */
    unlinkat(dir_fd, "fifo", 0);
    close(dir_fd);
}

static void test_stats_copy_is_bounded(void) {
    static npualloc_region r;
    region_template(&r);
    npualloc_device_stats out;
    r.devices[3].seq = 8;
    r.devices[3].num_cache_hits = 42;
    CHECK_EQ(npualloc_reader_stats(&r, 3, 1, &out), NPUALLOC_READ_OK);
    CHECK_EQ(out.seq, 8);
    CHECK_EQ(out.num_cache_hits, 42);
    CHECK(memcmp(&out, &r.devices[3], sizeof out) == 0);

    /* freed comes out of the region's allocated, current, current_at_reset;
     * a hostile region's extremes wrap (UBSan builds check: no overflow). */
    r.devices[3].allocated_bytes[NPUALLOC_POOL_SMALL] = (npualloc_stat){.current = 3 * MiB, .allocated = 7 * MiB,
                                                                        .current_at_reset = 1 * MiB};
    r.devices[3].requested_bytes[NPUALLOC_POOL_ALL] = (npualloc_stat){.current = INT64_MIN, .allocated = INT64_MAX,
                                                                      .current_at_reset = INT64_MAX};
    CHECK_EQ(npualloc_reader_stats(&r, 3, 1, &out), NPUALLOC_READ_OK);
    CHECK_EQ(out.allocated_bytes[NPUALLOC_POOL_SMALL].freed, 5 * MiB);
    CHECK_EQ(out.allocated_bytes[NPUALLOC_POOL_SMALL].current, 3 * MiB);
    CHECK_EQ(out.requested_bytes[NPUALLOC_POOL_ALL].freed, (int64_t)((uint64_t)INT64_MAX * 2 - (uint64_t)INT64_MIN));

    r.devices[3].seq = 9; /* a writer inside, for good: the attempts run out */
    CHECK_EQ(npualloc_reader_stats(&r, 3, 50, &out), NPUALLOC_READ_BUSY);
    CHECK_EQ(npualloc_reader_stats(&r, 3, 0, &out), NPUALLOC_READ_BUSY);
    CHECK_EQ(npualloc_reader_stats(&r, -1, 1, &out), NPUALLOC_READ_BAD_DEVICE);
    CHECK_EQ(npualloc_reader_stats(&r, NPUALLOC_MAX_DEVICES, 1, &out), NPUALLOC_READ_BAD_DEVICE);

    npualloc_saver_stats saver;
    r.saver[1].seq = 2;
    r.saver[1].paused_bytes = 4 * MiB;
    CHECK_EQ(npualloc_reader_saver_stats(&r, 1, 1, &saver), NPUALLOC_READ_OK);
    CHECK(memcmp(&saver, &r.saver[1], sizeof saver) == 0);
    r.saver[1].seq = 3;
    CHECK_EQ(npualloc_reader_saver_stats(&r, 1, 50, &saver), NPUALLOC_READ_BUSY);
    CHECK_EQ(npualloc_reader_saver_stats(&r, NPUALLOC_MAX_DEVICES, 1, &saver), NPUALLOC_READ_BAD_DEVICE);

    /* The config text: whole, NUL-terminated even when the region's is not. */
    char config[NPUALLOC_CONFIG_LEN];
    strcpy(r.header.config, "garbage_collection_threshold:0.5");
    r.header.config_seq = 4;
    CHECK_EQ(npualloc_reader_config(&r, 1, config), NPUALLOC_READ_OK);
    CHECK(strcmp(config, "garbage_collection_threshold:0.5") == 0);
    memset(r.header.config, 'x', sizeof r.header.config);
    CHECK_EQ(npualloc_reader_config(&r, 1, config), NPUALLOC_READ_OK);
    CHECK_EQ(strlen(config), NPUALLOC_CONFIG_LEN - 1);
    r.header.config_seq = 5; /* being rewritten, for good */
    CHECK_EQ(npualloc_reader_config(&r, 50, config), NPUALLOC_READ_BUSY);
}

/* The region's owner truncates the file after the reader mapped it: the
 * reader's next access faults (SIGBUS), which the reader library turns into
 * zero pages and a lost mapping that every read reports, instead of the end
 * of the reader (another user's `stats` or exporter, root's included). */
static void test_a_file_shrunk_under_the_mapping_is_reported_not_fatal(void) {
    static npualloc_region r;
    region_template(&r);
    r.header.device_count = 1;
    r.devices[0].seq = 2;
    r.devices[0].num_cache_hits = 42;
    const char *path = write_file("region", &r, sizeof r);
    npualloc_region_file file;
    CHECK_EQ(open_path(path, 0, &file), NPUALLOC_OPEN_OK);
    npualloc_device_stats out;
    CHECK_EQ(npualloc_reader_stats(file.region, 0, 1, &out), NPUALLOC_READ_OK);
    CHECK_EQ(out.num_cache_hits, 42);
    CHECK_EQ(npualloc_reader_lost(file.region), 0);
    CHECK_EQ(truncate(path, 0), 0);
    CHECK_EQ(npualloc_reader_stats(file.region, 0, 1, &out), NPUALLOC_READ_LOST);
    CHECK_EQ(npualloc_reader_lost(file.region), 1);
    CHECK_EQ(__atomic_load_n(&file.region->header.magic, __ATOMIC_RELAXED), 0); /* zero pages now */
    npualloc_reader_close(&file);
    /* A reader opening it now finds it short before mapping anything. */
    CHECK_EQ(open_path(path, 0, &file), NPUALLOC_OPEN_TRUNCATED);
}

/* Every open region is guarded; past the guard's table an open is refused
 * (an unguarded mapping would let the file's owner end the reader), and a
 * close makes room again. */
static void test_regions_open_at_once_are_bounded(void) {
    static npualloc_region r;
    region_template(&r);
    const char *path = write_file("region", &r, sizeof r);
    static npualloc_region_file files[NPUALLOC_READER_OPEN_MAX + 1];
    for (int i = 0; i < NPUALLOC_READER_OPEN_MAX; i++) CHECK_EQ(open_path(path, 0, &files[i]), NPUALLOC_OPEN_OK);
    npualloc_region_file refused;
    CHECK_EQ(open_path(path, 0, &refused), NPUALLOC_OPEN_TOO_MANY);
    CHECK(refused.region == NULL);
    CHECK_EQ(refused.fd, -1);
    npualloc_reader_close(&files[7]);
    CHECK_EQ(open_path(path, 0, &files[7]), NPUALLOC_OPEN_OK);
    CHECK_EQ(truncate(path, 0), 0); /* the last one opened is guarded too */
    npualloc_device_stats out;
    CHECK_EQ(npualloc_reader_stats(files[7].region, 0, 1, &out), NPUALLOC_READ_LOST);
    for (int i = 0; i < NPUALLOC_READER_OPEN_MAX; i++) npualloc_reader_close(&files[i]);
}

static void test_pause_state(void) {
    npualloc_region r;
    region_template(&r);
    r.header.pause = (npualloc_pause_state){.seq = 6, .state = NPUALLOC_PAUSED, .paused_bytes = 3 * MiB,
                                            .backup_bytes = 1 * MiB};
    npualloc_region_file file;
    CHECK_EQ(open_path(write_file("region", &r, sizeof r), 0, &file), NPUALLOC_OPEN_OK);
    npualloc_pause_state out;
    CHECK_EQ(npualloc_reader_pause_state(file.region, 1, &out), NPUALLOC_READ_OK);
    CHECK(out.state == NPUALLOC_PAUSED && out.paused_bytes == 3 * MiB && out.backup_bytes == 1 * MiB);
    npualloc_reader_close(&file);
    r.header.pause.seq = 7; /* the process inside an update, for good */
    CHECK_EQ(npualloc_reader_pause_state(&r, 50, &out), NPUALLOC_READ_BUSY);
}

static void test_post_and_ack(void) {
    npualloc_region r;
    region_template(&r);
    npualloc_region_file file = open_damaged(NULL, sizeof r, NPUALLOC_OPEN_OK); /* read-only */
    uint64_t seq = 0;
    int32_t status = -1;
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_EMPTY_CACHE, -1, 0.0, &seq), NPUALLOC_POST_READ_ONLY);
    CHECK_EQ(file.region->command.request_seq, 0);
    CHECK_EQ(npualloc_reader_withdraw(&file, 1), 0);
    npualloc_reader_close(&file);

    CHECK_EQ(open_path(write_file("region", &r, sizeof r), 1, &file), NPUALLOC_OPEN_OK);
    npualloc_command *c = &file.region->command;
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_SET_GC_THRESHOLD, 2, 0.75, &seq), NPUALLOC_POST_OK);
    CHECK_EQ(seq, 1);
    CHECK_EQ(npualloc_reader_request_seq(file.region), 1);
    CHECK(c->code == NPUALLOC_CMD_SET_GC_THRESHOLD && c->device == 2 && c->arg == 0.75);
    CHECK_EQ(npualloc_reader_acked(file.region, seq, &status), 0);
    /* Unacknowledged: the process may be reading the fields; nothing is stored over them. */
    uint64_t busy_seq = 0;
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_RECORD_HISTORY, 0, 9.0, &busy_seq), NPUALLOC_POST_BUSY);
    CHECK(busy_seq == 0 && c->request_seq == 1 && c->code == NPUALLOC_CMD_SET_GC_THRESHOLD && c->device == 2 &&
          c->arg == 0.75);
    c->closed_seq = 1; /* the process took it: too late to withdraw, and it answers */
    CHECK_EQ(npualloc_reader_withdraw(&file, seq), 0);
    CHECK_EQ(npualloc_reader_acked(file.region, seq, &status), 0);
    c->ack_status = NPUALLOC_CMD_EINVAL;
    c->ack_seq = 1;
    CHECK_EQ(npualloc_reader_acked(file.region, seq, &status), 1);
    CHECK_EQ(status, NPUALLOC_CMD_EINVAL);

    /* Withdrawn before the process came: closed, answered by the requester,
     * once only, and the next command is posted at once. */
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_EMPTY_CACHE, -1, 0.0, &seq), NPUALLOC_POST_OK);
    CHECK_EQ(seq, 2);
    CHECK_EQ(npualloc_reader_withdraw(&file, seq), 1);
    CHECK(c->closed_seq == 2 && c->ack_seq == 2);
    CHECK_EQ(npualloc_reader_acked(file.region, seq, &status), 1);
    CHECK_EQ(status, NPUALLOC_CMD_WITHDRAWN);
    CHECK_EQ(npualloc_reader_withdraw(&file, seq), 0);
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_RESET_PEAK, -1, 0.0, &seq), NPUALLOC_POST_OK);
    CHECK_EQ(seq, 3);
    /* 4 was never posted: withdrawing it closes nothing, though 3 is taken
     * (closed_seq 3, where a compare-and-swap from 3 would pass): it once
     * answered 4 withdrawn, and the process's answer to 3 then moved ack_seq
     * back under it. */
    c->closed_seq = 3;
    CHECK_EQ(npualloc_reader_withdraw(&file, seq + 1), 0);
    CHECK(c->closed_seq == 3 && c->ack_seq == 2);

    /* A crafted region at the end of the counter: refused, nothing stored. */
    c->request_seq = c->ack_seq = UINT64_MAX;
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_SNAPSHOT, 0, 1.0, &seq), NPUALLOC_POST_SEQ_EXHAUSTED);
    CHECK_EQ(c->request_seq, UINT64_MAX);
    CHECK_EQ(c->code, NPUALLOC_CMD_RESET_PEAK);
    npualloc_reader_close(&file);
}

/* The process saw request 1 (its request_seq load), then stalled before
 * taking it; meanwhile its requester withdrew it, posted 2 and withdrew that
 * too. Taking 1 late finds both withdrawn: nothing is answered (an answer
 * to 1 would move ack_seq back under 2's) and closed_seq stays at 2, so 2,
 * whose requester was told it was withdrawn, is never taken. */
static void test_a_late_take_leaves_later_withdrawals_closed(void) {
    npualloc_region r;
    region_template(&r);
    npualloc_region_file file;
    CHECK_EQ(open_path(write_file("region", &r, sizeof r), 1, &file), NPUALLOC_OPEN_OK);
    npualloc_command *c = &file.region->command;
    uint64_t seq = 0;
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_PAUSE, -1, 0.0, &seq), NPUALLOC_POST_OK);
    uint64_t seen = __atomic_load_n(&c->request_seq, __ATOMIC_ACQUIRE); /* the process's load */
    CHECK_EQ(npualloc_reader_withdraw(&file, seq), 1);
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_PAUSE, -1, 0.0, &seq), NPUALLOC_POST_OK);
    CHECK_EQ(npualloc_reader_withdraw(&file, seq), 1);
    CHECK_EQ(npa_region_take_command(file.region, seen), NPA_COMMAND_WITHDRAWN);
    CHECK(c->closed_seq == 2 && c->ack_seq == 2);
    CHECK_EQ(npa_region_take_command(file.region, 2), NPA_COMMAND_WITHDRAWN);
    CHECK_EQ(c->closed_seq, 2);
    /* The next request is taken as usual. */
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_RESET_PEAK, -1, 0.0, &seq), NPUALLOC_POST_OK);
    CHECK_EQ(npa_region_take_command(file.region, seq), NPA_COMMAND_TAKEN);
    CHECK_EQ(npualloc_reader_withdraw(&file, seq), 0);
    /* A slot someone rewrote (closed_seq past every request) is damaged and
     * mended: the request after it is taken. */
    c->ack_seq = seq;
    c->closed_seq = 12345;
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_RESET_PEAK, -1, 0.0, &seq), NPUALLOC_POST_OK);
    CHECK_EQ(npa_region_take_command(file.region, seq), NPA_COMMAND_DAMAGED);
    CHECK_EQ(c->closed_seq, seq);
    c->ack_seq = seq;
    CHECK_EQ(npualloc_reader_post(&file, NPUALLOC_CMD_RESET_PEAK, -1, 0.0, &seq), NPUALLOC_POST_OK);
    CHECK_EQ(npa_region_take_command(file.region, seq), NPA_COMMAND_TAKEN);
    npualloc_reader_close(&file);
}

/* --- the seqlock against the real writer ------------------------------- */

#define READERS 2
#define CHECKPOINTS 40
#define OPS_PER_CHECKPOINT 400

static const char *const pooled_names[] = {"allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                           "reserved_bytes", "active_bytes", "inactive_split_bytes",
                                           "requested_bytes"};

/* What every state the core publishes satisfies (no reset runs here): each
 * per-pool stat is the sum of its two pools, current = allocated - freed
 * (by construction since freed is implied, version 4: a check that the
 * reader handed out the freed form) and current <= peak. A copy torn across
 * an update breaks one of them. Returns the violations. */
static int inconsistencies(const npualloc_device_stats *s) {
    const npualloc_stat *pooled[] = {s->allocation, s->segment, s->active, s->inactive_split, s->allocated_bytes,
                                     s->reserved_bytes, s->active_bytes, s->inactive_split_bytes,
                                     s->requested_bytes};
    int bad = 0;
    for (size_t i = 0; i < sizeof pooled / sizeof *pooled; i++) {
        const npualloc_stat *st = pooled[i];
        for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++)
            if (st[pool].current != st[pool].allocated - st[pool].freed || st[pool].current > st[pool].peak) bad++;
        if (st[0].current != st[1].current + st[2].current || st[0].allocated != st[1].allocated + st[2].allocated ||
            st[0].freed != st[1].freed + st[2].freed) {
            if (bad++ == 0) fprintf(stderr, "inconsistent %s\n", pooled_names[i]);
        }
    }
    /* torch's order: a free lowers allocated at once, active once the block is really free. */
    if (!(s->allocated_bytes[0].current <= s->active_bytes[0].current &&
          s->active_bytes[0].current <= s->reserved_bytes[0].current))
        bad++;
    if (s->segment[0].current != s->num_device_alloc - s->num_device_free) bad++;
    if (s->num_cache_hits + s->num_cache_misses != s->allocation[0].allocated) bad++;
    if (s->seq % 2 != 0) bad++;
    return bad;
}

static struct {
    npualloc_region *region;
    _Atomic int checkpoint;            /* the writer's; a reader's snapshot after it covers its updates */
    _Atomic int reader_checkpoint[READERS];
    _Atomic int writer_done;
} race;

typedef struct reader_result {
    long snapshots, busy, inconsistent, went_back, distinct;
} reader_result;

static void *reader_thread(void *arg) {
    int index = (int)(intptr_t)arg;
    reader_result *result = calloc(1, sizeof *result);
    uint64_t last_seq = 0;
    for (;;) {
        int done = atomic_load(&race.writer_done);
        int checkpoint = atomic_load(&race.checkpoint);
        npualloc_device_stats copy;
        if (npualloc_reader_stats(race.region, 0, 1000, &copy) != NPUALLOC_READ_OK) {
            result->busy++;
            continue;
        }
        result->snapshots++;
        if (inconsistencies(&copy)) result->inconsistent++;
        if (copy.seq < last_seq) result->went_back++;
        if (copy.seq != last_seq) result->distinct++;
        last_seq = copy.seq;
        atomic_store(&race.reader_checkpoint[index], checkpoint);
        if (done) break;
    }
    return result;
}

/* Random mallocs and frees of small and large blocks, so every pool stat and
 * segment allocations and releases move (each store of them, under
 * ThreadSanitizer, checked against the readers' copies); a checkpoint every
 * OPS_PER_CHECKPOINT waits until each reader has copied since, so the readers
 * see the run's states whatever the scheduling. */
static void run_writer(fixture *fx) {
    void *live[64] = {0};
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int checkpoint = 1; checkpoint <= CHECKPOINTS; checkpoint++) {
        for (int op = 0; op < OPS_PER_CHECKPOINT; op++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            void **slot = &live[rng % 64];
            if (*slot) {
                CHECK_EQ(npa_free(fx->a, *slot, 0, NULL), NPA_FREE_OK);
                *slot = NULL;
            } else {
                size_t size = (rng >> 8) % 4 == 0 ? (rng >> 16) % (24 * MiB) + 1 : (rng >> 16) % (512 * KiB) + 1;
                *slot = alloc_exact(fx, 0, size);
            }
            if (op % 97 == 0) npa_empty_cache(fx->a, 0); /* segments go back: reserved and segment stats fall */
            if (op % 89 == 0) npa_reset_peak_stats(fx->a, 0); /* every peak written in one section */
        }
        atomic_store(&race.checkpoint, checkpoint);
        for (int i = 0; i < READERS; i++)
            while (atomic_load(&race.reader_checkpoint[i]) < checkpoint) sched_yield();
    }
    for (int i = 0; i < 64; i++)
        if (live[i]) CHECK_EQ(npa_free(fx->a, live[i], 0, NULL), NPA_FREE_OK);
}

static void test_snapshots_stay_consistent_under_a_writer(void) {
    race.region = calloc(1, sizeof *race.region);
    atomic_store(&race.checkpoint, 0);
    atomic_store(&race.writer_done, 0);
    fixture fx;
    fake_init(&fx.fake, 64 * GiB, false);
    fx.fake.stats[0] = &race.region->devices[0];
    fx.fake.threads[0] = race.region->threads[0]; /* the writer's own cache counts there */
    fixture_start(&fx, NULL);
    pthread_t readers[READERS];
    for (int i = 0; i < READERS; i++) {
        atomic_store(&race.reader_checkpoint[i], 0);
        CHECK_EQ(pthread_create(&readers[i], NULL, reader_thread, (void *)(intptr_t)i), 0);
    }
    run_writer(&fx);
    atomic_store(&race.writer_done, 1);
    for (int i = 0; i < READERS; i++) {
        reader_result *result;
        pthread_join(readers[i], (void **)&result);
        fprintf(stderr, "reader %d: %ld snapshots, %ld distinct, %ld gave up after 1000 attempts\n", i,
                result->snapshots, result->distinct, result->busy);
        CHECK_EQ(result->inconsistent, 0);
        CHECK_EQ(result->went_back, 0);
        CHECK(result->distinct >= CHECKPOINTS); /* it copied at least once after every checkpoint */
        free(result);
    }
    /* The writer's last state, read quietly, is its own copy. */
    npualloc_device_stats copy, own = stats_of(&fx, 0);
    CHECK_EQ(npualloc_reader_stats(race.region, 0, 1, &copy), NPUALLOC_READ_OK);
    CHECK(memcmp(&copy, &own, sizeof copy) == 0);
    CHECK_EQ(inconsistencies(&copy), 0);
    CHECK(copy.num_device_free > 0 && copy.allocation[0].allocated > CHECKPOINTS * OPS_PER_CHECKPOINT / 3);
    fixture_destroy(&fx);
    free(race.region);
}

/* --- the pause state against the real writer, one instruction at a time --- */

typedef struct pause_triple {
    uint32_t state;
    uint64_t paused, backup;
} pause_triple;

/* What npa_pause_command publishes over a pause, a failed resume and a
 * resume (hook/pause.c), from the region's first state. */
static const pause_triple pause_sequence[] = {
    {NPUALLOC_RUNNING, 0, 0},          {NPUALLOC_PAUSING, 0, 0},          {NPUALLOC_PAUSED, 12 * MiB, 5 * MiB},
    {NPUALLOC_RESUMING, 12 * MiB, 5 * MiB}, {NPUALLOC_PAUSED, 12 * MiB, 5 * MiB},
    {NPUALLOC_RESUMING, 12 * MiB, 5 * MiB}, {NPUALLOC_RUNNING, 0, 0},
};
#define PAUSE_STEPS (sizeof pause_sequence / sizeof *pause_sequence)

/* 0 when the reader met the writer inside its update. */
static int read_pause(const npualloc_region *r, pause_triple *out) {
    npualloc_pause_state copy;
    if (npualloc_reader_pause_state(r, 1, &copy) != NPUALLOC_READ_OK) return 0;
    *out = (pause_triple){copy.state, copy.paused_bytes, copy.backup_bytes};
    return 1;
}

static int same_triple(pause_triple a, pause_triple b) {
    return a.state == b.state && a.paused == b.paused && a.backup == b.backup;
}

/* A child publishes the sequence through the real writer, traced and
 * single-stepped; between every two of its instructions the test reads the
 * region as `npualloc stats` would. Every copy must be a triple the writer
 * published, in its order, each one seen: a reader landing inside an
 * update, wherever that is, must wait (BUSY), never pair one update's
 * state with another's byte counts. Deterministic: every interleaving of
 * the reader between the writer's instructions is tried, none left to
 * timing. (qemu-user has no ptrace: skipped there, said so.) */
static void test_pause_state_is_never_torn(void) {
    npualloc_region *r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(r != MAP_FAILED);
    if (r == MAP_FAILED) return;
    region_template(r);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child < 0) { /* -1 must reach neither waitpid (any child) nor kill (every process we may signal) */
        munmap(r, sizeof *r);
        return;
    }
    if (child == 0) {
        if (ptrace(PTRACE_TRACEME, 0, NULL, NULL) != 0) _exit(77);
        raise(SIGSTOP);
        for (size_t i = 1; i < PAUSE_STEPS; i++)
            npa_region_publish_pause(r, pause_sequence[i].state, pause_sequence[i].paused, pause_sequence[i].backup);
        _exit(0);
    }
    int status = 0;
    bool reaped = waitpid(child, &status, 0) == child && !WIFSTOPPED(status); /* a stopped child is not reaped */
    if (reaped && WIFEXITED(status) && WEXITSTATUS(status) == 77) {
        fprintf(stderr, "test_pause_state_is_never_torn: skipped, ptrace is not available here\n");
        munmap(r, sizeof *r);
        return;
    }
    CHECK(!reaped && WIFSTOPPED(status));
    size_t seen = 0; /* the index in pause_sequence of the last copy */
    long steps = 0, busy = 0, torn = 0;
    bool refused = false; /* the first single step: ptrace allowed to attach but not to step */
    while (!reaped && seen < PAUSE_STEPS - 1 && steps < 1000000 && torn == 0) {
        if (ptrace(PTRACE_SINGLESTEP, child, NULL, NULL) != 0) {
            refused = steps == 0;
            break;
        }
        if (waitpid(child, &status, 0) != child || !WIFSTOPPED(status)) {
            reaped = true; /* exited, killed, or gone: its pid is no longer ours to signal */
            break;
        }
        steps++;
        pause_triple copy;
        if (!read_pause(r, &copy)) {
            busy++;
        } else if (!same_triple(copy, pause_sequence[seen])) {
            if (same_triple(copy, pause_sequence[seen + 1])) {
                seen++;
            } else {
                torn++;
                fprintf(stderr, "after step %ld: state %u with %llu paused and %llu backup bytes, published "
                        "%u then %u\n", steps, copy.state, (unsigned long long)copy.paused,
                        (unsigned long long)copy.backup, pause_sequence[seen].state, pause_sequence[seen + 1].state);
            }
        }
    }
    if (!reaped) {
        kill(child, SIGKILL);
        CHECK_EQ(waitpid(child, &status, 0), child);
    }
    munmap(r, sizeof *r);
    if (refused) {
        fprintf(stderr, "test_pause_state_is_never_torn: skipped, ptrace refuses to single-step here\n");
        return;
    }
    fprintf(stderr, "pause state: %ld instructions stepped, the reader met the writer inside %ld times\n", steps, busy);
    CHECK_EQ(torn, 0);
    CHECK_EQ(seen, PAUSE_STEPS - 1);
    CHECK(busy >= (long)PAUSE_STEPS - 1); /* each update was caught in the middle */
}

/* --- the command slot against a process-side thread --------------------- */

#define COMMANDS 3000

/* What the requester posts as command seq; the process side checks it got it. */
static int32_t code_for(uint64_t seq) { return (int32_t)(seq % 8) + 1; }
static int32_t device_for(uint64_t seq) { return (int32_t)(seq % 17) - 1; }
static double arg_for(uint64_t seq) { return (double)seq * 0.5; }

/* The process's side as npa_region_poll_slow does it: request_seq with
 * acquire, the fields, then ack_status and ack_seq with release; the status
 * says whether the fields were the ones posted with that seq. */
static void *process_thread(void *arg) {
    npualloc_command *c = &((npualloc_region *)arg)->command;
    uint64_t acked = 0;
    while (acked < COMMANDS) {
        uint64_t requested = __atomic_load_n(&c->request_seq, __ATOMIC_ACQUIRE);
        if (requested == acked) {
            sched_yield();
            continue;
        }
        int32_t code = __atomic_load_n(&c->code, __ATOMIC_RELAXED);
        int32_t device = __atomic_load_n(&c->device, __ATOMIC_RELAXED);
        double value;
        __atomic_load(&c->arg, &value, __ATOMIC_RELAXED);
        int ok = code == code_for(requested) && device == device_for(requested) && value == arg_for(requested);
        __atomic_store_n(&c->ack_status, ok ? NPUALLOC_CMD_OK : NPUALLOC_CMD_EINVAL, __ATOMIC_RELAXED);
        __atomic_store_n(&c->ack_seq, requested, __ATOMIC_RELEASE);
        acked = requested;
    }
    return NULL;
}

static void test_commands_arrive_whole(void) {
    npualloc_region r;
    region_template(&r);
    npualloc_region_file file;
    CHECK_EQ(open_path(write_file("region", &r, sizeof r), 1, &file), NPUALLOC_OPEN_OK);
    pthread_t process;
    CHECK_EQ(pthread_create(&process, NULL, process_thread, file.region), 0);
    long rejected = 0, answered = 0;
    for (uint64_t next = 1; next <= COMMANDS; next++) {
        uint64_t seq = 0;
        CHECK_EQ(npualloc_reader_post(&file, code_for(next), device_for(next), arg_for(next), &seq), NPUALLOC_POST_OK);
        CHECK_EQ(seq, next);
        int32_t status;
        while (!npualloc_reader_acked(file.region, seq, &status)) sched_yield();
        answered++;
        if (status != NPUALLOC_CMD_OK) rejected++;
    }
    pthread_join(process, NULL);
    CHECK_EQ(answered, COMMANDS);
    CHECK_EQ(rejected, 0);
    npualloc_reader_close(&file);
}

int main(void) {
    CHECK(mkdtemp(dir) != NULL);
    RUN(test_open_validates_in_order);
    RUN(test_open_refuses_what_is_not_our_regular_file);
    RUN(test_locked_tells_whether_the_region_is_held);
    RUN(test_stats_copy_is_bounded);
    RUN(test_a_file_shrunk_under_the_mapping_is_reported_not_fatal);
    RUN(test_regions_open_at_once_are_bounded);
    RUN(test_pause_state);
    RUN(test_post_and_ack);
    RUN(test_a_late_take_leaves_later_withdrawals_closed);
    RUN(test_snapshots_stay_consistent_under_a_writer);
    RUN(test_pause_state_is_never_torn);
    RUN(test_commands_arrive_whole);
    char path[256];
    snprintf(path, sizeof path, "%s/region", dir);
    unlink(path);
    rmdir(dir);
    return check_report();
}
