/*
 * FreeToken shared C layouts: the GPU/CPU hand-off flag slot, the task descriptor
 * and the expert-bank descriptors.
 *
 * This header is the single definition of every layout that crosses between the
 * native packages (freetoken-cpu-moe, freetoken-cuda, freetoken-rocm). It is shipped
 * by freetoken-core and found with `freetoken.get_include()`. Its Python mirror is
 * `freetoken.handoff`; a test compiles this header and compares every size and offset.
 *
 * Plain C (C99 / C++17 / CUDA / HIP): fixed-width integers only, no pointers in the
 * structs (addresses are uint64_t so the layout is identical on host and device and
 * in Python), explicit padding.
 *
 * Hand-off protocol on one flag slot (one slot per (layer, batch-size) task):
 *   GPU:  writes inputs, fences at system scope, writes ready = 1
 *   CPU:  sees ready == 1 (acquire), writes ready = 0, computes, writes y,
 *         release-stores done = 1
 *   GPU:  waits done == 1, reads y, writes done = 0 (in either order: the CPU
 *         writes y again only after the next ready)
 * The watchdog, on a task not served in time, writes err != 0 and release-stores
 * done = 1, so the GPU side never hangs; the host side then raises.
 */
#ifndef FREETOKEN_HANDOFF_H
#define FREETOKEN_HANDOFF_H

#include <stdint.h>

#define FT_HANDOFF_ABI_VERSION 1u

/* ---- flag slot: one 64-byte cache line ------------------------------------- */
typedef struct ft_flag_slot {
    uint64_t ready;   /* offset  0: GPU -> CPU, 1 = inputs published              */
    uint64_t done;    /* offset  8: CPU -> GPU, 1 = y written (or err set)        */
    uint64_t err;     /* offset 16: 0 = ok, else an FT_ERR_* code                 */
    uint64_t seq;     /* offset 24: hand-offs served on this slot (CPU counts)    */
    /* Diagnostic GPU clock stamps (KernelIO kernels only; CUDA: %globaltimer ns, HIP:
     * shader clock ticks), read by the coordinator's stage trace; nothing else uses them. */
    uint64_t gpu_ready_ns;      /* offset 32: publish kernel, just before its fence      */
    uint64_t gpu_done_seen_ns;  /* offset 40: combine kernel, when it saw done           */
    uint64_t gpu_y_read_ns;     /* offset 48: combine kernel, y read and added           */
    uint64_t gpu_publish_start_ns; /* offset 56: publish kernel entry                   */
} ft_flag_slot;

#define FT_FLAG_SLOT_SIZE 64u
#define FT_FLAG_READY_OFFSET 0u
#define FT_FLAG_DONE_OFFSET 8u
#define FT_FLAG_ERR_OFFSET 16u
#define FT_FLAG_SEQ_OFFSET 24u
#define FT_FLAG_GPU_READY_NS_OFFSET 32u
#define FT_FLAG_GPU_DONE_SEEN_NS_OFFSET 40u
#define FT_FLAG_GPU_Y_READ_NS_OFFSET 48u
#define FT_FLAG_GPU_PUBLISH_START_NS_OFFSET 56u

/* err codes */
#define FT_ERR_NONE 0u
#define FT_ERR_WATCHDOG 1u      /* task not served within the watchdog bound */
#define FT_ERR_BAD_TASK 2u      /* descriptor failed validation on the CPU  */
#define FT_ERR_CPU_EXCEPTION 3u /* the CPU compute raised                   */

/* ---- element / weight formats ---------------------------------------------
 * GGUF block formats keep their ggml type ids so a GGUF tensor's type can be
 * passed through unchanged. */
#define FT_FMT_F32 0u
#define FT_FMT_F16 1u
#define FT_FMT_Q8_0 8u
#define FT_FMT_Q4_K 12u
#define FT_FMT_Q5_K 13u
#define FT_FMT_Q6_K 14u
#define FT_FMT_BF16 30u
#define FT_FMT_MXFP4 39u         /* ggml block_mxfp4: E8M0 exponent + 32 E2M1 codes (17 bytes) */
#define FT_FMT_FP8_E4M3_B128 100u /* E4M3 weights + float32 128x128 block scales (weight_scale_inv) */
#define FT_FMT_I32 200u           /* route ids */

