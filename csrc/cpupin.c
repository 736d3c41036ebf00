/* The C layer of cpupin: thin wrappers over the kernel calls that Python
 * cannot make cheaply. Each returns 0 (or a count) or -errno; policy,
 * validation and messages live in cpupin/_native.py. One file, one cdef
 * (cpupin.h), in sections:
 *
 *   the GIL          who drops it (the calls keep it; see the last section)
 *   affinity         tids, getcpu, CPU sets of any size, the mask check
 *   shared mappings  a file mapped for stores (a process's record)
 *   memory policy    set_mempolicy and get_mempolicy
 *   files under a root  openat2(RESOLVE_IN_ROOT), type-checked opens
 *   tasks            schedstat, comm and stat of every task of a process
 *   handoff          the benchmark: two threads passing a token
 *   stubs            the same functions where there is no affinity
 *   a signal's default, the descriptor limit  for exec's start, without
 *                    Python's signal and resource modules
 *   keeping the GIL  the redefinition of cffi's macros, before its wrappers */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#if defined(__linux__) && !defined(CPUPIN_FORCE_STUBS)
#define CPUPIN_HAVE_AFFINITY 1
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <linux/futex.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#else
#define CPUPIN_HAVE_AFFINITY 0
#endif

typedef struct cpupin_tasks cpupin_tasks;

/* --- the GIL -------------------------------------------------------------- */

/* Whether a call drops the GIL is decided here, per function, not by cffi:
 * see the end of this file. Only the long read of every task drops it. */
#ifdef Py_PYTHON_H
#define CPUPIN_DROP_GIL PyThreadState *cpupin_gil_ = PyEval_SaveThread()
#define CPUPIN_TAKE_GIL PyEval_RestoreThread(cpupin_gil_)
#else
#define CPUPIN_DROP_GIL
#define CPUPIN_TAKE_GIL
#endif

int cpupin_noop(void) { return 0; }

/* 1 when the calling thread holds the GIL inside a call: the test that the
 * redefinition at the end of this file reached cffi's wrappers. */
int cpupin_holds_gil(void)
{
#ifdef Py_PYTHON_H
    return PyGILState_Check();
#else
    return -ENOSYS;
#endif
}

/* --- thread names ------------------------------------------------------------ */

/* The kernel name of a thread named name[0..len) in UTF-8: its first 15
 * bytes at most, cut before a character that would not fit whole, each NUL
 * as '?', into out (16 bytes, NUL-terminated). Returns its length. The
 * same bytes as cpupin._native.thread_name_bytes makes of a name that
 * encodes as strict UTF-8. */
int cpupin_thread_name_cut(const char *name, size_t len, char *out)
{
    size_t n = len < 15 ? len : 15;

    if (len > 15)
        while (n > 0 && ((unsigned char)name[n] & 0xC0) == 0x80)
            n--;
    for (size_t i = 0; i < n; i++)
        out[i] = name[i] == '\0' ? '?' : name[i];
    out[n] = '\0';
    return (int)n;
}

#if CPUPIN_HAVE_AFFINITY

/* --- affinity --------------------------------------------------------------- */

long cpupin_gettid(void) { return (long)syscall(SYS_gettid); }

int cpupin_getcpu(void)
{
    int cpu = sched_getcpu();
    return cpu >= 0 ? cpu : -errno;
}

/* Sets of up to this many words (16384 CPUs) live on the stack. */
#define STACK_WORDS 256
#define WORD_BITS (8 * sizeof(unsigned long))

/* The kernel's cpu_set_t is an array of unsigned long; convert to and from
 * 64-bit words whatever the width and byte order of a long. */
static void to_words(const unsigned long *set, int nwords, uint64_t *out)
{
    memset(out, 0, nwords * sizeof *out);
    for (size_t i = 0; i < (size_t)nwords * 64 / WORD_BITS; i++)
        out[i * WORD_BITS / 64] |= (uint64_t)set[i] << (i * WORD_BITS % 64);
}

static void from_words(const uint64_t *in, int nwords, unsigned long *set)
{
    for (size_t i = 0; i < (size_t)nwords * 64 / WORD_BITS; i++)
        set[i] = (unsigned long)(in[i * WORD_BITS / 64] >> (i * WORD_BITS % 64));
}

static int significant(const uint64_t *words, int nwords)
{
    while (nwords > 0 && words[nwords - 1] == 0)
        nwords--;
    return nwords;
}

static int get_set(int tid, unsigned long *set, size_t size)
{
    memset(set, 0, size);
    if (tid == 0)
        return -pthread_getaffinity_np(pthread_self(), size, (cpu_set_t *)set);
    return sched_getaffinity(tid, size, (cpu_set_t *)set) == 0 ? 0 : -errno;
}

static int affinity(uint64_t *io, int set_first)
{
    unsigned long stack[STACK_WORDS * 64 / WORD_BITS];
    int tid = (int)io[0];
    int nwords = (int)io[1];
    size_t size = (size_t)nwords * 8;
    unsigned long *set;
    int rc = 0;

    if (nwords <= 0 || io[0] > INT32_MAX)
        return -EINVAL;
    set = nwords <= STACK_WORDS ? stack : malloc(size);
    if (set == NULL)
        return -ENOMEM;
    if (set_first) {
        from_words(io + 2, nwords, set);
        if (tid == 0)
            rc = -pthread_setaffinity_np(pthread_self(), size, (cpu_set_t *)set);
        else
            rc = sched_setaffinity(tid, size, (cpu_set_t *)set) == 0 ? 0 : -errno;
    }
    /* The kernel drops CPUs outside the cpuset without a word: read back. */
    if (rc == 0)
        rc = get_set(tid, set, size);
    if (rc == 0) {
        to_words(set, nwords, io + 2);
        rc = significant(io + 2, nwords);
    }
    if (set != stack)
        free(set);
    return rc;
}

int cpupin_get_affinity(uint64_t *io) { return affinity(io, 0); }

