"""The FP8 kernel's register bookkeeping, simulated lane by lane on the CPU (no GPU, no CuTe-DSL).

kernels/fwd_fp8.py builds its mma fragments with index arithmetic only (no ldmatrix, no tiled-mma partitioning):
Q rows from global memory, K words from shared memory, P packed from the S accumulators in a permuted key order,
V words transposed by byte permutes in that same order, and 8 output columns per lane.  This test rebuilds every
register exactly as the kernel's expressions do and feeds them to a model of ``mma.sync m16n8k32`` written from
the PTX ISA fragment tables (fp8_ptx.py's docstring), so a wrong index shows up as a wrong S or O here.
"""

import pytest
import torch

LANES = [(lane // 4, lane % 4) for lane in range(32)]  # (g, t)


def mma_16832(a_regs, b_regs, c):
    """a_regs[lane] = 4 registers of 4 values, b_regs[lane] = 2 registers, c[lane] = 4 fp32 -> D per lane.
    The matrices are assembled from the PTX ISA's fragment layouts, multiplied, and handed back the same way."""
    A = torch.full((16, 32), float("nan"), dtype=torch.float64)
    B = torch.full((32, 8), float("nan"), dtype=torch.float64)
    C = torch.zeros(16, 8, dtype=torch.float64)
    for lane, (g, t) in enumerate(LANES):
        for j in range(4):
            for i in range(4):
                A[g + 8 * (j % 2), 4 * t + i + 16 * (j // 2)] = a_regs[lane][j][i]
        for j in range(2):
            for i in range(4):
                B[4 * t + i + 16 * j, g] = b_regs[lane][j][i]
        for e in range(4):
            C[g + 8 * (e // 2), 2 * t + e % 2] = c[lane][e]
    assert not torch.isnan(A).any() and not torch.isnan(B).any(), "a fragment entry was never written"
    D = A @ B + C
    return [[D[g + 8 * (e // 2), 2 * t + e % 2].item() for e in range(4)] for (g, t) in LANES]


def transpose_4x4(w):  # fp8_ptx.transpose_bytes_4x4: out[c][r] = w[r][c]
    return [[w[r][c] for r in range(4)] for c in range(4)]


def word(row, col):  # a 4-byte read: 4 consecutive values of one row
    return [row[col + i].item() for i in range(4)]


@pytest.mark.parametrize("d", [64, 128])
def test_kernel_fragments_compute_q_kt_and_p_v(d):
    torch.manual_seed(d)
    tile_n = 64
    Q = torch.randint(-8, 8, (16, d)).double()  # small integers: every product and sum is exact
    K = torch.randint(-8, 8, (tile_n, d)).double()
    V = torch.randint(-8, 8, (tile_n, d)).double()
    P = torch.randint(0, 17, (16, tile_n)).double()  # stands for the e4m3 16*P values

    # Q fragments, as the kernel loads them: rows (g, g+8), columns 32c + 4t (+16)
    qa = [[[word(Q[g], 32 * c + 4 * t), word(Q[g + 8], 32 * c + 4 * t), word(Q[g], 32 * c + 16 + 4 * t),
            word(Q[g + 8], 32 * c + 16 + 4 * t)] for c in range(d // 32)] for (g, t) in LANES]
    # S = Q K^T: n8 tile jt, K row 8 jt + g, words at 32c + 4t and 32c + 16 + 4t
    acc_s = [[0.0] * (4 * (tile_n // 8)) for _ in LANES]
    for jt in range(tile_n // 8):
        for c in range(d // 32):
            bk = [[word(K[8 * jt + g], 32 * c + 4 * t), word(K[8 * jt + g], 32 * c + 16 + 4 * t)] for (g, t) in LANES]
            res = mma_16832([qa[lane][c] for lane in range(32)], bk,
                            [acc_s[lane][4 * jt:4 * jt + 4] for lane in range(32)])
            for lane in range(32):
                acc_s[lane][4 * jt:4 * jt + 4] = res[lane]
    S = Q @ K.T
    for lane, (g, t) in enumerate(LANES):
        for jt in range(tile_n // 8):
            for e in range(4):
                assert acc_s[lane][4 * jt + e] == S[g + 8 * (e // 2), 8 * jt + 2 * t + e % 2]

    # P in the accumulator layout (what softmax_p leaves in acc_s), then packed as softmax_p packs it
    acc_p = [[P[g + 8 * (e // 2), 8 * jt + 2 * t + e % 2].item() for jt in range(tile_n // 8) for e in range(4)]
             for (g, t) in LANES]
    pa = []
    for lane in range(32):
        chunks = []
        for c in range(tile_n // 32):
            regs = []
            for pair in range(2):
                ja, jb = 4 * (4 * c + 2 * pair), 4 * (4 * c + 2 * pair + 1)
                for hf in range(2):
                    x = acc_p[lane]
                    regs.append([x[ja + 2 * hf], x[ja + 2 * hf + 1], x[jb + 2 * hf], x[jb + 2 * hf + 1]])
            chunks.append(regs)
        pa.append(chunks)
    # O = P V: V words at rows key0 + {0, 1, 8, 9}, column 32 cb + 4g, transposed; n8 tile (cb, i)
    acc_o = [[0.0] * (4 * (d // 8)) for _ in LANES]
    for c in range(tile_n // 32):
        for cb in range(d // 32):
            halves = []
            for hf in range(2):
                halves.append([transpose_4x4([word(V[32 * c + 16 * hf + 2 * t + dk], 32 * cb + 4 * g)
                                              for dk in (0, 1, 8, 9)]) for (g, t) in LANES])
            for i in range(4):
                j = cb * 4 + i
                res = mma_16832([pa[lane][c] for lane in range(32)],
                                [[halves[0][lane][i], halves[1][lane][i]] for lane in range(32)],
                                [acc_o[lane][4 * j:4 * j + 4] for lane in range(32)])
                for lane in range(32):
                    acc_o[lane][4 * j:4 * j + 4] = res[lane]
    # epilogue order: lane t stores columns 32 cb + 8 t .. + 7 of rows g (hf 0) and g + 8 (hf 1)
    O = P @ V
    out = torch.full((16, d), float("nan"), dtype=torch.float64)
    for lane, (g, t) in enumerate(LANES):
        for hf in range(2):
            for cb in range(d // 32):
                vals = [acc_o[lane][4 * (4 * cb + i) + 2 * hf + e] for e in range(2) for i in range(4)]
                out[g + 8 * hf, 32 * cb + 8 * t:32 * cb + 8 * t + 8] = torch.tensor(vals, dtype=torch.float64)
    torch.testing.assert_close(out, O, rtol=0, atol=0)
