/* The files npualloc leaves for other processes (the stats region, snapshot
 * files) are the user's alone and are never written through something
 * another user planted at the same name. */
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include "region.h"

int npa_create_private_file_at(int dir_fd, const char *path, int access)
{
    int flags = access | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int fd = openat(dir_fd, path, flags, 0600);
    if (fd < 0 && errno == EEXIST) { /* left by an earlier process with our pid */
        unlinkat(dir_fd, path, 0);
        fd = openat(dir_fd, path, flags, 0600);
    }
    return fd;
}

int npa_create_private_file(const char *path, int access)
{
    return npa_create_private_file_at(AT_FDCWD, path, access);
}
