// Growable 64-byte aligned scratch memory, kept by one thread for one use (a kernel's
// activation tiles, a MoE call's carved workspace). Its functions are defined in
// aligned_buffer.cpp, compiled with the baseline flags: the ISA tiers all use this one
// copy instead of inline copies built with different instruction sets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ft {

class AlignedBuffer {
public:
    AlignedBuffer() = default;
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
    ~AlignedBuffer();
    // At least n bytes, 64-byte aligned; earlier contents are not kept when it grows.
    uint8_t* reserve(size_t n);

private:
    uint8_t* p_ = nullptr;
    size_t cap_ = 0;
};

}  // namespace ft
