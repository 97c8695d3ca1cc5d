"""K/V loaders of the FP8 forward (kernels/fwd_fp8.py): the warp role that copies each K/V tile into its shared
memory stage with cp.async, rows of a contiguous (or packed varlen) cache or of a paged pool.

Every thread of the CTA copies its share of the whole tile (16-byte chunks of padded rows, config_fp8.ROW_PAD);
keys past the sequence's end are zero-filled and read nothing.  The four-warp tiles unroll one copy per chunk
(load_row_chunk); the packed decode tile (one or two warps, 8-16 copies a thread and tensor) advances one strided
address (load_rows_strided).  Paged K/V looks each row's page up once per tile and lane (lookup_pages), shares it
by shuffles (copy_paged_row), and clamps page indices to the pool (clamp_page); the key-split decode tile issues the
page-table reads a tile ahead (kernels/fwd_fp8.py, page_ahead).  A mixin: FlashFwdFp8 supplies cfg, d / dv,
k_row / v_row, tile_n and num_threads.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int64, const_expr

from ..config_fp8 import paged_slot, paged_slot_row
from .fp8_ptx import cp_async_16


class Fp8KvLoader:
    @cute.jit
    def load_kv(self, nb, stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages):
        if const_expr(self.cfg.paged):
            self.load_kv_paged(nb, stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages)
        else:
            self.load_kv_rows(nb, stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr)

    @cute.jit
    def load_kv_rows(self, nb, stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr):
        for which in cutlass.range_constexpr(2):
            width = self.d if const_expr(which == 0) else self.dv
            row_bytes = self.k_row if const_expr(which == 0) else self.v_row
            base = k_base if const_expr(which == 0) else v_base
            rs = k_rs if const_expr(which == 0) else v_rs
            s_addr = (sK_addr if const_expr(which == 0) else sV_addr) + stage * (self.tile_n * row_bytes)
            chunks = width // 16
            if const_expr(self.num_threads >= 128):
                for j in cutlass.range_constexpr(self.tile_n * chunks // self.num_threads):
                    self.load_row_chunk(tidx + self.num_threads * j, chunks, nb, sk, base, rs, s_addr, row_bytes)
            else:
                self.load_rows_strided(nb, tidx, chunks, sk, base, rs, s_addr, row_bytes)

    @cute.jit
    def load_rows_strided(self, nb, tidx, chunks, sk, base, rs, s_addr, row_bytes):
        """The decode tile's copies of one tensor (8-16 a thread): a thread's rows lie num_threads / chunks apart,
        so one 64-bit source address advances by a fixed stride and the shared address by a constant.  Rebuilding
        each row's address took ~18 instructions a copy in a rolled loop (unrolled, the hoisted addresses spilled
        where the mma is emulated, sm_90a); this takes about six, unrolled.  Keys past sk read nothing
        (zero-filled) from the sequence's first row."""
        step = self.num_threads // chunks
        r, cidx = tidx // chunks, tidx % chunks
        key = nb * self.tile_n + r
        src = base + Int64(key) * Int64(rs) + Int64(cidx * 16)
        stride = Int64(rs) * step
        dst = s_addr + r * row_bytes + cidx * 16
        for j in cutlass.range_constexpr(self.tile_n // step):
            ok = key + step * j < sk
            cp_async_16(dst + step * j * row_bytes, src if ok else base, 16 if ok else 0)
            src = src + stride

    @cute.jit
    def load_kv_paged(self, nb, stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages):
        """Paged K/V: KV tile ``nb``, K and V rows together (d = dv: the same copies address both).  Lane l of each
        warp looks up the (page, row in page) of the warp's slots l and l + 32 (``config_fp8.paged_slot_row``)
        once per tile, so a thread waits for one page-table read, not one dependent read per copied row (the
        decode tile copies 8 rows a thread); each copy takes its row's pair from the owning lane by a shuffle.
        Keys past sk get row -1: zero-filled, nothing read (a last page's tail may hold anything)."""
        looked = self.lookup_pages(nb, tidx, sk, pages)
        self.copy_pages(stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages,
                        [(self.clamp_page(p, pages), r) for p, r in looked])

    @cute.jit
    def lookup_pages(self, nb, tidx, sk, pages):
        """This lane's (page as the table holds it, row in page) of tile ``nb``, one pair per 32 slots (rows of
        the warp, config_fp8.paged_slot_row); a key past sk gets row -1.  The page is clamped where it is used
        (clamp_page), so a lookup issued a tile ahead leaves its read in flight."""
        mPT, b, last_page, page_size, k_ps, v_ps = pages
        chunks = self.d // 16
        warp, lane = tidx // 32, tidx % 32
        slots = self.tile_n // self.cfg.num_warps
        looked = []
        for i in cutlass.range_constexpr((slots + 31) // 32):
            slot = (lane + 32 * i) % slots  # the 4-warp tile has 16 slots: lanes 16-31 repeat 0-15 (same reads)
            key = nb * self.tile_n + paged_slot_row(slot, warp, chunks, self.num_threads)
            ok = key < sk
            col = key // page_size if ok else 0  # column 0 exists whenever a tile is loaded (sk > 0)
            looked.append((mPT[b, col], key - col * page_size if ok else -1))
        return looked

    @cute.jit
    def keep_pages(self, ahead, looked):
        for i in cutlass.range_constexpr(len(looked)):
            ahead[2 * i] = looked[i][0]
            ahead[2 * i + 1] = looked[i][1]

    @cute.jit
    def clamp_page(self, page, pages):
        # page indices are the caller's contract: clamped to the pool, a lie reads a wrong page, never outside
        return cutlass.min(cutlass.max(page, 0), pages[2])

    @cute.jit
    def copy_pages(self, stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages, looked):
        """cp.async K and V rows of a tile into ``stage`` from the looked-up (clamped page, row) pairs."""
        mPT, b, last_page, page_size, k_ps, v_ps = pages
        chunks = self.d // 16
        lane = tidx % 32
        ks = sK_addr + stage * (self.tile_n * self.k_row)
        vs = sV_addr + stage * (self.tile_n * self.v_row)
        per = self.tile_n * chunks // self.num_threads
        if const_expr(self.num_threads >= 128):
            for j in cutlass.range_constexpr(per):
                self.copy_paged_row(j, tidx, lane, chunks, looked, k_base, v_base, k_rs, v_rs, k_ps, v_ps, ks, vs)
        else:  # the decode tile: rolled (unrolled, the 64-bit page offsets of every copy stay live)
            for j in cutlass.range(per, unroll=1):
                self.copy_paged_row(j, tidx, lane, chunks, looked, k_base, v_base, k_rs, v_rs, k_ps, v_ps, ks, vs)

    @cute.jit
    def copy_paged_row(self, j, tidx, lane, chunks, looked, k_base, v_base, k_rs, v_rs, k_ps, v_ps, ks, vs):
        slot = paged_slot(lane, j, chunks)
        page, row = looked[0]
        if const_expr(len(looked) > 1):  # slot // 32 is the same for every lane of a copy (32 // chunks | 32)
            hi = slot >= 32
            page = looked[1][0] if hi else page
            row = looked[1][1] if hi else row
        page = cute.arch.shuffle_sync(page, slot % 32)
        row = cute.arch.shuffle_sync(row, slot % 32)
        ok = row >= 0
        r, cidx = (tidx + self.num_threads * j) // chunks, tidx % chunks  # the tile row paged_slot_row names
        page64, row64 = Int64(page if ok else 0), Int64(row if ok else 0)
        cp_async_16(ks + r * self.k_row + cidx * 16, k_base + page64 * k_ps + row64 * Int64(k_rs) + Int64(cidx * 16),
                    16 if ok else 0)
        cp_async_16(vs + r * self.v_row + cidx * 16, v_base + page64 * v_ps + row64 * Int64(v_rs) + Int64(cidx * 16),
                    16 if ok else 0)

    @cute.jit
    def load_row_chunk(self, idx, chunks, nb, sk, base, rs, s_addr, row_bytes):
        r, cidx = idx // chunks, idx % chunks
        key = nb * self.tile_n + r
        ok = key < sk
        key_c = key if ok else 0
        cp_async_16(s_addr + r * row_bytes + cidx * 16, base + Int64(key_c) * Int64(rs) + Int64(cidx * 16),
                    16 if ok else 0)
