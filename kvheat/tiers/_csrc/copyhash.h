/* Shared by copyhash.c (the module) and copyhash_kernels.c (its fused kernels). */
#ifndef KVHEAT_COPYHASH_H
#define KVHEAT_COPYHASH_H

#include <stddef.h>
#include <stdint.h>

/* A block: `rows` runs of `row_bytes` contiguous bytes, `dst_stride` / `src_stride` bytes
 * apart on each side. */
typedef struct {
    ptrdiff_t rows, row_bytes, dst_stride, src_stride;
} Layout;

/* Copy the block and return xxh3-64 (seed 0) of its bytes in one pass: each 64-byte stripe
 * is hashed right after it is stored. Need row_bytes a multiple of 64 and more than 240
 * bytes in all (where xxh3 takes its long path); the AVX2 one needs the CPU to have it. */
uint64_t kvheat_copy_hash_fused(char *dst, const char *src, const Layout *l);
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KVHEAT_HAVE_AVX2_KERNEL 1
uint64_t kvheat_copy_hash_avx2(char *dst, const char *src, const Layout *l);
#endif

#endif
