// The fuzz driver's DeepSeek sparse attention calls (fuzz_dsa.cpp): each builds one random
// call on c, runs it under Call::run's contract and, when it succeeded on finite inputs,
// compares its outputs with a double-precision reference. Each returns whether the call
// succeeded; a broken contract throws Failure.
#pragma once

#include "fuzz_call.h"

namespace attnkit_fuzz {

// sparse_mla_prefill_fwd, or (strict) SGLang's sparse_mla_q8kv8_prefill_fwd contract.
bool fuzz_sparse_mla(Call& c, bool strict);
// flash_mla_with_kvcache: sparse over the V3.2 fp8 cache, dense over a bf16 or V3.2 cache.
bool fuzz_mla_decode(Call& c);
// quantize_v32_kv, every byte against FlashMLA's quantiser.
bool fuzz_quantize_v32(Call& c);
// fp8_mqa_logits (full, compressed, or fused with top-k), or (paged) fp8_paged_mqa_logits.
bool fuzz_indexer_logits(Call& c, bool paged);
// topk_transform: row-relative, ragged and paged.
bool fuzz_topk(Call& c);

}  // namespace attnkit_fuzz
