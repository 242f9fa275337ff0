// Fake CUDA devices for a CPU-only torch build, for the rehearsal only (gspo_mcore/rehearsal/device.py
// builds and loads it; nothing else does). FakeTensorMode makes device="cuda" tensors on its own, but
// a CPU build has no CUDA device guard (the first autograd op aborts in c10's getDeviceGuardImpl) and
// its CUDA hooks say "not built" (backward's at::accelerator::getAccelerator refuses). This registers
// c10's own FakeGuardImpl for CUDA (eight devices) and hooks that say built and available, under the
// registry key torch looks up ("CUDAHooks", at::detail::getCUDAHooks). No memory is ever allocated
// on these devices: only fake tensors live there.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};

}  // namespace

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