/* Reads the calling thread's mask into io (room for 2 + want[0] words) and
 * compares it with want[1...]: 1 the same, 0 not, or -errno. */
static int mask_read_is(uint64_t *io, const uint64_t *want)
{
    int nwords = (int)want[0];
    int rc;

    io[0] = 0;
    io[1] = (uint64_t)nwords;
    rc = affinity(io, 0);
    return rc < 0 ? rc : memcmp(io + 2, want + 1, (size_t)nwords * 8) == 0;
}

int cpupin_mask_is(const uint64_t *want)
{
    uint64_t stack[2 + STACK_WORDS];
    uint64_t *io = want[0] <= STACK_WORDS ? stack : malloc((2 + (size_t)want[0]) * 8);
    int rc;

    if (io == NULL)
        return -ENOMEM;
    rc = mask_read_is(io, want);
    if (io != stack)
        free(io);
    return rc;
}
int cpupin_set_affinity(uint64_t *io) { return affinity(io, 1); }

/* Moves the calling thread onto want[1...] (want[0] words) and reads its
 * mask back: 0 when the kernel holds exactly that, 1 when it holds less
 * (it keeps what the cpuset allows), or -errno. */
int cpupin_set_mask(const uint64_t *want)
{
    uint64_t stack[2 + STACK_WORDS];
    size_t bytes = (size_t)want[0] * 8;
    uint64_t *io = want[0] <= STACK_WORDS ? stack : malloc(2 * 8 + bytes);
    int rc;

    if (io == NULL)
        return -ENOMEM;
    io[0] = 0;
    io[1] = want[0];
    memcpy(io + 2, want + 1, bytes);
    rc = affinity(io, 1);
    if (rc >= 0)
        rc = memcmp(io + 2, want + 1, bytes) != 0;
    if (io != stack)
        free(io);
    return rc;
}

/* A pin: the calling thread's mask read into old[0...] (want[0] words),
 * then cpupin_set_mask(want). Returns the significant words of the old
 * mask, plus 65536 when the kernel holds exactly want; or -errno, and
 * then nothing moved. */
int cpupin_swap_mask(const uint64_t *want, uint64_t *old)
{
    uint64_t stack[2 + STACK_WORDS];
    size_t bytes = (size_t)want[0] * 8;
    uint64_t *io = want[0] <= STACK_WORDS ? stack : malloc(2 * 8 + bytes);
    int had, rc;

    if (io == NULL)
        return -ENOMEM;
    io[0] = 0;
    io[1] = want[0];
    had = affinity(io, 0);
    if (had >= 0) {
        memcpy(old, io + 2, bytes);
        rc = cpupin_set_mask(want);
        rc = rc < 0 ? rc : had | (rc == 0) << 16;
    } else {
        rc = had;
    }
    if (io != stack)
        free(io);
    return rc;
}

/* A new thread's first call: onto the mask want[1...] (want[0] words)
 * unless it is there already, then (name not NULL) its kernel name, cut
 * from the len bytes of its UTF-8 name as cpupin_thread_name_cut cuts.
 * One call and one buffer instead of three calls, and no Python string
 * work in the creator or the new thread: run cold, in a loop of starts,
 * such work costs ten times what it costs warm (bench/threads.py
 * --parts). Returns 1 when it moved, 0 when it was there, or -errno
 * (nothing named then: the caller takes the slow way). The kernel keeps
 * what its cpuset and online CPUs allow of a mask: less than asked is
 * -EINVAL, the caller's slow way too (it warns). */
int cpupin_thread_enter(const uint64_t *want, const char *name, size_t len)
{
    char comm[16];
    uint64_t stack[2 + STACK_WORDS];
    size_t bytes = (size_t)want[0] * 8;
    uint64_t *io = want[0] <= STACK_WORDS ? stack : malloc(2 * 8 + bytes);
    int rc;

    if (io == NULL)
        return -ENOMEM;
    rc = mask_read_is(io, want);
    if (rc == 0) {
        memcpy(io + 2, want + 1, bytes);
        rc = affinity(io, 1);
        if (rc >= 0)
            rc = memcmp(io + 2, want + 1, bytes) == 0 ? 1 : -EINVAL;
    } else if (rc == 1) {
        rc = 0;
    }
    if (io != stack)
        free(io);
    if (rc >= 0 && name != NULL) {
        cpupin_thread_name_cut(name, len, comm);
        prctl(PR_SET_NAME, (unsigned long)comm, 0UL, 0UL, 0UL);
    }
    return rc;
}

/* Parses "run wait slices\n"; returns 0 or -EINVAL. */
static int parse_schedstat(const char *p, unsigned long long *out3)
{
    for (int i = 0; i < 3; i++) {
        char *end;
        while (*p == ' ')
            p++;
        if (*p < '0' || *p > '9')
            return -EINVAL;
        out3[i] = strtoull(p, &end, 10);
        p = end;
    }
    return 0;
}

/* A task that is gone shows as ENOENT on open and ESRCH on read. */
static int gone(int err) { return err == ENOENT ? -ESRCH : -err; }

