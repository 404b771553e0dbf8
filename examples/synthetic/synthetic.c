/*
 * synthetic: the thesis's synthetic checkpoint benchmark (Listings 8.1 and
 * 8.2). Every process checkpoints cp_size elements of cp_type cp_count
 * times, at most every cp_interval seconds, through icheck and/or as an
 * MPI-IO write of the same bytes to pfs_dir, and prints each commit's time.
 *
 *   mpicc synthetic.c -o synthetic $(pkg-config --cflags --libs icheck)
 *   mpirun -np 4 ./synthetic synthetic.conf
 *
 * Configuration (key = value, '#' starts a comment):
 *   cp_size = 100000       # elements per process
 *   cp_type = float        # char, int, long, float, double
 *   cp_interval = 10       # seconds between checkpoints (0: every step)
 *   cp_count = 1000        # steps
 *   cp_mpiio = true        # also write the data with MPI-IO
 *   enable_ichk = false    # checkpoint through icheck
 *   fault_inject = 10      # seconds until rank 0 kills itself (0: never)
 *   probe_interval = 5     # seconds between icheck_probe_agents (0: never)
 *   is_invasive = true     # probe at all
 *   pfs_dir = /tmp         # where MPI-IO writes (the parallel file system)
 *   app = synthetic        # icheck application name
 *   icheck_config =        # icheck configuration (empty: $ICHECK_CONFIG)
 */
#include <mpi.h>
#include <icheck.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct config {
    long cp_size, cp_count;
    double cp_interval, fault_inject, probe_interval;
    int cp_type, cp_mpiio, enable_ichk, is_invasive;
    char pfs_dir[512], app[512], icheck_config[512];
};

static int truth(const char *v) { return !strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "yes"); }

static int read_config(const char *path, struct config *c)
{
    *c = (struct config){100000, 10, 0.0, 0.0, 0.0, ICHECK_FLOAT, 0, 1, 0, "/tmp", "synthetic", ""};
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "cannot open configuration %s\n", path);
        return -1;
    }
    char line[1024], key[128], value[512];
    int lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        value[0] = '\0';
        int n = sscanf(line, " %127[^= \t] = %511s", key, value);
        if (n < 1) continue;
        if (!strcmp(key, "cp_size")) c->cp_size = atol(value);
        else if (!strcmp(key, "cp_count")) c->cp_count = atol(value);
        else if (!strcmp(key, "cp_interval")) c->cp_interval = atof(value);
        else if (!strcmp(key, "fault_inject")) c->fault_inject = atof(value);
        else if (!strcmp(key, "probe_interval")) c->probe_interval = atof(value);
        else if (!strcmp(key, "cp_mpiio")) c->cp_mpiio = truth(value);
        else if (!strcmp(key, "enable_ichk")) c->enable_ichk = truth(value);
        else if (!strcmp(key, "is_invasive")) c->is_invasive = truth(value);
        else if (!strcmp(key, "pfs_dir")) snprintf(c->pfs_dir, sizeof c->pfs_dir, "%s", value);
        else if (!strcmp(key, "app")) snprintf(c->app, sizeof c->app, "%s", value);
        else if (!strcmp(key, "icheck_config")) snprintf(c->icheck_config, sizeof c->icheck_config, "%s", value);
        else if (!strcmp(key, "cp_type")) {
            if (!strcmp(value, "char")) c->cp_type = ICHECK_CHAR;
            else if (!strcmp(value, "int")) c->cp_type = ICHECK_INT;
            else if (!strcmp(value, "long")) c->cp_type = ICHECK_LONG;
            else if (!strcmp(value, "float")) c->cp_type = ICHECK_FLOAT;
            else if (!strcmp(value, "double")) c->cp_type = ICHECK_DOUBLE;
            else {
                fprintf(stderr, "%s:%d: cp_type %s is not char, int, long, float or double\n", path, lineno, value);
                fclose(f);
                return -1;
            }
        } else {
            fprintf(stderr, "%s:%d: unknown key %s\n", path, lineno, key);
            fclose(f);
            return -1;
        }
    }
    fclose(f);
    return 0;
}

static size_t type_size(int type)
{
    switch (type) {
    case ICHECK_CHAR: return 1;
    case ICHECK_INT: case ICHECK_FLOAT: return 4;
    default: return 8;
    }
}

