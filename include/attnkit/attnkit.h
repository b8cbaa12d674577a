// Umbrella header for attnkit's C++ API.
#pragma once

#include "attnkit/attention.h"
#include "attnkit/dsa.h"
#include "attnkit/attention_backward.h"
#include "attnkit/dtype.h"
#include "attnkit/error.h"
#include "attnkit/merge.h"
#include "attnkit/runtime.h"
#include "attnkit/serving.h"
#include "attnkit/sage.h"
#include "attnkit/sparse_mla.h"
#include "attnkit/tensor.h"
