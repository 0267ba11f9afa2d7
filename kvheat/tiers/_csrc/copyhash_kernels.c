/* copyhash.c's fused kernels: xxh3-64's long path (xxhash.h's own accumulate, scramble and
 * merge steps, default secret, seed 0) run over the 64-byte stripes as they are copied, so
 * the checksum costs no second pass over memory.
 *
 *   kvheat_copy_hash_fused: with the vector unit this file is built for (SSE2 on x86-64,
 *     NEON on AArch64, scalar elsewhere: xxhash.h's XXH_VECTOR);
 *   kvheat_copy_hash_avx2: with AVX2 (x86, GCC or Clang), used only where the CPU has it
 *     (checked at run time). */
#include <string.h>

#include "copyhash.h"

#define XXH_INLINE_ALL /* static copies: this file's xxh3 internals are its own */
#ifdef KVHEAT_HAVE_AVX2_KERNEL
#include <immintrin.h>
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#endif
#include "xxhash.h"

/* The loop both kernels share; `COPY_STRIPE(d, s)` copies 64 bytes, `ACC` and `SCRAMBLE`
 * are xxh3's steps for that vector unit. Mirrors XXH3_hashLong_internal_loop: every stripe
 * but the last accumulates with the secret at its place in the block, a full block of
 * stripes is scrambled, the last stripe uses the secret's last-stripe offset. A stripe is
 * hashed from the source it was just loaded from (in L1): hashing the destination waits on
 * the stores, 30-40% slower for a pool block's 2 KiB runs (bench/tiers/bandwidth.py). */
#define FUSED_LOOP(COPY_STRIPE, ACC, SCRAMBLE)                                              \
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;                                \
    const xxh_u8 *secret = XXH3_kSecret;                                                  \
    const size_t secret_size = sizeof(XXH3_kSecret);                                      \
    const size_t per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;    \
    const size_t len = (size_t)(l->rows * l->row_bytes);                                  \
    const size_t last = len / XXH_STRIPE_LEN - 1;                                         \
    size_t stripe = 0, in_block = 0;                                                      \
    for (ptrdiff_t r = 0; r < l->rows; r++) {                                             \
        char *d = dst + r * l->dst_stride;                                                \
        const char *s = src + r * l->src_stride;                                          \
        for (ptrdiff_t off = 0; off < l->row_bytes; off += XXH_STRIPE_LEN, stripe++) {    \
            COPY_STRIPE(d + off, s + off);                                                \
            if (stripe == last) {                                                         \
                ACC(acc, s + off, secret + secret_size - XXH_STRIPE_LEN                   \
                                      - XXH_SECRET_LASTACC_START);                         \
                break;                                                                    \
            }                                                                             \
            ACC(acc, s + off, secret + in_block * XXH_SECRET_CONSUME_RATE);              \
            if (++in_block == per_block) {                                                \
                SCRAMBLE(acc, secret + secret_size - XXH_STRIPE_LEN);                     \
                in_block = 0;                                                             \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    return XXH3_finalizeLong_64b(acc, secret, (xxh_u64)len);

#define COPY_STRIPE_MEMCPY(d, s) memcpy((d), (s), XXH_STRIPE_LEN)

uint64_t kvheat_copy_hash_fused(char *dst, const char *src, const Layout *l)
{
    FUSED_LOOP(COPY_STRIPE_MEMCPY, XXH3_accumulate_512, XXH3_scrambleAcc)
}

#ifdef KVHEAT_HAVE_AVX2_KERNEL
#define COPY_STRIPE_AVX2(d, s)                                                             \
    do {                                                                                  \
        __m256i a_ = _mm256_loadu_si256((const __m256i *)(s));                            \
        __m256i b_ = _mm256_loadu_si256((const __m256i *)((s) + 32));                     \
        _mm256_storeu_si256((__m256i *)(d), a_);                                          \
        _mm256_storeu_si256((__m256i *)((d) + 32), b_);                                   \
    } while (0)

__attribute__((__target__("avx2"))) uint64_t
kvheat_copy_hash_avx2(char *dst, const char *src, const Layout *l)
{
    FUSED_LOOP(COPY_STRIPE_AVX2, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2)
}
#endif