/* ---- activations ---------------------------------------------------------- */
#define FT_ACT_SILU 0u       /* SwiGLU: silu(gate) * up                         */
#define FT_ACT_GELU_TANH 1u  /* GeGLU with the tanh approximation               */
#define FT_ACT_SWIGLU_OAI 2u /* GPT-OSS: clamp, gate*sigmoid(alpha*gate)*(up+1) */

/* ---- one weight matrix per expert, stacked over experts -------------------
 * Logical shape [num_experts][rows][cols] (y = W x, x has cols elements).
 * Row r of expert e starts at data + e*expert_stride + r*row_stride bytes. For
 * block formats a row is cols/block_elems blocks in the file's own layout.
 * FP8_E4M3_B128: scale points to float32 [num_experts][ceil(rows/128)][ceil(cols/128)]
 * with expert stride scale_expert_stride bytes (weight = fp8 * scale).        */
typedef struct ft_weight_desc {
    uint64_t data;                /* offset  0 */
    uint64_t scale;               /* offset  8: 0 unless FP8_E4M3_B128 */
    uint64_t expert_stride;       /* offset 16: bytes between experts */
    uint64_t row_stride;          /* offset 24: bytes between rows */
    uint64_t scale_expert_stride; /* offset 32: bytes */
    uint32_t format;              /* offset 40: FT_FMT_* */
    uint32_t num_experts;         /* offset 44 */
    uint32_t rows;                /* offset 48 */
    uint32_t cols;                /* offset 52 */
    uint32_t pad[2];              /* offset 56 */
} ft_weight_desc;                 /* 64 bytes */

/* ---- an expert bank: the routed experts of one MoE layer ------------------ */
typedef struct ft_expert_bank {
    ft_weight_desc gate;    /* offset   0: [E][I][H] */
    ft_weight_desc up;      /* offset  64: [E][I][H] */
    ft_weight_desc down;    /* offset 128: [E][H][I] */
    uint32_t num_experts;   /* offset 192 */
    uint32_t hidden;        /* offset 196: H */
    uint32_t intermediate;  /* offset 200: I */
    uint32_t activation;    /* offset 204: FT_ACT_* */
    float act_alpha;        /* offset 208: SWIGLU_OAI alpha (1.702) */
    float act_limit;        /* offset 212: SWIGLU_OAI clamp limit (7.0) */
    uint32_t pad[10];       /* offset 216 */
} ft_expert_bank;           /* 256 bytes */

/* ---- a task: one (layer, batch-size slot) with stable buffers --------------
 * x[max_tokens][hidden] in act_dtype, ids int32 [max_tokens][top_k] (-1 = the
 * route is served on the GPU), w float32 [max_tokens][top_k],
 * y[max_tokens][hidden] in out_dtype. num_tokens is the live batch; the GPU may
 * rewrite it before raising ready (buffers live in pinned/mapped host memory). */
typedef struct ft_task_desc {
    uint32_t abi_version;   /* offset  0: FT_HANDOFF_ABI_VERSION */
    uint32_t layer;         /* offset  4 */
    uint32_t slot;          /* offset  8: batch-size slot index */
    uint32_t max_tokens;    /* offset 12 */
    uint32_t num_tokens;    /* offset 16 */
    uint32_t top_k;         /* offset 20 */
    uint32_t hidden;        /* offset 24 */
    uint32_t act_dtype;     /* offset 28: FT_FMT_F32 / F16 / BF16 */
    uint32_t out_dtype;     /* offset 32: FT_FMT_F32 / F16 / BF16 */
    uint32_t flags;         /* offset 36: FT_TASK_* */
    uint64_t x;             /* offset 40 */
    uint64_t ids;           /* offset 48 */
    uint64_t w;             /* offset 56 */
    uint64_t y;             /* offset 64 */
    uint64_t flag_slot;     /* offset 72: address of this task's ft_flag_slot */
    uint64_t bank;          /* offset 80: address of the layer's ft_expert_bank */
    uint64_t pad[5];        /* offset 88 */
} ft_task_desc;             /* 128 bytes */

#define FT_TASK_ACCUMULATE 1u /* y += result instead of y = result */

#ifdef __cplusplus
static_assert(sizeof(ft_flag_slot) == FT_FLAG_SLOT_SIZE, "ft_flag_slot layout");
static_assert(sizeof(ft_weight_desc) == 64, "ft_weight_desc layout");
static_assert(sizeof(ft_expert_bank) == 256, "ft_expert_bank layout");
static_assert(sizeof(ft_task_desc) == 128, "ft_task_desc layout");
#endif

#endif /* FREETOKEN_HANDOFF_H */
