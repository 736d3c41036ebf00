"""A C program whose threads each run one kind of loop, built with the
compiler that builds cpupin: spinning, computing, sleeping and ticking
threads with known behaviour, for the outside view's tests."""

import shutil
import subprocess

import pytest

PROBE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static volatile unsigned long sink;
static void *yielder(void *a) { (void)a; for (;;) sched_yield(); return 0; }
static void *poller(void *a) {
    /* An event loop polling with no timeout: eight waits on a pipe that
       never becomes ready, so each call does the kernel's work for them. */
    int p[2]; struct pollfd f[8]; (void)a;
    if (pipe(p) != 0) return 0;
    for (int i = 0; i < 8; i++) { f[i].fd = p[0]; f[i].events = POLLIN; }
    for (;;) poll(f, 8, 0);
    return 0;
}
static void *computer(void *a) {
    unsigned long x = 1; (void)a;
    for (;;) { x = x * 6364136223846793005UL + 1; sink = x; }
    return 0;
}
static void *sleeper(void *a) { (void)a; for (;;) pause(); return 0; }
static void *ticker(void *a) {
    struct timespec t = {0, 1000000}; (void)a;
    for (;;) nanosleep(&t, NULL);
    return 0;
}
int main(int argc, char **argv) {
    static const char *names[] = {"yield-spin", "poll-spin", "compute", "sleeper", "ticker"};
    void *(*bodies[])(void *) = {yielder, poller, computer, sleeper, ticker};
    for (int i = 1; i < argc; i++)
        for (int k = 0; k < 5; k++)
            if (strcmp(argv[i], names[k]) == 0) {
                pthread_t t;
                pthread_create(&t, NULL, bodies[k], NULL);
                pthread_setname_np(t, names[k]);
            }
    printf("ready\n");
    fflush(stdout);
    char c;
    return read(0, &c, 1) < 0;
}
"""


def build_probe(folder):
    """The probe's binary in ``folder`` (the test skips, saying why, without
    a C compiler). Run it with the kinds of thread to start, one argument a
    thread (``compute compute`` starts two); it prints ``ready`` and runs
    until its stdin closes."""
    gcc, out, binary = _compile(folder, "probe", PROBE, "-pthread")
    assert out.returncode == 0, out.stderr
    return binary


def _compile(folder, name, source, flag):
    """``source`` built as ``folder/name`` with the compiler cpupin builds
    with: (compiler, the run, the binary); skips, saying why, without one."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip(f"no C compiler to build the {name} (cpupin's own build needs one)")
    (folder / f"{name}.c").write_text(source)
    out = subprocess.run(
        [gcc, "-O1", flag, "-o", str(folder / name), str(folder / f"{name}.c")],
        capture_output=True,
        text=True,
        check=False,
    )
    return gcc, out, str(folder / name)


OMP_PROBE = r"""
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
static cpu_set_t masks[256];
static void cpus(const cpu_set_t *set) {
    int first = 1;
    printf("[");
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, set)) { printf("%s%d", first ? "" : ",", c); first = 0; }
    printf("]");
}
int main(void) {
    int n = omp_get_num_places();
    printf("{\"bind\": %d, \"places\": [", (int) omp_get_proc_bind());
    for (int i = 0; i < n; i++) {
        int k = omp_get_place_num_procs(i);
        int *ids = malloc(sizeof(int) * (k > 0 ? k : 1));
        omp_get_place_proc_ids(i, ids);
        printf("%s[", i ? "," : "");
        for (int j = 0; j < k; j++) printf("%s%d", j ? "," : "", ids[j]);
        printf("]");
        free(ids);
    }
    printf("]}\n");
    fflush(stdout);  /* a team libgomp cannot bind ends the program */
    int want = n > 0 ? (n < 256 ? n : 256) : 1, got = 0;
    #pragma omp parallel num_threads(want)
    {
        sched_getaffinity(0, sizeof(cpu_set_t), &masks[omp_get_thread_num()]);
        #pragma omp master
        got = omp_get_num_threads();
    }
    printf("[");
    for (int t = 0; t < got; t++) { printf("%s", t ? "," : ""); cpus(&masks[t]); }
    printf("]\n");
    return 0;
}
"""


def build_omp_probe(folder):
    """A program linked with the compiler's own libgomp that prints what
    libgomp made of the environment: a JSON line with ``omp_get_proc_bind``
    and each place's CPUs (``omp_get_place_proc_ids``), then a line with
    the mask of each thread of a team as large as the places. Skips, saying
    why, where the compiler cannot build OpenMP."""
    gcc, out, binary = _compile(folder, "omp_probe", OMP_PROBE, "-fopenmp")
    if out.returncode != 0 and "omp.h" in out.stderr:
        pytest.skip(f"{gcc} has no OpenMP (omp.h): install the compiler's libgomp")
    assert out.returncode == 0, out.stderr
    return binary
