#include "aligned_buffer.h"

#include <cstdlib>
#include <new>

namespace ft {

AlignedBuffer::~AlignedBuffer() { std::free(p_); }

uint8_t* AlignedBuffer::reserve(size_t n) {
    if (n > cap_) {
        std::free(p_);
        p_ = nullptr;
        cap_ = 0;
        const size_t cap = (n + 4095) & ~(size_t)4095;  // whole pages, a multiple of the alignment
        p_ = static_cast<uint8_t*>(std::aligned_alloc(64, cap));
        if (!p_) throw std::bad_alloc();
        cap_ = cap;
    }
    return p_;
}

}  // namespace ft
