// hgrt's step loop in native code: a run's kernels called one after another without Python.
//
// A run is a fixed list of steps (a function and its bound arguments). Called from Python,
// each step takes the GIL back between kernels; with two or more threads running modules at
// once they queue for it after every kernel, and a woken waiter pays the wake-up of a sleeping
// core (tens of microseconds on a VM). Here the whole list is one call that holds no GIL.
//
// hgrt.steps.make(funcs, args, solo, pool_mode, cpus) -> a function
//   `run(step, pos, tensor, ...)`: funcs[i](*args[i]) for every step, in order; each
//   (step, pos, tensor) triple puts `tensor` in place of argument `pos` of step `step` for this
//   run only (a caller's own buffers). A step marked solo runs on its caller's thread alone
//   (runtime.config_threadpool(pool_mode, 1, cpus), then back), as threads.solo does. One run
//   at a time per list: the caller's frame or claim.
// hgrt.steps.failed() -> the index of the step that raised in this thread's last failed run,
//   once (-1: none, or the run failed before its first step, on a bad override).
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <utility>
#include <vector>

namespace hgrt_steps {

namespace ffi = tvm::ffi;

thread_local int64_t failed_step = -1;

struct Step {
  ffi::Function func;
  std::vector<ffi::Any> args;
  std::vector<ffi::AnyView> views;  // args as views: what CallPacked takes
  bool solo;
};

class StepList {
 public:
  StepList(const ffi::Array<ffi::Function>& funcs, const ffi::Array<ffi::Array<ffi::Any>>& args,
           const ffi::Array<int64_t>& solo, int pool_mode, ffi::Array<ffi::String> cpus)
      : pool_mode_(pool_mode), cpus_(std::move(cpus)) {
    if (funcs.size() != args.size() || funcs.size() != solo.size()) {
      TVM_FFI_THROW(ValueError) << "hgrt.steps.make: " << funcs.size() << " functions, "
                                << args.size() << " argument lists, " << solo.size()
                                << " solo flags";
    }
    steps_.reserve(funcs.size());
    for (size_t i = 0; i < funcs.size(); ++i) {
      Step s{funcs[i], {}, {}, solo[i] != 0};
      for (const ffi::Any& a : args[i]) s.args.push_back(a);
      for (const ffi::Any& a : s.args) s.views.emplace_back(a);
      any_solo_ = any_solo_ || s.solo;
      steps_.push_back(std::move(s));
    }
    if (any_solo_) {
      config_ = ffi::Function::GetGlobalRequired("runtime.config_threadpool");
      num_threads_ = ffi::Function::GetGlobalRequired("runtime.NumThreads");
    }
  }

  void Run(ffi::PackedArgs overrides) {
    failed_step = -1;  // a bad override fails before any step: no step to name
    if (overrides.size() % 3 != 0) {
      TVM_FFI_THROW(ValueError) << "hgrt.steps: overrides come as (step, pos, tensor) triples";
    }
    // put the caller's tensors in; the guard puts the bound ones back, whatever happens
    std::vector<std::pair<ffi::AnyView*, ffi::AnyView>> saved;
    saved.reserve(overrides.size() / 3);
    struct Restore {
      std::vector<std::pair<ffi::AnyView*, ffi::AnyView>>& saved;
      ~Restore() {  // newest first: a slot overridden twice gets its own tensor back
        for (auto it = saved.rbegin(); it != saved.rend(); ++it) *it->first = it->second;
      }
    } restore{saved};
    for (int i = 0; i < overrides.size(); i += 3) {
      int64_t si = overrides[i].cast<int64_t>(), pos = overrides[i + 1].cast<int64_t>();
      if (si < 0 || si >= static_cast<int64_t>(steps_.size()) || pos < 0 ||
          pos >= static_cast<int64_t>(steps_[si].views.size())) {
        TVM_FFI_THROW(IndexError) << "hgrt.steps: no argument " << pos << " of step " << si;
      }
      ffi::AnyView* slot = &steps_[si].views[pos];
      saved.emplace_back(slot, *slot);
      *slot = overrides[i + 2];
    }
    int share = any_solo_ ? num_threads_().cast<int>() : 1;
    size_t i = 0;
    try {
      ffi::Any rv;
      for (; i < steps_.size(); ++i) {
        Step& s = steps_[i];
        Alone alone(this, s.solo && share > 1 ? share : 0);
        s.func.CallPacked(s.views.data(), static_cast<int32_t>(s.views.size()), &rv);
      }
    } catch (...) {
      failed_step = static_cast<int64_t>(i);
      throw;
    }
  }

 private:
  // A solo step's scope: the calling thread's pool at one thread, then back at `share`
  // (0: nothing to do). Putting it back never throws while a kernel's error unwinds.
  struct Alone {
    StepList* self;
    int share;
    Alone(StepList* list, int back) : self(list), share(back) {
      if (share) self->SetThreads(1);
    }
    ~Alone() {
      try {
        if (share) self->SetThreads(share);
      } catch (...) {  // (the kernel's own error is the one reported)
      }
    }
  };

  void SetThreads(int n) { config_(pool_mode_, n, cpus_); }

  std::vector<Step> steps_;
  int pool_mode_;  // how runtime.config_threadpool places the pool's threads (threads.py)
  ffi::Array<ffi::String> cpus_;
  ffi::Function config_, num_threads_;
  bool any_solo_ = false;
};

}  // namespace hgrt_steps

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using namespace hgrt_steps;
  refl::GlobalDef()
      .def("hgrt.steps.make",
           [](ffi::Array<ffi::Function> funcs, ffi::Array<ffi::Array<ffi::Any>> args,
              ffi::Array<int64_t> solo, int pool_mode, ffi::Array<ffi::String> cpus) {
             auto list =
                 std::make_shared<StepList>(funcs, args, solo, pool_mode, std::move(cpus));
             return ffi::Function::FromPacked(
                 [list](ffi::PackedArgs a, ffi::Any*) { list->Run(a); });
           })
      .def("hgrt.steps.failed", []() {
        int64_t step = failed_step;  // read once: a later failure elsewhere names no stale step
        failed_step = -1;
        return step;
      });
}
