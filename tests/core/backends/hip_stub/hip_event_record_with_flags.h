/* Declares what HIP runtimes newer than Debian's 5.2 provide for recording an event as a
 * node of a captured graph, so the event-ordered copy path of freetoken-rocm compiles
 * against the 5.2 headers (-include this file, -DFT_HIP_EVENT_RECORD_WITH_FLAGS=1).
 * The object it gives references hipEventRecordWithFlags; it does not load on HIP 5.2. */
#ifndef FREETOKEN_TEST_HIP_EVENT_RECORD_WITH_FLAGS_H
#define FREETOKEN_TEST_HIP_EVENT_RECORD_WITH_FLAGS_H
#include <hip/hip_runtime_api.h>
#ifndef hipEventRecordExternal
#define hipEventRecordExternal 0x1
#endif
extern "C" hipError_t hipEventRecordWithFlags(hipEvent_t event, hipStream_t stream, unsigned int flags);
#endif
