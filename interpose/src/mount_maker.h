/* Who may have made a mount that a path to a file of ours meets, told from
 * /proc/self without asking the mounted file system anything. Header-only:
 * the interposer (an oom_snapshot path, hook/snapshot.c) and the reader
 * library (the CLI's file paths, npualloc/files.py, through
 * npualloc_reader_mount_is_another_users) both use it, so the rule and its
 * parse of mountinfo are one. */
#ifndef NPA_MOUNT_MAKER_H
#define NPA_MOUNT_MAKER_H

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static inline ssize_t npa_mount_read_some(int fd, char *buffer, size_t size)
{
    ssize_t n;
    do
        n = read(fd, buffer, size);
    while (n < 0 && errno == EINTR);
    return n;
}

/* The mount ID of fd's file, as text, from its fdinfo (procfs: no other
 * file system is asked, as a stat of a FUSE mount's root would ask its
 * server); false when it cannot be read. */
static inline bool npa_mount_id_of(int fd, char id[24])
{
    char path[48], text[256];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
    int info = open(path, O_RDONLY | O_CLOEXEC);
    if (info < 0)
        return false;
    ssize_t n = npa_mount_read_some(info, text, sizeof text - 1);
    close(info);
    if (n <= 0)
        return false;
    text[n] = '\0';
    const char *at = strstr(text, "\nmnt_id:\t");
    size_t length = at ? strspn(at + 9, "0123456789") : 0;
    if (length == 0 || length >= 24)
        return false;
    memcpy(id, at + 9, length);
    id[length] = '\0';
    return true;
}

/* In our mount namespace only root makes mounts, but for the FUSE ones any
 * user makes through the setuid fusermount: their /proc/self/mountinfo line
 * has the type fuse, fuse.<subtype> or fuseblk (.<subtype>) and the super
 * option user_id=<who made it>, which fusermount sets itself. (A mount made
 * in a user namespace is not seen in ours.) So the mount is another user's
 * when it is a FUSE one whose user_id is neither ours nor root's, or when
 * that cannot be told: its line is not found or names no type, or a FUSE
 * one's names no user_id. The file is read a chunk at a time, each field
 * (each option, among the super options) kept to its first bytes, so a line
 * of any length costs no memory. */
static inline bool npa_mount_is_another_users(int mount_root)
{
    char id[24], ours[16], chunk[512], token[32];
    int info = npa_mount_id_of(mount_root, id) ? open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC) : -1;
    if (info < 0)
        return true;
    snprintf(ours, sizeof ours, "%u", (unsigned)geteuid());
    size_t length = 0;
    unsigned field = 0, type_field = 0; /* type_field 0: the "-" before the type not met yet */
    bool this_line = false, found = false, told = false, fuse = false, uid_said = false, uid_ours = false;
    ssize_t n;
    while (!found && (n = npa_mount_read_some(info, chunk, sizeof chunk)) > 0) {
        for (ssize_t i = 0; i < n && !found; i++) {
            char c = chunk[i];
            bool in_options = type_field != 0 && field == type_field + 2;
            if (c != ' ' && c != '\n' && !(c == ',' && in_options)) {
                if (length < sizeof token - 1)
                    token[length] = c;
                length++;
                continue;
            }
            bool whole = length < sizeof token;
            token[whole ? length : sizeof token - 1] = '\0';
            if (field == 0)
                this_line = whole && strcmp(token, id) == 0;
            else if (this_line && type_field == 0 && field >= 6 && whole && strcmp(token, "-") == 0)
                type_field = field + 1;
            else if (this_line && type_field != 0 && field == type_field)
                fuse = (whole && (strcmp(token, "fuse") == 0 || strcmp(token, "fuseblk") == 0)) ||
                       strncmp(token, "fuse.", 5) == 0 || strncmp(token, "fuseblk.", 8) == 0;
            else if (this_line && in_options && !uid_said && strncmp(token, "user_id=", 8) == 0) {
                uid_said = true;
                uid_ours = whole && (strcmp(token + 8, "0") == 0 || strcmp(token + 8, ours) == 0);
            }
            length = 0;
            if (c == ' ')
                field++;
            else if (c == '\n') {
                found = this_line;
                told = type_field != 0 && field >= type_field + 2; /* its type and super options were there */
                field = type_field = 0;
            }
        }
    }
    close(info);
    return !found || !told || (fuse && !uid_ours);
}

#endif
