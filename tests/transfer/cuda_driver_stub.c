/* A stand-in for the few CUDA driver calls `transfer_engine.cuda_ipc.CudaDriver` makes, with
   the driver API's own signatures (an IPC handle passed by value, device pointers as 64-bit
   integers, out-parameters by pointer), so that the ctypes marshaling of the real calls runs
   on a machine without libcuda. It moves no memory. */
#include <stddef.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { unsigned char bytes[16]; } CUuuid;

enum { INVALID_VALUE = 1, INVALID_HANDLE = 400 };
static const CUdeviceptr OPENED = 0x7e0000000000ULL;
static CUipcMemHandle exported;

CUresult cuInit(unsigned int flags) { return flags == 0 ? 0 : INVALID_VALUE; }

CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return 0; }

CUresult cuDevicePrimaryCtxRetain(void **context, CUdevice device) {
    *context = (void *)(size_t)(0x1000 + device);
    return 0;
}

CUresult cuCtxSetCurrent(void *context) { return context ? 0 : INVALID_VALUE; }

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) {
    for (int i = 0; i < 16; i++) uuid->bytes[i] = (unsigned char)(16 * device + i);
    return 0;
}

/* Allocations here are 1 MiB each, aligned. */
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr pointer) {
    *base = pointer & ~((CUdeviceptr)0xFFFFF);
    *size = 0x100000;
    return 0;
}

/* A handle with zero bytes in it, the first among them, as real handles have. */
CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr base) {
    for (int i = 0; i < 64; i++)
        handle->reserved[i] = (char)(i % 3 == 0 ? 0 : (base >> (8 * (i % 8))) + i);
    exported = *handle;
    return 0;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pointer, CUipcMemHandle handle, unsigned int flags) {
    if (flags != 1) return INVALID_VALUE;  /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
    if (memcmp(&handle, &exported, sizeof handle) != 0) return INVALID_HANDLE;
    *pointer = OPENED;
    return 0;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr pointer) {
    return pointer == OPENED ? 0 : INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    *text = error == INVALID_HANDLE ? "invalid resource handle" : "invalid argument";
    return 0;
}
