/*
 * icheck.h: the C API of icheck, an RDMA checkpoint service.
 *
 * Link with libicheck (pkg-config --cflags --libs icheck). Every call
 * returns ICHECK_SUCCESS (0) or a negative ICHECK_ERR_* code;
 * icheck_strerror(code) describes the code and icheck_last_error() the
 * detail of the last failure (label, sizes, peer).
 *
 * Calls marked "collective" must be made by every process of the
 * communicator given to icheck_init, in the same order.
 *
 * MPI programs include <mpi.h> before this header to get icheck_init;
 * programs without MPI use icheck_init_serial and need no MPI headers.
 */
#ifndef ICHECK_H
#define ICHECK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes. */
#define ICHECK_SUCCESS            0
#define ICHECK_ERR_NULL          (-1)  /* a required pointer argument is NULL */
#define ICHECK_ERR_ORDER         (-2)  /* call out of order (init first, restart before restore) */
#define ICHECK_ERR_ARG           (-3)  /* invalid type, mode, label or text */
#define ICHECK_ERR_CONFIG        (-4)  /* configuration file missing or invalid */
#define ICHECK_ERR_CONTROLLER    (-5)  /* controller unreachable or refused */
#define ICHECK_ERR_AGENT         (-6)  /* agent unreachable or failed */
#define ICHECK_ERR_FABRIC        (-7)  /* libfabric failure */
#define ICHECK_ERR_LABEL         (-8)  /* unknown label */
#define ICHECK_ERR_SIZE          (-9)  /* size differs from the checkpoint's */
#define ICHECK_ERR_TYPE          (-10) /* element type differs from the checkpoint's */
#define ICHECK_ERR_NO_CHECKPOINT (-11) /* no complete checkpoint exists */
#define ICHECK_ERR_CORRUPT       (-12) /* restored data fails its checksum */
#define ICHECK_ERR_INCOMPLETE    (-13) /* another process failed; version not complete */
#define ICHECK_ERR_RANKS         (-14) /* checkpoint written by another process count */
#define ICHECK_ERR_UNSUPPORTED   (-15) /* not supported */
#define ICHECK_ERR_INTERNAL      (-16) /* internal error (a bug) */
#define ICHECK_ERR_ADAPT         (-17) /* malleable label cannot be stored or restored as declared */
#define ICHECK_ERR_ACCESS        (-18) /* the application's capability cannot be read or kept */

/* Element types for icheck_add. ICHECK_LONG is a 64-bit integer. */
#define ICHECK_CHAR   1
#define ICHECK_INT    2
#define ICHECK_LONG   3
#define ICHECK_FLOAT  4
#define ICHECK_DOUBLE 5
#define ICHECK_BINARY 6

/* *status after icheck_init. */
#define ICHECK_FRESH   0 /* no checkpoint: start from the beginning */
#define ICHECK_RESTART 1 /* a complete checkpoint exists: icheck_restart fetches it */

/* icheck_finalize modes. */
#define IC_CLEANUP 0 /* delete the checkpoints */
#define IC_PERSIST 1 /* keep them in agent memory for the next run */

/* Hints for icheck_probe_agents. */
typedef struct icheck_hints {
    int remaining_commits; /* commits still expected (0 = unknown) */
} icheck_hints;

#if defined(MPI_VERSION) || defined(OMPI_MPI_H) || defined(MPICH)
/* Collective over comm. config may be NULL: then $ICHECK_CONFIG, else
 * /etc/icheck/icheck.toml. */
int icheck_init(const char *config, const char *app_name, MPI_Comm comm, int *status);
#endif
/* Fortran binding of icheck_init (communicator as a Fortran handle). */
int icheck_init_f(const char *config, const char *app_name, int fcomm, int *status);
/* For programs without MPI. */
int icheck_init_serial(const char *config, const char *app_name, int *status);
/* Adds (or replaces) a region of count elements of type; it must stay valid
 * until replaced or finalized. */
int icheck_add(const char *label, void *data, size_t count, int type);
/* Collective: checkpoints every added label as the next version. */
int icheck_commit(void);
/* Non-zero: icheck_commit returns once the data is staged. */
int icheck_enable_asynchronous(int flag);
/* Collective: completes an asynchronous commit. */
int icheck_wait(void);
/* Collective: prepares the restart from the newest complete version. */
int icheck_restart(void);
/* After icheck_restart: the element type (ICHECK_CHAR ... ICHECK_BINARY)
 * label has in the restarted version, or a negative error code. */
