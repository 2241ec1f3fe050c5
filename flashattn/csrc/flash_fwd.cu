// FlashAttention-2 forward as one fused CUDA kernel, for the flashattn "cuda" backend.
//
// Grid (B * H, ceil(Nq / BLOCK_M)); WARPS warps, each owning 16 query rows of a BLOCK_M-row tile. Per K/V tile
// of BLOCK_N keys:
//   S = Q K^T        mma.sync m16n8k16 (fp16 or bf16 in, fp32 accumulate), Q fragments kept in registers
//   online softmax   row max / row sum over the 4 lanes that share a row (two xor shuffles), base-2 exponentials
//   O += P V         P re-packed from the S accumulators straight into mma A fragments (no shared memory trip)
// K/V tiles are double-buffered in shared memory: cp.async (16-byte, zero-filling past the sequence end) fetches
// tile j + 1 while tile j is computed. Rows are XOR-swizzled in 16-byte chunks so ldmatrix is conflict-free.
// O is normalised once at the end and written with the natural-log log-sum-exp (-inf, and O = 0, for a row that
// sees no key). Causal masking (the diagonal anywhere: bottom-right as flash_attn, top-left as SDPA) costs nothing
// off the diagonal: fully hidden tiles are never loaded.
//
// Self-contained on purpose (no cuda_fp16.h): NVRTC compiles it at first use with no headers or toolchain, and
// nvcc compiles the same file in CI for the resource report.
//
// Each compile builds one variant (HEAD_DIM, IS_BF16, IS_CAUSAL) into one kernel, flash_fwd_kernel. The tile
// sizes and the variant come from flashattn/backends/cuda/kernel.py (compile_options) as -D defines and have no
// defaults here: the launch in Python and the kernel read the same values or the file does not compile.

#ifndef BLOCK_M
#error "BLOCK_M undefined: compile with flashattn.backends.cuda.kernel.compile_options(variant)"
#endif
#ifndef BLOCK_N
#error "BLOCK_N undefined: compile with flashattn.backends.cuda.kernel.compile_options(variant)"
#endif
#ifndef WARPS
#error "WARPS undefined: compile with flashattn.backends.cuda.kernel.compile_options(variant)"
#endif
#ifndef HEAD_DIM
#error "HEAD_DIM undefined: compile with flashattn.backends.cuda.kernel.compile_options(variant)"
#endif
#ifndef IS_BF16
#error "IS_BF16 undefined: compile with flashattn.backends.cuda.kernel.compile_options(variant)"
#endif
#ifndef IS_CAUSAL
#error "IS_CAUSAL undefined: compile with flashattn.backends.cuda.kernel.compile_options(variant)"
#endif
#ifndef SHARED_BYTES
#error "SHARED_BYTES undefined: compile with flashattn.backends.cuda.kernel.compile_options(variant)"
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))  // no math headers under NVRTC

// What the code below assumes of the values Python chose.
static_assert(BLOCK_M == 16 * WARPS, "each warp owns 16 query rows of the Q tile");
static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "tiles are whole m16n8k16 steps");

template <int D>
struct Tile {
    // Element offset of (row, col) in a row-major tile of D columns; col is a multiple of 8 (a 16-byte chunk).
    static __device__ __forceinline__ int offset(int row, int col) {
        return row * D + ((((col >> 3) ^ (row & 7))) << 3);
    }
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    int bytes = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

template <bool BF16>
__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats -> one register of two 16-bit values, lo in the low half (the lower column), rounded to nearest.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Copy rows [row0, row0 + ROWS) of a (seqlen, D) slice with row stride `stride` into a swizzled tile; rows past
// `rows_valid` are zero-filled. Every thread of the block takes its share of the 16-byte chunks.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(u16* tile, const u16* base, i64 stride, int row0, int rows_valid) {
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += WARPS * 32) {
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        bool valid = row0 + r < rows_valid;
        const u16* src = valid ? base + (i64)(row0 + r) * stride + c : base;
        cp_async_16(smem_addr(tile + Tile<D>::offset(r, c)), src, valid);
    }
}