static void check(int code, const char *what, int rank)
{
    if (code < 0) {
        const char *detail = icheck_last_error();
        fprintf(stderr, "rank %d: %s failed: %s (%s)\n", rank, what, icheck_strerror(code), detail ? detail : "");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

/* Writes every rank's bytes into one file at rank-ordered offsets. */
static double write_mpiio(const struct config *c, const void *data, size_t bytes, long step, int rank)
{
    char path[1100];
    snprintf(path, sizeof path, "%s/%s.%ld.mpiio", c->pfs_dir, c->app, step % 2);
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    MPI_File file;
    if (MPI_File_open(MPI_COMM_WORLD, path, MPI_MODE_CREATE | MPI_MODE_WRONLY, MPI_INFO_NULL, &file) != MPI_SUCCESS) {
        fprintf(stderr, "rank %d: cannot open %s for MPI-IO\n", rank, path);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_File_write_at_all(file, (MPI_Offset)rank * (MPI_Offset)bytes, data, (int)bytes, MPI_BYTE, MPI_STATUS_IGNORE);
    MPI_File_sync(file);
    MPI_File_close(&file);
    return MPI_Wtime() - start;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    struct config c;
    if (argc != 2 || read_config(argv[1], &c) != 0) {
        if (rank == 0) fprintf(stderr, "usage: %s CONFIG (see the comment at the top of synthetic.c)\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t bytes = (size_t)c.cp_size * type_size(c.cp_type);
    unsigned char *data = malloc(bytes ? bytes : 1);
    long step = 0;
    int status = ICHECK_FRESH;
    if (c.enable_ichk) {
        check(icheck_init(c.icheck_config[0] ? c.icheck_config : NULL, c.app, MPI_COMM_WORLD, &status), "icheck_init",
              rank);
        check(icheck_add("Array", data, (size_t)c.cp_size, c.cp_type), "icheck_add(Array)", rank);
        check(icheck_add("step", &step, 1, ICHECK_LONG), "icheck_add(step)", rank);
        if (status == ICHECK_RESTART) {
            check(icheck_restart(), "icheck_restart", rank);
            check(icheck_restore("Array", data, (size_t)c.cp_size), "icheck_restore(Array)", rank);
            check(icheck_restore("step", &step, 1), "icheck_restore(step)", rank);
            if (rank == 0) printf("RESTARTED at step %ld\n", step);
            step++;
        }
    }
    double begin = MPI_Wtime(), last_cp = -1e30, last_probe = begin;
    double icheck_total = 0.0, mpiio_total = 0.0;
    int commits = 0;
    if (rank == 0)
        printf("synthetic: %d processes, %zu bytes each, %ld steps, icheck %s, MPI-IO %s\n", size, bytes, c.cp_count,
               c.enable_ichk ? "on" : "off", c.cp_mpiio ? "on" : "off");
    for (; step < c.cp_count; step++) {
        for (size_t i = 0; i < bytes; i += 64) data[i] = (unsigned char)(step + rank + i); /* modify the data */
        double now = MPI_Wtime();
        if (now - last_cp >= c.cp_interval) {
            last_cp = now;
            double t_ichk = 0.0, t_io = 0.0, local;
            if (c.enable_ichk) {
                MPI_Barrier(MPI_COMM_WORLD);
                local = MPI_Wtime();
                check(icheck_commit(), "icheck_commit", rank);
                local = MPI_Wtime() - local;
                MPI_Reduce(&local, &t_ichk, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            }
            if (c.cp_mpiio) {
                local = write_mpiio(&c, data, bytes, step, rank);
                MPI_Reduce(&local, &t_io, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            }
            icheck_total += t_ichk;
            mpiio_total += t_io;
            commits++;
            if (rank == 0) printf("COMMIT step %ld icheck %.6f s mpiio %.6f s\n", step, t_ichk, t_io);
        }
        if (c.fault_inject > 0 && MPI_Wtime() - begin > c.fault_inject && rank == 0) {
            printf("FAULT injected at step %ld\n", step);
            fflush(stdout);
            raise(SIGKILL);
        }
        if (c.enable_ichk && c.is_invasive && c.probe_interval > 0 && MPI_Wtime() - last_probe > c.probe_interval) {
            icheck_hints hints = {(int)(c.cp_count - step)};
            check(icheck_probe_agents(&hints), "icheck_probe_agents", rank);
            last_probe = MPI_Wtime();
        }
    }
    if (rank == 0 && commits > 0) {
        printf("SUMMARY commits %d mean icheck %.6f s mean mpiio %.6f s", commits, icheck_total / commits,
               mpiio_total / commits);
        if (c.enable_ichk && c.cp_mpiio && icheck_total > 0) printf(" mpiio/icheck %.2f", mpiio_total / icheck_total);
        printf("\n");
    }
    if (c.enable_ichk) check(icheck_finalize(IC_PERSIST), "icheck_finalize", rank);
    free(data);
    MPI_Finalize();
    return 0;
}
