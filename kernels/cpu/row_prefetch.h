// Prefetching one attention head's K or V row, shared by the decode-attention kernels.
#pragma once

namespace radixmesh::attn {

// Every cache line of one head's K or V row: the rows are scattered over the pool (slots), so
// the hardware prefetcher cannot follow them; one line per row left the other three to miss.
template <int D, typename KV>
inline void prefetch_head_row(const KV* p) {
  for (int off = 0; off < D * static_cast<int>(sizeof(KV)); off += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + off);
}

}  // namespace radixmesh::attn