int cpupin_schedstat(int pid, int tid, unsigned long long *out3)
{
    char path[64], buf[128];
    ssize_t len;
    int fd;

    if (tid == 0)
        snprintf(path, sizeof path, "/proc/thread-self/schedstat");
    else if (pid == 0)
        snprintf(path, sizeof path, "/proc/self/task/%d/schedstat", tid);
    else
        snprintf(path, sizeof path, "/proc/%d/task/%d/schedstat", pid, tid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return gone(errno);
    len = read(fd, buf, sizeof buf - 1);
    if (len < 0) {
        int err = errno;
        close(fd);
        return gone(err);
    }
    close(fd);
    buf[len] = '\0';
    return parse_schedstat(buf, out3);
}

/* The calling thread's start time in clock ticks since boot (field 22 of
 * /proc/thread-self/stat, counted after the ')' that ends the name, which
 * may itself hold spaces and parentheses): what tells a thread from a later
 * one that reuses its tid. 0 or -errno. */
int cpupin_thread_start(unsigned long long *out)
{
    char buf[1024];
    ssize_t len;
    char *p;
    int fd = open("/proc/thread-self/stat", O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return -errno;
    len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0)
        return len < 0 ? -errno : -EINVAL;
    buf[len] = '\0';
    p = strrchr(buf, ')');
    if (p == NULL)
        return -EINVAL;
    p++;
    /* after ')': state is field 3; the start time is field 22 */
    for (int field = 3; field < 22; field++) {
        p = strchr(p + 1, ' ');
        if (p == NULL)
            return -EINVAL;
    }
    p++;
    if (*p < '0' || *p > '9')
        return -EINVAL;
    *out = strtoull(p, NULL, 10);
    return 0;
}

/* A step clock's marks. One argument (cffi calls with more cost more):
 * s[0..3] the step's start: CLOCK_MONOTONIC ns, the run and wait ns of the
 * schedstat open at s[8], the cgroup's throttled ns from the cpu.stat open
 * at s[9] (s[10] 2: v2's "throttled_usec", 1: v1's "throttled_time" in ns;
 * 0: not read, -1). Begin: when the last mark is younger than s[11] ns (the
 * previous step's end), it stands as the start and 1 is returned without
 * reading; else the start is read. End: s[4..7] get the step's four
 * differences (throttled -1 when unknown), also stored in the ring of
 * s[12] steps at s[88...] (step s[13] at slot s[13] % s[12]); s[13] counts
 * the steps, s[14..16] sum wall, wait and throttled ns; the wait is counted
 * in the first of the s[18] bucket bounds at s[20...] it does not exceed
 * (counts at s[52...], the last for none); the end becomes s[0..3]. Returns
 * 2 when the wait reached s[17] (>= 0), else 0; or -errno (-EBADF: the
 * schedstat descriptor no longer names its file). s[85] and s[86] are the
 * keys (file_key) of the two files; a cpu.stat that cannot be read any more
 * is dropped (s[9] = -1) with its errno in s[87]. s[19] is the thread
 * that owns the clock (cpupin_step_own): a mark made by any other thread
 * touches nothing and returns STEP_OTHER_THREAD (below every -errno). The
 * caller decides the bounds and what a slow step means. */
enum {
    STEP_KEEP = 12, STEP_COUNT = 13, STEP_SUMS = 14, STEP_SLOW = 17, STEP_NBOUNDS = 18,
    STEP_OWNER = 19, STEP_OTHER_THREAD = -4096, STEP_BOUNDS = 20, STEP_MAX_BOUNDS = 32,
    STEP_COUNTS = 52, STEP_SCHED_KEY = 85, STEP_STAT_KEY = 86, STEP_STAT_ERR = 87, STEP_RING = 88
};

/* The key a step clock keeps of each file it reads (its device and inode
 * in one number, as cpupin._native.file_key makes it), or 0. */
static long long file_key(int fd)
{
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        return 0;
    return (long long)(((unsigned long long)st.st_ino ^ ((unsigned long long)st.st_dev << 40))
                       & 0x7fffffffffffffffULL);
}

/* Whether descriptor fd still names the file whose key is key (never
 * when the clock holds no key: closed). */
static int keyed(int fd, long long key)
{
    return key != 0 && file_key(fd) == key;
}

/* A mark's readings. A descriptor is trusted only while it names the file
 * it was opened on: an application that closed it (os.closerange()) may
 * have a file of its own under that number now. The end of a step checks
 * both descriptors (one fstat each) before its readings are used, and so
 * vouches for the start's readings too: once a number stops naming our
 * file it never names it again (the clock opens afresh under a new one).
 * The start (check 0) therefore reads first and checks only a read that
 * failed, to tell a foreign file from a real error; its readings are used
 * only when the end's check passes. pread() never changes what it reads
 * from (pipes, sockets, eventfds refuse it: ESPIPE). */
static int step_read(long long *s, long long *out, int check)
{
    char buf[1024];
    unsigned long long st[3];
    ssize_t len;
    int sched_fd = (int)s[8], stat_fd = (int)s[9], stat_kind = (int)s[10];

    if (check && !keyed(sched_fd, s[STEP_SCHED_KEY]))
        return -EBADF;
    len = pread(sched_fd, buf, 127, 0);
    if (len < 0) {
        int err = errno;
        return check || keyed(sched_fd, s[STEP_SCHED_KEY]) ? gone(err) : -EBADF;
    }
    buf[len] = '\0';
    if (parse_schedstat(buf, st) < 0)
        return check || keyed(sched_fd, s[STEP_SCHED_KEY]) ? -EINVAL : -EBADF;
    out[1] = (long long)st[0];
    out[2] = (long long)st[1];
    out[3] = -1;
    if (stat_kind == 0 || stat_fd < 0)
        return 0;
    /* The cgroup's file is the clock's own business: one that went away
     * (the process moved and the old group was removed) or is not ours any
     * more makes the throttled figure unknown from then on, never an error
     * of the step. s[STEP_STAT_ERR] keeps why. */
    if (check && !keyed(stat_fd, s[STEP_STAT_KEY])) {
        s[9] = -1;
        s[STEP_STAT_ERR] = EBADF;
        return 0;
    }
    len = pread(stat_fd, buf, sizeof buf - 1, 0);
    if (len < 0) {
        int err = errno;
        s[9] = -1;
        s[STEP_STAT_ERR] = check || keyed(stat_fd, s[STEP_STAT_KEY]) ? err : EBADF;
        return 0;
    }
    buf[len] = '\0';
    {
        const char *key = stat_kind == 2 ? "throttled_usec " : "throttled_time ";
        const char *hit = strstr(buf, key);
        if (hit == NULL || (hit != buf && hit[-1] != '\n'))
            return 0;
        hit += strlen(key);
        if (*hit < '0' || *hit > '9')
            return 0;
        out[3] = (long long)strtoull(hit, NULL, 10);
        if (stat_kind == 2)
            out[3] *= 1000;
    }
    return 0;
}


static int step_mark(long long *s, int end)
{
    struct timespec ts;
    long long now[4];
    int rc;

    /* The schedstat is the owner's: another thread would time it, not
     * itself (pthread_self reads the thread pointer: no system call). */
    if ((unsigned long long)s[STEP_OWNER] != (unsigned long long)(uintptr_t)pthread_self())
        return STEP_OTHER_THREAD;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now[0] = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (!end && now[0] - s[0] < s[11])
        return 1;
    rc = step_read(s, now, end);
    if (rc < 0)
        return rc;
    if (end) {
        long long *slot = s + STEP_RING + 4 * (s[STEP_COUNT] % s[STEP_KEEP]);
        long long nb = s[STEP_NBOUNDS], b = 0;
        for (int i = 0; i < 3; i++)
            s[4 + i] = now[i] - s[i];
        /* The cgroup's throttled time sums its run queues (one a CPU, on
         * v1 and v2 alike): it can pass the step's wall time. The step
         * itself was held back at most all of it. */
        s[7] = now[3] >= 0 && s[3] >= 0 ? now[3] - s[3] : -1;
        if (s[7] > s[4])
            s[7] = s[4];
        for (int i = 0; i < 4; i++)
            slot[i] = s[4 + i];
        s[STEP_COUNT]++;
        s[STEP_SUMS] += s[4];
        s[STEP_SUMS + 1] += s[6];
        if (s[7] > 0)
            s[STEP_SUMS + 2] += s[7];
        while (b < nb && b < STEP_MAX_BOUNDS && s[6] > s[STEP_BOUNDS + b])
            b++;
        s[STEP_COUNTS + b]++;
        for (int i = 0; i < 4; i++)
            s[i] = now[i];
        return s[STEP_SLOW] >= 0 && s[6] >= s[STEP_SLOW] ? 2 : 0;
    }
    for (int i = 0; i < 4; i++)
        s[i] = now[i];
    return 0;
}
int cpupin_step_begin(long long *s) { return step_mark(s, 0); }
int cpupin_step_end(long long *s) { return step_mark(s, 1); }
int cpupin_step_own(long long *s)
{
    s[STEP_OWNER] = (long long)(uintptr_t)pthread_self();
    return 0;
}

/* The calling thread's kernel name (comm, what top -H, ps -L, perf and
 * py-spy show): at most 15 bytes, cut by the caller. */
int cpupin_set_thread_name(const char *name)
{
    return prctl(PR_SET_NAME, (unsigned long)name, 0UL, 0UL, 0UL) == 0 ? 0 : -errno;
}

/* --- shared mappings --------------------------------------------------------- */

/* length bytes of the file open at fd, mapped shared for reading and
 * writing: stores reach every reader of the file with no system call. The
 * caller closes fd after (the mapping keeps the file). 0 or -errno. */
int cpupin_map_shared(int fd, size_t length, void **addr)
{
    void *p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

    if (p == MAP_FAILED)
        return -errno;
    *addr = p;
    return 0;
}

int cpupin_unmap(void *addr, size_t length)
{
    return munmap(addr, length) == 0 ? 0 : -errno;
}

/* --- memory policy -------------------------------------------------------- */

/* set_mempolicy(2) and get_mempolicy(2) through syscall, without libnuma.
 * Node masks cross as 64-bit words like CPU sets; maxnode is the number of
 * bits plus one, the kernel's historical convention (libnuma does the same). */
int cpupin_set_mempolicy(int mode, const uint64_t *nodes, int nwords)
{
    unsigned long stack[STACK_WORDS * 64 / WORD_BITS];
    unsigned long *mask = NULL;
    unsigned long maxnode = 0;
    long rc;

    if (nwords < 0 || nwords > STACK_WORDS)
        return -EINVAL;
    if (nwords > 0) {
        from_words(nodes, nwords, stack);
        mask = stack;
        maxnode = (unsigned long)nwords * 64 + 1;
    }
    rc = syscall(SYS_set_mempolicy, mode, mask, maxnode);
    return rc == 0 ? 0 : -errno;
}

int cpupin_get_mempolicy(int *mode, uint64_t *nodes, int nwords)
{
    unsigned long stack[STACK_WORDS * 64 / WORD_BITS];
    long rc;

    if (nwords <= 0 || nwords > STACK_WORDS)
        return -EINVAL;
    memset(stack, 0, sizeof stack);
    rc = syscall(SYS_get_mempolicy, mode, stack, (unsigned long)nwords * 64 + 1, NULL, 0UL);
    if (rc != 0)
        return -errno;
    to_words(stack, nwords, nodes);
    return 0;
}

/* --- files under a root --------------------------------------------------- */

#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture */
#endif
#define CPUPIN_RESOLVE_NO_MAGICLINKS 0x02
#define CPUPIN_RESOLVE_IN_ROOT 0x10

struct cpupin_open_how { uint64_t flags, mode, resolve; };

/* Opens path as if rootfd were "/": ".." stops at the root and every
 * symlink, absolute or relative, resolves inside it (openat2, Linux 5.6).
 * The file is opened O_PATH first and its type checked, so that nothing but
 * a regular file (want_dir 0) or a directory (want_dir 1) is ever opened for
 * reading: no FIFO wait, no device open. *mode gets st_mode. Returns the fd,
 * -EMEDIUMTYPE when the type is wrong, or -errno (-ENOSYS or -EPERM where
 * openat2 is missing or refused by seccomp: the caller walks instead). */
int cpupin_open_in_root(int rootfd, const char *path, int want_dir, unsigned int *mode)
{
    struct cpupin_open_how how = {O_PATH | O_CLOEXEC, 0,
                                  CPUPIN_RESOLVE_IN_ROOT | CPUPIN_RESOLVE_NO_MAGICLINKS};
    struct stat st;
    char self[48];
    long pfd;
    int fd, ok;

    pfd = syscall(SYS_openat2, rootfd, path, &how, sizeof how);
    if (pfd < 0)
        return -errno;
    if (fstat((int)pfd, &st) < 0) {
        int err = errno;
        close((int)pfd);
        return -err;
    }
    *mode = st.st_mode;
    ok = want_dir ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode);
    if (!ok) {
        close((int)pfd);
        return -EMEDIUMTYPE;
    }
    /* Reopen the very inode checked, for reading. */
    snprintf(self, sizeof self, "/proc/self/fd/%ld", pfd);
    fd = open(self, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (want_dir ? O_DIRECTORY : 0));
    if (fd < 0 && errno == ENOENT) {
        /* No /proc: open the path again and make sure it is the same inode. */
        struct stat again;
        how.flags = O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (want_dir ? O_DIRECTORY : 0);
        fd = (int)syscall(SYS_openat2, rootfd, path, &how, sizeof how);
        if (fd >= 0 && (fstat(fd, &again) < 0 || again.st_dev != st.st_dev ||
                        again.st_ino != st.st_ino)) {
            close(fd);
            fd = -1;
            errno = EAGAIN;
        }
    }
    if (fd < 0) {
        int err = errno;
        close((int)pfd);
        return -err;
    }
    close((int)pfd);
    return fd;
}

