/* See shim.h: one forwarding function per `static inline` libfabric call. */
#include "shim.h"
#include <rdma/fi_errno.h>
#include <stdlib.h>
#include <string.h>

uint32_t icheck_fi_header_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
int icheck_fi_eagain(void) { return FI_EAGAIN; }
int icheck_fi_eavail(void) { return FI_EAVAIL; }
char *icheck_strdup(const char *s) { return strdup(s); }
int icheck_fi_manual_data_progress(const struct fi_domain_attr *attr) {
    return attr->data_progress == FI_PROGRESS_MANUAL;
}

int icheck_fi_close(struct fid *fid) { return fi_close(fid); }
int icheck_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
                     struct fid_domain **domain, void *context)
{ return fi_domain(fabric, info, domain, context); }
int icheck_fi_endpoint(struct fid_domain *domain, struct fi_info *info,
                       struct fid_ep **ep, void *context)
{ return fi_endpoint(domain, info, ep, context); }
int icheck_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
                      struct fid_cq **cq, void *context)
{ return fi_cq_open(domain, attr, cq, context); }
int icheck_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
                      struct fid_av **av, void *context)
{ return fi_av_open(domain, attr, av, context); }
int icheck_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags)
{ return fi_ep_bind(ep, bfid, flags); }
int icheck_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int icheck_fi_getname(struct fid *fid, void *addr, size_t *addrlen)
{ return fi_getname(fid, addr, addrlen); }
int icheck_fi_av_insert(struct fid_av *av, const void *addr, size_t count,
                        fi_addr_t *fi_addr, uint64_t flags, void *context)
{ return fi_av_insert(av, addr, count, fi_addr, flags, context); }
int icheck_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count,
                        uint64_t flags)
{ return fi_av_remove(av, fi_addr, count, flags); }
const char *icheck_fi_av_straddr(struct fid_av *av, const void *addr, char *buf,
                                 size_t *len)
{ return fi_av_straddr(av, addr, buf, len); }

int icheck_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len,
                     uint64_t access, uint64_t offset, uint64_t requested_key,
                     uint64_t flags, struct fid_mr **mr, void *context)
{ return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags, mr, context); }
int icheck_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags)
{ return fi_mr_bind(mr, bfid, flags); }
int icheck_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
void *icheck_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t icheck_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }

ssize_t icheck_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc,
                       fi_addr_t src_addr, uint64_t addr, uint64_t key,
                       void *context)
{ return fi_read(ep, buf, len, desc, src_addr, addr, key, context); }
ssize_t icheck_fi_write(struct fid_ep *ep, const void *buf, size_t len,
                        void *desc, fi_addr_t dest_addr, uint64_t addr,
                        uint64_t key, void *context)
{ return fi_write(ep, buf, len, desc, dest_addr, addr, key, context); }
ssize_t icheck_fi_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
                          uint64_t flags)
{ return fi_readmsg(ep, msg, flags); }
ssize_t icheck_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
                           uint64_t flags)
{ return fi_writemsg(ep, msg, flags); }

ssize_t icheck_fi_cq_read(struct fid_cq *cq, void *buf, size_t count)
{ return fi_cq_read(cq, buf, count); }
ssize_t icheck_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf,
                             uint64_t flags)
{ return fi_cq_readerr(cq, buf, flags); }
const char *icheck_fi_cq_strerror(struct fid_cq *cq, int prov_errno,
                                  const void *err_data, char *buf, size_t len)
{ return fi_cq_strerror(cq, prov_errno, err_data, buf, len); }
