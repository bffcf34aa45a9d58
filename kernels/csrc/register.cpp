// fasttrain._C: the operator schemas of the native backend and the Python module that loads them.
//
// kernels/noise.py, kernels/diffusion_loss.py and kernels/mixed_loss.py wrap these in their torch.library
// custom ops (fasttrain::noise, fasttrain::diffusion_loss, fasttrain::mixed_loss), which own the autograd
// rules and the fake (meta) implementations for every backend; these operators are their native
// kernels, dispatched on the device of the inputs:
// the CPU implementations (cpu/ops.cpp, cpu/mixed_ops.cpp) always, the CUDA ones (cuda/ops.cpp) when
// nvcc was found. mixed_loss has no CUDA kernel: on GPUs the Triton kernel (kernels/triton_mixed_loss.py)
// is the fused path.
// Only this file includes torch/library.h (the slowest header to compile).
// `bins` is mutated in place (the per-timestep statistics, kernels/bins.py), hence Tensor(a!).
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "cpu/kernels.h"
#include "ops.h"

TORCH_LIBRARY(fasttrain_C, m) {
  // Noise options: (spec, table, rows, mean, std), kernels/noise_spec.py (an empty spec: the plain stream);
  // loss shapes: (loss, huber_c), kernels/loss_shape.py; the loss's per-pixel weight: mask
  // (kernels/diffusion_loss.py); their defaults are the plain kernels.
  m.def(
      "noise(Tensor x0, Tensor t, Tensor alpha, Tensor sigma, Tensor? eps, int seed, Tensor offset, "
      "ScalarType out_dtype, bool write_eps, int[] spec=[], Tensor? table=None, Tensor? rows=None, Tensor? mean=None, "
      "Tensor? std=None) -> (Tensor, Tensor)");
  // The pyramid noise's unbiased global std (float32 0-d), before the noise op (noise_spec.noise_std).
  m.def(
      "noise_std(Tensor x0, int seed, Tensor offset, int[] spec, Tensor? table, Tensor? rows, Tensor? mean) "
      "-> Tensor");
  m.def(
      "loss(Tensor pred, Tensor x0, Tensor t, Tensor weight, Tensor iw, Tensor coef, Tensor pivots, "
      "Tensor(a!) bins, Tensor? eps, int seed, Tensor offset, int needs, int[] spec=[], Tensor? table=None, "
      "Tensor? rows=None, Tensor? mean=None, Tensor? std=None, int loss=0, Tensor? huber_c=None, Tensor? mask=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // (mean, per-sample, raw, weighted, x0_error [B, H], grad of out, grad of gate [B, H] or empty):
  // kernels/torch_ref_mixed_loss.loss_and_grad, with bins of 2 + H values.
  m.def(
      "mixed_loss(Tensor out, Tensor x0, Tensor t, Tensor weight, Tensor iw, Tensor tab, Tensor? gate, "
      "Tensor pivots, Tensor(a!) bins, Tensor? eps, int seed, Tensor offset, int[] spec=[], Tensor? table=None, "
      "Tensor? rows=None, Tensor? mean=None, Tensor? std=None, int loss=0, Tensor? huber_c=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("has_cuda() -> bool", []() -> bool {
#if defined(FT_WITH_CUDA)
    return true;
#else
    return false;
#endif
  });
  // Philox words 0 and 1 of counters offset .. offset + n - 1 on the CPU, int64 [2, n]: the tests
  // compare them bit for bit with kernels/philox.py.
  m.def("philox_words(int seed, int offset, int n) -> Tensor", &fasttrain::cpu::philox_words);
  // The CPU kernel set in use (default, avx2, avx512); a non-empty request switches to it (tests).
  m.def("cpu_capability(str request='') -> str",
        [](std::string request) -> std::string { return fasttrain::cpu::set_capability(request); });
}

TORCH_LIBRARY_IMPL(fasttrain_C, CPU, m) {
  m.impl("noise", &fasttrain::cpu::noise);
  m.impl("noise_std", &fasttrain::cpu::noise_std);
  m.impl("loss", &fasttrain::cpu::loss);
  m.impl("mixed_loss", &fasttrain::cpu::mixed_loss);
}

#if defined(FT_WITH_CUDA)
TORCH_LIBRARY_IMPL(fasttrain_C, CUDA, m) {
  m.impl("noise", &fasttrain::cuda::noise);
  m.impl("noise_std", &fasttrain::cuda::noise_std);
  m.impl("loss", &fasttrain::cuda::loss);
}
#endif

// A Python extension module only so that `import fasttrain._C` loads the library (and with it the
// registrations above); the operators are reached through torch.ops.fasttrain_C.
static PyModuleDef fasttrain_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                         "fasttrain native ops: torch.ops.fasttrain_C.{noise,noise_std,loss,mixed_loss}", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&fasttrain_c_module); }
