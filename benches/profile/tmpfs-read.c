/* How fast a process reads a file of the agents' store (tmpfs, 4 KiB pages)
 * into memory it has touched, against a memcpy of the same 256 MiB: pread in
 * 256 KiB pieces (what `restore = auto` does), mmap with MAP_POPULATE then
 * memcpy, and a faulting mmap then memcpy. Five rounds.
 *
 *   gcc -O2 -o /tmp/tmpfs-read benches/profile/tmpfs-read.c && /tmp/tmpfs-read
 *
 * Writes and removes /dev/shm/rdtest, or the file named as the argument
 * (on a tmpfs mounted with huge=within_size, say). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t len=256ul<<20; const char*path=argc>1?argv[1]:"/dev/shm/rdtest";
  int fd=open(path,O_RDWR|O_CREAT|O_TRUNC,0600); ftruncate(fd,len);
  char*w=mmap(0,len,PROT_READ|PROT_WRITE,MAP_SHARED,fd,0); for(size_t i=0;i<len;i+=64) w[i]=(char)i; munmap(w,len);
  char*out=aligned_alloc(4096,len); memset(out,1,len);
  for(int r=0;r<5;r++){
    double t=now(); size_t piece=256<<10;
    for(size_t o=0;o<len;o+=piece) pread(fd,out+o,piece,o);
    double a=now()-t;
    t=now(); char*m=mmap(0,len,PROT_READ,MAP_SHARED|MAP_POPULATE,fd,0); double p=now()-t;
    for(size_t o=0;o<len;o+=piece) memcpy(out+o,m+o,piece);
    double b=now()-t; munmap(m,len); double c=now()-t;
    t=now(); char*m2=mmap(0,len,PROT_READ,MAP_SHARED,fd,0);
    for(size_t o=0;o<len;o+=piece) memcpy(out+o,m2+o,piece);
    double d=now()-t; munmap(m2,len);
    t=now(); char*src=aligned_alloc(4096,len); memset(src,2,len); memcpy(out,src,len); double e0=now(); memcpy(out,src,len); double e=now()-e0; free(src);
    printf("pread %.1f ms | mmap populate %.1f + memcpy = %.1f ms (with munmap %.1f) | mmap faulting+memcpy %.1f ms | memcpy %.1f ms\n",a*1e3,p*1e3,b*1e3,c*1e3,d*1e3,e*1e3);
  }
  unlink(path); return 0;}
