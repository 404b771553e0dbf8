"""Sorts the samples of a system-wide `perf record` of an icheck job into
what the CPUs did: move bytes, checksum them, wait (polls and yields), run
libfabric's and icheck's own code, or the application's computation.

Usage: python3 perf_categories.py perf.data
Thread names decide the side (icheck-agent-*, icheck-fabric-progress,
icheck-prepare, the application's own threads); symbol names decide the
kind of work. The application's computation and idle time are listed but
left out of the shares.
"""
import collections
import re
import subprocess
import sys

APPLICATION_THREADS = ("mpi_checkpoint",)
MOVING = re.compile(
    r"copy|memmove|memcpy|tcp_|skb|process_vm|get_user_pages|follow_page|gup_|folio|pte|ip_|"
    r"__dev_queue|loopback|net_rx|napi|sock_|inet_|release_sock|lock_sock|clear_page|page_fault|"
    r"do_fault|shmem|filemap|mod_node_page_state|vm_normal_page|try_grab|unpin_user|"
    r"_raw_spin_unlock_irqrestore"
)
WAITING = re.compile(
    r"sched_yield|__schedule|^schedule$|finish_task_switch|pthread_spin|do_syscall_64|entry_SYSCALL|"
    r"exit_to_user|rseq|syscall_return|x64_sys_call|irqentry|ompi_|opal_|mca_"
)


def category(comm: str, sym: str) -> str:
    if comm == "swapper":
        return "idle"
    if comm in APPLICATION_THREADS and ("fill_bytes" in sym or "memmove" in sym):
        return "application computing"
    if comm.startswith("icheck-prepare"):
        return "agent: backing a new version's file (tmpfs zeroes pages)"
    if "crc" in sym.lower():
        return "checksums (rank, per 4 MiB chunk and 1 MiB block)"
    if comm.startswith(("icheck-agent", "icheck-fabric")) or comm in APPLICATION_THREADS:
        if MOVING.search(sym):
            return "moving the bytes (copies, kernel TCP, page pinning)"
        if WAITING.search(sym):
            return "waiting: polls and yields (progress threads, MPI)"
        return "libfabric's and icheck's own code"
    if comm.startswith(("tokio", "icheck")):
        return "daemons: control plane"
    return "other processes"


def main() -> None:
    report = subprocess.run(
        ["perf", "report", "-i", sys.argv[1], "--sort", "comm,dso,sym", "--stdio", "--percent-limit", "0.005"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shares: collections.Counter = collections.Counter()
    for line in report.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+(.{15,16}?)\s+(\S+)\s+\[(.)\]\s+(.*)", line)
        if m:
            shares[category(m.group(2).strip(), m.group(5).strip())] += float(m.group(1))
    outside = ("idle", "application computing")
    total = sum(v for k, v in shares.items() if k not in outside)
    print("| what the CPUs did | share of the service's and library's CPU time |")
    print("|---|---:|")
    for name, value in shares.most_common():
        share = f"{100 * value / total:.1f}%" if name not in outside and total else f"({value:.1f}% of all samples)"
        print(f"| {name} | {share} |")


if __name__ == "__main__":
    main()
