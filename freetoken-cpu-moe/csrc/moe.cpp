#include "moe.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "activation.h"
#include "aligned_buffer.h"
#include "fp_env.h"
#include "row_argmax.h"
#include "spin_pause.h"

namespace ft {
namespace {

struct Carve {
    size_t off = 0;
    size_t take(size_t n) {
        size_t o = off;
        off += (n + 63) & ~(size_t)63;
        return o;
    }
};

bool is_act_dtype(uint32_t f) { return f == FT_FMT_F32 || f == FT_FMT_F16 || f == FT_FMT_BF16; }

void load_row(uint32_t fmt, const void* src, float* dst, uint32_t n) {
    switch (fmt) {
        case FT_FMT_F32: std::memcpy(dst, src, (size_t)n * 4); break;
        case FT_FMT_F16: {
            const uint16_t* s = (const uint16_t*)src;
            for (uint32_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
            break;
        }
        case FT_FMT_BF16: {
            const uint16_t* s = (const uint16_t*)src;
            for (uint32_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
            break;
        }
        default: break;
    }
}

// dst[0..n) (format fmt) = src (+ dst if accumulate)
void store_row(uint32_t fmt, void* dst, const float* src, uint32_t n, bool accumulate) {
    switch (fmt) {
        case FT_FMT_F32: {
            float* d = (float*)dst;
            if (accumulate) for (uint32_t i = 0; i < n; ++i) d[i] += src[i];
            else std::memcpy(d, src, (size_t)n * 4);
            break;
        }
        case FT_FMT_F16: {
            uint16_t* d = (uint16_t*)dst;
            for (uint32_t i = 0; i < n; ++i) d[i] = float_to_half(src[i] + (accumulate ? half_to_float(d[i]) : 0.0f));
            break;
        }
        case FT_FMT_BF16: {
            uint16_t* d = (uint16_t*)dst;
            for (uint32_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i] + (accumulate ? bf16_to_float(d[i]) : 0.0f));
            break;
        }
        default: break;
    }
}

// Tokens per call from which linear_forward splits tokens instead of rows (the
// smallest count any tier's matrix path takes).
constexpr uint32_t kManyTokens = 8;

size_t dtype_size(uint32_t f) { return f == FT_FMT_F32 ? 4 : 2; }

uint32_t pick_chunk(uint32_t rows, int nthreads, uint32_t per_thread, uint32_t minimum) {
    uint32_t want = (rows + (uint32_t)nthreads * per_thread - 1) / ((uint32_t)nthreads * per_thread);
    want = std::max(want, minimum);
    want = (want + 7) & ~7u;
    return std::min(want, std::max(rows, 1u));
}

const char* fmt_name(uint32_t f) {
    switch (f) {
        case FT_FMT_F32: return "f32";
        case FT_FMT_F16: return "f16";
        case FT_FMT_BF16: return "bf16";
        case FT_FMT_Q8_0: return "q8_0";
        case FT_FMT_MXFP4: return "mxfp4";
        case FT_FMT_Q4_K: return "q4_k";
        case FT_FMT_Q5_K: return "q5_k";
        case FT_FMT_Q6_K: return "q6_k";
        case FT_FMT_FP8_E4M3_B128: return "fp8_e4m3_b128";
        default: return "unknown";
    }
}

struct Workspace {
    AlignedBuffer arena;
    std::vector<int32_t> slot_tok, slot_expert, expert_begin, expert_ids, count;
    std::vector<float> slot_w;
    std::vector<const void*> gptr, uptr, dptr, xptr;
    std::vector<RowBest> best;  // linear_forward's argmax: [row chunk][token]
};
thread_local Workspace tls_ws;

}  // namespace

void validate_weight(const ft_weight_desc& w, const char* name) {
    const std::string n(name);
    if (block_elems(w.format) == 0)
        throw BadTask(n + ": unsupported weight format id " + std::to_string(w.format));
    if (w.data == 0) throw BadTask(n + ": null data pointer");
    if (w.num_experts == 0 || w.rows == 0 || w.cols == 0) throw BadTask(n + ": empty shape");
    const uint32_t be = block_elems(w.format);
    if (w.cols % be)
        throw BadTask(n + ": cols=" + std::to_string(w.cols) + " is not a multiple of the " + fmt_name(w.format) +
                      " block size " + std::to_string(be));
    if (w.row_stride < row_bytes(w.format, w.cols)) throw BadTask(n + ": row_stride smaller than a row");
    if (w.num_experts > 1 && w.expert_stride < (uint64_t)w.rows * w.row_stride)
        throw BadTask(n + ": expert_stride smaller than one expert");
    if (w.format == FT_FMT_FP8_E4M3_B128 && w.scale == 0) throw BadTask(n + ": fp8_e4m3_b128 needs a scale pointer");
}

void validate_bank(const ft_expert_bank& b) {
    validate_weight(b.gate, "gate");
    validate_weight(b.up, "up");
    validate_weight(b.down, "down");
    const uint32_t E = b.num_experts, H = b.hidden, I = b.intermediate;
    auto shape = [&](const ft_weight_desc& w, const char* nm, uint32_t rows, uint32_t cols) {
        if (w.num_experts != E || w.rows != rows || w.cols != cols)
            throw BadTask(std::string("expert bank: ") + nm + " is [" + std::to_string(w.num_experts) + "][" +
                          std::to_string(w.rows) + "][" + std::to_string(w.cols) + "], expected [" +
                          std::to_string(E) + "][" + std::to_string(rows) + "][" + std::to_string(cols) + "]");
    };
    shape(b.gate, "gate", I, H);
    shape(b.up, "up", I, H);
    shape(b.down, "down", H, I);
    if (b.activation > FT_ACT_SWIGLU_OAI) throw BadTask("expert bank: unknown activation id " + std::to_string(b.activation));
}

void moe_forward(const MoeCall& c, Pool& pool, const KernelTable& k) {
    FlushDenormalsScope ftz;
    if (!c.bank) throw BadTask("moe: null expert bank");
    const ft_expert_bank& b = *c.bank;
    validate_bank(b);
    if (!is_act_dtype(c.x_fmt) || !is_act_dtype(c.y_fmt)) throw BadTask("moe: activations must be f32, f16 or bf16");
    const uint32_t T = c.T, K = c.K, H = b.hidden, I = b.intermediate, E = b.num_experts;
    if (T == 0) return;
    if (K == 0 || !c.x || !c.ids || !c.w || !c.y) throw BadTask("moe: null buffer or top_k == 0");

    Workspace& ws = tls_ws;
    // ---- routes: merge duplicates of a token, group by expert ----------------
    ws.count.assign(E, 0);
    std::vector<int32_t>& rt = ws.slot_expert;  // scratch: (e, t) pairs before sorting
    std::vector<float>& rw = ws.slot_w;
    rt.clear();
    rw.clear();
    std::vector<int32_t> rtok;
    rtok.reserve((size_t)T * K);
    for (uint32_t t = 0; t < T; ++t) {
        const size_t first = rt.size();
        for (uint32_t kk = 0; kk < K; ++kk) {
            const int32_t e = c.ids[(size_t)t * K + kk];
            if (e < 0) continue;
            if ((uint32_t)e >= E)
                throw BadTask("moe: expert id " + std::to_string(e) + " out of range [0, " + std::to_string(E) +
                              ") at token " + std::to_string(t));
            const float wt = c.w[(size_t)t * K + kk];
            bool merged = false;
            for (size_t q = first; q < rt.size(); ++q)
                if (rt[q] == e) { rw[q] += wt; merged = true; break; }
            if (!merged) {
                rt.push_back(e);
                rw.push_back(wt);
                rtok.push_back((int32_t)t);
                ws.count[e]++;
            }
        }
    }
    const uint32_t nslots = (uint32_t)rt.size();
    ws.expert_ids.clear();
    ws.expert_begin.clear();
    std::vector<int32_t> pos(E, 0);
    uint32_t acc = 0;
    for (uint32_t e = 0; e < E; ++e) {
        if (ws.count[e] == 0) continue;
        ws.expert_ids.push_back((int32_t)e);
        ws.expert_begin.push_back((int32_t)acc);
        pos[e] = (int32_t)acc;
        acc += ws.count[e];
    }
    ws.expert_begin.push_back((int32_t)acc);
    ws.slot_tok.assign(nslots, 0);
    std::vector<float> slot_w(nslots);
    for (uint32_t q = 0; q < nslots; ++q) {
        const int32_t s = pos[rt[q]]++;
        ws.slot_tok[s] = rtok[q];
        slot_w[s] = rw[q];
    }
    const uint32_t nexp = (uint32_t)ws.expert_ids.size();

    // ---- scratch layout -------------------------------------------------------
    const int nth = pool.num_threads();
    const ActKind kg = act_kind_for(b.gate.format), ku = act_kind_for(b.up.format), kd = act_kind_for(b.down.format);
    const size_t bg = act_bytes(kg, H), bu = act_bytes(ku, H), bd = act_bytes(kd, I);
    // Work items are long contiguous pieces of one matrix of one expert (the hardware
    // prefetchers stay locked on), at least ~4 per worker per phase.
    const uint32_t want = 4u * (uint32_t)nth;
    const uint32_t nexp_est = std::max<uint32_t>(nexp, 1u);
    const uint32_t pA = std::max<uint32_t>(1u, (want + 2 * nexp_est - 1) / (2 * nexp_est));
    const uint32_t pC = std::max<uint32_t>(1u, (want + nexp_est - 1) / nexp_est);
    const uint32_t chunkA = std::min(I, (((I + pA - 1) / pA) + 15) & ~15u);
    const uint32_t chunkC = std::min(H, (((H + pC - 1) / pC) + 15) & ~15u);
    const uint32_t piecesA = (I + chunkA - 1) / chunkA, piecesC = (H + chunkC - 1) / chunkC;
    const uint32_t chunkD = pick_chunk(H, nth, 4, 16);
    Carve cv;
    const size_t o_xf = cv.take((size_t)T * H * 4);
    const size_t o_xg = kg == ACT_F32 ? 0 : cv.take((size_t)T * bg);
    const size_t o_xu = (ku == ACT_F32 || ku == kg) ? 0 : cv.take((size_t)T * bu);
    const size_t o_h = cv.take((size_t)nslots * I * 4);
    const size_t o_u = cv.take((size_t)nslots * I * 4);
    const size_t o_hq = kd == ACT_F32 ? 0 : cv.take((size_t)nslots * bd);
    const size_t o_y = cv.take((size_t)T * H * 4);
    const size_t o_d = cv.take((size_t)nslots * H * 4);
    uint8_t* base = ws.arena.reserve(cv.off);
    float* xf = (float*)(base + o_xf);
    uint8_t* xg = base + o_xg;
    uint8_t* xu = ku == kg ? xg : base + o_xu;
    float* h = (float*)(base + o_h);
    float* u = (float*)(base + o_u);
    uint8_t* hq = base + o_hq;
    float* yacc = (float*)(base + o_y);
    float* dsl = (float*)(base + o_d);

    // ---- prepare the routed tokens' activations ------------------------------
    std::vector<uint8_t> routed(T, 0);
    for (uint32_t s = 0; s < nslots; ++s) routed[ws.slot_tok[s]] = 1;
    const size_t xsz = dtype_size(c.x_fmt);
    pool.parallel_for((int)T, [&](int t, int) {
        if (!routed[t]) return;
        float* xr = xf + (size_t)t * H;
        load_row(c.x_fmt, (const uint8_t*)c.x + (size_t)t * H * xsz, xr, H);
        if (kg != ACT_F32) k.prepare(kg, xr, H, xg + (size_t)t * bg);
        if (ku != ACT_F32 && ku != kg) k.prepare(ku, xr, H, xu + (size_t)t * bu);
    });
    ws.gptr.resize(nslots);
    ws.uptr.resize(nslots);
    ws.dptr.resize(nslots);
    for (uint32_t s = 0; s < nslots; ++s) {
        const uint32_t t = ws.slot_tok[s];
        ws.gptr[s] = kg == ACT_F32 ? (const void*)(xf + (size_t)t * H) : (const void*)(xg + (size_t)t * bg);
        ws.uptr[s] = ku == ACT_F32 ? (const void*)(xf + (size_t)t * H) : (const void*)(xu + (size_t)t * bu);
        ws.dptr[s] = kd == ACT_F32 ? (const void*)(h + (size_t)s * I) : (const void*)(hq + (size_t)s * bd);
    }
    ActParams ap;
    ap.kind = b.activation;
    ap.alpha = b.act_alpha;
    ap.limit = b.act_limit;

    // ---- one wake-up, two phases ---------------------------------------------
    // 1: items [0, itemsA): gate or up rows of one expert, (expert, matrix, piece of I),
    //    in expert order. The worker that finishes an expert's last gate/up item computes
    //    h = act(gate, up) for its slots and prepares it for the down format (B).
    //    Items [itemsA, itemsA + itemsC): down rows of one expert, (expert, piece of H),
    //    into per-slot rows (C); each waits for its expert's h. They are handed out after
    //    every gate/up item, so the experts finished early are computed while the last
    //    gate/up items run, and no worker waits at a barrier for the slowest one.
    // 2: y = sum of w x per-slot rows, items = row chunks of H (disjoint rows of y) (D)
    const int itemsA = (int)(nexp * 2 * piecesA);
    const int itemsC = (int)(nexp * piecesC);
    const int itemsD = (int)((H + chunkD - 1) / chunkD);
    const size_t ysz = dtype_size(c.y_fmt);
    // per expert: gate/up items still to finish; h state (0 pending, 1 ready, 2 failed)
    std::unique_ptr<std::atomic<uint32_t>[]> pend_a(new std::atomic<uint32_t>[nexp]);
    std::unique_ptr<std::atomic<uint32_t>[]> h_state(new std::atomic<uint32_t>[nexp]);
    for (uint32_t q = 0; q < nexp; ++q) {
        pend_a[q].store(2 * piecesA, std::memory_order_relaxed);
        h_state[q].store(0, std::memory_order_relaxed);
    }
    std::vector<Pool::Phase> phases(2);
    phases[0].nitems = itemsA + itemsC;
    phases[0].fn = [&](int it, int) {
        if (it < itemsA) {
            const uint32_t q = (uint32_t)it / (2 * piecesA), m = ((uint32_t)it / piecesA) % 2, piece = (uint32_t)it % piecesA;
            const uint32_t r0 = piece * chunkA, r1 = std::min(I, r0 + chunkA);
            const uint32_t e = ws.expert_ids[q], sb = ws.expert_begin[q], n = ws.expert_begin[q + 1] - sb;
            try {
                if (m == 0) k.dot_rows(b.gate, e, r0, r1, ws.gptr.data() + sb, n, h + (size_t)sb * I + r0, I);
                else k.dot_rows(b.up, e, r0, r1, ws.uptr.data() + sb, n, u + (size_t)sb * I + r0, I);
                if (pend_a[q].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
                for (uint32_t s = sb; s < sb + n; ++s) {
                    float* hr = h + (size_t)s * I;
                    apply_activation(ap, hr, hr, u + (size_t)s * I, I);
                    if (kd != ACT_F32) k.prepare(kd, hr, I, hq + (size_t)s * bd);
                }
            } catch (...) {
                h_state[q].store(2, std::memory_order_release);  // the down items of q give up
                throw;
            }
            h_state[q].store(1, std::memory_order_release);
            return;
        }
        const uint32_t ic = (uint32_t)(it - itemsA);
        const uint32_t q = ic / piecesC, piece = ic % piecesC;
        uint32_t st, spins = 0;
        while ((st = h_state[q].load(std::memory_order_acquire)) == 0) {
            cpu_pause();
            if ((++spins & 63) == 0) std::this_thread::yield();
        }
        if (st != 1) throw std::runtime_error("moe: the gate/up pass of an expert failed");
        const uint32_t r0 = piece * chunkC, r1 = std::min(H, r0 + chunkC);
        const uint32_t e = ws.expert_ids[q], sb = ws.expert_begin[q], n = ws.expert_begin[q + 1] - sb;
        k.dot_rows(b.down, e, r0, r1, ws.dptr.data() + sb, n, dsl + (size_t)sb * H + r0, H);
    };
    phases[1].nitems = itemsD;
    phases[1].fn = [&](int it, int) {
        const uint32_t r0 = (uint32_t)it * chunkD, r1 = std::min(H, r0 + chunkD), rl = r1 - r0;
        for (uint32_t t = 0; t < T; ++t) std::memset(yacc + (size_t)t * H + r0, 0, (size_t)rl * 4);
        for (uint32_t s = 0; s < nslots; ++s) {
            float* yr = yacc + (size_t)ws.slot_tok[s] * H + r0;
            const float wt = slot_w[s];
            const float* dr = dsl + (size_t)s * H + r0;
            for (uint32_t r = 0; r < rl; ++r) yr[r] += wt * dr[r];
        }
        for (uint32_t t = 0; t < T; ++t)
            store_row(c.y_fmt, (uint8_t*)c.y + ((size_t)t * H + r0) * ysz, yacc + (size_t)t * H + r0, rl, c.accumulate);
    };
    pool.run_phases(phases);
}

void linear_forward(const ft_weight_desc& w, const void* x, uint32_t x_fmt, uint32_t T, void* y, uint32_t y_fmt,
                    bool accumulate, Pool& pool, const KernelTable& k, int64_t* argmax) {
    FlushDenormalsScope ftz;
    validate_weight(w, "weights");
    if (!is_act_dtype(x_fmt) || !is_act_dtype(y_fmt)) throw BadTask("linear: activations must be f32, f16 or bf16");
    if (argmax && accumulate) throw BadTask("linear: argmax of an accumulated output");
    if (T == 0) return;
    if (!x || (!y && !argmax)) throw BadTask("linear: null buffer");
    const uint32_t R = w.rows, C = w.cols;
    const int nth = pool.num_threads();
    const ActKind kx = act_kind_for(w.format);
    const size_t bx = act_bytes(kx, C);
    Workspace& ws = tls_ws;
    Carve cv;
    const size_t o_xf = cv.take((size_t)T * C * 4);
    const size_t o_xq = kx == ACT_F32 ? 0 : cv.take((size_t)T * bx);
    const size_t o_y = cv.take((size_t)T * R * 4);
    uint8_t* base = ws.arena.reserve(cv.off);
    float* xf = (float*)(base + o_xf);
    uint8_t* xq = base + o_xq;
    float* yacc = (float*)(base + o_y);
    const size_t xsz = dtype_size(x_fmt), ysz = dtype_size(y_fmt);
    pool.parallel_for((int)T, [&](int t, int) {
        float* xr = xf + (size_t)t * C;
        load_row(x_fmt, (const uint8_t*)x + (size_t)t * C * xsz, xr, C);
        if (kx != ACT_F32) k.prepare(kx, xr, C, xq + (size_t)t * bx);
    });
    ws.xptr.resize(T);
    for (uint32_t t = 0; t < T; ++t)
        ws.xptr[t] = kx == ACT_F32 ? (const void*)(xf + (size_t)t * C) : (const void*)(xq + (size_t)t * bx);
    // Few tokens: short row chunks, all tokens (the weights are read once per call).
    // Many tokens (prefill): the kernels' matrix path packs the tokens of a call once,
    // so calls get long row chunks (multiples of its 16-row tiles, at least 128 rows)
    // and the tokens are split instead, in groups of whole 16-token tiles with the
    // remainder in the last group (every group keeps >= 16 tokens, so each token takes
    // the same kernel path whatever the number of workers).
    uint32_t chunk = pick_chunk(R, nth, 8, 16), tchunk = T, tgroups = 1;
    if (T >= kManyTokens) {
        const uint32_t row_items = std::max(1u, std::min((R + 127) / 128, 4u * (uint32_t)nth));
        chunk = std::min(R, (((R + row_items - 1) / row_items) + 15) & ~15u);
        const uint32_t nrow = (R + chunk - 1) / chunk;
        const uint32_t want_t = std::max(1u, (4u * (uint32_t)nth + nrow - 1) / nrow);
        tchunk = std::max(16u, ((T + want_t - 1) / want_t + 15) & ~15u);
        tgroups = std::max(1u, T / tchunk);
    }
    const uint32_t nrow = (R + chunk - 1) / chunk;
    const int items = (int)(nrow * tgroups);
    if (argmax) ws.best.resize((size_t)nrow * T);
    RowBest* best = ws.best.data();
    pool.parallel_for(items, [&](int it, int) {
        const uint32_t rc = (uint32_t)it % nrow, tg = (uint32_t)it / nrow;
        const uint32_t r0 = rc * chunk, r1 = std::min(R, r0 + chunk);
        const uint32_t t0 = tg * tchunk, t1 = tg + 1 == tgroups ? T : t0 + tchunk;
        k.dot_rows(w, 0, r0, r1, ws.xptr.data() + t0, t1 - t0, yacc + (size_t)t0 * R + r0, R);
        for (uint32_t t = t0; t < t1; ++t) {
            float* acc = yacc + (size_t)t * R + r0;
            if (y) store_row(y_fmt, (uint8_t*)y + ((size_t)t * R + r0) * ysz, acc, r1 - r0, accumulate);
            if (!argmax) continue;
            // compare the values as y holds them
            if (y_fmt == FT_FMT_BF16)
                for (uint32_t r = 0; r < r1 - r0; ++r) acc[r] = bf16_to_float(float_to_bf16(acc[r]));
            else if (y_fmt == FT_FMT_F16)
                for (uint32_t r = 0; r < r1 - r0; ++r) acc[r] = half_to_float(float_to_half(acc[r]));
            best[(size_t)rc * T + t] = row_best(acc, r1 - r0, r0);
        }
    });
    if (!argmax) return;
    for (uint32_t t = 0; t < T; ++t) {
        RowBest b = best[t];
        for (uint32_t rc = 1; rc < nrow; ++rc) b = row_best_merge(b, best[(size_t)rc * T + t]);
        argmax[t] = b.index;
    }
}

void run_task(const ft_task_desc* d, Pool& pool, const KernelTable& k) {
    FlushDenormalsScope ftz;
    if (!d) throw BadTask("task: null descriptor address");
    if (d->abi_version != FT_HANDOFF_ABI_VERSION)
        throw BadTask("task: abi_version " + std::to_string(d->abi_version) + " != " +
                      std::to_string(FT_HANDOFF_ABI_VERSION) + " (freetoken-core and freetoken-cpu-moe disagree)");
    if (!d->bank) throw BadTask("task: descriptor has no expert bank (desc.bank == 0)");
    const ft_expert_bank* b = (const ft_expert_bank*)(uintptr_t)d->bank;
    if (d->num_tokens > d->max_tokens)
        throw BadTask("task: num_tokens " + std::to_string(d->num_tokens) + " > max_tokens " +
                      std::to_string(d->max_tokens));
    if (d->hidden != b->hidden)
        throw BadTask("task: hidden " + std::to_string(d->hidden) + " != bank hidden " + std::to_string(b->hidden));
    if (d->flags & ~(uint32_t)FT_TASK_ACCUMULATE) throw BadTask("task: unknown flags " + std::to_string(d->flags));
    if (!is_act_dtype(d->act_dtype) || !is_act_dtype(d->out_dtype))
        throw BadTask("task: act_dtype/out_dtype must be FT_FMT_F32, F16 or BF16");
    if (d->top_k == 0) throw BadTask("task: top_k == 0");
    MoeCall c;
    c.bank = b;
    c.x = (const void*)(uintptr_t)d->x;
    c.x_fmt = d->act_dtype;
    c.ids = (const int32_t*)(uintptr_t)d->ids;
    c.w = (const float*)(uintptr_t)d->w;
    c.T = d->num_tokens;
    c.K = d->top_k;
    c.y = (void*)(uintptr_t)d->y;
    c.y_fmt = d->out_dtype;
    c.accumulate = (d->flags & FT_TASK_ACCUMULATE) != 0;
    moe_forward(c, pool, k);
}

}  // namespace ft
