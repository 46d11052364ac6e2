/* The kernels' scratch buffers (scratch.h): per thread, one per slot, grow-only, freed when the
 * thread exits (a pthread key's destructor) or on qg_scratch_release(); and qg_thread_release(),
 * which frees a thread's scratch and its OpenMP team when it hands the kernels to another thread. */
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "scratch.h"

typedef struct {
    void *p[SCR_SLOTS];
    size_t n[SCR_SLOTS];
} arena_t;

static pthread_key_t arena_key;
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;
static int arena_ok;

static void arena_free(void *v) {
    arena_t *a = v;
    for (int i = 0; i < SCR_SLOTS; i++) free(a->p[i]);
    free(a);
}

static void arena_init(void) { arena_ok = pthread_key_create(&arena_key, arena_free) == 0; }

void *hp_scratch(int slot, size_t bytes) {
    pthread_once(&arena_once, arena_init);
    if (!arena_ok || slot < 0 || slot >= SCR_SLOTS) return NULL;
    arena_t *a = pthread_getspecific(arena_key);
    if (!a) {
        a = calloc(1, sizeof *a);
        if (!a || pthread_setspecific(arena_key, a)) {
            free(a);
            return NULL;
        }
    }
    if (a->n[slot] < bytes || !a->p[slot]) {
        free(a->p[slot]);
        a->p[slot] = NULL;
        a->n[slot] = 0;
        /* an eighth more than asked, whole cache lines: a prompt a few tokens longer reuses it */
        const size_t want = (bytes + bytes / 8 + 64 + 63) & ~(size_t)63;
        a->p[slot] = aligned_alloc(64, want);
        if (!a->p[slot]) return NULL;
        a->n[slot] = want;
    }
    return a->p[slot];
}

/* Frees the calling thread's scratch buffers (they are made again when next needed). */
void qg_scratch_release(void) {
    pthread_once(&arena_once, arena_init);
    if (!arena_ok) return;
    arena_t *a = pthread_getspecific(arena_key);
    if (!a) return;
    pthread_setspecific(arena_key, NULL);
    arena_free(a);
}

/* Bytes the calling thread's scratch buffers hold (tests, the memory report). */
int64_t qg_scratch_bytes(void) {
    pthread_once(&arena_once, arena_init);
    arena_t *a = arena_ok ? pthread_getspecific(arena_key) : NULL;
    int64_t total = 0;
    for (int i = 0; a && i < SCR_SLOTS; i++) total += (int64_t)a->n[i];
    return total;
}

/* Frees the calling thread's scratch buffers and its OpenMP worker threads (both are made again if
 * the thread runs kernels later). For a thread that hands the model to another, as the server's
 * main thread does to its engine thread: libgomp cuts its workers' spin-wait to almost nothing
 * while it manages more threads than there are CPUs, and the loading thread's idle team counted
 * among them (the engine thread's workers then slept and were woken at every barrier: on 2 cores
 * about 165 context switches and 10 ms a 1B decode step). Returns omp_pause_resource_all's result
 * (0, or -1 inside a parallel region, where nothing is freed). */
int qg_thread_release(void) {
    if (omp_in_parallel()) return -1;
    qg_scratch_release();
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9) /* OpenMP 5.0's pause: GCC 9+ */
    return omp_pause_resource_all(omp_pause_hard);
#else
    return 0; /* an older compiler's libgomp: the team stays */
#endif
}