/* --- tasks: every task of one process --------------------------------------- */

enum { F_SCHED, F_COMM, F_STAT, NFILES };
static const char *const file_names[NFILES] = {"schedstat", "comm", "stat"};

struct task {
    int tid;
    int fd[NFILES]; /* -1 when not kept open */
    unsigned long long ino[NFILES]; /* the file each kept one was opened on */
};

/* A kept descriptor is trusted only while it still names the file it was
 * opened on: an application that closes descriptors it did not open
 * (os.closerange(), a daemonizing library) frees the number, and the next
 * file it opens gets it. Such a number is forgotten, never read or closed.
 * procfs is one device, so its inode tells its files apart. */
static unsigned long long ino_of(int fd)
{
    struct stat st;
    return fd >= 0 && fstat(fd, &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

static int still_ours(int fd, unsigned long long ino)
{
    return fd >= 0 && ino != 0 && ino_of(fd) == ino;
}

struct cpupin_tasks {
    int pid;
    int dirfd;
    int stat_fd; /* the process's stat, for its thread count; -1 if none */
    unsigned long long dir_ino, stat_ino;
    int max_open, nopen;
    struct task *tasks;
    int ntasks, cap;
    int *tids;
    int tids_cap;
};

cpupin_tasks *cpupin_tasks_open(int pid, int max_open, int *err)
{
    char path[48];
    cpupin_tasks *t;

    if (pid == 0)
        snprintf(path, sizeof path, "/proc/self/task");
    else
        snprintf(path, sizeof path, "/proc/%d/task", pid);
    t = calloc(1, sizeof *t);
    if (t == NULL) {
        *err = -ENOMEM;
        return NULL;
    }
    t->pid = pid;
    t->dirfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (t->dirfd < 0) {
        *err = gone(errno);
        free(t);
        return NULL;
    }
    t->dir_ino = ino_of(t->dirfd);
    if (pid == 0)
        snprintf(path, sizeof path, "/proc/self/stat");
    else
        snprintf(path, sizeof path, "/proc/%d/stat", pid);
    t->stat_fd = open(path, O_RDONLY | O_CLOEXEC);
    t->stat_ino = ino_of(t->stat_fd);
    t->max_open = max_open;
    *err = 0;
    return t;
}

/* Forgets every kept descriptor of the tasks (without closing: they may
 * name the application's files now). */
static void forget_tasks(cpupin_tasks *t)
{
    for (int i = 0; i < t->ntasks; i++)
        for (int f = 0; f < NFILES; f++)
            t->tasks[i].fd[f] = -1;
    t->nopen = 0;
}

/* Checks the folder's and the stat file's descriptors, reopening what is
 * no longer ours; returns 0 or -errno. */
static int check_dir(cpupin_tasks *t)
{
    char path[48];
    if (!still_ours(t->dirfd, t->dir_ino)) {
        int fd;
        if (t->pid == 0)
            snprintf(path, sizeof path, "/proc/self/task");
        else
            snprintf(path, sizeof path, "/proc/%d/task", t->pid);
        fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0)
            return gone(errno);
        t->dirfd = fd;
        t->dir_ino = ino_of(fd);
        forget_tasks(t); /* the same tidy-up closed those too, most likely */
    }
    if (t->stat_fd >= 0 && !still_ours(t->stat_fd, t->stat_ino)) {
        if (t->pid == 0)
            snprintf(path, sizeof path, "/proc/self/stat");
        else
            snprintf(path, sizeof path, "/proc/%d/stat", t->pid);
        t->stat_fd = open(path, O_RDONLY | O_CLOEXEC);
        t->stat_ino = ino_of(t->stat_fd);
    }
    return 0;
}

static void close_task(cpupin_tasks *t, struct task *k)
{
    for (int f = 0; f < NFILES; f++) {
        if (k->fd[f] >= 0) {
            if (still_ours(k->fd[f], k->ino[f]))
                close(k->fd[f]);
            t->nopen--;
            k->fd[f] = -1;
        }
    }
}

void cpupin_tasks_close(cpupin_tasks *t)
{
    if (t == NULL)
        return;
    for (int i = 0; i < t->ntasks; i++)
        close_task(t, &t->tasks[i]);
    if (still_ours(t->dirfd, t->dir_ino))
        close(t->dirfd);
    if (still_ours(t->stat_fd, t->stat_ino))
        close(t->stat_fd);
    free(t->tasks);
    free(t->tids);
    free(t);
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Lists the tids in the task folder, sorted; returns the count or -errno. */
static int list_tids(cpupin_tasks *t)
{
    char buf[16384];
    int n = 0;

    if (lseek(t->dirfd, 0, SEEK_SET) < 0)
        return -errno;
    for (;;) {
        long len = syscall(SYS_getdents64, t->dirfd, buf, sizeof buf);
        if (len < 0)
            return gone(errno);
        if (len == 0)
            break;
        for (long off = 0; off < len;) {
            struct dirent64 *d = (struct dirent64 *)(buf + off);
            off += d->d_reclen;
            if (d->d_name[0] < '1' || d->d_name[0] > '9')
                continue;
            if (n == t->tids_cap) {
                int cap = t->tids_cap ? 2 * t->tids_cap : 64;
                int *grown = realloc(t->tids, cap * sizeof *grown);
                if (grown == NULL)
                    return -ENOMEM;
                t->tids = grown;
                t->tids_cap = cap;
            }
            t->tids[n++] = atoi(d->d_name);
        }
    }
    qsort(t->tids, n, sizeof *t->tids, cmp_int);
    return n;
}

/* Brings t->tasks in line with the n sorted tids, keeping the descriptors
 * of tasks still listed and closing those of tasks gone. */
static int merge_tasks(cpupin_tasks *t, int n)
{
    struct task *next = malloc((n ? n : 1) * sizeof *next);
    int i = 0, j = 0;

    if (next == NULL)
        return -ENOMEM;
    while (j < n) {
        if (i < t->ntasks && t->tasks[i].tid < t->tids[j]) {
            close_task(t, &t->tasks[i++]);
        } else if (i < t->ntasks && t->tasks[i].tid == t->tids[j]) {
            next[j++] = t->tasks[i++];
        } else {
            next[j].tid = t->tids[j];
            for (int f = 0; f < NFILES; f++)
                next[j].fd[f] = -1;
            j++;
        }
    }
    while (i < t->ntasks)
        close_task(t, &t->tasks[i++]);
    free(t->tasks);
    t->tasks = next;
    t->ntasks = n;
    return 0;
}

static int open_file(cpupin_tasks *t, int tid, int f)
{
    char path[40];
    snprintf(path, sizeof path, "%d/%s", tid, file_names[f]);
    return openat(t->dirfd, path, O_RDONLY | O_CLOEXEC);
}

/* Reads one file of a task through its kept descriptor, opening (and keeping,
 * within the budget) one when it has none. A kept descriptor whose read fails
 * belonged to a task that is gone, perhaps with its tid reused: it is closed
 * and the file opened afresh once. Returns the length or -errno. */
static ssize_t read_file(cpupin_tasks *t, struct task *k, int f, char *buf, size_t size)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = k->fd[f], kept = fd >= 0;
        ssize_t len;
        if (kept && !still_ours(fd, k->ino[f])) {
            k->fd[f] = -1; /* not ours any more: forgotten, not closed */
            t->nopen--;
            fd = -1;
            kept = 0;
        }
        if (!kept) {
            fd = open_file(t, k->tid, f);
            if (fd < 0 && (errno == EMFILE || errno == ENFILE) && t->nopen > 0) {
                /* Out of descriptors: give back every kept one, keep none
                 * from now on, and read open-read-close instead. */
                for (int i = 0; i < t->ntasks; i++)
                    close_task(t, &t->tasks[i]);
                t->max_open = 0;
                fd = open_file(t, k->tid, f);
            }
            if (fd < 0)
                return gone(errno); /* -EMFILE stays distinct from a task gone */
            if (t->nopen < t->max_open) {
                k->fd[f] = fd;
                k->ino[f] = ino_of(fd);
                t->nopen++;
                kept = 1;
            }
        }
        len = pread(fd, buf, size - 1, 0);
        if (len > 0) {
            if (!kept)
                close(fd);
            buf[len] = '\0';
            return len;
        }
        if (kept) {
            close(fd);
            k->fd[f] = -1;
            t->nopen--;
        } else {
            close(fd);
            return -ESRCH;
        }
    }
    return -ESRCH;
}

