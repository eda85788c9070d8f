"""exit() from a signal handler that lands on a thread inside its own
per-thread cache's fast path (issue 14): the hook's at_exit gives the cache
back without waiting for any lock of ours, that thread's cache lock
included."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import SIM_LIB, compile_c, preload_env

EXIT_IN_FAST_PATH = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/time.h>

static int (*npu_malloc)(void **, size_t, int);
static int (*npu_free)(void *);
static int (*set_device)(int);

/* A second thread with a cache on the device: the fast paths run only while
 * two threads or more have one. */
static void *companion(void *arg)
{
    (void)arg;
    void *p = NULL;
    if (set_device(0) == 0 && npu_malloc(&p, 512, 0) == 0)
        npu_free(p);
    for (;;)
        pause();
}

int main(int argc, char **argv)
{
    void *runtime = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!runtime)
        return 2;
    int (*init)(const char *) = (int (*)(const char *))dlsym(runtime, "aclInit");
    set_device = (int (*)(int))dlsym(runtime, "aclrtSetDevice");
    npu_malloc = (int (*)(void **, size_t, int))dlsym(RTLD_DEFAULT, "aclrtMalloc");
    npu_free = (int (*)(void *))dlsym(RTLD_DEFAULT, "aclrtFree");
    if (init(NULL) != 0 || set_device(0) != 0)
        return 3;
    pthread_t other;
    if (pthread_create(&other, NULL, companion, NULL) != 0)
        return 5;
    usleep(20000); /* it has its cache */
    signal(SIGALRM, (void (*)(int))exit);
    struct itimerval when = {.it_value = {.tv_sec = 0, .tv_usec = atoi(argv[2])}};
    setitimer(ITIMER_REAL, &when, NULL);
    for (;;) { /* warm after the first pairs: each later pair is the fast path's */
        void *p = NULL;
        if (npu_malloc(&p, 4096, 0) != 0 || npu_free(p) != 0)
            return 4;
    }
}
"""


def test_exit_from_a_signal_handler_inside_the_fast_path_ends_the_process(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    program = compile_c(tmp_path_factory, "exit_in_fast_path", EXIT_IN_FAST_PATH)
    procs = [subprocess.Popen([str(program), str(SIM_LIB / "libascendcl.so"), str(20000 + 37 * i)],
                              env=preload_env(NPUALLOC_SHM_DIR=str(tmp_path), NPUSIM_MALLOC_US="0",
                                              NPUSIM_FREE_US="0"),
                              stderr=subprocess.PIPE, text=True) for i in range(24)]
    hung = 0
    for proc in procs:
        try:
            proc.communicate(timeout=20)
            assert proc.returncode == 14, proc.returncode  # exit(SIGALRM's number), from the handler
        except subprocess.TimeoutExpired:
            hung += 1
            proc.kill()
            proc.communicate()
    assert hung == 0, f"{hung} of {len(procs)} processes never ended"
