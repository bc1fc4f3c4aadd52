// Make one thread's CPUID instruction report fewer vector extensions than the CPU has, so a
// library that picks its kernels from CPUID at load (onnxruntime's MLAS) picks the ones of a
// narrower ISA. Benchmarks only: python/cpuid_cap.py compiles and drives it.
//
// Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, 0) makes CPUID raise SIGSEGV in the
// calling thread and in threads it creates afterwards. The handler below runs the real CPUID
// with faulting lifted for a moment, clears the masked feature bits, writes the four registers
// and steps over the two-byte instruction. Any other SIGSEGV goes to the handler that was
// installed before (TVM's backtrace printer, or the default).
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction previous;
// bits to clear: leaf 7 subleaf 0 EBX, ECX, EDX; leaf 7 subleaf 1 EAX
static unsigned mask7b, mask7c, mask7d, mask71a;

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
  if (leaf == 7 && sub == 0) {
    b &= ~mask7b;
    c &= ~mask7c;
    d &= ~mask7d;
  } else if (leaf == 7 && sub == 1) {
    a &= ~mask71a;
  }
  r[REG_RAX] = a;
  r[REG_RBX] = b;
  r[REG_RCX] = c;
  r[REG_RDX] = d;
  r[REG_RIP] += 2;
}

// Fault CPUID in the calling thread (and the threads it creates from now on), clearing these
// bits. 0 on success, else the errno of the failed call (EINVAL/ENODEV: no CPUID faulting).
int cpuid_cap_begin(unsigned leaf7_ebx, unsigned leaf7_ecx, unsigned leaf7_edx,
                    unsigned leaf7_1_eax) {
  mask7b = leaf7_ebx;
  mask7c = leaf7_ecx;
  mask7d = leaf7_edx;
  mask71a = leaf7_1_eax;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  struct sigaction before;
  if (sigaction(SIGSEGV, &sa, &before) != 0) return -1;
  if (before.sa_sigaction != on_segv) previous = before;
  return syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) == 0 ? 0 : -2;
}

// CPUID runs unfaulted again in the calling thread.
int cpuid_cap_end(void) { return (int)syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1); }

// What CPUID leaf 7 says in EBX to the calling thread now (for checking the cap).
unsigned cpuid_leaf7_ebx(void) {
  unsigned a, b, c, d;
  __cpuid_count(7, 0, a, b, c, d);
  return b;
}
