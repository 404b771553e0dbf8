/*
 * Real symbols for libfabric's `static inline` calls.
 *
 * libfabric implements most of its API as `static inline` functions that jump
 * through the provider's ops tables; they have no symbol in libfabric.so, so
 * Rust cannot call them directly. Each `icheck_*` function below forwards to
 * the inline call of the same name. Only calls that exist unchanged in both
 * libfabric 1.17 and 2.x are wrapped.
 */
#ifndef ICHECK_LIBFABRIC_SHIM_H
#define ICHECK_LIBFABRIC_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>

/* The API version this crate was compiled against (FI_VERSION of the headers). */
uint32_t icheck_fi_header_version(void);
/* Errno-style constants that are macros of macros in fi_errno.h. */
int icheck_fi_eagain(void);
int icheck_fi_eavail(void);
/* strdup, for hint strings that fi_freeinfo will free(). */
char *icheck_strdup(const char *s);
/* Whether a domain moves data only inside the application's calls
 * (FI_PROGRESS_MANUAL). The field sits in an anonymous union in 2.x, which
 * bindgen names differently; in C it is `data_progress` in both. */
int icheck_fi_manual_data_progress(const struct fi_domain_attr *attr);

int icheck_fi_close(struct fid *fid);
int icheck_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
                     struct fid_domain **domain, void *context);
int icheck_fi_endpoint(struct fid_domain *domain, struct fi_info *info,
                       struct fid_ep **ep, void *context);
int icheck_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
                      struct fid_cq **cq, void *context);
int icheck_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
                      struct fid_av **av, void *context);
int icheck_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int icheck_fi_enable(struct fid_ep *ep);
int icheck_fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int icheck_fi_av_insert(struct fid_av *av, const void *addr, size_t count,
                        fi_addr_t *fi_addr, uint64_t flags, void *context);
int icheck_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count,
                        uint64_t flags);
const char *icheck_fi_av_straddr(struct fid_av *av, const void *addr, char *buf,
                                 size_t *len);

int icheck_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len,
                     uint64_t access, uint64_t offset, uint64_t requested_key,
                     uint64_t flags, struct fid_mr **mr, void *context);
int icheck_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int icheck_fi_mr_enable(struct fid_mr *mr);
void *icheck_fi_mr_desc(struct fid_mr *mr);
uint64_t icheck_fi_mr_key(struct fid_mr *mr);

ssize_t icheck_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc,
                       fi_addr_t src_addr, uint64_t addr, uint64_t key,
                       void *context);
ssize_t icheck_fi_write(struct fid_ep *ep, const void *buf, size_t len,
                        void *desc, fi_addr_t dest_addr, uint64_t addr,
                        uint64_t key, void *context);
ssize_t icheck_fi_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
                          uint64_t flags);
ssize_t icheck_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
                           uint64_t flags);

ssize_t icheck_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t icheck_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf,
                             uint64_t flags);
const char *icheck_fi_cq_strerror(struct fid_cq *cq, int prov_errno,
                                  const void *err_data, char *buf, size_t len);

#endif
