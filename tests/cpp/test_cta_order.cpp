// The CTA order of the tile launches (csrc/core/seq.h tile_item, with the chunk sizes the
// launchers take from interleave_chunk / packed_interleave_chunk): for every chunk size, the
// grid visits each (batch, head, tile) exactly once, and chunks of one are head-major.
#include "../../csrc/core/seq.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <tuple>
#include <vector>

namespace {

using adaattn::AttnParams;
using adaattn::WorkItem;
using Visit = std::tuple<int, int, int>;  // (b, h, tile index)

AttnParams dense_params(int batch, int heads_q, int heads_kv, int len) {
  AttnParams p{};
  p.batch = batch;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.len_q = p.len_k = len;
  return p;
}

// The visits of a grid of heads * tile_slots CTAs, checked one by one: in range, slot
// consistent with (b, tile) for dense calls, every valid visit new.
template <bool kKeys, bool kReverse>
std::set<Visit> visits(const AttnParams& p, int block_rows) {
  const int heads = kKeys ? p.heads_kv : p.heads_q;
  const int64_t slots = adaattn::tile_slots<kKeys>(p, block_rows);
  std::set<Visit> seen;
  for (int64_t x = 0; x < slots * heads; ++x) {
    const WorkItem w = adaattn::tile_item<kKeys, kReverse>(p, x, block_rows);
    if (!w.valid) continue;
    REQUIRE(w.b >= 0);
    REQUIRE(w.b < p.batch);
    REQUIRE(w.h >= 0);
    REQUIRE(w.h < heads);
    REQUIRE(w.slot >= 0);
    REQUIRE(w.slot < slots);
    if (p.cu_seqlens_q == nullptr) REQUIRE(w.slot == w.b * (slots / p.batch) + w.index);
    REQUIRE(seen.insert(Visit{w.b, w.h, w.index}).second);
  }
  return seen;
}

}  // namespace

TEST_CASE("cta order: chunk sizes keep the last chunk whole", "[cta_order]") {
  for (int64_t units = 1; units <= 300; ++units) {
    for (int64_t tiles : {1, 2, 3, 7, 8, 32, 64, 128, 131, 132, 200, 1000}) {
      for (int64_t wave : {132, 264, 114}) {
        const int chunk = adaattn::interleave_chunk(units, tiles, wave);
        // About one wave of CTAs per chunk: ceil(wave / tiles) units up to twice that less one,
        // or every unit when there are fewer.
        const int64_t per_wave = (wave + tiles - 1) / tiles;
        if (units < per_wave) {
          REQUIRE(chunk == units);
        } else {
          REQUIRE(chunk >= per_wave);
          REQUIRE(chunk < 2 * per_wave);
        }
      }
    }
  }
  REQUIRE(adaattn::interleave_chunk(16, 32, 132) == 5);  // GQA 16/4 B4 L4k bwd: 5, 5, 6 units
  REQUIRE(adaattn::interleave_chunk(64, 1000, 132) == 1);  // a wave per head: head-major
  for (int heads = 1; heads <= 64; ++heads) {
    const int chunk = adaattn::packed_interleave_chunk(heads);
    REQUIRE(chunk >= std::min(heads, 4));
    REQUIRE(chunk <= (heads < 8 ? heads : 7));
  }
}

TEST_CASE("cta order: dense grids visit every tile once, any chunk", "[cta_order]") {
  for (auto [batch, heads_q, heads_kv, len] :
       std::vector<std::tuple<int, int, int, int>>{{1, 1, 1, 64}, {3, 4, 2, 300}, {4, 16, 4, 4096},
                                                   {5, 6, 3, 129}, {2, 8, 8, 1}}) {
    AttnParams p = dense_params(batch, heads_q, heads_kv, len);
    for (int chunk = 0; chunk <= heads_q * batch; ++chunk) {
      p.interleave_pairs = chunk;
      const int q_tiles = (len + 127) / 128, k_tiles = (len + 63) / 64;
      CHECK(visits<false, true>(p, 128).size() == static_cast<size_t>(batch * heads_q * q_tiles));
      if (chunk <= heads_kv * batch) {
        CHECK(visits<true, false>(p, 64).size() ==
              static_cast<size_t>(batch * heads_kv * k_tiles));
      }
    }
  }
}

TEST_CASE("cta order: chunks of one are head-major, heaviest tile first", "[cta_order]") {
  AttnParams p = dense_params(2, 3, 3, 256);
  p.interleave_pairs = 1;
  std::vector<Visit> order;
  for (int64_t x = 0; x < 2 * 3 * 2; ++x) {
    const WorkItem w = adaattn::tile_item<false, true>(p, x, 128);
    order.emplace_back(w.h, w.b, w.index);
  }
  CHECK(order.front() == Visit{0, 0, 1});  // head 0, entry 0, its last (heaviest) query tile
  CHECK(order[1] == Visit{0, 0, 0});
  CHECK(order.back() == Visit{2, 1, 0});
  p.interleave_pairs = 3;  // the tiles of three units alternate
  const WorkItem second = adaattn::tile_item<false, true>(p, 1, 128);
  CHECK(second.h == 0);  // unit 1: head 0, entry 1, its heaviest tile
  CHECK(second.b == 1);
  CHECK(second.index == 1);
}

TEST_CASE("cta order: packed sequences visit every tile once, any chunk", "[cta_order]") {
  const std::vector<int> cu{0, 100, 400, 407, 536, 536, 700};  // one empty sequence
  AttnParams p{};
  p.batch = static_cast<int>(cu.size()) - 1;
  p.heads_q = 6;
  p.heads_kv = 2;
  p.len_q = p.len_k = cu.back();
  p.cu_seqlens_q = p.cu_seqlens_k = cu.data();
  size_t q_tiles = 0, k_tiles = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    q_tiles += (cu[s + 1] - cu[s] + 127) / 128;
    k_tiles += (cu[s + 1] - cu[s] + 63) / 64;
  }
  for (int chunk = 0; chunk <= 6; ++chunk) {
    p.interleave_pairs = chunk;
    CHECK(visits<false, true>(p, 128).size() == q_tiles * 6);
    if (chunk <= 2) CHECK(visits<true, false>(p, 64).size() == k_tiles * 2);
  }
}
