// Make one thread's CPUID instruction report fewer vector extensions than the CPU has, so a
// library that picks its kernels from CPUID at load (onnxruntime's MLAS) picks the ones of a
// narrower ISA. Benchmarks only: python/cpuid_cap.py compiles and drives it.
//
// Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, 0) makes CPUID raise SIGSEGV in the
// calling thread and in threads it creates afterwards. The handler below runs the real CPUID
// with faulting lifted for a moment, clears the masked feature bits, writes the four registers
// and steps over the two-byte instruction. Any other SIGSEGV goes to the handler that was
// installed before (TVM's backtrace printer, or the default).
//
// Where the CPU has no CPUID faulting (AMD hosts, most VMs on them), cpuid_cap.py patches a copy
// of onnxruntime's library instead: each CPUID and XGETBV instruction becomes an INT3 (padded
// with NOPs), and the SIGTRAP handler below runs the real instruction for it, clearing the same
// leaf-7 bits and, from XCR0, the AVX-512 and AMX state (an AVX2-only OS enables neither).
// Other leaves pass through as the CPU answers them. Under gdb, pass SIGTRAP to the process
// (`handle SIGTRAP nostop noprint pass`): a debugger that swallows it skips the instruction.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction previous;
// bits to clear: leaf 7 subleaf 0 EBX, ECX, EDX; leaf 7 subleaf 1 EAX
static unsigned mask7b, mask7c, mask7d, mask71a;

static void clear_masked(unsigned leaf, unsigned sub, unsigned *a, unsigned *b, unsigned *c,
                         unsigned *d) {
  if (leaf == 7 && sub == 0) {
    *b &= ~mask7b;
    *c &= ~mask7c;
    *d &= ~mask7d;
  } else if (leaf == 7 && sub == 1) {
    *a &= ~mask71a;
  }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
  (void)sig;
  (void)info;
  greg_t *r = ((ucontext_t *)context)->uc_mcontext.gregs;
  const unsigned char *ip = (const unsigned char *)r[REG_RIP];
  if (ip[0] != 0x0f || ip[1] != 0xa2) {  // not CPUID: the earlier handler takes it
    sigaction(SIGSEGV, &previous, NULL);
    return;  // the instruction faults again, now into that handler
  }
  unsigned leaf = (unsigned)r[REG_RAX], sub = (unsigned)r[REG_RCX], a, b, c, d;
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
  __cpuid_count(leaf, sub, a, b, c, d);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
  clear_masked(leaf, sub, &a, &b, &c, &d);
  r[REG_RAX] = a;
  r[REG_RBX] = b;
  r[REG_RCX] = c;
  r[REG_RDX] = d;
  r[REG_RIP] += 2;
}

// `handler` for `sig`; what was there before kept in `previous` (unless it was `handler`).
static int install(int sig, void (*handler)(int, siginfo_t *, void *),
                   struct sigaction *previous_out) {
  struct sigaction sa, before;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  if (sigaction(sig, &sa, &before) != 0) return -1;
  if (before.sa_sigaction != handler) *previous_out = before;
  return 0;
}

// Fault CPUID in the calling thread (and the threads it creates from now on), clearing these
// bits. 0 on success, else the errno of the failed call (EINVAL/ENODEV: no CPUID faulting).
int cpuid_cap_begin(unsigned leaf7_ebx, unsigned leaf7_ecx, unsigned leaf7_edx,
                    unsigned leaf7_1_eax) {
  mask7b = leaf7_ebx;
  mask7c = leaf7_ecx;
  mask7d = leaf7_edx;
  mask71a = leaf7_1_eax;
  if (install(SIGSEGV, on_segv, &previous) != 0) return -1;
  if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {  // no faulting: handler back
    sigaction(SIGSEGV, &previous, NULL);
    return -2;
  }
  return 0;
}

// CPUID runs unfaulted again in the calling thread.
int cpuid_cap_end(void) { return (int)syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1); }

// What CPUID leaf 7 says in EBX to the calling thread now (for checking the cap).
unsigned cpuid_leaf7_ebx(void) {
  unsigned a, b, c, d;
  __cpuid_count(7, 0, a, b, c, d);
  return b;
}

