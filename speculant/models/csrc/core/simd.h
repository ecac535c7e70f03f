// The ISA branch of this build, chosen by the compiler's target flags: AVX-512 (F, BW, VL, DQ), AVX2
// with FMA and F16C, ARM NEON (aarch64), or plain C++. Each arch header gives the same primitives (a
// 16-lane float vector, fused multiply-add, the lanes' sum in one fixed tree, a block's weights
// dequantized, integer dot products of int8 blocks) and its tile sizes; the kernels are written
// once over them, so every branch computes every value by the same IEEE operations in the same
// order: the same bits on every machine.
#pragma once

#if defined(SPK_FORCE_GENERIC)
#include "arch/generic.h"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include "arch/x86/avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "arch/x86/avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "arch/arm/neon.h"
#else
#include "arch/generic.h"
#endif
