// absl-tune.cc - the one C++ file of the coordinator: runtime settings of the
// Abseil library that gRPC core runs on, exposed to C (coord.c).
//
// Debian's Abseil is built without NDEBUG, so absl::Mutex tracks lock ordering for
// deadlock detection on every lock (GraphCycles: stack traces, a global graph),
// which gRPC takes many times per call and per message. That is a debugging aid;
// a production daemon turns it off (the release builds of Abseil have it off).
#include <absl/synchronization/mutex.h>

extern "C" void coord_absl_tune(void)
{
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}
