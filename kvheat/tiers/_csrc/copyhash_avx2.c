/* The AVX2 kernel of copyhash.c: xxh3-64's long path (xxhash.h's own accumulate, scramble
 * and merge steps, default secret, seed 0) run over the stripes as they are copied, so the
 * checksum costs no second pass over memory. Built for x86 with GCC or Clang; used only
 * where the CPU has AVX2 (checked at run time). */
#include "copyhash.h"

#ifdef KVHEAT_HAVE_AVX2_KERNEL
#include <immintrin.h>

#define XXH_INLINE_ALL /* static copies: this file's xxh3 internals are its own */
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include "xxhash.h"

__attribute__((__target__("avx2"))) uint64_t
kvheat_copy_hash_avx2(char *dst, const char *src, const Layout *l)
{
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    const xxh_u8 *secret = XXH3_kSecret;
    const size_t secret_size = sizeof(XXH3_kSecret);
    const size_t per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    const size_t len = (size_t)(l->rows * l->row_bytes);
    const size_t last = len / XXH_STRIPE_LEN - 1;
    size_t stripe = 0, in_block = 0;
    for (ptrdiff_t r = 0; r < l->rows; r++) {
        char *d = dst + r * l->dst_stride;
        const char *s = src + r * l->src_stride;
        for (ptrdiff_t off = 0; off < l->row_bytes; off += XXH_STRIPE_LEN, stripe++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(s + off));
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + off + 32));
            _mm256_storeu_si256((__m256i *)(d + off), a);
            _mm256_storeu_si256((__m256i *)(d + off + 32), b);
            if (stripe == last) {  /* XXH3_hashLong_internal_loop's last stripe */
                XXH3_accumulate_512_avx2(acc, d + off, secret + secret_size - XXH_STRIPE_LEN
                                                       - XXH_SECRET_LASTACC_START);
                break;
            }
            XXH3_accumulate_512_avx2(acc, d + off, secret + in_block * XXH_SECRET_CONSUME_RATE);
            if (++in_block == per_block) {
                XXH3_scrambleAcc_avx2(acc, secret + secret_size - XXH_STRIPE_LEN);
                in_block = 0;
            }
        }
    }
    return XXH3_finalizeLong_64b(acc, secret, (xxh_u64)len);
}
#endif
