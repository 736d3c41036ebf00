/* The cdef header: what Python sees of the C layer. cffi parses it, so it
 * holds no preprocessor lines; every function returns 0 (or a count) on
 * success and -errno on failure, never -1 with errno on the side. */

static const int CPUPIN_HAVE_AFFINITY;
static const int CPUPIN_SIGPIPE;
static const int CPUPIN_SIGXFSZ;

int cpupin_noop(void);
/* 1 when the GIL is held inside a call (it is: see cpupin.c's end). */
int cpupin_holds_gil(void);
long cpupin_gettid(void);
int cpupin_getcpu(void);

/* Masks cross as 64-bit words, word i holding CPUs 64*i to 64*i+63, so
 * that no byte order leaks into Python. Each call takes one buffer, io:
 * io[0] the tid (0 for the calling thread), io[1] the size of the kernel's CPU
 * set in words (the caller grows it on -EINVAL), io[2...] the mask: read by
 * set, then written with the mask the kernel holds. One argument, because
 * cffi calls with several cost 70 ns more. Both return how many words are
 * significant (the highest nonzero one plus one) or -errno. */
int cpupin_get_affinity(uint64_t *io);
int cpupin_set_affinity(uint64_t *io);
/* The calling thread onto want[1...] (want[0] words), read back: 0 when
 * the kernel holds exactly that, 1 when less, or -errno. */
int cpupin_set_mask(const uint64_t *want);
/* A pin: the old mask into old[0...want[0]), then cpupin_set_mask(want):
 * the old mask's significant words plus 65536 when the kernel holds want,
 * or -errno (nothing moved). */
int cpupin_swap_mask(const uint64_t *want, uint64_t *old);
/* Whether the calling thread's mask is want[1...] (want[0] words): 1 or 0,
 * or -errno. Needs no buffer of the caller's: a new thread's first check. */
int cpupin_mask_is(const uint64_t *want);
/* A new thread's first call: onto the mask want[1...] unless there, then
 * (name not NULL) named from the len bytes of its UTF-8 name, cut as
 * cpupin_thread_name_cut cuts. 1 moved, 0 already there, or -errno. */
int cpupin_thread_enter(const uint64_t *want, const char *name, size_t len);
/* A thread's kernel name from its UTF-8 name: at most 15 bytes, cut on a
 * character, NUL as '?', into out (16 bytes). Returns its length. */
int cpupin_thread_name_cut(const char *name, size_t len, char *out);

/* One task's /proc/<pid>/task/<tid>/schedstat; tid 0 is the calling thread. */
int cpupin_schedstat(int pid, int tid, unsigned long long *out3);

/* The calling thread's start time, in clock ticks since boot (field 22 of
 * /proc/thread-self/stat). 0 or -errno. */
int cpupin_thread_start(unsigned long long *out);

/* A step clock's marks (the layout of s is in cpupin.c): the start, the
 * last step's differences, the schedstat and cpu.stat descriptors, the
 * cgroup version (0: none), the join window, then a ring of steps and
 * their sums. begin returns 1 when the previous end stands as the start;
 * both 0 or -errno, or -4096 when called by a thread other than the one
 * that made itself the owner with cpupin_step_own (which returns 0). */
int cpupin_step_begin(long long *s);
int cpupin_step_end(long long *s);
int cpupin_step_own(long long *s);

/* The calling thread's kernel name (prctl PR_SET_NAME; 15 bytes at most). */
int cpupin_set_thread_name(const char *name);

/* The calling thread's memory policy (set_mempolicy/get_mempolicy): mode
 * and a node mask of nwords 64-bit words (node i in word i/64, at most 256
 * words; 0 words: no mask). Return 0 or -errno. */
int cpupin_set_mempolicy(int mode, const uint64_t *nodes, int nwords);
int cpupin_get_mempolicy(int *mode, uint64_t *nodes, int nwords);

/* path opened as if rootfd were "/" (openat2 RESOLVE_IN_ROOT, no magic
 * links), for reading, only when it is a regular file (want_dir 0) or a
 * directory (1). Returns the fd, -EMEDIUMTYPE for another type (*mode holds
 * st_mode), or -errno; -ENOSYS/-EPERM: openat2 missing or refused. */
int cpupin_open_in_root(int rootfd, const char *path, int want_dir, unsigned int *mode);

/* Every task of one process, with descriptors kept open between reads. */
typedef struct cpupin_tasks cpupin_tasks;
cpupin_tasks *cpupin_tasks_open(int pid, int max_open, int *err);
void cpupin_tasks_close(cpupin_tasks *t);
/* Writes 5 numbers a thread into vals (tid, run_ns, wait_ns, timeslices,
 * last_cpu or -1) and the NUL-terminated names one after another into names
 * (65 bytes a thread is always enough). Returns the thread count with *need
 * set to the bytes of names written; -ENOSPC with *need set to the thread
 * count when nout threads or names_size bytes are too few; or -errno. */
int cpupin_tasks_read(cpupin_tasks *t, int last_cpu, long long *vals,
                      char *names, int names_size, int nout, int *need);

/* The handoff benchmark: two threads, pinned to cpu_a and cpu_b (-1: left
 * unpinned), pass a token back and forth through a futex (spin: through a
 * shared cache line, without sleeping). Thread A sleeps idle_us before each
 * handoff so that B's core can fall idle. For each of the rounds after the
 * warmup ones, rtt[i] is A's round trip in ns and wake[i] the time from A's
 * handoff to B running. Returns the rounds measured or -errno. */
int cpupin_handoff(int cpu_a, int cpu_b, int rounds, int warmup, int idle_us, int spin,
                   uint64_t *rtt, uint64_t *wake);

/* A file mapped shared (MAP_SHARED, read and write), and unmapped: 0 or
 * -errno. What a process's record is written through. */
int cpupin_map_shared(int fd, size_t length, void **addr);
int cpupin_unmap(void *addr, size_t length);

/* Give a signal its default action (SIG_DFL), before an exec. */
int cpupin_default_signal(int signum);

/* The soft limit on open descriptors in *soft (-1: unlimited): 0 or -errno. */
int cpupin_nofile_limit(long long *soft);
