/*
 * icheck_mpi.c: the MPI side of libicheck, compiled with the user's own
 * mpicc by `make install` (into libicheck_mpi.a), so libicheck itself links
 * no MPI library and assumes no MPI implementation's ABI.
 *
 * icheck_init duplicates the application's communicator, learns the node
 * layout, and hands libicheck a table of collective operations
 * (icheck_comm_ops) that it calls back; libicheck frees the table's context
 * through ops.destroy at icheck_finalize.
 */
#include <mpi.h>
#include <icheck.h>

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

/* Must match IcheckCommOps in icheck-ffi/src/comm.rs. */
typedef struct icheck_comm_ops {
    void *ctx;
    int rank, size, node_rank, node_index, nodes, max_per_node;
    int (*barrier)(void *ctx, int node_only);
    int (*allreduce_u64)(void *ctx, uint64_t *value, int op, int node_only); /* op: 0 sum, 1 min, 2 max */
    int (*bcast)(void *ctx, void *buf, size_t len, int node_only);           /* from rank 0 of the group */
    int (*allgather)(void *ctx, const void *send, size_t len, void *recv, int node_only);
    void (*destroy)(void *ctx);
} icheck_comm_ops;

int icheck_init_with_ops(const char *config, const char *app_name, const icheck_comm_ops *ops, int *status);

struct ctx {
    MPI_Comm comm, node;
};

static MPI_Comm pick(void *ctx, int node_only)
{
    struct ctx *c = ctx;
    return node_only ? c->node : c->comm;
}

static int ick_barrier(void *ctx, int node_only) { return MPI_Barrier(pick(ctx, node_only)); }

static int ick_allreduce_u64(void *ctx, uint64_t *value, int op, int node_only)
{
    MPI_Op mop = op == 0 ? MPI_SUM : op == 1 ? MPI_MIN : MPI_MAX;
    return MPI_Allreduce(MPI_IN_PLACE, value, 1, MPI_UINT64_T, mop, pick(ctx, node_only));
}

static int ick_bcast(void *ctx, void *buf, size_t len, int node_only)
{
    if (len > INT_MAX) return MPI_ERR_COUNT;
    return MPI_Bcast(buf, (int)len, MPI_BYTE, 0, pick(ctx, node_only));
}

static int ick_allgather(void *ctx, const void *send, size_t len, void *recv, int node_only)
{
    if (len > INT_MAX) return MPI_ERR_COUNT;
    return MPI_Allgather(send, (int)len, MPI_BYTE, recv, (int)len, MPI_BYTE, pick(ctx, node_only));
}

static void ick_destroy(void *ctx)
{
    struct ctx *c = ctx;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        MPI_Comm_free(&c->node);
        MPI_Comm_free(&c->comm);
    }
    free(c);
}

int icheck_init(const char *config, const char *app_name, MPI_Comm comm, int *status)
{
    struct ctx *c = malloc(sizeof *c);
    if (!c) return ICHECK_ERR_INTERNAL;
    if (MPI_Comm_dup(comm, &c->comm) != MPI_SUCCESS) {
        free(c);
        return ICHECK_ERR_ARG;
    }
    icheck_comm_ops ops = {0};
    MPI_Comm_rank(c->comm, &ops.rank);
    MPI_Comm_size(c->comm, &ops.size);
    MPI_Comm_split_type(c->comm, MPI_COMM_TYPE_SHARED, ops.rank, MPI_INFO_NULL, &c->node);
    int node_size;
    MPI_Comm_rank(c->node, &ops.node_rank);
    MPI_Comm_size(c->node, &node_size);
    int leader = ops.node_rank == 0;
    MPI_Allreduce(&leader, &ops.nodes, 1, MPI_INT, MPI_SUM, c->comm);
    MPI_Allreduce(&node_size, &ops.max_per_node, 1, MPI_INT, MPI_MAX, c->comm);
    /* Leaders number the nodes by their rank among leaders. */
    MPI_Comm leaders;
    MPI_Comm_split(c->comm, leader ? 0 : MPI_UNDEFINED, ops.rank, &leaders);
    ops.node_index = 0;
    if (leaders != MPI_COMM_NULL) {
        MPI_Comm_rank(leaders, &ops.node_index);
        MPI_Comm_free(&leaders);
    }
    MPI_Bcast(&ops.node_index, 1, MPI_INT, 0, c->node);
    ops.ctx = c;
    ops.barrier = ick_barrier;
    ops.allreduce_u64 = ick_allreduce_u64;
    ops.bcast = ick_bcast;
    ops.allgather = ick_allgather;
    ops.destroy = ick_destroy;
    /* libicheck owns the context from here (also when it fails). */
    return icheck_init_with_ops(config, app_name, &ops, status);
}

int icheck_init_f(const char *config, const char *app_name, int fcomm, int *status)
{
    return icheck_init(config, app_name, MPI_Comm_f2c((MPI_Fint)fcomm), status);
}
