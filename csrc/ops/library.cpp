// The adaattn op namespace. Each family (ops/<family>/) adds its schemas with
// TORCH_LIBRARY_FRAGMENT beside its checks, autograd and CPU registration.
#include <torch/library.h>

TORCH_LIBRARY(adaattn, m) {}
