/* A cache-line ping-pong of our own, the anchor for `cpupin handoff --spin`:
 * two threads pinned to CPUs A and B flip one shared int; one-way latency is
 * half the median round trip, without timestamps inside the loop.
 *     cc -O2 -pthread pingpong.c -o pingpong && ./pingpong A B [rounds] */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int flag __attribute__((aligned(64)));
static long rounds = 1000000;

static void pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
        fprintf(stderr, "cannot pin to CPU %d\n", cpu);
        exit(2);
    }
}

static void *pong(void *arg)
{
    pin(*(int *)arg);
    for (long i = 0; i < rounds; i++) {
        while (__atomic_load_n(&flag, __ATOMIC_ACQUIRE) != 1)
            ;
        __atomic_store_n(&flag, 0, __ATOMIC_RELEASE);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int a, b;
    pthread_t t;
    struct timespec t0, t1;

    if (argc < 3) {
        fprintf(stderr, "usage: %s CPU_A CPU_B [ROUNDS]\n", argv[0]);
        return 2;
    }
    a = atoi(argv[1]);
    b = atoi(argv[2]);
    if (a == b) {
        fprintf(stderr, "two spinners on one CPU wait on each other: give two CPUs\n");
        return 2;
    }
    if (argc > 3)
        rounds = atol(argv[3]);
    pthread_create(&t, NULL, pong, &b);
    pin(a);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < rounds; i++) {
        __atomic_store_n(&flag, 1, __ATOMIC_RELEASE);
        while (__atomic_load_n(&flag, __ATOMIC_ACQUIRE) != 0)
            ;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(t, NULL);
    printf("%.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / rounds / 2);
    return 0;
}