// ---- the patched-library cap (no CPUID faulting) ----
#define MAX_SITES 512
enum { SITE_CPUID = 0, SITE_XGETBV = 1 };
static uint64_t xcr0_mask;
static unsigned long site_at[MAX_SITES];  // addresses in the library's own (objdump's) terms
static unsigned char site_kind[MAX_SITES];
static int n_sites;
static char library_tag[256];  // a part of the patched library's path no other library has
static struct sigaction previous_trap;
static volatile long trap_hits;

// Which patched instruction the INT3 at `at` stands for, or -1 when it is not one of ours.
static int site_kind_at(unsigned long at) {
  Dl_info dl;
  struct link_map *map = NULL;
  // dladdr1 is not async-signal-safe on paper; the traps come from ordinary code, not from
  // other signal handlers, and the loader's lock it takes is recursive (traps inside dlopen)
  if (!dladdr1((void *)at, &dl, (void **)&map, RTLD_DL_LINKMAP) || map == NULL ||
      dl.dli_fname == NULL || strstr(dl.dli_fname, library_tag) == NULL)
    return -1;
  unsigned long in_library = at - (unsigned long)map->l_addr;  // the load bias taken off
  for (int i = 0; i < n_sites; i++)
    if (site_at[i] == in_library) return site_kind[i];
  return -1;
}

// A SIGTRAP that is not ours goes where it would have gone without this handler, which stays.
static void pass_on(int sig, siginfo_t *info, void *context) {
  if (previous_trap.sa_flags & SA_SIGINFO) {
    previous_trap.sa_sigaction(sig, info, context);
  } else if (previous_trap.sa_handler == SIG_IGN) {
    return;
  } else if (previous_trap.sa_handler != SIG_DFL) {
    previous_trap.sa_handler(sig);
  } else {  // the default action: end the process as a SIGTRAP would have
    signal(sig, SIG_DFL);
    raise(sig);
  }
}

static void on_trap(int sig, siginfo_t *info, void *context) {
  greg_t *r = ((ucontext_t *)context)->uc_mcontext.gregs;
  unsigned long at = (unsigned long)r[REG_RIP] - 1;  // the INT3 that trapped
  int kind = info->si_code == SI_KERNEL ? site_kind_at(at) : -1;
  if (kind < 0) {
    pass_on(sig, info, context);
    return;
  }
  __sync_fetch_and_add(&trap_hits, 1);
  if (kind == SITE_CPUID) {
    unsigned leaf = (unsigned)r[REG_RAX], sub = (unsigned)r[REG_RCX], a, b, c, d;
    __cpuid_count(leaf, sub, a, b, c, d);
    clear_masked(leaf, sub, &a, &b, &c, &d);
    r[REG_RAX] = a;
    r[REG_RBX] = b;
    r[REG_RCX] = c;
    r[REG_RDX] = d;
    r[REG_RIP] = (greg_t)(at + 2);
  } else {
    unsigned lo, hi, which = (unsigned)r[REG_RCX];
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(which));
    uint64_t v = (uint64_t)hi << 32 | lo;
    if (which == 0) v &= ~xcr0_mask;
    r[REG_RAX] = (uint32_t)v;
    r[REG_RDX] = (uint32_t)(v >> 32);
    r[REG_RIP] = (greg_t)(at + 3);
  }
}

// Answer the INT3s at these addresses (in objdump's terms; kind 0: a CPUID, 2 bytes; 1: an
// XGETBV, 3 bytes) of the library whose path contains `tag`, process-wide, with the bits given
// cleared. 0 on success.
int cpuid_trap_begin(unsigned leaf7_ebx, unsigned leaf7_ecx, unsigned leaf7_edx,
                     unsigned leaf7_1_eax, unsigned long long xcr0, const unsigned long *at,
                     const unsigned char *kind, int n, const char *tag) {
  if (n < 0 || n > MAX_SITES || strlen(tag) == 0 || strlen(tag) >= sizeof library_tag)
    return -1;
  mask7b = leaf7_ebx;
  mask7c = leaf7_ecx;
  mask7d = leaf7_edx;
  mask71a = leaf7_1_eax;
  xcr0_mask = xcr0;
  memcpy(site_at, at, (size_t)n * sizeof *at);
  memcpy(site_kind, kind, (size_t)n);
  n_sites = n;
  strcpy(library_tag, tag);
  return install(SIGTRAP, on_trap, &previous_trap) != 0 ? -2 : 0;
}

// How many patched instructions have been answered so far.
long cpuid_trap_hits(void) { return trap_hits; }