int icheck_label_type(const char *label);
/* Restores one label into data (count elements of the label's type). */
int icheck_restore(const char *label, void *data, size_t count);
/* Collective: restarts if needed and restores every added label. */
int icheck_restart_all(void);
/* Collective: moves to new agents if the controller placed new ones (the
 * next commit goes there; the newest version is already with them). hints
 * may be NULL. Returns 0 if nothing changed, else the new agent count. */
int icheck_probe_agents(const icheck_hints *hints);
/* Collective: the newest version whose copies or parity shards on other
 * checkpoint nodes are in place (0: none yet), written to *version. */
int icheck_protected_version(int64_t *version);
/* Collective: waits until version (or a newer one) is protected, at most
 * timeout_secs seconds; an error (icheck_last_error) says why it is not. */
int icheck_wait_protected(int64_t version, double timeout_secs);
/* Collective: IC_PERSIST or IC_CLEANUP. */
int icheck_finalize(int mode);
/*
 * Malleability: data that survives a change of the process count.
 *
 * A run with another process count than the version it restarts from (a
 * restart with M != N processes, or the processes of a communicator that
 * grew or shrank in the job) restores labels added with icheck_add_adapt
 * or icheck_add_adapt_global: each process receives exactly its part for
 * the new count, read from the agents that hold the old processes' data.
 * Labels added with icheck_add cannot be restored by another count.
 */

/* Attributes of replicated data (icheck_add_adapt). */
#define ICHECK_CONSTANT        1 /* the same everywhere: every process gets rank 0's value */
#define ICHECK_SIZE            2 /* restored as the current process count */
#define ICHECK_RANK            3 /* restored as the current rank */
#define ICHECK_DEFAULT         4 /* restored as *default_value in every element */
#define ICHECK_DEFAULT_JOINING 5 /* *default_value for processes that did not exist
                                    when the version was written; the others get theirs */
#define ICHECK_VOLATILE        6 /* recalculated by recalc(data, count, old_size,
                                    size, rank, arg) instead of read */

/* A VOLATILE label's recalculation. */
typedef void (*icheck_recalc_fn)(void *data, size_t count, int old_size, int size, int rank, void *arg);

/* Adds replicated data (count elements of type) with an attribute.
 * default_value points to one element (ICHECK_DEFAULT*, else NULL);
 * recalc and arg are for ICHECK_VOLATILE (else NULL). */
int icheck_add_adapt(const char *label, void *data, size_t count, int type, int attribute,
                     const void *default_value, icheck_recalc_fn recalc, void *arg);

/* Distributions of a 1-D array over the processes (icheck_add_adapt_global). */
#define ICHECK_BLOCK      1 /* contiguous near-equal parts; the first N mod P hold one more */
#define ICHECK_CYCLIC     2 /* blocks of `param` elements dealt round robin */
#define ICHECK_PREDEFINED 3 /* 2-D grids per process count, from an icheck_pmap */
#define ICHECK_MANUAL     4 /* the whole array goes to rank `param`; the others get nothing */

/* Processor mappings of a rows x cols array (row-major global index
 * i * cols + j), one 2-D process grid per supported process count; rank r
 * holds block (r / dims[1], r % dims[1]), cut like ICHECK_BLOCK along each
 * dimension and stored row-major. */
typedef struct icheck_pmap icheck_pmap;
icheck_pmap *icheck_pmap_create(int64_t rows, int64_t cols);
/* Adds the grid dims[0] x dims[1] for num_procs processes; global_count
 * must be rows * cols. */
int icheck_add_processor_mapping(int num_procs, const int dims[2], int64_t global_count, icheck_pmap *pmap);
void icheck_pmap_free(icheck_pmap *pmap);

/* Adds this process's part (local_count elements of type) of a distributed
 * 1-D array of global_count elements. param: the width for ICHECK_CYCLIC,
 * the root for ICHECK_MANUAL, else ignored; pmap for ICHECK_PREDEFINED
 * (copied; NULL otherwise). Every process must declare the same
 * global_count and distribution (the next commit checks). */
int icheck_add_adapt_global(const char *label, void *local, size_t local_count, int type,
                            int64_t global_count, int distribution, int64_t param, const icheck_pmap *pmap);
/* After icheck_restart: elements of label this process receives (>= 0),
 * or a negative error code. */
int64_t icheck_local_count(const char *label);
/* Collective: after the process count changed (the application committed
 * just before), restarts if not done yet and restores label into data
 * (count = icheck_local_count(label) elements). */
int icheck_redistribute(const char *label, void *data, size_t count);

/* A static description of a return code. */
const char *icheck_strerror(int code);
/* The detail of the last failure in this process, or NULL. */
const char *icheck_last_error(void);
/* ABI version: MAJOR * 10000 + MINOR * 100 + PATCH. */
int icheck_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* ICHECK_H */
