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
/* Restores one label into data (count elements of the label's type). */
int icheck_restore(const char *label, void *data, size_t count);
/* Collective: restarts if needed and restores every added label. */
int icheck_restart_all(void);
/* Collective: moves to new agents if the controller placed new ones (the
 * next commit goes there; the newest version is already with them). hints
 * may be NULL. Returns 0 if nothing changed, else the new agent count. */
int icheck_probe_agents(const icheck_hints *hints);
/* Collective: IC_PERSIST or IC_CLEANUP. */
int icheck_finalize(int mode);
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