/* Field n of a stat line, counted after the last ')' so that no name
 * confuses it; -1 when it is not a number. */
static long stat_field(const char *buf, int n)
{
    const char *p = strrchr(buf, ')');
    int field = 2;
    if (p == NULL)
        return -1;
    for (p++; *p && field < n; p++)
        if (*p == ' ')
            field++;
    return *p >= '0' && *p <= '9' ? atol(p) : -1;
}

/* Whether the process still has the threads last listed: its thread count
 * (field 20) is unchanged. A thread that exited shows as a failed read of
 * its kept descriptor, so the same count and no failed read mean the same
 * set, and the listing (80 us for 256 tasks) can be skipped. */
static int same_count(cpupin_tasks *t)
{
    char buf[1024];
    ssize_t len;
    if (t->stat_fd < 0 || t->ntasks == 0)
        return 0;
    len = pread(t->stat_fd, buf, sizeof buf - 1, 0);
    if (len <= 0)
        return 0;
    buf[len] = '\0';
    return stat_field(buf, 20) == t->ntasks;
}

static int tasks_read(cpupin_tasks *t, int last_cpu, long long *vals,
                      char *names, int names_size, int nout, int *need)
{
    int n, rc, count, used, listed = 0;
    char buf[1024];

    rc = check_dir(t);
    if (rc < 0)
        return rc;
again:
    count = used = 0;
    if (!listed && same_count(t)) { /* listed is set before any goto: no loop */
        n = t->ntasks;
    } else {
        listed = 1;
        n = list_tids(t);
        if (n < 0)
            return n;
        if (n == 0)
            return -ESRCH; /* the folder of a process that is gone lists nothing */
        rc = merge_tasks(t, n);
        if (rc < 0)
            return rc;
    }
    if (n > nout || (size_t)names_size < (size_t)n * 65) {
        *need = n;
        return -ENOSPC;
    }
    for (int i = 0; i < n; i++) {
        struct task *k = &t->tasks[i];
        unsigned long long st[3];
        long long cpu = -1;
        ssize_t len;

        len = read_file(t, k, F_SCHED, buf, sizeof buf);
        if (len < 0 && len != -ESRCH)
            return (int)len; /* EMFILE, EACCES...: an error, not a thread gone */
        if (len < 0 || parse_schedstat(buf, st) < 0) {
            if (!listed) {
                listed = 1; /* a thread is gone, so others may have come: list them */
                goto again;
            }
            continue;       /* exited while being read */
        }
        len = read_file(t, k, F_COMM, buf, 65);
        if (len < 0 && len != -ESRCH)
            return (int)len;
        if (len < 0)
            continue;
        if (buf[len - 1] == '\n')
            buf[--len] = '\0';
        if (last_cpu) {
            char sbuf[1024];
            ssize_t slen = read_file(t, k, F_STAT, sbuf, sizeof sbuf);
            if (slen < 0 && slen != -ESRCH)
                return (int)slen;
            if (slen < 0)
                continue;
            cpu = stat_field(sbuf, 39);
        }
        memcpy(names + used, buf, len + 1);
        used += len + 1;
        vals[5 * count + 0] = k->tid;
        vals[5 * count + 1] = (long long)st[0];
        vals[5 * count + 2] = (long long)st[1];
        vals[5 * count + 3] = (long long)st[2];
        vals[5 * count + 4] = cpu;
        count++;
    }
    if (count == 0)
        return -ESRCH; /* a live process has a thread: every one read was gone */
    *need = used;
    return count;
}

