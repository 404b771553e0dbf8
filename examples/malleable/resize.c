/*
 * resize.c: a malleable MPI application in C that changes its process count
 * inside one job with standard MPI (MPI_Comm_spawn + MPI_Intercomm_merge to
 * grow, MPI_Comm_split to shrink) and lets icheck redistribute its data
 * after every change (paper 000's approach B: commit right before the
 * resize, then every process of the new communicator calls
 * icheck_redistribute for each label).
 *
 * The computation: a BLOCK-distributed array x of --global 64-bit integers,
 * each step x[i] = x[i] * A + (i ^ step) + acc (wrapping), then
 * acc = sum of all x (MPI_Allreduce). The result is the same for any
 * decomposition, so a resized run must print exactly what a fixed run
 * prints.
 *
 *   mpirun -np 2 resize --app r            # 2 -> 4 -> 2 processes
 *   mpirun -np 2 resize --app r --fixed    # the same steps, never resized
 *
 * Output (rank 0): "PHASE procs=P steps=A..B", "RESULT acc=<u64>".
 */
#include <mpi.h>
#include <icheck.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *app = "resize";
static long steps_per_phase = 20;
static long global = 1000003;
static int fixed = 0;

#define CHECK(call)                                                                     \
    do {                                                                                \
        int rc_ = (call);                                                               \
        if (rc_ < 0) {                                                                  \
            const char *detail_ = icheck_last_error();                                  \
            fprintf(stderr, "%s failed: %s (%s)\n", #call, icheck_strerror(rc_),        \
                    detail_ ? detail_ : "");                                            \
            MPI_Abort(MPI_COMM_WORLD, 1);                                               \
        }                                                                               \
    } while (0)

/* First global index of rank r's BLOCK part of n elements over p. */
static int64_t block_start(int64_t n, int p, int r) {
    return r * (n / p) + (r < n % p ? r : n % p);
}
static int64_t block_count(int64_t n, int p, int r) {
    return n / p + (r < n % p ? 1 : 0);
}

/* The state every process holds. */
struct state {
    uint64_t *x;   /* this rank's BLOCK part */
    int64_t count; /* its elements */
    uint64_t acc;  /* replicated: the last sum */
    int64_t step;  /* replicated: the next step */
};

static void compute(MPI_Comm comm, struct state *s, long until) {
    int rank, size;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    int64_t first = block_start(global, size, rank);
    for (; s->step < until; s->step++) {
        uint64_t local = 0;
        for (int64_t k = 0; k < s->count; k++) {
            uint64_t i = (uint64_t)(first + k);
            s->x[k] = s->x[k] * 6364136223846793005ULL + (i ^ (uint64_t)s->step) + s->acc;
            local += s->x[k];
        }
        MPI_Allreduce(&local, &s->acc, 1, MPI_UINT64_T, MPI_SUM, comm);
    }
}

/* Registers the labels over the current communicator's count. */
static void add_labels(struct state *s) {
    CHECK(icheck_add_adapt_global("x", s->x, (size_t)s->count, ICHECK_LONG, global, ICHECK_BLOCK, 0, NULL));
    CHECK(icheck_add_adapt("acc", &s->acc, 1, ICHECK_LONG, ICHECK_CONSTANT, NULL, NULL, NULL));
    CHECK(icheck_add_adapt("step", &s->step, 1, ICHECK_LONG, ICHECK_CONSTANT, NULL, NULL, NULL));
}

/* Commit, then leave icheck's old communicator (the agents keep the data). */
static void commit_before_resize(struct state *s) {
    (void)s;
    CHECK(icheck_commit());
    CHECK(icheck_finalize(IC_PERSIST));
}

