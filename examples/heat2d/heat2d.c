/*
 * heat2d: 2-D Jacobi heat diffusion with icheck checkpoint/restart.
 *
 * The N x N grid is split into blocks of rows over the MPI ranks (each rank
 * keeps one halo row above and below). The top edge is held at 100 degrees,
 * the other edges at 0. Every K iterations the rank's rows and the
 * iteration number are committed; a restarted run continues from the newest
 * complete version. At the end rank 0 prints a checksum of the whole grid,
 * the same with and without a failure in between.
 *
 *   mpicc heat2d.c -o heat2d $(pkg-config --cflags --libs icheck)
 *   mpirun -np 4 ./heat2d --n 512 --iters 400 --every 50 [--fail-at 220] [--probe-every 4]
 *
 * --fail-at I: rank 0 kills itself (SIGKILL) at iteration I, like a node
 * failure; run the same command again to restart.
 * --probe-every P: after every P-th commit, icheck_probe_agents may move the
 * run to more or fewer agents (Algorithm 5). Rank 0 prints each commit's and
 * probe's seconds. --hint-remaining 1 also tells the controller how many
 * commits remain, so it changes agents only when that pays back (eq. 6.12).
 */
#include <mpi.h>
#include <icheck.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void check(int code, const char *what, int rank)
{
    if (code < 0) {
        const char *detail = icheck_last_error();
        fprintf(stderr, "rank %d: %s failed: %s (%s)\n", rank, what, icheck_strerror(code), detail ? detail : "");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

int main(int argc, char **argv)
{
    long n = 256, iters = 200, every = 25, fail_at = -1, probe_every = 0, hint = 0;
    const char *app = "heat2d";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--n")) n = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) iters = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--every")) every = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--fail-at")) fail_at = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--app")) app = argv[i + 1];
        else if (!strcmp(argv[i], "--probe-every")) probe_every = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--hint-remaining")) hint = atol(argv[i + 1]);
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    /* Rows [first, first + rows) of the interior rows 1..n-2 belong to this rank. */
    long interior = n - 2, base = interior / size, extra = interior % size;
    long rows = base + (rank < extra ? 1 : 0);
    long first = 1 + rank * base + (rank < extra ? rank : extra);
    size_t cells = (size_t)(rows + 2) * (size_t)n;
    double *grid = calloc(cells, sizeof(double));
    double *next = calloc(cells, sizeof(double));
    if (!grid || !next) MPI_Abort(MPI_COMM_WORLD, 1);
    if (first == 1)
        for (long j = 0; j < n; j++) grid[j] = next[j] = 100.0; /* hot top edge */

    long iter = 0;
    int status;
    check(icheck_init(NULL, app, MPI_COMM_WORLD, &status), "icheck_init", rank);
    /* The rank's own rows (halos excluded) and the iteration count. */
    check(icheck_add("grid", grid + n, (size_t)(rows * n), ICHECK_DOUBLE), "icheck_add(grid)", rank);
    check(icheck_add("iter", &iter, 1, ICHECK_LONG), "icheck_add(iter)", rank);
    if (status == ICHECK_RESTART) {
        check(icheck_restart(), "icheck_restart", rank);
        check(icheck_restore("grid", grid + n, (size_t)(rows * n)), "icheck_restore(grid)", rank);
        check(icheck_restore("iter", &iter, 1), "icheck_restore(iter)", rank);
        if (rank == 0) printf("RESTARTED at iteration %ld\n", iter);
        iter++;
    } else if (rank == 0) {
        printf("FRESH start\n");
    }

    long commits = 0;
    int up = rank > 0 ? rank - 1 : MPI_PROC_NULL, down = rank < size - 1 ? rank + 1 : MPI_PROC_NULL;
    for (; iter <= iters; iter++) {
        /* Halo exchange: first row up, last row down. */
        MPI_Sendrecv(grid + n, (int)n, MPI_DOUBLE, up, 0, grid + (rows + 1) * n, (int)n, MPI_DOUBLE, down, 0,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Sendrecv(grid + rows * n, (int)n, MPI_DOUBLE, down, 1, grid, (int)n, MPI_DOUBLE, up, 1, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        for (long i = 1; i <= rows; i++)
            for (long j = 1; j < n - 1; j++)
                next[i * n + j] = 0.25 * (grid[(i - 1) * n + j] + grid[(i + 1) * n + j] + grid[i * n + j - 1] +
                                          grid[i * n + j + 1]);
        for (long i = 1; i <= rows; i++) memcpy(grid + i * n + 1, next + i * n + 1, (size_t)(n - 2) * sizeof(double));
        if (iter % every == 0) {
            double started = MPI_Wtime();
            check(icheck_commit(), "icheck_commit", rank);
            if (rank == 0) printf("COMMITTED iteration %ld seconds=%.4f\n", iter, MPI_Wtime() - started);
            commits++;
            if (probe_every > 0 && commits % probe_every == 0) {
                icheck_hints hints = { .remaining_commits = hint ? (int)((iters - iter) / every) : 0 };
                started = MPI_Wtime();
                int agents = icheck_probe_agents(&hints);
                check(agents, "icheck_probe_agents", rank);
                double seconds = MPI_Wtime() - started;
                if (rank == 0 && agents > 0) printf("PROBE agents=%d seconds=%.4f\n", agents, seconds);
                if (rank == 0 && agents == 0) printf("PROBE unchanged seconds=%.4f\n", seconds);
            }
            if (rank == 0) fflush(stdout);
        }
        if (iter == fail_at && rank == 0) {
            printf("FAULT injected at iteration %ld\n", iter);
            fflush(stdout);
            raise(SIGKILL);
        }
    }

    /* Position-weighted sum: equal only if every cell is equal. */
    double local = 0.0, total = 0.0;
    for (long i = 1; i <= rows; i++)
        for (long j = 0; j < n; j++) local += grid[i * n + j] * (double)((first + i - 1) * n + j + 1);
    MPI_Reduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("CHECKSUM %.17g\n", total);
    check(icheck_finalize(IC_CLEANUP), "icheck_finalize", rank);
    free(grid);
    free(next);
    MPI_Finalize();
    return 0;
}