template <int D, bool BF16, bool CAUSAL>
__device__ void flash_fwd(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                          u16* __restrict__ out, float* __restrict__ lse, int nheads, int nheads_k, int seqlen_q,
                          int seqlen_k, int diagonal, i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
                          i64 v_sb, i64 v_ss, i64 v_sh, i64 o_sb, i64 o_ss, i64 o_sh, float scale_log2) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sq = smem;                          // BLOCK_M x D
    u16* sk = sq + BLOCK_M * D;              // 2 x BLOCK_N x D
    u16* sv = sk + 2 * BLOCK_N * D;          // 2 x BLOCK_N x D
    static_assert(sizeof(u16) * (BLOCK_M + 4 * BLOCK_N) * D == SHARED_BYTES,
                  "the launch's dynamic shared memory (kernel.shared_bytes in Python) is exactly these tiles");

    const int m_block = blockIdx.y, bh = blockIdx.x;  // batch x heads on x: y would cap it at 65535
    const int b = bh / nheads, h = bh % nheads, hk = h / (nheads / nheads_k);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;  // mma fragment coordinates: row group, column pair
    const int row0 = m_block * BLOCK_M;

    const u16* qb = q + b * q_sb + h * q_sh;
    const u16* kb = k + b * k_sb + hk * k_sh;
    const u16* vb = v + b * v_sb + hk * v_sh;

    // Keys [0, n_end) can be visible to this tile; causal: query i sees key j <= i + diagonal (diagonal = Nk - Nq
    // aligns the diagonal bottom-right as flash_attn does, 0 top-left as torch SDPA does).
    int n_end = seqlen_k;
    if (CAUSAL) {
        int last_row = min(row0 + BLOCK_M, seqlen_q) - 1;
        n_end = max(0, min(seqlen_k, last_row + diagonal + 1));
    }
    const int n_blocks = (n_end + BLOCK_N - 1) / BLOCK_N;

    load_tile<D, BLOCK_M>(sq, qb, q_ss, row0, seqlen_q);
    if (n_blocks > 0) {
        load_tile<D, BLOCK_N>(sk, kb, k_ss, 0, seqlen_k);
        load_tile<D, BLOCK_N>(sv, vb, v_ss, 0, seqlen_k);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();

    // Q fragments for this warp's 16 rows, all D columns: D / 16 k-steps of 4 registers.
    u32 qf[D / 16][4];
    #pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        int r = warp * 16 + (lane % 16), c = ks * 16 + (lane / 16) * 8;
        ldmatrix_x4(smem_addr(sq + Tile<D>::offset(r, c)), qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3]);
    }

    float acc[D / 8][4];  // O: D / 8 column blocks of the m16n8 accumulator
    #pragma unroll
    for (int i = 0; i < D / 8; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    float row_max[2] = {NEG_INF, NEG_INF};  // rows group and group + 8, in scaled log2 units
    float row_sum[2] = {0.f, 0.f};               // this lane's partial sums; reduced over the quad at the end
    const int q_row[2] = {row0 + warp * 16 + group, row0 + warp * 16 + group + 8};

    for (int j = 0; j < n_blocks; ++j) {
        const int buf = j & 1;
        if (j + 1 < n_blocks) {  // prefetch the next K/V tile into the other buffer
            load_tile<D, BLOCK_N>(sk + (buf ^ 1) * BLOCK_N * D, kb, k_ss, (j + 1) * BLOCK_N, seqlen_k);
            load_tile<D, BLOCK_N>(sv + (buf ^ 1) * BLOCK_N * D, vb, v_ss, (j + 1) * BLOCK_N, seqlen_k);
        }
        cp_async_commit();
        const u16* tk = sk + buf * BLOCK_N * D;
        const u16* tv = sv + buf * BLOCK_N * D;

        float s[BLOCK_N / 8][4];
        #pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i)
            #pragma unroll
            for (int e = 0; e < 4; ++e) s[i][e] = 0.f;
        #pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            #pragma unroll
            for (int nb = 0; nb < BLOCK_N / 8; nb += 2) {  // two 8-key column blocks per ldmatrix.x4
                int mi = lane / 8;
                int r = nb * 8 + (mi / 2) * 8 + (lane % 8), c = ks * 16 + (mi % 2) * 8;
                u32 b0, b1, b2, b3;
                ldmatrix_x4(smem_addr(tk + Tile<D>::offset(r, c)), b0, b1, b2, b3);
                mma_16816<BF16>(s[nb], qf[ks], b0, b1);
                mma_16816<BF16>(s[nb + 1], qf[ks], b2, b3);
            }
        }

        // Scale, mask (past the sequence end; above the causal diagonal) and take the new row maxima.
        const bool edge = (j + 1) * BLOCK_N > seqlen_k || (CAUSAL && (j + 1) * BLOCK_N > row0 + diagonal);
        float new_max[2] = {row_max[0], row_max[1]};
        #pragma unroll
        for (int nb = 0; nb < BLOCK_N / 8; ++nb) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[nb][e] * scale_log2;
                if (edge) {
                    int key = j * BLOCK_N + nb * 8 + quad * 2 + (e & 1);
                    bool hidden = key >= seqlen_k || (CAUSAL && key > q_row[e / 2] + diagonal);
                    if (hidden) x = NEG_INF;
                }
                s[nb][e] = x;
                new_max[e / 2] = fmaxf(new_max[e / 2], x);
            }
        }
        float alpha[2], base[2];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffff, new_max[r], 1));
            new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffff, new_max[r], 2));
            // A row with nothing visible yet keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
            base[r] = new_max[r] == NEG_INF ? 0.f : new_max[r];
            alpha[r] = exp2_approx(row_max[r] - base[r]);
            row_max[r] = new_max[r];
            row_sum[r] *= alpha[r];
        }
        #pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            acc[i][0] *= alpha[0];
            acc[i][1] *= alpha[0];
            acc[i][2] *= alpha[1];
            acc[i][3] *= alpha[1];
        }

        // P = exp2(S - max), summed per row, packed into A fragments: keys 16 kk .. 16 kk + 15 are the column
        // blocks 2 kk and 2 kk + 1 of S, exactly the m16k16 A layout.
        u32 pf[BLOCK_N / 16][4];
        #pragma unroll
        for (int nb = 0; nb < BLOCK_N / 8; ++nb) {
            float p0 = exp2_approx(s[nb][0] - base[0]), p1 = exp2_approx(s[nb][1] - base[0]);
            float p2 = exp2_approx(s[nb][2] - base[1]), p3 = exp2_approx(s[nb][3] - base[1]);
            row_sum[0] += p0 + p1;
            row_sum[1] += p2 + p3;
            pf[nb / 2][(nb % 2) * 2 + 0] = pack2<BF16>(p0, p1);
            pf[nb / 2][(nb % 2) * 2 + 1] = pack2<BF16>(p2, p3);
        }

        // O += P V: V (keys x D) read transposed so that keys are the k dimension.
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            #pragma unroll
            for (int nb = 0; nb < D / 8; nb += 2) {
                int mi = lane / 8;
                int r = kk * 16 + (mi % 2) * 8 + (lane % 8), c = nb * 8 + (mi / 2) * 8;
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(smem_addr(tv + Tile<D>::offset(r, c)), b0, b1, b2, b3);
                mma_16816<BF16>(acc[nb], pf[kk], b0, b1);
                mma_16816<BF16>(acc[nb + 1], pf[kk], b2, b3);
            }
        }

        cp_async_wait_all();  // the next tile has landed ...
        __syncthreads();      // ... for every warp, and nobody still reads the buffer it will overwrite
    }

    // Normalise once, write O and the log-sum-exp (natural log).
    u16* ob = out + b * o_sb + h * o_sh;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int row = q_row[r];
        if (row < seqlen_q) {
            u16* orow = ob + (i64)row * o_ss;
            #pragma unroll
            for (int nb = 0; nb < D / 8; ++nb) {
                u32 packed = pack2<BF16>(acc[nb][2 * r] * inv, acc[nb][2 * r + 1] * inv);
                *reinterpret_cast<u32*>(orow + nb * 8 + quad * 2) = packed;
            }
            if (quad == 0) {
                lse[(i64)bh * seqlen_q + row] =
                    sum > 0.f ? (row_max[r] + __log2f(sum)) * 0.69314718055994531f : NEG_INF;
            }
        }
    }
}

// Launch bounds (WARPS * 32 = 128 threads, 2 blocks per SM) allow 255 registers: without the 2, NVRTC's ptxas aims
// for 3 blocks, caps the d = 128 kernels at 168 registers and spills on sm_80.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    flash_fwd_kernel(const u16* q, const u16* k, const u16* v, u16* out, float* lse, int nheads, int nheads_k,
                     int seqlen_q, int seqlen_k, int diagonal, i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss,
                     i64 k_sh, i64 v_sb, i64 v_ss, i64 v_sh, i64 o_sb, i64 o_ss, i64 o_sh, float scale_log2) {
    flash_fwd<HEAD_DIM, IS_BF16, IS_CAUSAL>(q, k, v, out, lse, nheads, nheads_k, seqlen_q, seqlen_k, diagonal, q_sb,
                                            q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh,
                                            scale_log2);
}