/* Joins icheck with the new communicator and takes this process's part. */
static void redistribute_after_resize(MPI_Comm comm, struct state *s) {
    int status;
    CHECK(icheck_init(NULL, app, comm, &status));
    if (status != ICHECK_RESTART) {
        fprintf(stderr, "expected a checkpoint to redistribute\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    CHECK(icheck_restart());
    int64_t count = icheck_local_count("x");
    CHECK((int)(count < 0 ? count : 0));
    free(s->x);
    s->x = malloc((size_t)(count > 0 ? count : 1) * sizeof(uint64_t));
    s->count = count;
    add_labels(s);
    CHECK(icheck_redistribute("x", s->x, (size_t)count));
    CHECK(icheck_redistribute("acc", &s->acc, 1));
    CHECK(icheck_redistribute("step", &s->step, 1));
}

static void phase(MPI_Comm comm, struct state *s, long until) {
    int rank, size;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    if (rank == 0) {
        printf("PHASE procs=%d steps=%" PRId64 "..%ld\n", size, s->step, until);
        fflush(stdout);
    }
    compute(comm, s, until);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int child = 0;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--app") && a + 1 < argc) app = argv[++a];
        else if (!strcmp(argv[a], "--steps-per-phase") && a + 1 < argc) steps_per_phase = atol(argv[++a]);
        else if (!strcmp(argv[a], "--global") && a + 1 < argc) global = atol(argv[++a]);
        else if (!strcmp(argv[a], "--fixed")) fixed = 1;
        else if (!strcmp(argv[a], "--child")) child = 1;
        else {
            fprintf(stderr, "usage: %s [--app NAME] [--steps-per-phase S] [--global N] [--fixed]\n", argv[0]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    struct state s = {NULL, 0, 0, 0};
    MPI_Comm comm, parent, merged;
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    MPI_Comm_get_parent(&parent);
    int rank, size;

    if (fixed) {
        MPI_Comm_rank(comm, &rank);
        MPI_Comm_size(comm, &size);
        s.count = block_count(global, size, rank);
        s.x = malloc((size_t)(s.count > 0 ? s.count : 1) * sizeof(uint64_t));
        for (int64_t k = 0; k < s.count; k++) s.x[k] = (uint64_t)(block_start(global, size, rank) + k);
        phase(comm, &s, 3 * steps_per_phase);
    } else if (!child) {
        /* Phase 1: the initial processes. */
        MPI_Comm_rank(comm, &rank);
        MPI_Comm_size(comm, &size);
        int status;
        CHECK(icheck_init(NULL, app, comm, &status));
        s.count = block_count(global, size, rank);
        s.x = malloc((size_t)(s.count > 0 ? s.count : 1) * sizeof(uint64_t));
        for (int64_t k = 0; k < s.count; k++) s.x[k] = (uint64_t)(block_start(global, size, rank) + k);
        add_labels(&s);
        phase(comm, &s, steps_per_phase);
        commit_before_resize(&s);

        /* Grow: as many new processes as there are now. */
        char *child_argv[] = {"--child", "--app", (char *)app, "--steps-per-phase", NULL, "--global", NULL, NULL};
        char steps_text[32], global_text[32];
        snprintf(steps_text, sizeof steps_text, "%ld", steps_per_phase);
        snprintf(global_text, sizeof global_text, "%ld", global);
        child_argv[4] = steps_text;
        child_argv[6] = global_text;
        MPI_Comm inter;
        MPI_Comm_spawn(argv[0], child_argv, size, MPI_INFO_NULL, 0, comm, &inter, MPI_ERRCODES_IGNORE);
        MPI_Intercomm_merge(inter, 0, &merged);
        parent = inter;
    } else {
        MPI_Intercomm_merge(parent, 1, &merged);
    }

    if (!fixed) {
        /* Phase 2: the grown communicator (parents first, then children). */
        redistribute_after_resize(merged, &s);
        phase(merged, &s, 2 * steps_per_phase);
        commit_before_resize(&s);

        /* Shrink: the spawned processes leave. */
        MPI_Comm_rank(merged, &rank);
        MPI_Comm_size(merged, &size);
        MPI_Comm small;
        MPI_Comm_split(merged, rank < size / 2 ? 0 : MPI_UNDEFINED, rank, &small);
        MPI_Comm_free(&merged);
        MPI_Comm_disconnect(&parent);
        if (small == MPI_COMM_NULL) {
            free(s.x);
            MPI_Comm_free(&comm);
            MPI_Finalize();
            return 0;
        }
        /* Phase 3: the initial processes again. */
        redistribute_after_resize(small, &s);
        phase(small, &s, 3 * steps_per_phase);
        CHECK(icheck_finalize(IC_CLEANUP));
        MPI_Comm_free(&small);
    }
    MPI_Comm_rank(comm, &rank);
    if (rank == 0) {
        printf("RESULT acc=%" PRIu64 "\n", s.acc);
        fflush(stdout);
    }
    free(s.x);
    MPI_Comm_free(&comm);
    MPI_Finalize();
    return 0;
}