int cpupin_tasks_read(cpupin_tasks *t, int last_cpu, long long *vals,
                      char *names, int names_size, int nout, int *need)
{
    int rc;
    /* Past this many tasks the read takes over 100 us: long enough that
     * other Python threads should run meanwhile. Shorter ones keep the GIL,
     * since taking it back can wait a whole switch interval (5 ms). */
    if (t->ntasks < 64)
        return tasks_read(t, last_cpu, vals, names, names_size, nout, need);
    CPUPIN_DROP_GIL;
    rc = tasks_read(t, last_cpu, vals, names, names_size, nout, need);
    CPUPIN_TAKE_GIL;
    return rc;
}


/* --- handoff: the benchmark ---------------------------------------------------- */

struct handoff {
    int turn __attribute__((aligned(64))); /* 0: A holds the token, 1: B does */
    uint64_t sent_ns __attribute__((aligned(64)));
    int cpu_a, cpu_b, rounds, warmup, idle_us, spin, err;
    uint64_t *rtt, *wake;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int pin_self(int cpu)
{
    cpu_set_t set;
    if (cpu < 0)
        return 0;
    if (cpu >= CPU_SETSIZE)
        return -EINVAL;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return -pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void wait_turn(struct handoff *h, int want)
{
    int seen;
    while ((seen = __atomic_load_n(&h->turn, __ATOMIC_ACQUIRE)) != want) {
        if (h->spin)
            relax();
        else
            syscall(SYS_futex, &h->turn, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
    }
}

static void give_turn(struct handoff *h, int to)
{
    __atomic_store_n(&h->turn, to, __ATOMIC_RELEASE);
    if (!h->spin)
        syscall(SYS_futex, &h->turn, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void *side_b(void *arg)
{
    struct handoff *h = arg;
    int rc = pin_self(h->cpu_b);
    if (rc < 0)
        __atomic_store_n(&h->err, rc, __ATOMIC_RELAXED);
    for (int i = 0; i < h->warmup + h->rounds; i++) {
        uint64_t t;
        wait_turn(h, 1);
        t = now_ns();
        if (i >= h->warmup)
            h->wake[i - h->warmup] = t - h->sent_ns;
        give_turn(h, 0);
    }
    return NULL;
}

static void *side_a(void *arg)
{
    struct handoff *h = arg;
    int rc = pin_self(h->cpu_a);
    if (rc < 0)
        __atomic_store_n(&h->err, rc, __ATOMIC_RELAXED);
    for (int i = 0; i < h->warmup + h->rounds; i++) {
        uint64_t t0;
        if (h->idle_us > 0) {
            struct timespec pause = {h->idle_us / 1000000, (h->idle_us % 1000000) * 1000L};
            nanosleep(&pause, NULL);
        }
        t0 = now_ns();
        h->sent_ns = t0;
        give_turn(h, 1);
        wait_turn(h, 0);
        if (i >= h->warmup)
            h->rtt[i - h->warmup] = now_ns() - t0;
    }
    return NULL;
}

static int handoff(int cpu_a, int cpu_b, int rounds, int warmup, int idle_us, int spin,
                   uint64_t *rtt, uint64_t *wake)
{
    struct handoff *h;
    pthread_t a, b;
    int rc;

    if (rounds <= 0 || warmup < 0 || idle_us < 0)
        return -EINVAL;
    if (spin && (cpu_a < 0 || cpu_b < 0 || cpu_a == cpu_b))
        return -EDEADLK; /* two spinners on one CPU wait on each other */
    if (posix_memalign((void **)&h, 64, sizeof *h) != 0)
        return -ENOMEM;
    memset(h, 0, sizeof *h);
    h->cpu_a = cpu_a;
    h->cpu_b = cpu_b;
    h->rounds = rounds;
    h->warmup = warmup;
    h->idle_us = idle_us;
    h->spin = spin;
    h->rtt = rtt;
    h->wake = wake;
    rc = -pthread_create(&b, NULL, side_b, h);
    if (rc == 0) {
        rc = -pthread_create(&a, NULL, side_a, h);
        if (rc == 0) {
            pthread_join(a, NULL);
        } else {
            /* B waits for a token that never comes: hand it over warmup+rounds times. */
            h->spin = 0;
            h->cpu_b = -1;
            for (int i = 0; i < warmup + rounds; i++) {
                give_turn(h, 1);
                wait_turn(h, 0);
            }
        }
        pthread_join(b, NULL);
    }
    if (rc == 0)
        rc = h->err < 0 ? h->err : rounds;
    free(h);
    return rc;
}

int cpupin_handoff(int cpu_a, int cpu_b, int rounds, int warmup, int idle_us, int spin,
                   uint64_t *rtt, uint64_t *wake)
{
    int rc;
    CPUPIN_DROP_GIL; /* it runs for seconds */
    rc = handoff(cpu_a, cpu_b, rounds, warmup, idle_us, spin, rtt, wake);
    CPUPIN_TAKE_GIL;
    return rc;
}

#else /* --- stubs: no thread affinity, so that the package still imports ------ */

long cpupin_gettid(void) { return -ENOSYS; }
int cpupin_getcpu(void) { return -ENOSYS; }
int cpupin_get_affinity(uint64_t *io) { return -ENOSYS; }
int cpupin_set_affinity(uint64_t *io) { return -ENOSYS; }
int cpupin_set_mask(const uint64_t *want) { return -ENOSYS; }
int cpupin_swap_mask(const uint64_t *want, uint64_t *old) { return -ENOSYS; }
int cpupin_map_shared(int fd, size_t length, void **addr) { return -ENOSYS; }
int cpupin_unmap(void *addr, size_t length) { return -ENOSYS; }
int cpupin_mask_is(const uint64_t *want) { return -ENOSYS; }
int cpupin_thread_enter(const uint64_t *want, const char *name, size_t len) { return -ENOSYS; }
int cpupin_handoff(int cpu_a, int cpu_b, int rounds, int warmup, int idle_us, int spin,
                   uint64_t *rtt, uint64_t *wake)
{
    return -ENOSYS;
}
int cpupin_schedstat(int pid, int tid, unsigned long long *out3) { return -ENOSYS; }
int cpupin_thread_start(unsigned long long *out) { return -ENOSYS; }
int cpupin_step_begin(long long *s) { return -ENOSYS; }
int cpupin_step_end(long long *s) { return -ENOSYS; }
int cpupin_step_own(long long *s) { return -ENOSYS; }
int cpupin_open_in_root(int rootfd, const char *path, int want_dir, unsigned int *mode)
{
    return -ENOSYS;
}
int cpupin_set_mempolicy(int mode, const uint64_t *nodes, int nwords) { return -ENOSYS; }
int cpupin_set_thread_name(const char *name) { return -ENOSYS; }
int cpupin_get_mempolicy(int *mode, uint64_t *nodes, int nwords) { return -ENOSYS; }
cpupin_tasks *cpupin_tasks_open(int pid, int max_open, int *err)
{
    *err = -ENOSYS;
    return NULL;
}
void cpupin_tasks_close(cpupin_tasks *t) { (void)t; }
int cpupin_tasks_read(cpupin_tasks *t, int last_cpu, long long *vals,
                      char *names, int names_size, int nout, int *need)
{
    return -ENOSYS;
}

#endif

/* --- a signal's default ------------------------------------------------------ */

/* Give signal signum its default action (SIG_DFL), as a shell leaves it for
 * the command it runs: cpupin exec calls it just before execve for the
 * signals Python ignores for itself (SIGPIPE, SIGXFSZ), without importing
 * Python's signal module (0.6 ms of every start). Python's own view of the
 * signal is not told: the caller is about to become another program. 0 or
 * -errno. */
static const int CPUPIN_SIGPIPE = SIGPIPE;
static const int CPUPIN_SIGXFSZ = SIGXFSZ;

int cpupin_default_signal(int signum)
{
    struct sigaction action;

    memset(&action, 0, sizeof action);
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    return sigaction(signum, &action, NULL) == 0 ? 0 : -errno;
}

/* --- the descriptor limit -------------------------------------------------- */

/* RLIMIT_NOFILE's soft limit (-1: unlimited), which sizes how many files a
 * task reader may keep open, without Python's resource module (0.2-0.5 ms
 * of cpupin exec's start). 0 or -errno. */
int cpupin_nofile_limit(long long *soft)
{
    struct rlimit limit;

    if (getrlimit(RLIMIT_NOFILE, &limit) != 0)
        return -errno;
    *soft = limit.rlim_cur == RLIM_INFINITY ? -1 : (long long)limit.rlim_cur;
    return 0;
}

/* --- keeping the GIL ------------------------------------------------------- */

/* cffi wraps every call in Py_BEGIN_ALLOW_THREADS ... Py_END_ALLOW_THREADS,
 * whose wrappers follow this text. Dropping the GIL costs the caller the wait
 * to get it back: with one other Python thread busy, a 300 ns affinity call
 * took 560 us on average (bench/RESULTS.md). So the calls keep the GIL, as
 * os.sched_setaffinity does, and cpupin_tasks_read, which takes hundreds of
 * microseconds, drops it itself. tests/test_contracts.py checks from inside
 * a call (cpupin_holds_gil) that this took, against a build with
 * CPUPIN_RELEASE_GIL (cffi's default), and that it precedes every wrapper
 * in the generated source. */
#if defined(Py_PYTHON_H) && !defined(CPUPIN_RELEASE_GIL)
#undef Py_BEGIN_ALLOW_THREADS
#undef Py_END_ALLOW_THREADS
#define Py_BEGIN_ALLOW_THREADS {
#define Py_END_ALLOW_THREADS }
#endif

/* cffi also saves and restores errno around every call, in a per-thread
 * block that its backend allocates on a thread's first call and frees at the
 * thread's exit: 3.5 us added to the start of every thread whose first step
 * is one call (a cpupin.Thread naming itself, bench/RESULTS.md). No caller
 * reads ffi.errno: every function returns -errno itself. So the two are
 * nothing here; tests/test_contracts.py checks they precede the wrappers. */
#if defined(Py_PYTHON_H) && defined(_cffi_restore_errno) && !defined(CPUPIN_RELEASE_GIL)
#undef _cffi_restore_errno
#undef _cffi_save_errno
#define _cffi_restore_errno() ((void)0)
#define _cffi_save_errno() ((void)0)
#endif
