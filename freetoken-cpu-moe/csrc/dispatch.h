// Runtime ISA dispatch: which kernel tiers this CPU can run, and which one is active.
#pragma once

#include <string>
#include <vector>

#include "common.h"

namespace ft {

const std::vector<std::string>& tier_order();  // every tier, best first: the order a cap follows
std::vector<std::string> isa_tiers();          // supported tiers at or below FREETOKEN_CPU_MOE_ISA, best first
const KernelTable* active_kernels();           // tier in use
const KernelTable* kernels_by_name(const std::string& name);  // throws std::invalid_argument
void set_active_isa(const std::string& name);  // throws if unsupported

}  // namespace ft
