// cuda_runtime.h (emulator shim): the runtime API the backend calls, on host memory.
// "Device" memory is host memory from malloc (exactly the size asked, so that AddressSanitizer
// sees any access past it); streams run synchronously; a captured stream records its
// launches and copies into a graph that cudaGraphLaunch replays.
#pragma once

#include "cuemu.h"

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchFailure = 719,
    cudaErrorUnknown = 999,
} cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};
enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
};
enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00

typedef struct cuemu_event *cudaEvent_t;
typedef struct cuemu_graph *cudaGraph_t;
typedef struct cuemu_graph *cudaGraphExec_t;
typedef struct cuemu_graph_node *cudaGraphNode_t;

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem, sharedMemPerBlock, sharedMemPerBlockOptin, sharedMemPerMultiprocessor;
    int major, minor, multiProcessorCount, warpSize_, maxThreadsPerBlock, l2CacheSize;
    int memoryBusWidth, memoryClockRate, clockRate;
};

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaMalloc(void **p, size_t n);
template <class T> static inline cudaError_t cudaMalloc(T **p, size_t n) { return cudaMalloc((void **) p, n); }
cudaError_t cudaFree(void *p);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st = 0);
cudaError_t cudaMemset(void *d, int v, size_t n);
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st = 0);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode m);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaFuncSetAttributeImpl(const void *fn, cudaFuncAttribute a, int v);

// what the backend asks of a function: the architecture its code was compiled for (the
// emulator runs the kernels' sm_90 code: __CUDA_ARCH__ 900)
struct cudaFuncAttributes {
    size_t sharedSizeBytes, constSizeBytes, localSizeBytes;
    int maxThreadsPerBlock, numRegs, ptxVersion, binaryVersion, cacheModeCA;
    int maxDynamicSharedSizeBytes, preferredShmemCarveout;
};
cudaError_t cudaFuncGetAttributesImpl(cudaFuncAttributes *a, const void *fn);
template <class F> static inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, F *fn)
{
    return cudaFuncGetAttributesImpl(a, (const void *) fn);
}

// cudaLaunchKernelEx with its launch attributes: programmatic stream serialization is
// emulated (its contract checked: cuemu.cc pdl_check); any other attribute is refused.
enum cudaLaunchAttributeID {
    cudaLaunchAttributeIgnore = 0,
    cudaLaunchAttributeProgrammaticStreamSerialization = 5,
};
union cudaLaunchAttributeValue {
    char pad[64];
    int programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
    cudaLaunchAttributeID id;
    char pad[8 - sizeof(cudaLaunchAttributeID)];
    cudaLaunchAttributeValue val;
};
typedef struct cudaLaunchConfig_st {
    dim3 gridDim, blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;
cudaError_t cuemu_launch_attr_refused(int id);
template <class... P, class... A>
static inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t *cfg, void (*k)(P...),
                                             A &&...args)
{
    unsigned flags = 0;
    const char *name = cuemu::take_launch_name();
    for (unsigned i = 0; i < cfg->numAttrs; i++) {
        if (cfg->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization) {
            if (cfg->attrs[i].val.programmaticStreamSerializationAllowed)
                flags |= cuemu::LAUNCH_PDL;
        } else if (cfg->attrs[i].id != cudaLaunchAttributeIgnore) {
            return cuemu_launch_attr_refused((int) cfg->attrs[i].id);
        }
    }
    return cuemu::launch_ex(name, k, cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes,
                            cfg->stream, flags, std::forward<A>(args)...) < 0
               ? cudaErrorInvalidConfiguration
               : cudaSuccess;
}
template <class F> static inline cudaError_t cudaFuncSetAttribute(F *fn, cudaFuncAttribute a, int v)
{
    return cudaFuncSetAttributeImpl((const void *) fn, a, v);
}
