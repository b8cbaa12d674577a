// This ISA variant's table of op loops (compiled once per ISA, like the loops themselves).
#include "cpu/kernel_table.h"

#include "cpu/kernels.h"

#define ATTNKIT_STR2(x) #x
#define ATTNKIT_STR(x) ATTNKIT_STR2(x)

namespace attnkit::cpu::ATTNKIT_ISA {

const KernelTable kernel_table = {ATTNKIT_STR(ATTNKIT_ISA), &attention_fwd,  &attention_decodes,
                                   &sparse_mla_fwd,            &sage_int8_fwd,  &merge_states,
                                   &mla_decode_fwd,            &v32_quantize,   &indexer_logits,
                                   &topk_select,               &attention_bwd};

}  // namespace attnkit::cpu::ATTNKIT_ISA
