/* splitmix.h - SplitMix64's output function (Steele, Lea and Flood, "Fast splittable
 * pseudorandom number generators", 2014; Vigna's constants): a bijective 64-bit mix, the
 * base of every counter-based random stream here (seeded sampling, request seeds, the mock
 * engine's logits, synthetic checkpoints).  Those streams are reproducible results: a seeded
 * request's tokens and a generated checkpoint's bytes follow from this function, so it must
 * not change.
 */
#pragma once

#include <stdint.h>

static inline uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
